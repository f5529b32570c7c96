"""checkmate.train.copyengine: the ordering, fencing and buffer-reuse rules, on CPU stand-ins.

``ThreadCopyEngine`` runs copies on a thread, as a CUDA side stream would, with a delay
that widens every race: a reader that did not wait, or a writer that did not fence, would
see a half-done or later copy. What the stand-in does not model: a device's own memory
and its stream semantics (checked by the device check, testbed/device_check.py, and by the
CUDA test below where a GPU exists).
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from checkmate.errors import CheckmateError
from checkmate.train.copyengine import (
    BufferPool,
    CudaCopyEngine,
    SyncCopyEngine,
    ThreadCopyEngine,
    engine_for,
)


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
    from fakes import assert_optim_equal, assert_state_equal

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
