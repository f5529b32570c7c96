"""The asynchronous device-to-host share copy (checkmate.train.d2h).

Its ordering logic runs here with the CPU stand-in ``ThreadStager`` (a worker thread for the
copy stream, threading.Events for CUDA events; see its docstring for what it does not
model): a send never reads a buffer before its copy completed, a buffer is never refilled
before its send finished, buffers are allocated once and reused, a sender failure is one
line. End to end, stock DDP and FSDP2 jobs (gloo, two ranks, two real shadows) replicate
through the copier and stay bit-identical with the same jobs without Checkmate. The CUDA
stager's own test needs a GPU and skips without one.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from fakes import assert_optim_equal, assert_state_equal, host_layout, rank_main, run_ranks

from checkmate.errors import CheckmateError
from checkmate.train.d2h import CudaStager, ShareCopier, ThreadStager

STEPS, SEED = 6, 3


def _parts(it: int) -> tuple[list, dict]:
    """Two parameters' sources filled with values of iteration ``it``, and the segments
    (elem offset, count, flat offset, partition) this rank owns of them."""
    a = torch.arange(100, dtype=torch.float32) + 1000 * it
    b = torch.arange(40, dtype=torch.float32) - 1000 * it
    segs = {"a": [(0, 10, 0, 0), (50, 30, 50, 1)], "b": [(5, 20, 105, 1)]}
    return [("a", a, segs["a"]), ("b", b, segs["b"])], {"a": a, "b": b}


def _expected(it: int) -> list[tuple[int, int, list[float]]]:
    parts, _ = _parts(it)
    return [(off, part, src[lo:lo + n].tolist()) for _, src, segs in parts
            for lo, n, off, part in segs]


class _Recorder:
    def __init__(self, slow: float = 0.0) -> None:
        self.got: list[tuple[int, int, list]] = []
        self.slow = slow
        self.busy = threading.Lock()

    def __call__(self, it: int, index: int, runs: list) -> None:
        with self.busy:
            got = [(off, part, a.tolist()) for off, part, a in runs]
            time.sleep(self.slow)  # the buffers stay held while this "sends"
            # still the same values at the end of the send: nothing refilled them meanwhile
            assert got == [(off, part, a.tolist()) for off, part, a in runs], it
            self.got.append((it, index, got))


def test_sends_wait_for_their_copy_and_buffers_are_reused():
    stager = ThreadStager(delay=0.03)  # copies finish well after submit returns
    rec = _Recorder()
    c = ShareCopier(stager, rec, depth=2)
    for it in range(1, 8):
        parts, src = _parts(it)
        t0 = time.perf_counter()
        c.submit(it, 4, parts)
        assert time.perf_counter() - t0 < 0.02 or c.stats["waits"]  # no wait for the copy
        c.fence()  # the "training stream" now waits for the copy (host wait on the CPU)
        for t in src.values():
            t.fill_(float("nan"))  # the next iteration writes the gradient memory
    c.drain()
    c.close()
    assert [g[0] for g in rec.got] == list(range(1, 8)) and {g[1] for g in rec.got} == {4}
    for it, _, got in rec.got:
        assert got == _expected(it), it  # never the nan written after the fence
    assert c.stats["buffers"] <= 4 and c.stats["sent"] == 7  # two keys, depth 2: reused


def test_no_buffer_is_refilled_before_its_send_finished():
    """A slow sender: the third submit must wait for a buffer (back-pressure), and every
    send still reads exactly its own iteration's values."""
    rec = _Recorder(slow=0.08)
    c = ShareCopier(ThreadStager(), rec, depth=2)
    for it in range(1, 7):
        c.submit(it, 0, _parts(it)[0])  # no fence: nothing overwrites the sources here
    c.drain()
    c.close()
    assert c.stats["waits"] > 0 and c.stats["buffers"] == 4
    assert [g[0] for g in rec.got] == list(range(1, 7))
    for it, _, got in rec.got:
        assert got == _expected(it), it


def test_the_sender_never_runs_ahead_of_a_copy():
    """Copies held back by their start event: nothing is sent until they ran."""
    class Gate:
        def __init__(self) -> None:
            self.ev = threading.Event()

        def synchronize(self) -> None:
            self.ev.wait()

    class Held(ThreadStager):
        def __init__(self) -> None:
            super().__init__()
            self.gate = Gate()

        def mark(self) -> Gate:  # the "reduction" completes only when the gate opens
            return self.gate

    stager, rec = Held(), _Recorder()
    c = ShareCopier(stager, rec)
    c.submit(1, 0, _parts(1)[0])
    time.sleep(0.2)
    assert rec.got == [] and stager.copies == 0
    stager.gate.ev.set()
    c.drain()
    c.close()
    assert rec.got and rec.got[0][2] == _expected(1)


def test_a_failed_send_is_one_line_at_the_next_fence():
    def send(it: int, index: int, runs: list) -> None:
        raise OSError("network is unreachable")

    c = ShareCopier(ThreadStager(), send)
    c.submit(3, 0, _parts(3)[0])
    with pytest.raises(CheckmateError, match="iteration 3: OSError: network is unreachable"):
        c.drain()
    with pytest.raises(CheckmateError, match="shadows failed"):
        c.fence()
    c.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CudaStager needs a CUDA device")
def test_cuda_stager_copies_the_share_to_pinned_memory():
    """Values, order, and no host synchronization in submit and fence: torch's sync debug
    mode turns any synchronizing CUDA call there into an error (from the third iteration,
    when both pinned buffers of each parameter exist)."""
    class Gated:  # the sender's wait, held until the checked window closed (the debug
        def __init__(self, ev: object, gate: threading.Event) -> None:  # mode is global)
            self.ev, self.gate = ev, gate

        def synchronize(self) -> None:
            self.gate.wait()
            self.ev.synchronize()

    class GatedStager(CudaStager):
        gate = threading.Event()

        def copy(self, after: object, pairs: list) -> Gated:
            return Gated(super().copy(after, pairs), self.gate)

        def order_current_after(self, event: Gated) -> None:
            super().order_current_after(event.ev)

    dev = torch.device("cuda", torch.cuda.current_device())
    rec = _Recorder()
    stager = GatedStager(dev)
    c = ShareCopier(stager, rec)
    for it in range(1, 6):
        parts, _ = _parts(it)
        parts = [(k, t.to(dev), s) for k, t, s in parts]
        torch.cuda.current_stream(dev).synchronize()  # the test's own inputs are ready
        stager.gate.clear()
        if it >= 3:
            torch.cuda.set_sync_debug_mode("error")
        try:
            c.submit(it, 0, parts)
            c.fence()
            for _, t, _ in parts:
                t.fill_(float("nan"))  # ordered after the copy by the fence
        finally:
            torch.cuda.set_sync_debug_mode(0)
            stager.gate.set()
        if it == 2:
            c.drain()  # both buffers back in the pool before the checked iterations
    c.drain()
    c.close()
    assert [g[2] for g in rec.got] == [_expected(it) for it in range(1, 6)]
    assert c.stats["buffers"] == 4


# ----------------------------------------------------------------------------- end to end
def _worker(cfg: dict, rank: int, world: int) -> int:
    """Stock DDP (or FSDP2) without Checkmate, then through DDPSession (FSDPSession) with
    the copier on ThreadStager; rank 0 saves both and the shadows' state."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from checkmate.testbed.models import build
    from checkmate.train import FSDPSession
    from checkmate.train.ddp_hook import DDPSession
    from checkmate.train.session import rng_seed
    from checkmate.train.shadow_client import restore_state_dicts

    fsdp = cfg["kind"] == "fsdp"

    def make() -> tuple:
        w = build("gpt", SEED, STEPS)
        if not fsdp:
            return w, DDP(w.model, bucket_cap_mb=0.05)
        from torch.distributed.fsdp import fully_shard

        for blk in w.model.blocks:
            fully_shard(blk)
        fully_shard(w.model)
        from checkmate.optim import AdamW

        w.optimizer = AdamW(w.model.parameters(), lr=3e-3)
        w.scheduler = torch.optim.lr_scheduler.LambdaLR(w.optimizer, lambda i: 1.0)
        return w, w.model

    def full(sd: dict) -> dict:
        from torch.distributed.tensor import DTensor

        return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in sd.items()}

    def optim_full(osd: dict) -> dict:
        return {"state": {i: full(st) for i, st in osd["state"].items()},
                "param_groups": osd["param_groups"]}

    w, model = make()
    for it in range(1, STEPS + 1):
        torch.manual_seed(rng_seed(SEED, rank, it))
        w.optimizer.zero_grad()
        x, y = w.batch(rank, it)
        w.loss(model(x), y).backward()
        w.optimizer.step()
        w.scheduler.step()
    ref = {"model": full(w.model.state_dict()), "optimizer": optim_full(w.optimizer.state_dict())}
    w, model = make()
    layout = host_layout(cfg["net"], cfg["ips"], rank, world, SEED)
    stager = ThreadStager(delay=0.002)
    cls = FSDPSession if fsdp else DDPSession
    sess = cls(model, w.optimizer, w.scheduler, layout, stager=stager)
    sess.start()
    for it in range(1, STEPS + 1):
        sess.begin(it)
        w.optimizer.zero_grad()
        x, y = w.batch(rank, it)
        w.loss(sess.model(x), y).backward()
        sess.step()
    prot = sess.finish(timeout=30)
    got = {"model": full(w.model.state_dict()), "optimizer": optim_full(w.optimizer.state_dict())}
    if rank == 0:
        msd, osd, sit, _, _ = restore_state_dicts(layout.shadow_tcp, sess.spec, STEPS)
        torch.save({"ref": ref, "got": got, "shadow_model": msd, "shadow_optimizer": osd,
                    "iteration": sit, "protected": prot["protected"],
                    "stats": sess.copier.stats, "copies": stager.copies}, cfg["out"])
    sess.close()
    return 0


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_jobs_replicate_through_the_copier_bit_identical(loopback_shadows, tmp_path, kind):
    net, ips = loopback_shadows
    out = tmp_path / "out.pt"
    res = run_ranks(__file__, json.dumps({"kind": kind, "net": net, "ips": ips,
                                          "out": str(out)}), 2)
    assert all(r.returncode == 0 for r in res), [r.stderr[-2000:] for r in res]
    got = torch.load(out, weights_only=False)
    assert got["protected"] is True and got["iteration"] == STEPS
    assert got["stats"]["sent"] == got["stats"]["submits"] == got["copies"] > 0
    assert got["stats"]["buffers"] <= 2 * 64  # allocated once per parameter, not per step
    assert_state_equal(got["got"]["model"], got["ref"]["model"], f"{kind}: Checkmate vs plain")
    assert_optim_equal(got["got"]["optimizer"], got["ref"]["optimizer"], kind)
    assert_state_equal(got["shadow_model"], got["got"]["model"], f"{kind}: shadows")
    assert_optim_equal(got["shadow_optimizer"], got["got"]["optimizer"], f"{kind}: shadows",
                       lrs=False)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    cfg = json.loads(sys.argv[1])
    rank_main(lambda rank, world: _worker(cfg, rank, world))
