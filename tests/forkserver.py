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
    """Answer requests until stdin closes (returns None) or, in a forked child, return its request."""
    children: set[int] = set()
    sys.stdout.write(json.dumps({"ready": os.getpid()}) + "\n")
    sys.stdout.flush()
    while True:
        ready, _, _ = select.select([sys.stdin], [], [], 0.05)
        _reap(exits_dir, children)
        if not ready:
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
            return request
        children.add(pid)
        sys.stdout.write(json.dumps({"pid": pid}) + "\n")
        sys.stdout.flush()


def _become(request: dict) -> None:
    """In the forked child: the command's session, stdio, directory, environment and ``sys.path[0]``."""
    os.setsid()  # as Popen(start_new_session=True): a test kills its process group
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
    job = _serve(exits)
    if job is None:
        sys.exit(0)
    _become(job)
    argv = job["argv"]
    del exits, job
    code: int | str | None = 0
    try:
        _run(argv)
    except SystemExit as exc:
        code = exc.code
    except BaseException as exc:
        sys.excepthook(type(exc), exc, exc.__traceback__)
        code = -signal.SIGINT if isinstance(exc, KeyboardInterrupt) else 1
    _exit(code)
