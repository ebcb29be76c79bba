"""Put first on PYTHONPATH by a bench with HSXBENCH_TRACE_DIR set: loads bench/worker_trace.py's
tracer into each process of the run (it acts only in a worker that imports workers.extract)."""

import os
import sys

if os.environ.get("HSXBENCH_TRACE_DIR"):
    try:
        import importlib.util

        _path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "worker_trace.py")
        _spec = importlib.util.spec_from_file_location("hsxbench_worker_trace", _path)
        _module = importlib.util.module_from_spec(_spec)
        sys.modules["hsxbench_worker_trace"] = _module
        _spec.loader.exec_module(_module)
        _module.install()
    except Exception as exc:  # a diagnostic must never stop the run it watches
        print(f"hsxbench worker_trace not installed: {exc!r}", file=sys.stderr)
