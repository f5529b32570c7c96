"""The one copy engine (checkmate.train.copyengine) and its users, on CPU stand-ins.

``ThreadCopyEngine`` runs copies on a thread, as a CUDA side stream would, with a delay
that widens every race: a reader that did not wait, or a writer that did not fence, would
see a half-done or later copy. Checked here: the ordering, fencing and buffer-reuse rules;
GoCkpt through a slow engine still checkpoints bit-exactly; the DDP/FSDP2 senders' share
copier (checkmate.train.share_copy): a send never reads a buffer before its copy completed,
a buffer is never refilled before its send finished, buffers are allocated once and reused,
a sender failure is one line; and end to end, stock DDP and FSDP2 jobs (gloo, two ranks, two
real shadows) replicate through the copier and stay bit-identical with the same jobs without
Checkmate. What the stand-in does not model: a device's own memory and its stream semantics
(checked by the device check, testbed/device_check.py, and by the CUDA tests here where a
GPU exists; they skip without one).
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
from checkmate.train.copyengine import (
    BufferPool,
    CudaCopyEngine,
    SyncCopyEngine,
    ThreadCopyEngine,
    engine_for,
)
from checkmate.train.share_copy import ShareCopier


def test_copies_read_the_state_as_issued_once_fenced_and_wait_returns_only_complete_copies():
    eng = ThreadCopyEngine(delay=0.05)
    live = torch.arange(1000, dtype=torch.float32)
    want = []
    tickets = []
    for _ in range(5):
        tickets.append(eng.copy(1000, [(0, live)]))
        want.append(live.clone())
        eng.fence()  # the "next optimizer step" may now change the state
        live.add_(1.0)
    for t, w in zip(tickets, want, strict=True):
        assert torch.equal(t.wait(), w)  # each copy holds the state of its own step
        t.release()
    eng.close()


def test_without_the_fence_a_write_would_race_the_copy():
    """The stand-in really is asynchronous: a write before the fence lands in the copy.
    (This is what ``fence`` exists to prevent; GoCkpt fences before every step.)"""
    eng = ThreadCopyEngine(delay=0.2)
    live = torch.zeros(100)
    t = eng.copy(100, [(0, live)])
    live.fill_(7.0)  # no fence: the copy has not run yet
    assert torch.equal(t.wait(), torch.full((100,), 7.0))
    t.release()
    eng.close()


def test_staged_copy_is_immune_to_an_in_place_change_right_after():
    eng = ThreadCopyEngine(delay=0.1)
    grad = torch.randn(500)
    before = grad.clone()
    t = eng.copy(500, [(0, grad)], stage=True)
    grad.mul_(0.5)  # clipping scales the gradient in place, with no fence
    assert torch.equal(t.wait(), before)
    t.release()
    eng.close()


def test_parts_land_at_their_offsets_and_zero_fills_the_rest():
    for eng in (SyncCopyEngine(), ThreadCopyEngine()):
        a, b = torch.full((3,), 1.0), torch.full((2,), 2.0)
        t = eng.copy(8, [(0, a), (5, b)], zero=True)
        assert t.wait().tolist() == [1, 1, 1, 0, 0, 2, 2, 0]
        t.release()
        eng.close()


def test_buffers_are_reused_only_after_release_and_the_limit_blocks():
    pool = BufferPool(limit=4 * 100)
    x = pool.acquire(100)
    got: list[torch.Tensor] = []
    th = threading.Thread(target=lambda: got.append(pool.acquire(100)))
    th.start()
    time.sleep(0.2)
    assert not got, "a second buffer was handed out past the limit"
    pool.release(x)
    th.join(5)
    assert got and got[0] is x and pool.allocated == 1  # the same buffer, reused
    with pytest.raises(CheckmateError, match="released twice"):
        pool.release(x) or pool.release(x)


def test_an_owner_holds_at_most_depth_buffers_of_one_size():
    """The share copier's bound: an owner's third buffer at depth 2 waits for a release
    (counted in ``waits``), gets a released one back, and a size change is one error."""
    pool = BufferPool()
    a, b = pool.acquire(8, owner="w", depth=2), pool.acquire(8, owner="w", depth=2)
    got: list[torch.Tensor] = []
    th = threading.Thread(target=lambda: got.append(pool.acquire(8, owner="w", depth=2)))
    th.start()
    time.sleep(0.2)
    assert not got and pool.waits == 1
    pool.release(b)
    th.join(5)
    assert got and got[0] is b and pool.allocated == 2
    assert pool.acquire(8, owner="v", depth=2) is not a  # another owner: its own buffers
    with pytest.raises(CheckmateError, match="w: its share is 9 elements, was 8"):
        pool.acquire(9, owner="w", depth=2)


def test_a_failed_copy_is_one_error_at_wait_and_its_buffer_comes_back():
    eng = ThreadCopyEngine()
    t = eng.copy_into([(torch.empty(3), torch.ones(4))])  # shapes that cannot be copied
    eng.fence()  # the fence orders, it does not report: the ticket does
    with pytest.raises(CheckmateError, match="a copy failed"):
        t.wait()
    t.release()
    ok = eng.copy(4, [(0, torch.ones(4))])
    assert ok.wait().tolist() == [1.0] * 4
    ok.release()
    assert eng.pool.held == 0
    eng.close()


def test_a_released_ticket_cannot_be_read_and_a_buffer_is_not_shared():
    eng = ThreadCopyEngine()
    t1 = eng.copy(10, [(0, torch.ones(10))])
    t2 = eng.copy(10, [(0, torch.zeros(10))])
    assert t1.wait().data_ptr() != t2.wait().data_ptr()
    t1.release()
    with pytest.raises(CheckmateError, match="after its release"):
        t1.wait()
    t3 = eng.copy(10, [(0, torch.full((10,), 3.0))])
    assert t3.wait().tolist() == [3.0] * 10 and t2.wait().tolist() == [0.0] * 10
    eng.close()


def test_bad_parts_and_devices_are_one_error_line():
    eng = SyncCopyEngine()
    with pytest.raises(CheckmateError, match="1-D float32"):
        eng.copy(4, [(0, torch.ones(4, dtype=torch.float64))])
    with pytest.raises(CheckmateError, match="inside the buffer"):
        eng.copy(4, [(2, torch.ones(4))])
    with pytest.raises(CheckmateError, match="no engine for meta"):
        engine_for(torch.device("meta"))


def test_copy_into_caller_buffers_is_fenced_like_live_state():
    eng = ThreadCopyEngine(delay=0.1)
    src = {"w": torch.randn(64), "step": torch.tensor(3, dtype=torch.int64)}
    dst = {k: torch.empty_like(v) for k, v in src.items()}
    want = {k: v.clone() for k, v in src.items()}
    t = eng.copy_into([(dst[k], src[k]) for k in src])
    eng.fence()
    src["w"].zero_()
    t.wait()
    assert all(torch.equal(dst[k], want[k]) for k in src)
    eng.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (no GPU here)")
def test_cuda_engine_copies_async_into_pinned_buffers_in_order():
    dev = torch.device("cuda", 0)
    eng = CudaCopyEngine(dev)
    live = torch.arange(1 << 20, dtype=torch.float32, device=dev)
    tickets, want = [], []
    for _ in range(4):
        tickets.append(eng.copy(live.numel(), [(0, live)]))
        want.append(live.cpu())
        eng.fence()
        live.add_(1.0)
    for t, w in zip(tickets, want, strict=True):
        h = t.wait()
        assert h.is_pinned() and torch.equal(h, w)
        t.release()


def test_gockpt_with_a_slow_copy_engine_still_checkpoints_bit_exactly(tmp_path):
    """GoCkpt driven by hand (one rank, no session) with a copy stand-in that takes 50 ms
    per copy: every slice and gradient is still in flight when the next step would change
    its source, so a missing fence or an unstaged gradient would put a later state into
    the checkpoint. It must equal the trainer's state at the window's end, bit for bit."""
    from checkmate.gockpt.trainer import GoCkpt, restore
    from checkmate.optim import AdamW, clip_grad_norm_
    from checkmate.optim.hyper import control_hyper

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.Tanh(),
                                torch.nn.Linear(48, 5))
    opt = AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, amsgrad=True)
    g = GoCkpt(model, opt, tmp_path, every=4, steps=3, job=5)
    g.engine.close()
    g.engine = ThreadCopyEngine(delay=0.05)
    want = None
    for it in range(1, 9):
        torch.manual_seed(100 + it)
        opt.zero_grad()
        model(torch.randn(8, 32)).pow(2).sum().backward()
        g.before_clip(it)
        coef = clip_grad_norm_(model.parameters(), 0.5)[1]
        lrs = [float(x["lr"]) for x in opt.param_groups]
        hyper = [control_hyper("adamw", x) for x in opt.param_groups]
        opt.step()
        g.after_step(it, it, {"iteration": it, "lrs": lrs, "clip_coef": coef, "hyper": hyper,
                              "buffers": {}, "extra": {"scheduler": None, "hyper": hyper,
                                                       "user": {}}})
        if it == 7:  # the window opened after step 4 ends at 4 + 3
            want = {"model": {k: v.clone() for k, v in model.state_dict().items()},
                    "optim": opt.state_dict()}
            want["optim"] = {"state": {i: {k: v.clone() if torch.is_tensor(v) else v
                                           for k, v in s.items()}
                                       for i, s in want["optim"]["state"].items()},
                             "param_groups": want["optim"]["param_groups"]}
    g.close()
    assert g.errors == [] and g.committed == 7, (g.errors, g.committed)
    it, _, msd, osd, _ = restore(tmp_path, g.spec, 7)
    assert it == 7
    assert_state_equal(msd, want["model"], "model at 7")
    assert_optim_equal(osd, want["optim"], "optimizer at 7", lrs=False)


# ----------------------------------------------------------------------------- the share copier
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
    engine = ThreadCopyEngine(delay=0.03)  # copies finish well after submit returns
    rec = _Recorder()
    c = ShareCopier(engine, rec, depth=2)
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
    c = ShareCopier(ThreadCopyEngine(), rec, depth=2)
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

    class Held(ThreadCopyEngine):
        def __init__(self) -> None:
            super().__init__()
            self.gate = Gate()

        def mark(self) -> Gate:  # the "reduction" completes only when the gate opens
            return self.gate

    engine, rec = Held(), _Recorder()
    c = ShareCopier(engine, rec)
    c.submit(1, 0, _parts(1)[0])
    time.sleep(0.2)
    assert rec.got == [] and engine.copies == 0
    engine.gate.ev.set()
    c.drain()
    c.close()
    assert rec.got and rec.got[0][2] == _expected(1)


def test_a_failed_send_is_one_line_at_the_next_fence():
    def send(it: int, index: int, runs: list) -> None:
        raise OSError("network is unreachable")

    c = ShareCopier(ThreadCopyEngine(), send)
    c.submit(3, 0, _parts(3)[0])
    with pytest.raises(CheckmateError, match="iteration 3: OSError: network is unreachable"):
        c.drain()
    with pytest.raises(CheckmateError, match="shadows failed"):
        c.fence()
    c.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_engine_copies_the_share_to_pinned_memory():
    """Values, order, and no host synchronization in submit and fence: torch's sync debug
    mode turns any synchronizing CUDA call there into an error (from the third iteration,
    when both pinned buffers of each parameter exist)."""
    class Gated:  # the sender's wait, held until the checked window closed (the debug
        def __init__(self, ev: object, gate: threading.Event) -> None:  # mode is global)
            self.ev, self.gate = ev, gate

        def synchronize(self) -> None:
            self.gate.wait()
            self.ev.synchronize()

    class GatedEngine(CudaCopyEngine):
        gate = threading.Event()

        def enqueue(self, after: object, pairs: list) -> Gated:
            return Gated(super().enqueue(after, pairs), self.gate)

        def order_current_after(self, event: Gated) -> None:
            super().order_current_after(event.ev)

    dev = torch.device("cuda", torch.cuda.current_device())
    rec = _Recorder()
    engine = GatedEngine(dev)
    c = ShareCopier(engine, rec)
    for it in range(1, 6):
        parts, _ = _parts(it)
        parts = [(k, t.to(dev), s) for k, t, s in parts]
        torch.cuda.current_stream(dev).synchronize()  # the test's own inputs are ready
        engine.gate.clear()
        if it >= 3:
            torch.cuda.set_sync_debug_mode("error")
        try:
            c.submit(it, 0, parts)
            c.fence()
            for _, t, _ in parts:
                t.fill_(float("nan"))  # ordered after the copy by the fence
        finally:
            torch.cuda.set_sync_debug_mode(0)
            engine.gate.set()
        if it == 2:
            c.drain()  # both buffers back in the pool before the checked iterations
    c.drain()
    c.close()
    assert [g[2] for g in rec.got] == [_expected(it) for it in range(1, 6)]
    assert c.stats["buffers"] == 4


# ----------------------------------------------------------------------------- end to end
def _worker(cfg: dict, rank: int, world: int) -> int:
    """Stock DDP (or FSDP2) without Checkmate, then through DDPSession (FSDPSession) with
    the copier on ThreadCopyEngine; rank 0 saves both and the shadows' state."""
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
    engine = ThreadCopyEngine(delay=0.002)
    cls = FSDPSession if fsdp else DDPSession
    sess = cls(model, w.optimizer, w.scheduler, layout, copy_engine=engine)
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
                    "stats": sess.copier.stats, "copies": engine.copies}, cfg["out"])
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
