"""The tests' fork server: one Python process per pytest process that imports the third-party packages
a worker process imports (torch, transformers and its Qwen3.5 modules, celery, kombu, redis,
pydantic, safetensors, boto3...), then forks one child per Python process a test starts through
``jobfixtures`` (``WorkerProcess``, the shared worker, ``run_cli``, ``run_python``, ``run_bench``).
The child takes the command's environment, working directory, stdout and stderr, and runs
``python -m module ...``, ``python -c code ...`` or ``python script ...`` as the interpreter would
(``runpy``, ``__main__``, ``sys.argv``, ``sys.path[0]``), exiting as it does. It is the same separate
process a test would otherwise start with ``subprocess``, less the ~2.5 CPU seconds of importing
torch and transformers again (a worker's start and stop: about 5 CPU s -> 1 on the 2-core CI
machine; the child ends with ``os._exit`` after the interpreter's own exit steps, since tearing its
modules down would copy every page it shares with the server). The project's own modules (``hsx``, ``workers``,
``producer``, ``settings``) are imported by the child, never here, so whatever they read from the
environment at import they read from the command's own.

Only a command whose environment outside ``HSX_*`` is this server's own is forked
(``jobfixtures.same_libraries_env``): one that changes ``PYTHONPATH``, ``COLUMNS`` or any variable a
library could read at import gets a fresh interpreter. ``TEST_FORK_SERVER=0`` turns the server off.

A process forked here starts its own Python children the same way (:func:`_route_children`): its
``subprocess.Popen([sys.executable, "-m", "celery" | "workers" | "producer", ...])`` or
``subprocess.Popen([sys.executable, "script.py", ...])`` asks this server for the child over the Unix
socket ``<dir>/fork.sock`` (the child's ends of its stdio passed with the request: inherited streams,
files, ``DEVNULL`` and ``PIPE`` alike) when the child's environment allows, so that ``producer run``'s
launcher and the launcher's Celery workers (in the tests, benches and ``producer run`` as processes),
and the benches' helper processes (``bench/planning.py ceiling-worker``), are forked too, not fresh
interpreters importing torch and transformers again (~8 CPU-s per worker start on this machine). What
differs from a real child: its parent is this server (a tree read with psutil does not show it, and
its ``cmdline`` is the server's), it has a session of its own, and the launcher's parent-death
signal (``workers.launcher.die_with_parent``) is sent by a thread watching the requester's pid. A test
that reads the process tree runs its command unrouted (``jobfixtures.unrouted``).

Protocol, one JSON line each way on stdin / stdout: ``{"argv", "env", "cwd", "stdout", "stderr"}``
(``argv``: the interpreter's arguments, ``-m module ...``, ``-c code ...`` or ``script ...``; the
two files appended to, ``stderr`` null for the same file as ``stdout``) -> ``{"pid"}``. A child's
exit code (``Popen.returncode``'s convention: ``-N`` for signal N) is written to ``<dir>/<pid>.exit``
once this server has reaped it. When stdin closes, the server SIGKILLs the process groups of the
children still running and exits.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import sys

#: What a worker process imports from outside the project (each tried; one missing is skipped).
PREIMPORT = (
    "numpy", "torch", "safetensors", "safetensors.torch", "transformers", "transformers.modeling_utils",
    "transformers.core_model_loading", "transformers.masking_utils", "transformers.models.auto.modeling_auto",
    "transformers.models.auto.tokenization_auto", "transformers.models.qwen3_5.modeling_qwen3_5",
    "transformers.models.qwen3_5.configuration_qwen3_5", "tokenizers", "celery", "celery.bin.celery", "celery.apps.worker",
    "celery.worker", "celery.concurrency.thread", "celery.backends.redis", "kombu", "kombu.transport.redis", "redis",
    "pydantic", "pydantic_settings", "boto3", "botocore.session", "botocore.client", "yaml", "dotenv", "psutil",
)


def _preimport() -> None:
    import importlib

    for name in PREIMPORT:
        try:
            importlib.import_module(name)
        except Exception:  # an optional package: the child imports what it needs itself
            pass


def _reap(exits_dir: str, children: set[int]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        children.discard(pid)
        tmp = os.path.join(exits_dir, f"{pid}.exit.tmp")
        with open(tmp, "w") as f:
            f.write(str(os.waitstatus_to_exitcode(status)))
        os.replace(tmp, os.path.join(exits_dir, f"{pid}.exit"))


def _serve(exits_dir: str) -> dict | None:
    """Answer requests until stdin closes (returns None) or, in a forked child, return its request.
    Requests come on stdin (the pytest process) and on ``<exits_dir>/fork.sock`` (the processes forked
    here, :func:`_route_children`: a JSON datagram with the child's stdin, stdout and stderr as file
    descriptors; the reply ``{"pid"}``)."""
    children: set[int] = set()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(os.path.join(exits_dir, "fork.sock"))
    listener.listen(64)
    sys.stdout.write(json.dumps({"ready": os.getpid()}) + "\n")
    sys.stdout.flush()
    while True:
        ready, _, _ = select.select([sys.stdin, listener], [], [], 0.05)
        _reap(exits_dir, children)
        if listener in ready:
            conn, _ = listener.accept()
            try:
                msg, fds, _flags, _addr = socket.recv_fds(conn, 1 << 20, 3)
                request = {**json.loads(msg), "fds": fds}
            except (OSError, ValueError):
                conn.close()
                continue
            pid = os.fork()
            if pid == 0:
                listener.close()
                conn.close()
                return request
            children.add(pid)
            for fd in fds:
                os.close(fd)
            try:
                conn.sendall(json.dumps({"pid": pid}).encode())
            except OSError:
                pass
            conn.close()
        if sys.stdin not in ready:
            continue
        line = sys.stdin.readline()
        if not line:
            for pid in children:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except OSError:
                    pass
            return None
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            listener.close()
            return request
        children.add(pid)
        sys.stdout.write(json.dumps({"pid": pid}) + "\n")
        sys.stdout.flush()


def _become(request: dict) -> None:
    """In the forked child: the command's session, stdio, directory, environment and ``sys.path[0]``."""
    os.setsid()  # as Popen(start_new_session=True): a test kills its process group
    if "fds" in request:  # a routed child: the requester's stdin, stdout, stderr
        for target, fd in enumerate(request["fds"]):
            os.dup2(fd, target)
        for fd in set(request["fds"]):
            os.close(fd)
    else:
        null = os.open(os.devnull, os.O_RDONLY)
        out = os.open(request["stdout"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        err = os.open(request["stderr"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644) if request.get("stderr") else out
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(err, 2)
        for fd in {null, out, err}:
            os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    if "numpy" in sys.modules:  # numpy's global generator was seeded here: seed each child afresh
        sys.modules["numpy"].random.seed()
    if request.get("parent_death"):
        _signal_when_gone(request["parent_death"], signal.SIGTERM)


def _signal_when_gone(pid: int, sig: int) -> None:
    """Send ``sig`` to this process when process ``pid`` ends (``PR_SET_PDEATHSIG`` for a parent that is
    not the real one): a daemon thread blocked on the pid's ``pidfd``."""
    import threading

    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:  # gone before this child ran: the kernel's signal would have come at once
        os.kill(os.getpid(), sig)
        return

    def watch() -> None:
        select.select([pidfd], [], [])
        os.kill(os.getpid(), sig)

    threading.Thread(target=watch, name="parent-death", daemon=True).start()


#: The ``python -m`` commands a forked process starts through this server (:func:`_route_children`). Not
#: their modules: ``workers.follower`` (a tensor-parallel group's rank) checks that its parent is its
#: leader, and a routed child's parent is this server.
ROUTED_MODULES = frozenset({"celery", "workers", "producer"})
#: ``Popen`` arguments a routed child honours; any other makes a real ``Popen``.
ROUTED_KWARGS = frozenset({"env", "cwd", "stdin", "stdout", "stderr", "start_new_session", "preexec_fn", "close_fds",
                           "text", "universal_newlines", "encoding", "errors", "bufsize"})


def routed_command(args) -> bool:
    """Whether ``args`` is a command this server forks for a forked process: ``[sys.executable, "-m",
    <one of ROUTED_MODULES>, ...]`` or ``[sys.executable, "<script>.py", ...]`` (the benches'
    own helper processes: ``bench/planning.py ceiling-worker``...), every argument a string."""
    if not isinstance(args, (list, tuple)) or len(args) < 2 or args[0] != sys.executable:
        return False
    if not all(isinstance(a, str) for a in args):
        return False
    if args[1] == "-m":
        return len(args) >= 3 and args[2] in ROUTED_MODULES
    return args[1].endswith(".py") and not args[1].startswith("-") and os.path.isfile(args[1])


def _route_children(exits_dir: str, server_env: dict[str, str]) -> None:
    """In a forked child: ``subprocess.Popen`` becomes a subclass that asks this server to fork the
    commands it can (:func:`routed_command`, an environment the server could fork
    (``jobfixtures.same_libraries_env``), no ``preexec_fn`` but the launcher's parent-death one) and
    starts the rest as ``Popen`` does. ``Popen`` itself makes the pipes (``PIPE``), opens ``DEVNULL``
    and wraps the streams (``text``...); only the start of the child (``_execute_child``: the child's
    ends of its stdin, stdout and stderr go to the server instead of a fork and exec) and the reaping
    (``_internal_poll``, ``_wait``: the exit code, ``-N`` for signal N, is the one the server wrote
    when it reaped the child) differ, so ``communicate``, ``wait``, ``poll`` and ``send_signal`` work
    as for any child."""
    import subprocess
    from pathlib import Path

    from jobfixtures import ForkedProcess, same_libraries_env

    popen = subprocess.Popen
    sock_path = os.path.join(exits_dir, "fork.sock")

    def request_for(args, positional, kwargs) -> dict | None:
        if positional or not set(kwargs) <= ROUTED_KWARGS or not routed_command(args):
            return None
        preexec = kwargs.get("preexec_fn")
        if preexec is not None and "die_with_parent" not in getattr(preexec, "__qualname__", ""):
            return None
        env = dict(os.environ if kwargs.get("env") is None else kwargs["env"])
        if not same_libraries_env(env, server_env):
            return None
        return {"argv": list(args[1:]), "env": env, "cwd": os.fspath(kwargs.get("cwd") or os.getcwd()),
                "parent_death": os.getpid() if preexec is not None else None}

    class RoutedPopen(popen):
        def __init__(self, args, *positional, **kwargs):
            self._routed = False
            self._forked = None
            self._request = request_for(args, positional, kwargs)
            super().__init__(args, *positional, **kwargs)

        def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo,
                           creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite, *rest):
            if self._request is None:
                return super()._execute_child(args, executable, preexec_fn, close_fds, pass_fds, cwd, env,
                                              startupinfo, creationflags, shell, p2cread, p2cwrite, c2pread,
                                              c2pwrite, errread, errwrite, *rest)
            # the child's ends (-1: inherited from this process)
            fds = [p2cread if p2cread != -1 else 0, c2pwrite if c2pwrite != -1 else 1,
                   errwrite if errwrite != -1 else 2]
            try:
                with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
                    s.connect(sock_path)
                    socket.send_fds(s, [json.dumps(self._request).encode()], fds)
                    reply = s.recv(4096)
            finally:
                self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)
            if not reply:
                raise OSError(f"the tests' fork server did not start {args!r}")
            self.pid = json.loads(reply)["pid"]
            self._child_created = True
            self._routed = True
            self._forked = ForkedProcess(self.pid, list(args), Path(exits_dir) / f"{self.pid}.exit")

        def _internal_poll(self, *args, **kwargs):
            if self._forked is None:
                return super()._internal_poll(*args, **kwargs)
            if self.returncode is None:
                self.returncode = self._forked.poll()
            return self.returncode

        def _wait(self, timeout):
            if self._forked is None:
                return super()._wait(timeout)
            if self.returncode is None:
                self.returncode = self._forked.wait(timeout)
            return self.returncode

    subprocess.Popen = RoutedPopen


def _run(argv: list[str]) -> None:
    """``python ARGV`` in this process, as the interpreter runs it: ``-m module args``, ``-c code args``
    or ``script args`` (``sys.argv`` and ``sys.path[0]`` set the way each form sets them)."""
    import runpy

    if argv[0] == "-m":
        sys.argv = ["-m", *argv[2:]]  # run_module puts the module's file first, as -m does
        sys.path[0] = os.getcwd()
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    elif argv[0] == "-c":
        import types

        sys.argv = ["-c", *argv[2:]]
        sys.path[0] = ""
        main = types.ModuleType("__main__")
        main.__dict__["__builtins__"] = __builtins__
        sys.modules["__main__"] = main
        exec(compile(argv[1], "<string>", "exec"), main.__dict__)
    else:
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")


def _exit(code) -> None:
    """Exit as the interpreter does at the end of ``python ...`` (the non-daemon threads joined, the atexit
    functions run, a ``SystemExit`` argument that is not an int printed, stdio flushed, an uncaught
    KeyboardInterrupt ending the process by SIGINT: ``code`` ``-SIGINT``), but without
    tearing down every module object: that writes to each page the child shares with this server,
    and copying them made a worker's exit cost more CPU than its start."""
    import atexit
    import threading

    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code
    else:
        print(code, file=sys.stderr)
        status = 1
    try:
        threading._shutdown()  # what Py_FinalizeEx does first: wait for the non-daemon threads
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        if status == -signal.SIGINT:  # an uncaught KeyboardInterrupt: the interpreter ends by SIGINT
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        os._exit(status & 0xFF)


if __name__ == "__main__":
    exits = sys.argv[1]
    _preimport()
    import jobfixtures  # noqa: F401  (same_libraries_env, for the children's routing: imported once here)

    server_env = dict(os.environ)
    job = _serve(exits)
    if job is None:
        sys.exit(0)
    _become(job)
    _route_children(exits, server_env)
    argv = job["argv"]
    del exits, job, server_env
    code: int | str | None = 0
    try:
        _run(argv)
    except SystemExit as exc:
        code = exc.code
    except BaseException as exc:
        sys.excepthook(type(exc), exc, exc.__traceback__)
        code = -signal.SIGINT if isinstance(exc, KeyboardInterrupt) else 1
    _exit(code)
