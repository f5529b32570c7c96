"""Shadow building blocks without sockets: coverage sets, assembly, gaps, the model spec."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from checkmate.protocol import wire
from checkmate.shadow.assembler import Assembler
from checkmate.shadow.control_message import parse_control
from checkmate.shadow.feed import control_body, encode_grad
from checkmate.shadow.intervals import IntervalSet
from checkmate.spec.model import ModelSpec, SpecError

# ----- IntervalSet ------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 60), st.integers(0, 20)), max_size=30))
def test_intervals_match_a_bitmap(adds):
    iv, bitmap = IntervalSet(), np.zeros(90, bool)
    for a, n in adds:
        new = iv.add(a, a + n)
        expect = ~bitmap[a:a + n]
        got = np.zeros(n, bool)
        for s, e in new:
            assert not bitmap[s:e].any()
            got[s - a:e - a] = True
        assert (got == expect).all()
        bitmap[a:a + n] = True
        assert iv.total == bitmap.sum()
    missing = np.ones(90, bool)
    for s, e in iv.missing(0, 90):
        missing[s:e] = False
    assert (missing == bitmap).all()
    assert all(a < b for a, b in zip(iv.ends, iv.starts[1:], strict=False))  # merged runs


# ----- Assembler --------------------------------------------------------------------------
def _asm(start=100, end=1100, groups=1, **kw):
    done: list = []
    drops: Counter = Counter()
    asm = Assembler(start, end, groups,
                    lambda it, g, c: done.append((it, g.copy(), c)), drops, **kw)
    return asm, done, drops


def _ctrl(asm, it, lrs=(0.1,), frag=7, order=None, **kw):
    body = control_body(it, list(lrs), **kw)
    pieces = [(a, body[a:a + frag]) for a in range(0, len(body), frag)]
    for a, p in (order(pieces) if order else pieces):
        asm.place_control(it, a, len(p), len(body), memoryview(p))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_placement_any_order_with_duplicates(dtype):
    rng = np.random.default_rng(1)
    asm, done, drops = _asm()
    g = rng.standard_normal(1000).astype(np.float32)
    chunks = [(a, min(37, 1000 - a)) for a in range(0, 1000, 37)]
    order = rng.permutation(len(chunks))
    for i in order:
        a, n = chunks[i]
        asm.place(1, 100 + a, n, int(wire.DType[dtype.upper()]),
                  memoryview(encode_grad(g[a:a + n], dtype)))
    # a partially overlapping resend and an exact duplicate place nothing new
    asm.place(1, 100 + 30, 20, int(wire.DType[dtype.upper()]),
              memoryview(encode_grad(g[30:50] + 1, dtype)))
    assert drops["duplicate"] == 1 and not done
    _ctrl(asm, 1, order=lambda p: p[::-1])
    assert [d[0] for d in done] == [1]
    expect = torch.from_numpy(g)
    if dtype != "float32":
        expect = expect.to(getattr(torch, dtype)).float()
    assert torch.equal(torch.from_numpy(done[0][1]), expect)
    assert done[0][2].lrs == [0.1]


def test_partial_overlap_places_only_new_elements():
    asm, done, drops = _asm(0, 10)
    asm.place(1, 0, 4, 0, memoryview(np.arange(4, dtype="<f4").tobytes()))
    asm.place(1, 2, 8, 0, memoryview((np.arange(2, 10, dtype="<f4") * 10).tobytes()))
    _ctrl(asm, 1)
    assert done[0][1].tolist() == [0, 1, 2, 3, 40, 50, 60, 70, 80, 90]
    assert drops["duplicate"] == 0


def test_iterations_dispatch_in_order_and_stale_or_far_ones_drop():
    asm, done, drops = _asm(0, 4, window=3)
    one = memoryview(np.ones(4, "<f4").tobytes())
    asm.place(2, 0, 4, 0, one)
    _ctrl(asm, 2)
    assert not done  # 2 is complete but 1 is not: wait for 1
    asm.place(1, 0, 4, 0, one)
    _ctrl(asm, 1)
    assert [d[0] for d in done] == [1, 2]
    asm.place(1, 0, 4, 0, one)
    assert drops["stale"] == 1
    asm.place(asm.committed + 4, 0, 4, 0, one)  # beyond the window
    assert drops["window"] == 1


def test_gap_is_reported_once_with_missing_ranges():
    asm, done, drops = _asm(0, 100, gap_timeout=0.5)
    asm.place(1, 0, 40, 0, memoryview(np.zeros(40, "<f4").tobytes()))
    asm.place(1, 60, 40, 0, memoryview(np.zeros(40, "<f4").tobytes()))
    _ctrl(asm, 1)
    asm.place(2, 0, 100, 0, memoryview(np.zeros(100, "<f4").tobytes()))
    t = asm.open[2].first_seen
    asm.check_gaps(t + 0.1)
    assert not asm.gaps  # not yet past the timeout
    asm.check_gaps(t + 0.6)
    asm.check_gaps(t + 5)
    assert asm.gap_count == 1
    gap = asm.gaps[0]
    assert gap["iteration"] == 1 and gap["missing"] == [[40, 60]]
    assert gap["missing_elements"] == 20 and gap["control"] == "ok"
    assert not done


def test_gap_for_an_iteration_never_seen_and_a_bad_control_message():
    asm, _, drops = _asm(0, 10, gap_timeout=0.0)
    asm.place(2, 0, 10, 0, memoryview(np.zeros(10, "<f4").tobytes()))
    asm.check_gaps(asm.open[2].first_seen + 1)
    assert asm.gaps[0]["iteration"] == 1 and asm.gaps[0]["missing"] == [[0, 10]]
    assert asm.gaps[0]["control"] == "missing"

    asm, done, drops = _asm(0, 10, gap_timeout=0.0)
    asm.place(1, 0, 10, 0, memoryview(np.zeros(10, "<f4").tobytes()))
    body = json.dumps({"iteration": 1, "lrs": [0.1, 0.2], "clip_coef": None}).encode()
    asm.place_control(1, 0, len(body), len(body), memoryview(body))  # 2 lrs, 1 group
    assert drops["control_invalid"] == 1 and not done
    asm.place(2, 0, 10, 0, memoryview(np.zeros(10, "<f4").tobytes()))
    asm.check_gaps(asm.open[2].first_seen + 1)
    assert "lrs" in asm.gaps[0]["control"]


def test_control_validation():
    ok = parse_control(control_body(3, [0.1, 0.2], clip_coef=0.5, skip=True), 3, 2)
    assert ok.lrs == [0.1, 0.2] and ok.clip_coef == 0.5 and ok.skip
    for body, why in [
        (control_body(4, [0.1, 0.2]), "iteration"),
        (b"[1]", "object"),
        (json.dumps({"iteration": 3, "lrs": [0.1, float("nan")]}).encode(), "lrs"),
        (json.dumps({"iteration": 3, "lrs": [0.1, 0.1], "clip_coef": "x"}).encode(), "clip"),
        (json.dumps({"iteration": 3, "lrs": [0.1, 0.1], "skip": 1}).encode(), "skip"),
    ]:
        with pytest.raises(ValueError, match=why):
            parse_control(body, 3, 2)


# ----- ModelSpec --------------------------------------------------------------------------
def _spec_dict():
    return ModelSpec.build(3, [("a", (2, 3)), ("b", (4,))], "adamw",
                           [{"params": ["a"], "lr": 0.1}, {"params": ["b"], "lr": 0.2}],
                           2).to_json()


@pytest.mark.parametrize("mutate, why", [
    (lambda d: d["params"][1].update(offset=5), "offset must be 6"),
    (lambda d: d.update(total=11), "total is 11"),
    (lambda d: d["params"][0].update(numel=5), "numel"),
    (lambda d: d["optimizer"].update(kind="lamb"), "kind"),
    (lambda d: d["optimizer"]["groups"][1].update(params=["zz"]), "unknown parameter"),
    (lambda d: d["optimizer"]["groups"].pop(), "no optimizer group"),
    (lambda d: d["optimizer"]["groups"][0].update(betas=[0.9]), "betas"),
    (lambda d: d.update(grad_dtype="int8"), "grad_dtype"),
    (lambda d: d.update(partitions=0), "partitions"),
    (lambda d: d["params"].append(dict(d["params"][0], offset=10)), "twice"),
])
def test_spec_rejects_bad_fields(mutate, why):
    d = _spec_dict()
    mutate(d)
    with pytest.raises(SpecError, match=why):
        ModelSpec.from_json(d)


@pytest.mark.parametrize("kind", ["adamw", "adam", "sgd"])
def test_spec_group_defaults_are_the_optimizers_defaults(kind):
    """A group that omits a hyperparameter gets torch's default for its kind, the same value
    checkmate.optim.hyper.resolve gives (AdamW's weight_decay is 0.01, not 0)."""
    from checkmate.optim.hyper import resolve

    d = _spec_dict()
    d["optimizer"]["kind"] = kind
    for g in d["optimizer"]["groups"]:
        for k in ("betas", "eps", "weight_decay", "momentum", "dampening"):
            g.pop(k, None)
    spec = ModelSpec.from_json(d)
    for g in spec.groups:
        want = resolve(kind, {"lr": g.lr})
        assert g.hyper(kind) == {k: want[k] for k in g.hyper(kind)}


def test_spec_round_trip_and_torch_state_dicts():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4),
                            torch.nn.Linear(4, 2))
    groups = lambda mm: [  # noqa: E731
        {"params": [mm[0].weight, mm[2].weight], "weight_decay": 0.1},
        {"params": [mm[0].bias, mm[1].weight, mm[1].bias, mm[2].bias], "weight_decay": 0.0,
         "amsgrad": True}]
    o = torch.optim.AdamW(groups(m), lr=1e-3)
    spec = ModelSpec.from_torch(5, m, o, 3)
    assert ModelSpec.from_json(spec.dumps()) == spec
    assert spec.slots == ("param", "exp_avg", "exp_avg_sq", "max_exp_avg_sq")
    for _ in range(2):
        m(torch.randn(6, 3)).sum().backward()
        o.step()
    flat = spec.flat_from_state_dicts(m.state_dict(), o.state_dict())
    bufs = spec.decode_buffers(spec.encode_buffers(dict(m.named_buffers())))
    msd, osd = spec.state_dicts(flat, 2, bufs)
    m2 = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4),
                             torch.nn.Linear(4, 2))
    m2.load_state_dict(msd)
    o2 = torch.optim.AdamW(groups(m2), lr=1e-3)
    o2.load_state_dict(osd)
    a, b = o.state_dict(), o2.state_dict()
    assert a["state"].keys() == b["state"].keys()
    for i in a["state"]:
        assert a["state"][i].keys() == b["state"][i].keys()
        for k in a["state"][i]:
            assert torch.equal(a["state"][i][k], b["state"][i][k])
    for k, v in m.state_dict().items():
        assert torch.equal(v, m2.state_dict()[k]), k


def test_group_ranges_follow_partition_cuts():
    spec = ModelSpec.build(1, [("a", (5,)), ("b", (5,)), ("c", (5,))], "sgd",
                           [{"params": ["a", "c"], "lr": 0.1, "momentum": 0.9},
                            {"params": ["b"], "lr": 0.1}], 2)
    assert spec.bounds(0) == (0, 7) and spec.bounds(1) == (7, 15)
    assert spec.group_ranges(*spec.bounds(0)) == [(0, 5, 0), (5, 7, 1)]
    assert spec.group_ranges(*spec.bounds(1)) == [(0, 3, 1), (3, 8, 0)]
    assert spec.slots == ("param", "momentum_buffer")
