"""Helpers for tests that run the real job: CLI subprocesses, worker processes, brokers, the
session's shared worker (:class:`SharedWorker`), and the per-sample reference forward that shards
are checked against. The fixtures built from them live in conftest.py.

Every subprocess gets a clean environment: the machine's own ``HSX_*`` / ``AWS_*`` variables are
removed, so a test never talks to a server it did not start.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]


def clean_env(**hsx) -> dict[str, str]:
    """os.environ without HSX_* / AWS_* vars and the terminal's size (``COLUMNS`` / ``LINES``: output
    must not wrap as the terminal running the tests does), plus ``HSX_<KEY>=value`` for each keyword."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HSX_", "AWS_")) and k not in ("COLUMNS", "LINES")}
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONUNBUFFERED"] = "1"
    env["TOKENIZERS_PARALLELISM"] = "false"
    for key, value in hsx.items():
        if value is not None:
            env[f"HSX_{key.upper()}"] = str(value)
    return env


def run_cli(module: str, args: list[str], env: dict[str, str], timeout_s: float = 300) -> subprocess.CompletedProcess:
    """``python -m <module> args...`` in the repo root; returns the completed process (text output).
    A process of its own, forked from the fork server where ``env`` allows (:func:`run_python`)."""
    return run_python(["-m", module, *args], env, timeout_s=timeout_s)


def cli_json(proc: subprocess.CompletedProcess) -> dict:
    """The JSON report a ``--json`` command printed on stdout (fails the test with stderr if none)."""
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout)


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class ForkedProcess:
    """What a test holds of a process the fork server started (tests/forkserver.py): the parts of
    ``subprocess.Popen`` the tests use (``pid``, ``args``, ``returncode``, ``poll``, ``wait``,
    ``send_signal``, ``terminate``, ``kill``). Its exit code is the one the server wrote when it
    reaped the process."""

    def __init__(self, pid: int, args: list[str], exit_path: Path, server: subprocess.Popen | None = None):
        self.pid = pid
        self.args = args
        self.returncode: int | None = None
        self._exit_path = exit_path
        self._server = server

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                self.returncode = int(self._exit_path.read_text())
            except (OSError, ValueError):
                if self._server is not None and self._server.poll() is not None and not _exists(self.pid):
                    self.returncode = -signal.SIGKILL  # the server is gone (it kills its children as it exits)
                return self.returncode
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.02)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _read_text(path: Path) -> str:
    """A captured stream's file as ``text=True`` decodes a pipe (locale encoding, universal newlines)."""
    import locale

    data = path.read_bytes().decode(locale.getpreferredencoding(False)) if path.exists() else ""
    return data.replace("\r\n", "\n").replace("\r", "\n")


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


class ForkedPopen(ForkedProcess):
    """:class:`ForkedProcess` for :func:`python_popen`: ``communicate`` returns what the process wrote to
    the streams given as ``subprocess.PIPE`` (captured in files: read once it has exited)."""

    def __init__(self, pid: int, args: list[str], exit_path: Path, server: subprocess.Popen, out: Path | None,
                 err: Path | None):
        super().__init__(pid, args, exit_path, server)
        self.stdout = self.stderr = None  # no pipe to read from while it runs: communicate()
        self._out, self._err = out, err

    def communicate(self, input=None, timeout: float | None = None) -> tuple[str | None, str | None]:
        assert input is None, "no stdin for a forked process"
        self.wait(timeout)
        return (_read_text(self._out) if self._out else None, _read_text(self._err) if self._err else None)


class ForkServer:
    """The session's worker fork server (tests/forkserver.py), started by :func:`fork_server`."""

    def __init__(self):
        import tempfile
        import threading

        self.dir = Path(tempfile.mkdtemp(prefix="hsx-forkserver-"))
        self.env = clean_env()
        self._lock = threading.Lock()
        self._log = open(self.dir / "server.log", "wb")
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("forkserver.py")), str(self.dir)],
                                     cwd=ROOT, env=self.env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._log, text=True, start_new_session=True)
        hello = self.proc.stdout.readline()
        assert hello.startswith('{"ready"'), f"the fork server did not start: {hello!r}\n{self.log()[-3000:]}"

    def log(self) -> str:
        return (self.dir / "server.log").read_text(errors="replace")

    def takes(self, env: dict[str, str]) -> bool:
        """Whether a process with ``env`` may be forked here: see :func:`same_libraries_env`."""
        return self.proc.poll() is None and same_libraries_env(env, self.env)

    def spawn(self, cmd: list[str], env: dict[str, str], stdout: Path, stderr: Path | None = None,
              cwd: Path = ROOT) -> ForkedProcess:
        """``cmd`` (``[sys.executable, ...]``: ``-m module``, ``-c code`` or a script, and their
        arguments) forked from the server in its own session, in ``cwd``, its stdout appended to
        ``stdout`` and its stderr to ``stderr`` (default: the same file)."""
        assert cmd[0] == sys.executable and cmd[1:], cmd
        request = {"argv": cmd[1:], "env": env, "cwd": str(cwd), "stdout": str(stdout),
                   "stderr": str(stderr) if stderr else None}
        with self._lock:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            reply = self.proc.stdout.readline()
        assert reply, f"the fork server exited:\n{self.log()[-3000:]}"
        pid = json.loads(reply)["pid"]
        return ForkedProcess(pid, cmd, self.dir / f"{pid}.exit", self.proc)

    def stop(self) -> None:
        import shutil

        if self.proc.poll() is None:
            self.proc.stdin.close()  # the server kills what it still runs, and exits
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


#: Variables that differ between the tests' environments and are read by no library at import: the
#: running test's name (pytest), the cache directories torch's inductor and Triton compile into
#: (``TORCHINDUCTOR_CACHE_DIR``, which inductor puts into os.environ when a test first compiles, and
#: ``TRITON_CACHE_DIR``, which the benches set for their workers: read when a kernel compiles), and the
#: terminal's size (``COLUMNS``, ``LINES``: rich reads them when a console is made, and the server
#: imports no rich; the CLI's consoles are made by the child's own import of ``producer``).
NOT_READ_AT_IMPORT = frozenset({"PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "COLUMNS", "LINES"})


def same_libraries_env(env: dict[str, str], server_env: dict[str, str]) -> bool:
    """Whether a process with ``env`` sees, in what the fork server's libraries read at import, what
    the server saw: every variable outside ``HSX_*`` (the project's settings, read by the child's own
    imports) and :data:`NOT_READ_AT_IMPORT` is the same; ``PYTHONPATH`` compared as its directories
    with repeats dropped (``ROOT:ROOT`` finds what ``ROOT`` finds: a bench puts the repo first again)."""
    def outside(e):
        out = {k: v for k, v in e.items() if not k.startswith("HSX_") and k not in NOT_READ_AT_IMPORT}
        if "PYTHONPATH" in out:
            out["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(out["PYTHONPATH"].split(os.pathsep)))
        return out

    return outside(env) == outside(server_env)


def fresh_interpreter(env: dict[str, str]) -> dict[str, str]:
    """``env`` made one that the fork server does not take (a variable no library reads): the command
    starts as a fresh interpreter, and so do its own Python children (as a user's do). For the tests
    that read a process tree, which a forked command's routed children are not in (tests/forkserver.py)."""
    return {**env, "TEST_FRESH_INTERPRETER": "1"}


_fork_server: ForkServer | None = None


def fork_server() -> ForkServer | None:
    """This pytest process's fork server, started on first use; None with ``TEST_FORK_SERVER=0``."""
    global _fork_server
    if os.environ.get("TEST_FORK_SERVER", "1") == "0":
        return None
    if _fork_server is None:
        _fork_server = ForkServer()
    return _fork_server


def stop_fork_server() -> None:
    global _fork_server
    if _fork_server is not None:
        _fork_server.stop()
        _fork_server = None


def worker_popen(cmd: list[str], env: dict[str, str], log, log_path: Path):
    """A worker process for ``cmd`` (``python -m celery ... worker``): forked from the session's
    fork server (tests/forkserver.py) when its environment allows, else ``subprocess.Popen`` (a
    fresh interpreter). Stdout and stderr go to ``log`` (the open file of ``log_path``), its own
    session, the repo root as its directory."""
    server = forking_server(env)
    if server is not None:
        return server.spawn(cmd, env, log_path)
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def forking_server(env: dict[str, str]) -> ForkServer | None:
    """The fork server if it may fork a process with ``env`` (started on first use), else None."""
    if not same_libraries_env(env, clean_env()):  # the server would not take it: do not start one for it
        return None
    server = fork_server()
    return server if server is not None and server.takes(env) else None


def run_python(args: list[str], env: dict[str, str], cwd: Path = ROOT, timeout_s: float | None = 300
               ) -> subprocess.CompletedProcess:
    """``subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True,
    timeout=timeout_s)``, forked from the fork server (tests/forkserver.py) where ``env`` allows: the
    same separate process, its output captured in files and decoded as ``text=True`` does (universal
    newlines); past ``timeout_s`` it is killed and ``subprocess.TimeoutExpired`` raised."""
    import tempfile

    cmd = [sys.executable, *args]
    server = forking_server(env)
    if server is None:
        return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s)
    with tempfile.TemporaryDirectory(prefix="hsx-run-", dir=server.dir) as d:
        out, err = Path(d) / "stdout", Path(d) / "stderr"
        proc = server.spawn(cmd, env, out, err, cwd=cwd)
        try:
            code = proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise

        return subprocess.CompletedProcess(cmd, code, _read_text(out), _read_text(err))


def python_popen(args: list[str], env: dict[str, str], *, stdout, stderr, cwd: Path = ROOT):
    """``subprocess.Popen([sys.executable, *args], cwd=cwd, env=env, stdout=stdout, stderr=stderr,
    text=True, start_new_session=True)``, forked from the fork server (tests/forkserver.py) where
    ``env`` allows: a :class:`ForkedPopen` (``pid``, ``poll``, ``wait``, ``send_signal``,
    ``communicate``...). ``stdout`` / ``stderr``: ``subprocess.PIPE`` (read with ``communicate``),
    ``subprocess.DEVNULL``, an open file, or for ``stderr`` ``subprocess.STDOUT``."""
    import uuid

    cmd = [sys.executable, *args]
    server = forking_server(env)
    named = all(getattr(f, "name", None) and isinstance(f.name, str) for f in (stdout, stderr)
                if f not in (subprocess.PIPE, subprocess.DEVNULL, subprocess.STDOUT))
    if server is None or not named or stdout is None or stderr is None:
        return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=stdout, stderr=stderr, text=True, start_new_session=True)
    captured: dict[str, Path] = {}

    def path(stream, which: str) -> Path:
        if stream is subprocess.PIPE:
            captured[which] = server.dir / f"{which}-{uuid.uuid4().hex}"
            captured[which].touch()
            return captured[which]
        return Path(os.devnull) if stream is subprocess.DEVNULL else Path(stream.name)

    out = path(stdout, "stdout")
    err = out if stderr is subprocess.STDOUT else path(stderr, "stderr")
    proc = server.spawn(cmd, env, out, err, cwd=cwd)
    return ForkedPopen(proc.pid, cmd, proc._exit_path, server.proc, captured.get("stdout"), captured.get("stderr"))


class WorkerProcess:
    """A real ``celery -A workers worker -Q gpu`` process (threads pool, ``concurrency`` threads, default one),
    forked from the fork server where its environment allows (:func:`worker_popen`)."""

    def __init__(self, env: dict[str, str], name: str, log_path: Path, concurrency: int = 1):
        self.log_path = log_path
        self._log = open(log_path, "wb")
        cmd = [sys.executable, "-m", "celery", "-A", "workers", "worker", "-Q", "gpu", "-P", "threads", "-c", str(concurrency),
               "-n", f"{name}@%h", "-l", "INFO", "--without-gossip", "--without-mingle"]
        self.proc = worker_popen(cmd, env, self._log, log_path)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout_s: float = 90) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if "ready." in self.log():
                return
            assert self.proc.poll() is None, f"worker exited early:\n{self.log()[-3000:]}"
            time.sleep(0.2)
        raise AssertionError(f"worker not ready after {timeout_s} s:\n{self.log()[-3000:]}")

    def kill(self) -> None:
        """SIGKILL the worker's whole process group (no warm shutdown, nothing acknowledged)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self, timeout_s: float = 30) -> None:
        """Warm shutdown (SIGTERM; SIGKILL of the process group after ``timeout_s``)."""
        try:
            stop_process(self.proc, timeout_s)
        finally:
            self._log.close()


def stop_process(proc: subprocess.Popen, timeout_s: float) -> None:
    """SIGTERM ``proc``, wait up to ``timeout_s``, then SIGKILL its process group."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def wait_until(predicate, timeout_s: float, what: str, poll_s: float = 0.2):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


class TcpBroker:
    """valkey-server on a loopback TCP port with a password: stands in for a cluster's Redis."""

    def __init__(self, state_dir: Path, password: str = "test-broker-pw"):
        from hsx.broker import valkey_binary

        self.port = free_port()
        self.password = password
        state_dir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [valkey_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--requirepass", password,
             "--dir", str(state_dir), "--appendonly", "yes", "--save", "", "--maxmemory-policy", "noeviction"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        import redis

        client = redis.Redis(host="127.0.0.1", port=self.port, password=password)
        wait_until(lambda: _ping(client), 10, "valkey-server to answer PING")

    @property
    def url(self) -> str:
        return f"redis://:{self.password}@127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


def _ping(client) -> bool:
    try:
        return bool(client.ping())
    except Exception:
        return False


@contextlib.contextmanager
def environ(env: dict[str, str]):
    """``os.environ`` is exactly ``env`` inside the block (and ``get_settings()`` reads it afresh);
    both are restored after."""
    from settings import get_settings

    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    get_settings.cache_clear()
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)
        get_settings.cache_clear()


def _no_workers(env: dict[str, str], log_path: Path, count: int | None = None):
    raise AssertionError("this command started workers: run it on the shared worker (shared_worker.producer) "
                         "or as a process (run_cli)")


def run_here(args: list[str], env: dict[str, str], local_workers=_no_workers) -> subprocess.CompletedProcess:
    """``python -m producer ARGS`` run in this process: the CLI's ``main`` with ``os.environ`` set to
    ``env``, in the repo root, stdout and stderr captured; returns what :func:`run_cli` returns (the
    exit code ``python -m producer`` would exit with, stdout and stderr text). For commands whose
    output is what a test checks, without a Python start and the imports per command.

    ``producer.run.LocalWorkers`` is replaced by ``local_workers`` meanwhile: by default a command
    that would start workers fails the test (:class:`SharedWorker` passes its own). An exception
    that ``python -m producer`` would print as a traceback propagates and fails the test. The signal
    handlers ``main`` installs are restored after.
    """
    from producer import cli
    from producer import run as run_module

    stdout, stderr = io.StringIO(), io.StringIO()
    # Wide, unless the test sets it: rich wraps at 80 columns, and a long temp path (pytest-xdist's
    # popen-gwN dirs) would break the phrases tests look for across lines.
    env = {"COLUMNS": "400", **env}
    widths = {c: (c._width, c._height) for c in (cli.console, cli.out)}  # rich keeps a size met at import
    signals = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}
    real = run_module.LocalWorkers
    run_module.LocalWorkers = local_workers
    for c in widths:
        if env["COLUMNS"].isdigit():
            c.size = (int(env["COLUMNS"]), 25)
    try:
        with (environ(env), contextlib.chdir(ROOT), contextlib.redirect_stdout(stdout),
              contextlib.redirect_stderr(stderr)):
            try:
                code = cli.main(list(args))
            except SystemExit as exc:  # argparse's usage errors
                code = exc.code if isinstance(exc.code, int) else 1
    finally:
        run_module.LocalWorkers = real
        for c, (width, height) in widths.items():
            c._width, c._height = width, height
        for s, handler in signals.items():
            signal.signal(s, handler)
    return subprocess.CompletedProcess([sys.executable, "-m", "producer", *args], code, stdout.getvalue(), stderr.getvalue())


class SharedWorker:
    """One broker and one worker process for the whole test session, and ``python -m producer``
    commands run in the test process against them.

    The broker is the embedded one (``hsx.broker.EmbeddedBroker``: valkey-server on a unix socket,
    as ``producer run`` starts it). The worker runs the ``celery worker`` command line that
    ``python -m workers`` starts for a CPU slot (``workers.launcher.worker_command``: threads pool,
    ``task_threads`` threads, events on), with the tiny-qwen3.5 target preloaded, serving every
    local store under ``root``.

    :meth:`producer` runs the CLI's ``main`` here (:func:`run_here`) with ``HSX_BROKER_URL`` set to
    the shared broker and ``producer.run.LocalWorkers`` replaced by a handle on the shared worker,
    so a ``producer run`` plans, enqueues, waits for its markers and reports as the command does,
    without starting a broker and a worker of its own (seconds of process start and model load per
    test). The handle
    refuses a job whose worker-side settings (model, cache, faults, limits...) differ from the
    shared worker's: such a test needs a worker of its own. What only the whole process stack
    shows (the embedded broker's life cycle, the launcher, signals, warm shutdown) is left to the
    tests that run ``producer run`` with :func:`run_cli`.
    """

    #: Settings a job may set otherwise than the shared worker: where its files and its own state go
    #: (``store_url`` must be under ``root``), and the broker (always the shared one here).
    # batch_tokens: producer run passes its run's budget to its workers (their warm-up's reach)
    PER_JOB = frozenset({"store_url", "allowed_stores", "state_dir", "spool_dir", "broker_url", "batch_tokens"})

    def __init__(self, tmp: Path, cache: Path, root: Path, name: str = "cpu0"):
        from hsx.access import normalise
        from hsx.broker import EmbeddedBroker
        from settings import Settings
        from workers.launcher import worker_command

        self.root = normalise(str(root))
        self.broker = EmbeddedBroker(tmp / "broker").start()
        self.env = clean_env(broker_url=self.broker.url, cache_dir=cache, model="tiny-qwen3.5", store_url=root,
                             spool_dir=tmp / "spool", state_dir=tmp / "state")
        with environ(self.env):
            self.settings = Settings(_env_file=None)
        self.log_path = tmp / "worker.log"
        self.jobs = 0
        """How many ``producer run`` jobs the worker served."""
        self._log = open(self.log_path, "wb")
        self.proc = worker_popen(worker_command(self.settings, name, "INFO"), self.env, self._log, self.log_path)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def producer(self, args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
        """``python -m producer ARGS`` with environment ``env`` plus the shared broker's URL, run in
        this process with the shared worker as its workers (:func:`run_here`)."""
        return run_here(args, {**env, "HSX_BROKER_URL": self.broker.url}, local_workers=self._local_workers)

    def _local_workers(self, env: dict[str, str], log_path: Path, count: int | None = None) -> _SharedWorkerHandle:
        """Stands for ``producer.run.LocalWorkers(env, log_path, count)``: the job's worker settings
        (``env`` is what the workers ``run`` starts would get) must be the shared worker's."""
        from hsx.access import normalise
        from settings import Settings

        with environ(env):
            job = Settings(_env_file=None)
        differ = {name: (getattr(job, name), getattr(self.settings, name)) for name in Settings.model_fields
                  if name not in self.PER_JOB and getattr(job, name) != getattr(self.settings, name)}
        from workers.faults import ENV as FAULTS  # fault injection is no setting, but the worker's all the same
        if env.get(FAULTS) != self.env.get(FAULTS):
            differ["faults"] = (env.get(FAULTS), self.env.get(FAULTS))
        assert not differ, (f"this job's worker settings differ from the shared worker's (job, shared): {differ}; "
                            "give the test a worker of its own (WorkerProcess) or run it with run_cli")
        assert self.root.contains(normalise(job.store_url)), (
            f"--output {job.store_url} is outside the shared worker's store root {self.root}: use tmp_path")
        assert count in (None, 1), f"--workers {count}: the shared worker is one process"
        assert self.proc.poll() is None, f"the shared worker exited:\n{self.log()[-3000:]}"
        self.jobs += 1
        return _SharedWorkerHandle(self)

    def stop(self, timeout_s: float = 30) -> None:
        """Warm shutdown of the worker (SIGTERM; SIGKILL after ``timeout_s``), then the broker."""
        try:
            stop_process(self.proc, timeout_s)
        finally:
            self._log.close()
            self.broker.stop()


class _SharedWorkerHandle:
    """What ``run_job`` holds of its workers (``alive``, ``log_tail``, ``stop``, ``kill``), for the
    shared worker: stopping it is left to the session's end."""

    def __init__(self, shared: SharedWorker):
        self.shared = shared
        self.log_path = shared.log_path

    def alive(self) -> bool:
        return self.shared.proc.poll() is None

    def log_tail(self, n: int = 30) -> str:
        return "\n".join(self.shared.log().splitlines()[-n:])

    def stop(self, timeout_s: float = 60.0, say=None, every_s: float = 10.0, on_kill=None) -> None:
        pass

    def kill(self) -> None:
        pass


def read_samples(run_store) -> dict[int, dict]:
    """Every sample of every shard certified by a marker, keyed by sample_index.

    Fails if a sample appears twice or a shard does not match its marker's sha256 / size.
    """
    from hsx.records import Marker, done_batches
    from hsx.shard import read_shard
    from hsx.store import verify

    samples: dict[int, dict] = {}
    for batch in sorted(done_batches(run_store)):
        marker = Marker.read(run_store, batch)
        key = marker.shard.key
        verify(run_store, key, marker.shard.bytes, marker.shard.sha256)
        path = run_store.local_path(key)
        if path is None:
            path = Path(os.environ.get("TMPDIR", "/tmp")) / f"hsx-test-{os.getpid()}-{batch}.safetensors"
            path.write_bytes(run_store.read(key))
        tensors, meta = read_shard(path)
        cu = tensors["cu_seqlens"].tolist()
        for j, sample in enumerate(tensors["sample_index"].tolist()):
            assert sample not in samples, f"sample {sample} appears twice (again in batch {batch})"
            lo, hi = cu[j], cu[j + 1]
            samples[sample] = {
                "batch": batch,
                "meta": meta,
                **{name: t[lo:hi] for name, t in tensors.items() if name not in ("cu_seqlens", "sample_index")},
            }
    return samples


def plan_samples(run_store) -> dict[int, dict]:
    """Every planned sample's input ids and loss mask, keyed by sample_index (from the plan files)."""
    from hsx.plan import read_batch, read_batch_list

    out = {}
    for b in read_batch_list(run_store):
        plan = read_batch(run_store, b.batch)
        cu = plan.cu_seqlens_N1
        for j, sample in enumerate(plan.sample_index_N.tolist()):
            out[sample] = {"input_ids": plan.input_ids_T[cu[j]:cu[j + 1]], "loss_mask": plan.loss_mask_T[cu[j]:cu[j + 1]]}
    return out


def assert_matches_reference(model, samples: dict[int, dict], layer_ids: list[int], *, atol: float, rtol: float,
                             final: str = "postnorm") -> int:
    """Each stored sample == the reference forward on it alone (``hsx/reference.py``: layer id i is
    the output of decoder layer i, id N-1 and ``final_prenorm`` the last layer's raw output,
    ``final_postnorm`` after the model's norm), for every layer and each final ``final`` names.

    ``samples`` as :func:`read_samples` gives them (``hidden_states`` [S, K, H]). Returns the
    number of values compared; a mismatch fails with the sample, the tensor and the max |diff|.
    """
    from hsx.reference import reference_states
    from hsx.shard import Final

    compared = 0
    for sample, s in samples.items():
        ref = reference_states(model, torch.as_tensor(np.asarray(s["input_ids"]), dtype=torch.long), layer_ids, final)
        pairs = [(f"layer {layer}", s["hidden_states"][:, k], ref["hidden_states"][:, k]) for k, layer in enumerate(layer_ids)]
        pairs += [(name, s[name], ref[name]) for name in Final(final).tensors]
        for what, got, want in pairs:
            got = got.float()
            diff = (got - want).abs().max().item()
            assert torch.allclose(got, want, atol=atol, rtol=rtol), (
                f"sample {sample} {what}: max |diff| {diff:.3g} > atol {atol} + rtol {rtol} x |ref|")
            compared += got.numel()
    return compared


def closed_port_url() -> str:
    """``http://127.0.0.1:<port>`` with nothing listening on the port."""
    return f"http://127.0.0.1:{free_port()}"


#: keys every benchmark's ``machine`` block has (``machine_info`` in bench/planning.py).
BENCH_MACHINE_KEYS = {"date_utc", "cpus", "cpu_model", "ram_gib", "python", "torch", "transformers", "git_commit"}


def run_bench(script: str, args: list[str], cache: Path, timeout_s: float = 300) -> subprocess.CompletedProcess:
    """``python bench/<script> <args>`` in a clean environment (no HSX_* / AWS_* of the machine; the tiny
    models' cache ``cache``); asserts exit 0 and returns the finished process."""
    proc = run_python([f"bench/{script}", *args], clean_env(cache_dir=cache), timeout_s=timeout_s)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    return proc
