"""A Ctrl-C (SIGINT), SIGTERM or SIGHUP that ``python -m producer`` received, kept beside the
KeyboardInterrupt its handler raised, so that no such signal is ever lost.

CPython raises a signal handler's exception in whatever Python code the main thread runs next.
When that is a finalizer (``__del__``, a weakref callback such as the one that drops a finished
thread from ``threading``'s WeakSet, a generator the garbage collector closes) the exception is
printed as ``Exception ignored in ...`` and dropped; a library's ``except BaseException`` that does
not re-raise drops it silently. The run then went on as if the user had not pressed Ctrl-C: a
``producer run --regenerate`` answered every batch and extracted them too, and exited 0.

:func:`install` (``producer.cli.main``) sets handlers that note the signal here before they raise
KeyboardInterrupt; the loops that wait (``producer.run.wait_for_markers``, the planner's tick)
and the step between the two stages of ``run --regenerate`` call :func:`check`, which raises
KeyboardInterrupt again for a signal noted here: the run stops at the next poll as it would have.
Once a KeyboardInterrupt propagates the command ends with the shell's code for the signal
(:func:`exit_code`: 130 for Ctrl-C, 143 for SIGTERM, 129 for SIGHUP), so a noted signal is never
raised twice. :func:`uninstall` restores the handlers and forgets the signal (``main`` returns).
"""

from __future__ import annotations

import signal

_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_received: int | None = None  # the first signal noted since install(); None: none
_previous: dict[int, object] = {}


def _on_signal(signum, _frame):
    # SIGTERM and SIGHUP (a closed terminal or SSH session) take the same path as Ctrl-C, so `run`
    # stops the broker and workers it started.
    global _received
    if _received is None:
        _received = signum
    raise KeyboardInterrupt


def install() -> None:
    """Handle SIGINT, SIGTERM and SIGHUP: note the signal, raise KeyboardInterrupt (main thread only)."""
    global _received
    _received = None
    for s in _SIGNALS:
        if s == signal.SIGINT and signal.getsignal(s) == signal.SIG_IGN:
            continue  # started with Ctrl-C ignored (a background job of a script): as Python leaves it
        previous = signal.signal(s, _on_signal)
        _previous.setdefault(s, previous)


def uninstall() -> None:
    """Put back the handlers :func:`install` replaced; forget any signal noted."""
    global _received
    for s, handler in list(_previous.items()):
        signal.signal(s, handler if handler is not None else signal.SIG_DFL)
    _previous.clear()
    _received = None


def received() -> int | None:
    """The signal noted since :func:`install` (``signal.SIGINT`` ...), or None."""
    return _received


def exit_code() -> int:
    """The exit code for a command stopped by the noted signal: 128 + its number, as a shell reports a
    process a signal ended (130 SIGINT, 143 SIGTERM, 129 SIGHUP; a scheduler such as Kubernetes or
    Slurm reads 143 as "terminated"). 130 when none was noted (a KeyboardInterrupt raised otherwise)."""
    return 128 + int(_received) if _received is not None else 128 + int(signal.SIGINT)


def check() -> None:
    """Raise KeyboardInterrupt if a signal was noted: its own KeyboardInterrupt may have been dropped."""
    if _received is not None:
        raise KeyboardInterrupt
