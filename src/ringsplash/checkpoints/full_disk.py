"""A full disk during a save: one clear error instead of a traceback per writer thread.

``held_logs`` holds back, while a save runs, the ERROR records of orbax's writer threads and the
unraisable exceptions of tensorstore's callbacks; ``no_space`` finds the ENOSPC in an error's
chain; ``join_writers`` lets orbax's other writer threads fail before the held logs are dropped.
"""

import errno
import logging
import sys
import threading
import time

__all__ = ["held_logs", "join_writers", "no_space"]


def no_space(err: BaseException) -> str | None:
    """The first line of the error in ``err``'s chain that says the disk is full (an ``OSError``
    ENOSPC from Python, or tensorstore's "No space left on device [os_error_code='28']"); None if
    none does."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        text = str(err)
        if (isinstance(err, OSError) and err.errno == errno.ENOSPC) or "No space left on device" in text:
            return (text.strip().splitlines() or [""])[0][:200]
        err = err.__cause__ or err.__context__
    return None


def join_writers(timeout: float = 60.0) -> None:
    """Wait for orbax's writer threads still running after a failed save (each fails on its own)."""
    try:
        from orbax.checkpoint._src.futures.future import _SignalingThread
    except ImportError:  # another orbax layout: nothing to wait for by name
        return
    deadline = time.monotonic() + timeout
    for thread in threading.enumerate():
        if isinstance(thread, _SignalingThread) and thread is not threading.current_thread():
            thread.join(max(0.0, deadline - time.monotonic()))


class _Held(logging.Filter):
    """Holds back, during a save, the ERROR records of orbax's writer threads (each with a
    traceback) and the unraisable exceptions of tensorstore's callbacks into closed event loops;
    they are emitted afterwards unless cleared (a full disk: one error says it all)."""

    def __init__(self):
        super().__init__()
        self.records: list[logging.LogRecord] = []
        self.unraisable: list = []

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR:
            self.records.append(record)
            return False
        return True

    def clear(self) -> None:
        self.records.clear()
        self.unraisable.clear()


class held_logs:
    def __enter__(self) -> _Held:
        self.held, self.logger, self.hook = _Held(), logging.getLogger("absl"), sys.unraisablehook
        self.logger.addFilter(self.held)
        sys.unraisablehook = self.held.unraisable.append
        return self.held

    def __exit__(self, *exc) -> None:
        self.logger.removeFilter(self.held)
        sys.unraisablehook = self.hook
        for record in self.held.records:
            self.logger.handle(record)
        for unraisable in self.held.unraisable:
            self.hook(unraisable)
