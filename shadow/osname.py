"""Give the current thread its Python name in the kernel too (``/proc/PID/task/TID/comm``).

Python 3.11 leaves every thread named after the process, so per-thread CPU accounting
(top -H, /proc, the training benchmark's per-thread shadow CPU) could not tell the receive
thread from the step thread.
"""

from __future__ import annotations

import ctypes
import threading

_PR_SET_NAME = 15
_libc = None


def name_thread() -> None:
    """Best effort: copy ``threading.current_thread().name`` (first 15 bytes) to the kernel."""
    global _libc
    try:
        if _libc is None:
            _libc = ctypes.CDLL(None, use_errno=True)
        name = threading.current_thread().name.encode()[:15]
        _libc.prctl(_PR_SET_NAME, ctypes.c_char_p(name), 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux, or no prctl: only the accounting label is lost
