"""A command's process ends without the interpreter's last garbage collections.

At exit CPython collects garbage over every object still alive; with torch (or Numba and
llvmlite) loaded those are hundreds of thousands, and the collections took 2-5 s per
process on a loaded 2-core machine (0.4-0.9 s for a shadow), paid by whoever waits for the
process to end: the launcher for its shadows, a test or the testbed for every command it
runs. The last atexit handler freezes the heap (``gc.freeze``), which makes those
collections cheap. What is still alive then is not released one by one any more -- its
finalizers do not run, as after ``os._exit`` -- so the handler first flushes every open
stream (``checkmate.train.run_script`` ends its workers the same way): no buffered write
is lost, whether the file sits in a module's globals or in a reference cycle. Handlers
registered before ``install`` (at import time: logging's, torch's) still run after it.

A process that loaded triton is left to the usual teardown: triton's nanobind bindings
report every one of their objects still alive at exit as a leak, hundreds of lines on
stderr.
"""

from __future__ import annotations

import _io
import atexit
import contextlib
import gc
import sys

_installed = False


def _flush_and_freeze() -> None:
    if "triton" in sys.modules:
        return
    # type(), not isinstance: no __class__ lookup (torch.distributed.reduce_op warns);
    # _io._IOBase is the C base of every stream, Python-level ones (gzip, ...) included.
    for obj in gc.get_objects():
        if issubclass(type(obj), _io._IOBase):
            with contextlib.suppress(Exception):
                if not obj.closed:
                    obj.flush()
    gc.freeze()


def install() -> None:
    """Flush open streams and freeze the heap at exit, after the atexit handlers registered
    later than this call have run."""
    global _installed
    if not _installed:
        atexit.register(_flush_and_freeze)
        _installed = True
