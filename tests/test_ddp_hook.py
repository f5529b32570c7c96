"""An unmodified torch DistributedDataParallel (gloo) feeding real shadows through the hook.

Real processes throughout: two trainer processes (gloo on loopback) wrap the model in stock
``DistributedDataParallel`` and train through ``DDPSession``; two ``shadow serve`` processes
receive the reduced gradient shares and the control messages. Every trainer is SIGKILLed
mid-run, a new pair resumes from the shadows, and the final state must equal, bit for bit,
stock DDP trained without Checkmate (no hook, no shadows) with the same data and seeds; the
shadows' state must equal the trainers'.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fakes import (
    assert_optim_equal,
    assert_state_equal,
    free_port,
    host_layout,
    lose_every,
    rank_main,
    run_ranks,
)

pytestmark = pytest.mark.slow

STEPS, KILL_AT, SEED = 8, 5, 11
BUCKET_MB = 0.05  # small: DDP's rebuild after iteration 1 reorders several buckets


# ----------------------------------------------------------------------------- worker
def _backward(w: object, ddp: object, rank: int, it: int, accumulate: bool) -> None:
    """One iteration's backward; ``accumulate``: two micro-batches, the first inside
    ``ddp.no_sync()`` (only the second reduces, the sum of both)."""
    x, y = w.batch(rank, it)
    if not accumulate:
        w.loss(ddp(x), y).backward()
        return
    h = len(x) // 2
    with ddp.no_sync():
        w.loss(ddp(x[:h]), y[:h]).backward()
    w.loss(ddp(x[h:]), y[h:]).backward()


def _worker(cfg: dict, rank: int, world: int) -> int:
    """One trainer rank: optionally stock DDP alone first (the reference), then DDPSession
    with a kill or a resume."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from checkmate.testbed.models import build
    from checkmate.train.ddp_hook import DDPSession
    from checkmate.train.session import rng_seed

    out = Path(cfg["out"])
    if cfg.get("reference"):  # stock DDP without Checkmate, the same data and seeds
        w = build(cfg["model"], SEED, STEPS)
        ddp = DDP(w.model, bucket_cap_mb=BUCKET_MB)
        for it in range(1, STEPS + 1):
            torch.manual_seed(rng_seed(SEED, rank, it))
            w.optimizer.zero_grad()
            _backward(w, ddp, rank, it, cfg.get("accumulate", False))
            if w.max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(w.model.parameters(), w.max_grad_norm)
            w.optimizer.step()
            w.scheduler.step()
        if rank == 0:
            torch.save({"model": w.model.state_dict(),
                        "optimizer": w.optimizer.state_dict()}, cfg["reference"])
        del ddp
    w = build(cfg["model"], SEED, STEPS)
    ddp = DDP(w.model, bucket_cap_mb=BUCKET_MB)
    layout = host_layout(cfg["net"], cfg["ips"], rank, world, SEED,
                         bucket_elems=cfg.get("bucket_elems", 4096))
    sess = DDPSession(ddp, w.optimizer, w.scheduler, layout, w.max_grad_norm)
    if cfg.get("drop_every"):
        lose_every(sess, cfg["drop_every"])
    start = sess.start(resume=cfg["resume"])
    if cfg["resume"]:
        assert sess.restored_extra == {"data": {"iteration": start}}
    for it in range(start + 1, STEPS + 1):
        sess.begin(it)
        w.optimizer.zero_grad()
        _backward(w, sess.model, rank, it, cfg.get("accumulate", False))
        if cfg.get("misuse") == "second-backward" and it == 2:
            x, y = w.batch(rank, it)
            w.loss(sess.model(x), y).backward()
        if cfg.get("misuse") == "no_sync-after-reduce" and it == 2:
            x, y = w.batch(rank, it)
            with sess.model.no_sync():
                w.loss(sess.model(x), y).backward()
        sess.step(extra={"data": {"iteration": it}})
        if it == cfg.get("kill_at"):
            os.kill(os.getpid(), signal.SIGKILL)
    prot = sess.finish(timeout=30)
    if rank == 0:
        from checkmate.train.shadow_client import restore_state_dicts

        msd, osd, sit, _, _ = restore_state_dicts(layout.shadow_tcp, sess.spec, STEPS)
        torch.save({"model": w.model.state_dict(), "optimizer": w.optimizer.state_dict(),
                    "shadow_model": msd, "shadow_optimizer": osd, "shadow_iteration": sit,
                    "start": start, "protected": prot["protected"],
                    "hook_stats": sess.hook_stats, "copy_bytes": sess.sender.copy_bytes,
                    "repair": sess.repair.status()},
                   out)
    sess.close()
    return 0


def _run(cfg: dict, world: int = 2) -> list[subprocess.CompletedProcess]:
    """Every rank of this file's worker with ``cfg``."""
    return run_ranks(__file__, json.dumps(cfg), world)


# ----------------------------------------------------------------------------- tests
def test_stock_ddp_kill_restore_bit_identical(loopback_shadows, tmp_path):
    """gpt: AdamW with two groups, clipping, dropout, warm-up + cosine, two micro-batches
    per step (the first under ``ddp.no_sync()``). Small DDP buckets, so DDP's rebuild after
    iteration 1 reorders several buckets while the shadows' offsets stay the spec's. After
    the restore every 9th replicated copy is lost, so the shadows repair from the trainers
    that hold them.
    (BatchNorm buffers through the hook: the launcher test's example.)"""
    net, ips = loopback_shadows
    ref = tmp_path / "plain.pt"
    base = {"model": "gpt", "net": net, "ips": ips, "out": str(tmp_path / "x"),
            "accumulate": True}
    res = _run({**base, "resume": False, "kill_at": KILL_AT, "reference": str(ref)})
    assert [r.returncode for r in res] == [-signal.SIGKILL] * 2, [r.stderr[-2000:] for r in res]
    out = tmp_path / "hook.pt"
    res = _run({**base, "resume": True, "out": str(out), "drop_every": 9})
    assert all(r.returncode == 0 for r in res), [r.stderr[-2000:] for r in res]

    plain = torch.load(ref, weights_only=False)
    got = torch.load(out, weights_only=False)
    assert KILL_AT - 1 <= got["start"] <= KILL_AT  # restored, not started over
    assert got["protected"] is True and got["shadow_iteration"] == STEPS
    assert got["hook_stats"]["pieces"] > 0 and got["copy_bytes"] > 0
    assert got["hook_stats"]["buckets"] >= 4 * (STEPS - got["start"])  # several DDP buckets
    # every 9th copy was lost: the shadows asked rank 0 for its own pieces (the owners map
    # of the hook's shares) and got them from its replica log
    assert got["repair"]["requests"] > 0 and got["repair"]["answered_elements"] > 0
    assert got["repair"]["gone"] == 0
    # the trainers after kill + restore equal stock DDP that never saw Checkmate
    assert_state_equal(got["model"], plain["model"], "restored run vs stock DDP")
    assert_optim_equal(got["optimizer"], plain["optimizer"], "restored run vs stock DDP")
    # the shadows equal the trainers (their param groups hold the rate of the last step,
    # the trainers' the next one's: a restore takes it from the scheduler)
    assert_state_equal(got["shadow_model"], got["model"], "shadows vs trainers")
    assert_optim_equal(got["shadow_optimizer"], got["optimizer"], "shadows vs trainers",
                        lrs=False)


@pytest.mark.parametrize("misuse,needle", [
    ("second-backward", "twice (a second backward outside ddp.no_sync()"),
    ("no_sync-after-reduce", "iteration 2: a backward after DDP reduced")])
def test_a_reduction_the_shadows_miss_is_one_error_line_on_every_rank(loopback_shadows,
                                                                      tmp_path, misuse,
                                                                      needle):
    """A second reducing backward, or an accumulation pass after the reduction, would make
    the trainers step on a gradient the shadows never got."""
    net, ips = loopback_shadows
    res = _run({"model": "cnn", "net": net, "ips": ips, "resume": False, "misuse": misuse,
                "out": str(tmp_path / "x")})
    for r in res:
        assert r.returncode == 2, r.stderr[-2000:]
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
        assert lines[0].startswith("checkmate: error: iteration 2: "), lines[0]
        assert needle in lines[0] and "no_sync()" in lines[0], lines[0]


@pytest.mark.parametrize("world,partitions,bucket_elems", [(2, 2, 4096), (3, 2, 1000),
                                                           (4, 3, 1 << 20)])
def test_owned_segments_cover_every_element_once_and_match_the_repair_owners(
        world, partitions, bucket_elems):
    from checkmate.spec.model import ModelSpec
    from checkmate.testbed.models import build
    from checkmate.train.ddp import bucket_ranges
    from checkmate.train.ddp_hook import owned_segments
    from checkmate.train.ring import replica_owners

    w = build("gpt", 1, 2)
    spec = ModelSpec.from_torch(7, w.model, w.optimizer, partitions)
    buckets = [(a, b) for a, b, _ in bucket_ranges([p.numel for p in spec.params],
                                                  bucket_elems)]
    hits = torch.zeros(spec.total, dtype=torch.int32)
    bounds = [spec.bounds(q) for q in range(partitions)]
    for r in range(world):
        segs = owned_segments(spec, buckets, world, r)
        assert set(segs) == {p.name for p in spec.params}
        for name, ss in segs.items():
            ps = spec.param(name)
            for lo, n, off, part in ss:
                assert off == ps.offset + lo and 0 <= lo and lo + n <= ps.numel
                assert bounds[part][0] <= off and off + n <= bounds[part][1]
                hits[off:off + n] += 1
                # the shadow asks this rank for exactly these elements
                for q in range(partitions):
                    for a, b, owner in replica_owners(buckets, world, *bounds[q]):
                        if a < off + n and off < b:
                            assert owner == r
    assert torch.equal(hits, torch.ones_like(hits))


def test_bad_setup_is_one_clear_error():
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    from checkmate.errors import CheckmateError
    from checkmate.testbed.models import build
    from checkmate.train import JobLayout, ShadowTarget
    from checkmate.train.ddp_hook import DDPSession

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        def layout(mode: str = "host") -> JobLayout:
            return JobLayout(job_id=7, rank=0, world=1, trainers=[("127.0.0.1", 1)],
                             shadows=[ShadowTarget(0, "127.0.0.1", 9)],
                             shadow_tcp=[("127.0.0.1", 9)], mode=mode)

        w = build("cnn", 1, 2)
        with pytest.raises(CheckmateError, match="needs a torch DistributedDataParallel"):
            DDPSession(w.model, w.optimizer, None, layout())
        ddp = DDP(w.model)
        with pytest.raises(CheckmateError, match="host mode only"):
            DDPSession(ddp, w.optimizer, None, layout("switch"))
        ddp.register_comm_hook(None, allreduce_hook)
        sess = DDPSession(ddp, w.optimizer, None, layout())
        try:
            with pytest.raises(CheckmateError, match="cannot register Checkmate's DDP comm"):
                sess._start_comm(0)
            # iteration 0 is the seeded state: a step with no begin() never reaches shadows
            with pytest.raises(CheckmateError, match=r"step\(\) again for iteration 0: call "
                                                     r"begin\(iteration\)"):
                sess.step()
        finally:
            sess.close()
        f = build("cnn", 1, 2)
        f.model.fc.bias.requires_grad_(False)
        with pytest.raises(CheckmateError, match="fc.bias is frozen"):
            DDPSession(DDP(f.model), f.optimizer, None, layout())
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    cfg = json.loads(sys.argv[1])
    rank_main(lambda rank, world: _worker(cfg, rank, world))
