"""The CPU side of GoCkpt mode: one local process per trainer rank (checkmate.gockpt.trainer).

It receives one partition's state in slices, each captured at a later iteration, and the
gradients of the slices already received, rolls every slice forward to the window's last
iteration with the shadows' own code (``checkmate.shadow.reseed.Reseed``: a FlatOptimizer
per slice, the trainers' arithmetic bit for bit), and persists the consistent result as a
shadow partition checkpoint (DCP, several writer threads) that ``checkmate.gockpt.trainer.restore``
and a plain ``dcp.load`` of the joined checkpoint read. Training never waits for the roll
forward; it pays for issuing the copies of the slices and gradients (checkmate.train.copyengine:
they overlap its next steps; a sender thread writes them here), and waits for a write only
when the disk is a whole window behind (``GoCkpt._wait_previous``).

The roll-forward runs as messages arrive; the write runs on a thread of its own, so the
process keeps taking the next window's slices while it writes (a window that completes
while the previous checkpoint is still being written waits for it: one write at a time).

Messages (``multiprocessing`` connection; arrays follow as raw bytes, never pickled):
``("begin",
spec_json, partition, t0)``, ``("piece", iteration, step, offset, count)`` +
one array per slot, ``("iteration", iteration, count, control)`` + the gradient of the
first ``count`` elements of the partition, ``("stop",)``. Answers: ``("committed",
iteration, seconds)`` after a checkpoint is on disk, ``("error", text)``.
"""

from __future__ import annotations

import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

from checkmate.errors import CheckmateError


def recv_array(conn: Connection, n: int) -> np.ndarray:
    """One float32 array of ``n`` elements, received straight into its own buffer."""
    out = np.empty(n, np.float32)
    got = conn.recv_bytes_into(memoryview(out).cast("B"))
    if got != 4 * n:
        raise CheckmateError(f"gockpt: expected {4 * n} bytes, got {got}")
    return out


def serve(conn: Connection, root: str, keep: int, threads: int) -> None:
    """The worker's loop (the process target); ends at ``stop`` or when the trainer is gone,
    after the checkpoint being written is on disk."""
    import threading

    from checkmate.shadow import persist
    from checkmate.shadow.control_message import Control
    from checkmate.shadow.reseed import Reseed
    from checkmate.spec.model import ModelSpec

    spec: ModelSpec | None = None
    window: Reseed | None = None
    partition = 0
    writer: threading.Thread | None = None
    send_lock = threading.Lock()

    def answer(msg: tuple) -> None:
        with send_lock:
            try:
                conn.send(msg)
            except (BrokenPipeError, OSError):
                pass  # the trainer is gone; the checkpoint is on disk all the same

    def write(s: ModelSpec, last: int, step: int, arrays: dict, c: Control) -> None:
        t = time.perf_counter()
        try:
            persist.save(root, s, partition, last, step, arrays, c.buffers, c.extra, c.lrs,
                         keep=keep, threads=threads)
        except CheckmateError as e:
            answer(("error", f"cannot write the checkpoint of iteration {last}: {e}"))
            return
        answer(("committed", last, time.perf_counter() - t))

    def spec_of(obj: Any) -> ModelSpec:
        return spec if spec is not None and spec.to_json() == obj else ModelSpec.from_json(obj)

    try:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                return  # the trainer is gone: no window can complete any more
            try:
                if msg[0] == "stop":
                    return
                if msg[0] == "begin":
                    _, spec_json, partition, t0 = msg
                    spec = spec_of(spec_json)
                    start, end = spec.bounds(partition)
                    window = Reseed(spec, start, end, t0, "gockpt", limit=1 << 30)
                elif msg[0] == "piece":
                    _, it, step, offset, count = msg
                    assert spec is not None and window is not None
                    arrays = {s: recv_array(conn, count) for s in spec.slots}
                    window.add_piece(it, step, offset, count, arrays)
                elif msg[0] == "iteration":
                    _, it, count, ctl = msg
                    assert spec is not None and window is not None
                    grad = np.zeros(window.size, np.float32)
                    grad[:count] = recv_array(conn, count)
                    window.on_iteration(it, grad, Control(**ctl))
                    if window.done():
                        last, step, arrays, c = window.result()
                        window = None
                        if writer is not None:
                            writer.join()  # one write at a time
                        writer = threading.Thread(target=write, name="ckm-gockpt-write",
                                                  args=(spec, last, step, arrays, c))
                        writer.start()
                else:
                    raise CheckmateError(f"gockpt: unknown message {msg[0]!r}")
            except CheckmateError as e:
                window = None  # this window is lost; the next one starts afresh
                answer(("error", str(e)))
    finally:
        if writer is not None:
            writer.join()


def lock_path(root: str | Path, rank: int) -> Path:
    """The file a rank's process holds locked while it lives
    (checkmate.gockpt.trainer.wait_idle)."""
    return Path(root) / f".rank{rank}.lock"


def main(conn: Connection, root: str, rank: int, spec_json: Any, keep: int, threads: int
         ) -> Any:
    """Process entry point: one thread for the kernels (the trainer owns the cores), and a
    session of its own, so that a launcher stopping the trainer's process group does not
    stop a checkpoint write half-way (the process ends by itself once its trainer is gone
    and what it received is written). It holds its rank's lock file while it lives, so a
    restarted job can wait for it (and a second incarnation of the rank waits here). It
    compiles the optimizer kernels, then says ``("ready",)``."""
    import fcntl
    import os

    os.setsid()
    os.environ.setdefault("NUMBA_NUM_THREADS", "1")
    Path(root).mkdir(parents=True, exist_ok=True)
    with open(lock_path(root, rank), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            from checkmate.shadow.kernels import warm_up
            from checkmate.spec.model import ModelSpec

            warm_up(ModelSpec.from_json(spec_json))  # compile before the first window
            conn.send(("ready",))
            serve(conn, root, keep, threads)
        except KeyboardInterrupt:
            pass
        finally:
            conn.close()
