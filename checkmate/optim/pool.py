"""Run one elementwise kernel on several threads, the calling thread included.

Numba's ``workqueue`` layer (the one that does not fight torch's OpenMP threads, see
:mod:`checkmate.optim.kernels`) wakes its workers twice per launch (a thread-count sync,
then the work), keeps the caller waiting meanwhile and splits the work statically. After
an idle gap each wake-up costs tens to hundreds of microseconds here, so small and
medium steps paid more in launch than in work (measured: 0.3 ms for a 131072-element
AdamW step after 10 ms idle, 4x the serial kernel).

Here the caller starts on the work at once; helper threads, woken with one lock release
each, join in when they get a core. Every participant takes ``grab`` elements at a time
from a shared atomic counter (``ctl[0]``), so a late or slowed thread simply does less.
``ctl[1]`` counts participants inside the kernel: the caller returns when it is zero. The
work is elementwise, so who does which piece never changes a result.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

import numba
import numpy as np
from numba import njit, types
from numba.extending import intrinsic


@intrinsic
def fetch_add(typingctx, ctl, index, delta):
    """``ctl[index] += delta`` atomically (sequentially consistent); returns the old value."""
    if not (isinstance(ctl, types.Array) and ctl.dtype == types.int64):
        return None
    sig = types.int64(ctl, types.intp, types.int64)

    def codegen(context, builder, signature, args):
        arr = context.make_array(signature.args[0])(context, builder, args[0])
        ptr = builder.gep(arr.data, [args[1]])
        return builder.atomic_rmw("add", ptr, args[2], "seq_cst")

    return sig, codegen


@njit(cache=True, nogil=True)
def _inside(ctl: np.ndarray) -> int:
    """Participants still inside the kernel (an atomic read)."""
    return fetch_add(ctl, 1, 0)


class _Pool:
    """Helper threads parked on one lock each; one job at a time (``run`` holds a lock)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.helpers: list[threading.Lock] = []
        self.job: tuple[Callable[..., Any], tuple[Any, ...]] | None = None

    def _helper(self, go: threading.Lock) -> None:
        while True:
            go.acquire()
            job = self.job
            if job is None:
                continue
            worker, args = job
            try:
                worker(*args)
            except Exception:  # noqa: BLE001 - the caller runs the same call and raises it
                pass

    def _grow(self, count: int) -> None:
        while len(self.helpers) < count:
            go = threading.Lock()
            go.acquire()
            self.helpers.append(go)
            threading.Thread(target=self._helper, args=(go,), daemon=True,
                             name=f"checkmate-optim-{len(self.helpers)}").start()

    def run(self, worker: Callable[..., Any], args: tuple[Any, ...], threads: int) -> None:
        """``worker(*args, ctl)`` on ``threads`` threads (the caller is one of them)."""
        ctl = np.zeros(2, np.int64)
        full = (*args, ctl)
        with self.lock:
            self._grow(threads - 1)
            self.job = (worker, full)
            for go in self.helpers[:threads - 1]:
                if go.locked():  # else a wake-up is still pending: it will see this job
                    go.release()
            try:
                worker(*full)
            finally:
                while _inside(ctl) != 0:  # a helper is finishing its last piece
                    time.sleep(0)
                self.job = None


_POOL = _Pool()


def _after_fork() -> None:
    global _POOL
    _POOL = _Pool()  # the helper threads do not exist in a forked child


os.register_at_fork(after_in_child=_after_fork)


def run(worker: Callable[..., Any], args: tuple[Any, ...], threads: int | None = None) -> None:
    """Run ``worker(*args, ctl)`` on ``threads`` threads (default: Numba's thread count)
    and return when all are done. ``worker`` is a nogil Numba function that takes pieces
    with ``fetch_add(ctl, 0, grab)`` between ``fetch_add(ctl, 1, 1)`` and
    ``fetch_add(ctl, 1, -1)``. Calls from several Python threads run one after another."""
    n = numba.get_num_threads() if threads is None else threads
    _POOL.run(worker, args, max(1, n))
