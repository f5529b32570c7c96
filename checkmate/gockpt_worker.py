"""The CPU side of GoCkpt mode: one local process per trainer rank (checkmate.gockpt).

It receives one partition's state in slices, each captured at a later iteration, and the
gradients of the slices already received, rolls every slice forward to the window's last
iteration with the shadows' own code (``checkmate.shadow.reseed.Reseed``: a FlatOptimizer
per slice, the trainers' arithmetic bit for bit), and persists the consistent result as a
shadow partition checkpoint (DCP, several writer threads) that ``checkmate.gockpt.restore``
and a plain ``dcp.load`` of the joined checkpoint read. Training never waits for the roll
forward or the write; it pays only for copying the slices and gradients into the pipe.

Messages (``multiprocessing`` connection; arrays follow as raw bytes, never pickled):
``("begin", spec_json, partition, t0)``, ``("piece", iteration, step, offset, count)`` +
one array per slot, ``("iteration", iteration, count, control)`` + the gradient of the
first ``count`` elements of the partition, ``("stop",)``. Answers: ``("committed",
iteration, seconds)`` after a checkpoint is on disk, ``("error", text)``.
"""

from __future__ import annotations

import time
from multiprocessing.connection import Connection
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
    """The worker's loop (the process target); ends at ``stop`` or when the trainer is gone."""
    from checkmate.shadow import persist
    from checkmate.shadow.assembler import Control
    from checkmate.shadow.reseed import Reseed
    from checkmate.spec import ModelSpec

    spec: ModelSpec | None = None
    window: Reseed | None = None
    partition = 0
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return  # the trainer is gone: nothing to finish for anybody
        try:
            if msg[0] == "stop":
                return
            if msg[0] == "begin":
                _, spec_json, partition, t0 = msg
                spec = ModelSpec.from_json(spec_json) if spec is None or \
                    spec.to_json() != spec_json else spec
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
                    t = time.perf_counter()
                    last, step, arrays, c = window.result()
                    window = None
                    persist.save(root, spec, partition, last, step, arrays, c.buffers,
                                 c.extra, c.lrs, keep=keep, threads=threads)
                    conn.send(("committed", last, time.perf_counter() - t))
            else:
                raise CheckmateError(f"gockpt: unknown message {msg[0]!r}")
        except CheckmateError as e:
            window = None  # this window is lost; the next one starts afresh
            conn.send(("error", str(e)))


def main(conn: Connection, root: str, keep: int, threads: int) -> Any:
    """Process entry point: one thread for the kernels (the trainer owns the cores)."""
    import os

    os.environ.setdefault("NUMBA_NUM_THREADS", "1")
    try:
        serve(conn, root, keep, threads)
    except KeyboardInterrupt:
        pass
    finally:
        conn.close()
