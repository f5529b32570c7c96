"""The CheckFreq baseline (checkmate.train.baselines): its snapshot overlaps the next
iteration and only the next update waits for it; what it persists is the state of the
iteration it was taken at, bit for bit. Real model, real optimizer, real files; the copy
runs on the CPU stand-in for a copy stream (checkmate.train.copyengine.ThreadCopyEngine)."""

from __future__ import annotations

import time

import torch

from checkmate.optim import AdamW
from checkmate.train.baselines import Baseline
from checkmate.train.copyengine import ThreadCopyEngine


def _job():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
    return model, AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)


def _step(model, opt, it):
    torch.manual_seed(it)
    opt.zero_grad()
    model(torch.randn(16, 64)).pow(2).mean().backward()


def _same(a, b) -> bool:
    if torch.is_tensor(a):
        return a.dtype == b.dtype and torch.equal(a.view(-1).view(torch.uint8),
                                                  b.view(-1).view(torch.uint8))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def test_checkfreq_persists_each_iterations_own_state(tmp_path):
    model, opt = _job()
    ck = Baseline("checkfreq", str(tmp_path), 0, every=1)
    want = {}
    for it in range(1, 6):
        _step(model, opt, it)
        ck.before_step()
        opt.step()
        ck.save(it, model, opt)
        want[it] = {"model": {k: v.clone() for k, v in model.state_dict().items()},
                    "optim": torch.load(_roundtrip(opt.state_dict(), tmp_path),
                                        weights_only=False)}
    ck.finish()
    kept = sorted(tmp_path.glob("step-*.pt"))
    assert [p.name for p in kept] == ["step-3.pt", "step-4.pt", "step-5.pt"]
    for p in kept:
        it = int(p.stem.split("-")[1])
        got = torch.load(p, weights_only=False)
        assert got["iteration"] == it
        assert _same(got["model"], want[it]["model"]), f"model of iteration {it}"
        assert _same(got["optim"], want[it]["optim"]), f"optimizer of iteration {it}"


def _roundtrip(sd, d):
    path = d / "tmp-optim.pt"
    torch.save(sd, path)  # a deep copy of the optimizer state as it is now
    return path


def test_checkfreq_save_returns_at_once_and_the_next_update_waits(tmp_path):
    model, opt = _job()
    ck = Baseline("checkfreq", str(tmp_path), 0, every=1)
    ck._engine = ThreadCopyEngine(delay=0.5)  # a slow copy, to see who waits for it
    _step(model, opt, 1)
    opt.step()
    t = time.perf_counter()
    ck.save(1, model, opt)
    assert time.perf_counter() - t < 0.3, "the snapshot did not overlap: save() waited"
    before = {k: v.clone() for k, v in model.state_dict().items()}
    _step(model, opt, 2)  # the next iteration's compute runs while the copy does
    t = time.perf_counter()
    ck.before_step()
    assert time.perf_counter() - t > 0.1, "the update did not wait for the snapshot"
    opt.step()  # the state changes only now
    ck.finish()
    got = torch.load(tmp_path / "step-1.pt", weights_only=False)
    assert _same(got["model"], before)
