"""checkmate.optim.pool: the parallel launch our kernels use (caller + helper threads
taking pieces from an atomic counter). Results must not depend on who ran which piece;
several Python threads and a forked child must be able to launch."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
from numba import njit

from checkmate.optim import kernels, ops, pool
from checkmate.optim.pool import fetch_add

N = 1_000_003  # not a multiple of any piece size


def _arrays(seed: int) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    p, g, m = (rng.standard_normal(N).astype(np.float32) for _ in range(3))
    v = np.abs(rng.standard_normal(N)).astype(np.float32)
    return p, g, m, v


def _scalars() -> np.ndarray:
    return ops.adam_scalars(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01,
                            decoupled=True, step=3, gscale=np.float32(0.75))


def _serial(seed: int) -> tuple[np.ndarray, ...]:
    p, g, m, v = _arrays(seed)
    kernels._adam_serial(p, g, m, v, np.zeros(0, np.float32), _scalars(), False)
    return p, m, v


def _parallel(seed: int, threads: int, grab: int) -> tuple[np.ndarray, ...]:
    p, g, m, v = _arrays(seed)
    pool.run(kernels._adam_worker, (p, g, m, v, np.zeros(0, np.float32), _scalars(), False,
                                    grab), threads)
    return p, m, v


def _same(a: tuple[np.ndarray, ...], b: tuple[np.ndarray, ...]) -> bool:
    return all(np.array_equal(x.view(np.int32), y.view(np.int32))
               for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("threads,grab", [(1, 16384), (2, 16384), (3, 32768), (2, 1 << 20)])
def test_any_thread_count_and_piece_size_gives_the_serial_bits(threads: int, grab: int) -> None:
    assert _same(_parallel(0, threads, grab), _serial(0))


@njit(nogil=True)
def _owner_worker(owner: np.ndarray, acc: np.ndarray, grab: int, ctl: np.ndarray) -> None:
    """Marks each piece with the entry rank of the thread that took it (0: first in);
    a dependent chain per element makes the whole call last tens of milliseconds."""
    n = owner.shape[0]
    me = fetch_add(ctl, 1, 1)
    while True:
        lo = fetch_add(ctl, 0, grab)
        if lo >= n:
            break
        for i in range(lo, min(lo + grab, n)):
            owner[i] = me
            x = float(i)
            for _ in range(100):
                x = x * 0.999999 + 1e-3
            acc[i] = x
    fetch_add(ctl, 1, -1)


def test_helpers_really_take_pieces() -> None:
    """With 2 threads a second thread takes pieces while the first still works (else the
    pool would be a serial loop in disguise)."""
    owner = np.full(200_000, -1, np.int64)
    acc = np.zeros(owner.shape[0])
    for _ in range(10):
        owner[:] = -1
        pool.run(_owner_worker, (owner, acc, 2048), 2)
        assert (owner >= 0).all()
        if (owner == 1).any():
            return
    pytest.fail("no second thread ever took a piece while the first was working")


def test_launches_from_several_python_threads() -> None:
    """Shadows in one process step from their own threads: launches serialize, results
    are each thread's own serial bits."""
    out: dict[int, tuple[np.ndarray, ...]] = {}

    def work(seed: int) -> None:
        out[seed] = _parallel(seed, 2, 16384)

    ts = [threading.Thread(target=work, args=(seed,)) for seed in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=60)
    assert sorted(out) == [0, 1, 2, 3]
    for seed in range(4):
        assert _same(out[seed], _serial(seed)), seed


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_can_launch() -> None:
    """Helper threads do not survive fork, and another thread may be mid-launch (holding
    the pool's lock) at that moment: the child must still launch, not wait forever."""
    _parallel(0, 2, 16384)  # the parent has helpers now
    held, leave = threading.Event(), threading.Event()

    def launcher() -> None:  # another thread mid-launch while we fork
        with pool._POOL.lock:
            held.set()
            leave.wait(60)

    t = threading.Thread(target=launcher)
    t.start()
    held.wait(60)
    try:
        pid = os.fork()
    finally:
        if pid != 0:
            leave.set()
            t.join()
    if pid == 0:  # child: exit status says whether the bits were right
        code = 1
        try:
            code = 0 if _same(_parallel(0, 2, 16384), _serial(0)) else 1
        finally:
            os._exit(code)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.05)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    pytest.fail("the forked child's parallel step hung")
