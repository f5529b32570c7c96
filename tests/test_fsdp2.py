"""An FSDP2 (``fully_shard``) job on CPU with gloo feeding real shadows through FSDPSession.

Real processes throughout: two trainer processes (gloo on loopback) shard the model with
``fully_shard`` and train through ``FSDPSession``; two ``shadow serve`` processes receive
each rank's reduced gradient shard and the control messages. Every trainer is SIGKILLed
mid-run, a new pair resumes from the shadows, and the final state must equal, bit for bit,
stock FSDP2 trained with torch's clip_grad_norm_ and no Checkmate at all (the same
checkmate.optim.AdamW, see ``_optimizer``); the shadows' state must equal the trainers'.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fakes import (
    assert_optim_equal,
    assert_state_equal,
    host_layout,
    lose_every,
    rank_main,
    run_ranks,
)
from torch import nn

pytestmark = pytest.mark.slow

STEPS, KILL_AT, SEED, MAX_NORM = 8, 5, 5, 0.5
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_fsdp.py"


def _model() -> nn.Module:
    """Rows that do not split evenly over two ranks (5, 33), a BatchNorm, three FSDP units."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 33), nn.BatchNorm1d(33), nn.ReLU(),
                         nn.Linear(33, 33), nn.ReLU(), nn.Linear(33, 5))


def _shard(m: nn.Module) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for i in (0, 3):
        fully_shard(m[i])
    fully_shard(m)
    return m


def _optimizer(m: nn.Module) -> torch.optim.Optimizer:
    """AdamW, two groups (no decay on biases and the BatchNorm). checkmate.optim's, in the
    reference too: torch.optim.AdamW's parameter can differ from it by ulps wherever torch's
    float32 sqrt is not correctly rounded (tests/test_optim_vs_torch.py), FSDP2 or not."""
    from checkmate.optim import AdamW

    decay = [p for n, p in m.named_parameters() if n.endswith("weight") and n != "1.weight"]
    rest = [p for n, p in m.named_parameters() if not (n.endswith("weight") and n != "1.weight")]
    return AdamW([{"params": decay, "weight_decay": 0.05},
                  {"params": rest, "weight_decay": 0.0}], lr=3e-2)


def _backward(m: nn.Module, rank: int, it: int) -> None:
    """Two micro-batches, each reduce-scattered: FSDP2 accumulates the sharded gradient."""
    from checkmate.train.session import rng_seed

    torch.manual_seed(rng_seed(SEED, rank, it))
    for _ in range(2):
        x = torch.randn(6, 8)
        y = torch.randint(0, 5, (6,))
        nn.functional.cross_entropy(m(x), y).backward()


def _full_state(m: nn.Module, opt: torch.optim.Optimizer) -> dict:
    """Whole model and optimizer state (a collective: every rank calls it)."""
    from torch.distributed.tensor import DTensor

    def full(v: object) -> object:
        return v.full_tensor() if isinstance(v, DTensor) else v
    osd = opt.state_dict()
    return {"model": {k: full(v) for k, v in m.state_dict().items()},
            "optimizer": {"state": {i: {k: full(v) for k, v in st.items()}
                                    for i, st in sorted(osd["state"].items())},
                          "param_groups": osd["param_groups"]}}


def _sched(opt: torch.optim.Optimizer) -> object:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / 4))


# ----------------------------------------------------------------------------- worker
def _worker(cfg: dict, rank: int, world: int) -> int:
    from checkmate.train import FSDPSession

    if cfg.get("reference"):  # stock FSDP2 and torch.optim, no Checkmate
        m = _shard(_model())
        opt = _optimizer(m)
        sched = _sched(opt)
        for it in range(1, STEPS + 1):
            opt.zero_grad()
            _backward(m, rank, it)
            torch.nn.utils.clip_grad_norm_(m.parameters(), MAX_NORM)
            opt.step()
            sched.step()
        ref = _full_state(m, opt)
        if rank == 0:
            torch.save(ref, cfg["reference"])
    m = _shard(_model())
    opt = _optimizer(m)
    sched = _sched(opt)
    layout = host_layout(cfg["net"], cfg["ips"], rank, world, SEED)
    sess = FSDPSession(m, opt, sched, layout, MAX_NORM)
    if cfg.get("drop_every"):
        lose_every(sess, cfg["drop_every"])
    start = sess.start(resume=cfg["resume"])
    for it in range(start + 1, STEPS + 1):
        sess.begin(it)
        opt.zero_grad()
        if cfg.get("misuse") != "no-backward" or it != 2:
            _backward(sess.model, rank, it)
        sess.step(extra={"data": {"iteration": it}})
        if it == cfg.get("kill_at"):
            os.kill(os.getpid(), signal.SIGKILL)
    prot = sess.finish(timeout=30)
    got = _full_state(m, opt)
    if rank == 0:
        from checkmate.train.shadow_client import restore_state_dicts

        msd, osd, sit, _, _ = restore_state_dicts(layout.shadow_tcp, sess.spec, STEPS)
        torch.save({**got, "shadow_model": msd, "shadow_optimizer": osd,
                    "shadow_iteration": sit, "start": start, "protected": prot["protected"],
                    "extra": sess.restored_extra if cfg["resume"] else None,
                    "stats": sess.shard_stats, "repair": sess.repair.status()},
                   cfg["out"])
    sess.close()
    return 0


def _run(cfg: dict, world: int = 2) -> list[subprocess.CompletedProcess]:
    """Every rank of this file's worker with ``cfg``."""
    return run_ranks(__file__, json.dumps(cfg), world)


# ----------------------------------------------------------------------------- tests
def test_fsdp2_kill_restore_bit_identical_to_stock_fsdp2(loopback_shadows, tmp_path):
    """Clipping that bites (max norm 0.5), two micro-batches per step, two param groups,
    warm-up; after the restore every 7th copy is lost, so the shadows repair from the rank
    that holds the shard."""
    net, ips = loopback_shadows
    ref = tmp_path / "stock.pt"
    base = {"net": net, "ips": ips, "out": str(tmp_path / "x")}
    res = _run({**base, "resume": False, "kill_at": KILL_AT, "reference": str(ref)})
    assert [r.returncode for r in res] == [-signal.SIGKILL] * 2, [r.stderr[-2000:] for r in res]
    out = tmp_path / "fsdp.pt"
    res = _run({**base, "resume": True, "out": str(out), "drop_every": 7})
    assert all(r.returncode == 0 for r in res), [r.stderr[-2000:] for r in res]

    stock = torch.load(ref, weights_only=False)
    got = torch.load(out, weights_only=False)
    assert KILL_AT - 1 <= got["start"] <= KILL_AT  # restored, not started over
    assert got["extra"] == {"data": {"iteration": got["start"]}}
    assert got["protected"] is True and got["shadow_iteration"] == STEPS
    assert got["stats"]["pieces"] > 0 and got["stats"]["bytes"] > 0
    assert got["repair"]["requests"] > 0 and got["repair"]["answered_elements"] > 0
    # the trainers after kill + restore equal stock FSDP2 that never saw Checkmate; the
    # BatchNorm statistics are rank 0's in both (FSDPSession broadcasts rank 0's, as DDP does)
    assert_state_equal(got["model"], stock["model"], "restored run vs stock FSDP2")
    assert_optim_equal(got["optimizer"], stock["optimizer"], "restored run vs stock FSDP2")
    # the shadows equal the trainers (their groups hold the last step's rate)
    assert_state_equal(got["shadow_model"], got["model"], "shadows vs trainers")
    assert_optim_equal(got["shadow_optimizer"], got["optimizer"], "shadows vs trainers",
                        lrs=False)


def test_a_step_without_gradients_is_one_error_line_on_every_rank(loopback_shadows, tmp_path):
    net, ips = loopback_shadows
    res = _run({"net": net, "ips": ips, "resume": False, "misuse": "no-backward",
                "out": str(tmp_path / "x")})
    for r in res:
        assert r.returncode == 2, r.stderr[-2000:]
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
        assert lines[0].startswith("checkmate: error: iteration 2: no gradient for 8 of 8 "
                                   "parameters"), lines[0]


def test_launch_restarts_a_killed_hsdp_trainer_bit_identical(tmp_path):
    """examples/train_fsdp.py under ``checkmate launch``, as HSDP (2 replicas x 2 shards on
    a (dp_replicate, dp_shard) mesh, passed to the session): a SIGKILL at a random rank and
    iteration is recovered by the launcher and the run ends as a clean one, bit for bit.
    (Plain FSDP2 under the launcher: tests/test_restart_exact.py, at 2 to 5 ranks.)"""
    hsdp, world = 2, 4
    rank, at = random.randrange(world), random.randrange(3, STEPS)
    why = f"rank {rank} killed at iteration {at}"

    def launch(name: str, env: dict[str, str] | None = None, *args: str) -> tuple[str, dict]:
        out = tmp_path / f"{name}.pt"
        p = subprocess.run(
            [sys.executable, "-m", "checkmate.launch.cli", "launch", "--nproc-per-node",
             str(world), "--shadows", "2", "--max-restarts", "1", *args, str(EXAMPLE),
             "--steps",
             str(STEPS + 2), "--out", str(out), "--hsdp", str(hsdp)],
            capture_output=True, text=True,
            timeout=400, env={**os.environ, "NUMBA_NUM_THREADS": "1", **(env or {})})
        assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
        return p.stdout + p.stderr, torch.load(out, weights_only=False)

    clean, ref = launch("clean")
    assert "restarting the worker group" not in clean, why
    assert "(one data-parallel group: dp_replicate x dp_shard)" in clean, clean[-2000:]
    killed, got = launch("killed", {"CHECKMATE_KILL_AT": f"{rank}:{at}"})
    assert "restarting the worker group" in killed, (why, killed[-3000:])
    assert "Traceback" not in killed, killed[-3000:]
    m = re.search(r"attempt 1: resumed from the shadows at iteration (\d+)", killed)
    assert m and at - 1 <= int(m.group(1)) <= at, (why, killed[-3000:])
    assert_state_equal(got["model"], ref["model"], f"model ({why})")
    assert_optim_equal(got["optimizer"], ref["optimizer"], f"optimizer ({why})")
    assert got["scheduler"] == ref["scheduler"], why
    # A bit of one rank's shard flips (silent data corruption): its replica holds the same
    # shard, so the check of every 2 iterations names the pair, and the restart rewinds to
    # the newest verified iteration: bit-identical again (issue 35, HSDP's replicas).
    rank, at = random.randrange(world), random.randrange(1, 5)
    found = -(-at // 2) * 2
    why = f"a bit of rank {rank}'s shard flipped after iteration {at}"
    pair = sorted({rank, (rank + hsdp) % world})  # replicate-major: same dp_shard coordinate
    flipped, got = launch("flipped", {"CHECKMATE_FLIP_AT": f"{rank}:{at}"}, "--verify-every",
                          "2", "--on-divergence", "restore")
    assert (f"iteration {found}: the model and optimizer state shards of data-parallel "
            f"rank(s) {pair[0]}, {pair[1]} differ from each other (HSDP") in flipped, \
        (why, flipped[-3000:])
    assert "restarting the worker group" in flipped and "Traceback" not in flipped, why
    assert_state_equal(got["model"], ref["model"], f"model ({why})")
    assert_optim_equal(got["optimizer"], ref["optimizer"], f"optimizer ({why})")


@pytest.mark.parametrize("world,partitions", [(2, 2), (3, 2), (4, 3), (7, 1)])
def test_shards_follow_torch_chunk_and_the_owners_cover_every_element_once(world, partitions):
    """The geometry FSDPSession relies on, without processes: each rank's rows are
    torch.chunk's (FSDP2 pads missing chunks with empty shards), every flat element is
    owned by one rank, and what a rank sends is what the shadows' owners map names it for."""
    from checkmate.optim import AdamW
    from checkmate.spec.model import ModelSpec
    from checkmate.train.fsdp import shard_owners, shard_ranges, shard_rows
    from checkmate.train.segments import cut_segments

    for rows in (1, 2, 5, 33, 64):
        chunks = [c.shape[0] for c in torch.arange(rows).chunk(world)]
        chunks += [0] * (world - len(chunks))
        assert [b - a for a, b in (shard_rows(rows, world, r) for r in range(world))] == \
            chunks
    m = _model()
    spec = ModelSpec.from_torch(7, m, AdamW(m.parameters()), partitions)
    shards = shard_ranges(spec, world)
    hits = torch.zeros(spec.total, dtype=torch.int32)
    bounds = [spec.bounds(q) for q in range(partitions)]
    for r in range(world):
        mine = [(a, b) for a, b, o in shard_owners(spec, shards, 0, spec.total) if o == r]
        for name, segs in cut_segments(spec, mine).items():
            ps = spec.param(name)
            lo_r, hi_r = shards[name][r]
            for lo, n, off, part in segs:
                assert lo_r <= lo and lo + n <= hi_r and off == ps.offset + lo
                assert bounds[part][0] <= off and off + n <= bounds[part][1]
                hits[off:off + n] += 1
                for q in range(partitions):  # the shadow asks this rank for these elements
                    for a, b, owner in shard_owners(spec, shards, *bounds[q]):
                        if a < off + n and off < b:
                            assert owner == r and bounds[q][0] <= a and b <= bounds[q][1]
    assert torch.equal(hits, torch.ones_like(hits))


@pytest.mark.parametrize("replicas", [1, 2, 3])
def test_hsdp_replicas_send_each_segment_of_their_shard_once_between_them(replicas):
    from checkmate.optim import AdamW
    from checkmate.spec.model import ModelSpec
    from checkmate.train.fsdp import replica_share, shard_owners, shard_ranges
    from checkmate.train.segments import cut_segments

    m = _model()
    spec = ModelSpec.from_torch(7, m, AdamW(m.parameters()), 4)
    shards = shard_ranges(spec, 2)
    mine = cut_segments(spec, [(a, b) for a, b, o in shard_owners(spec, shards, 0,
                                                                   spec.total) if o == 1])
    sent = [s for rep in range(replicas)
            for segs in replica_share(mine, replicas, rep).values() for s in segs]
    assert sorted(sent) == sorted(s for segs in mine.values() for s in segs)
    assert {s[3] % replicas for s in replica_share(mine, replicas, replicas - 1)[
        spec.params[0].name]} <= {replicas - 1}


def _refusals(rank: int, world: int) -> int:
    """Sessions over FSDP2 models they cannot replicate: each one CheckmateError line."""
    from torch.distributed.fsdp import fully_shard

    from checkmate.errors import CheckmateError
    from checkmate.optim import AdamW
    from checkmate.train import (
        CheckmateSession,
        DDPSession,
        FSDPSession,
        JobLayout,
        ShadowTarget,
    )

    layout = JobLayout(job_id=7, rank=rank, world=world, trainers=[("127.0.0.1", 1)] * world,
                       shadows=[ShadowTarget(0, "127.0.0.1", 9)],
                       shadow_tcp=[("127.0.0.1", 9)], mode="host")
    out = {}
    sharded = _shard(_model())
    part = _model()
    fully_shard(part[0])  # only one block: the rest is never reduced
    cases = {"CheckmateSession": (CheckmateSession, sharded, layout),
             "DDPSession": (DDPSession, sharded, layout),
             "partial": (FSDPSession, part, layout),
             "switch": (FSDPSession, sharded, JobLayout(**{**layout.__dict__,
                                                           "mode": "switch"}))}
    for name, (cls, m, lay) in cases.items():
        try:
            cls(m, AdamW(m.parameters()), None, lay)
            out[name] = "accepted"
        except CheckmateError as e:
            out[name] = str(e)
    # a mesh with a pipeline dimension (as from_env passes it): FSDP2 + PP is not supported
    from checkmate.train.session_group import MeshGroup, place_in_mesh

    pp = place_in_mesh([[0, 1], [2, 3]], ("pp", "dp"), rank)
    sess = FSDPSession.__new__(FSDPSession)
    sess.mesh = MeshGroup(pp, None, None, None)
    try:
        sess.__init__(sharded, AdamW(sharded.parameters()), None, layout)
        out["pp"] = "accepted"
    except CheckmateError as e:
        out["pp"] = str(e)
    print(json.dumps(out), flush=True)
    return 0


def test_sessions_that_cannot_replicate_an_fsdp2_model_refuse_it_in_one_line():
    for p in run_ranks(__file__, "refusals", 2, timeout=120):
        assert p.returncode == 0, p.stderr[-2000:]
        got = json.loads(p.stdout.strip().splitlines()[-1])
        assert all("\n" not in v for v in got.values()), got
        assert "checkmate.train.FSDPSession" in got["CheckmateSession"]
        assert "needs a torch DistributedDataParallel" in got["DDPSession"]
        assert got["partial"].startswith("parameter 1.weight is not sharded"), got["partial"]
        assert "host mode only" in got["switch"], got["switch"]
        assert got["pp"].startswith("FSDP2 on a mesh with pp dimensions is not supported "
                                    "yet"), got["pp"]


if __name__ == "__main__":
    if sys.argv[1] == "refusals":
        rank_main(_refusals)
    cfg = json.loads(sys.argv[1])
    rank_main(lambda rank, world: _worker(cfg, rank, world))
