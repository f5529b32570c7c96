"""A command's process ends without the interpreter's last garbage collections.

At exit CPython collects garbage over every object still alive; with torch (or Numba and
llvmlite) loaded those are millions, and the collections took 2-5 s per process on a loaded
2-core machine (0.4-0.9 s for a shadow), paid by whoever waits for the process to end: the
launcher for its shadows, a test or the testbed for every command it runs. Freezing the
heap (``gc.freeze``) in an atexit handler leaves the rest of the teardown as it is: objects
are still released by reference count (files flushed and closed, finalizers run); only
garbage caught in reference cycles is left to the operating system, as it is for any
process that ends with ``os._exit``.
"""

from __future__ import annotations

import atexit
import gc

_installed = False


def install() -> None:
    """Freeze the heap at exit, after the atexit handlers registered later have run."""
    global _installed
    if not _installed:
        atexit.register(gc.freeze)
        _installed = True
