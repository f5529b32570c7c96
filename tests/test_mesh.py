"""Mesh jobs (issue 34): pipeline or tensor parallel beside data parallel, one session per
data-parallel group.

The unit tests pin how a DeviceMesh is cut into data-parallel groups, how a group is named
on the wire, and how one restore point is chosen over every group. The launch tests run
examples/train_pp.py (a small language model in two pipeline stages, torch's
PipelineStage with GPipe and 1F1B, 2 x 2 ranks) under ``checkmate launch --pp 2`` and
examples/train_tp.py (its blocks split by parallelize_module, DTensor parameters, 2 x 2
ranks) under ``--tp 2``: a run with one rank SIGKILLed at a random iteration is
bit-identical, rank by rank, to a run without Checkmate (``--mode off``, the same ring
without shadows). A two-process check pins the tensor-parallel clip norm: the norm of the
whole model, every shard and every copy counted once.
"""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from fakes import same_state

from checkmate.errors import CheckmateError
from checkmate.protocol import wire
from checkmate.train.resume_point import Holding, choose_groups
from checkmate.train.session_group import place_in_mesh

ROOT = Path(__file__).resolve().parents[1]
PP = ROOT / "examples" / "train_pp.py"
TP = ROOT / "examples" / "train_tp.py"
THREE_D = ROOT / "examples" / "train_3d.py"
STEPS = 8
WORLD = 4


# ----------------------------------------------------------------------------- fast
def test_a_mesh_is_cut_into_data_parallel_groups_over_its_other_dimensions():
    grid = np.arange(8).reshape(2, 2, 2)  # pp x dp x tp
    places = [place_in_mesh(grid, ("pp", "dp", "tp"), r) for r in range(8)]
    assert {p.groups for p in places} == {4}
    assert places[0].rows == [[0, 2], [1, 3], [4, 6], [5, 7]]  # (pp, tp) row-major
    assert places[0].cols == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert [(p.group, p.dp_rank) for p in places] == [
        (0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (3, 0), (2, 1), (3, 1)]
    assert places[5].other_dims == ("pp", "tp") and places[5].dp_dims == ("dp",)
    # HSDP: both data-parallel dimensions make one group, replicate-major
    hsdp = place_in_mesh(np.arange(4).reshape(2, 2), ("dp_replicate", "dp_shard"), 3)
    assert (hsdp.groups, hsdp.group, hsdp.dp_rank, hsdp.dp_world) == (1, 0, 3, 4)


def test_a_mesh_without_names_or_without_a_data_parallel_dimension_is_one_line():
    with pytest.raises(CheckmateError, match="needs a name for every dimension"):
        place_in_mesh(np.arange(4).reshape(2, 2), None, 0)
    with pytest.raises(CheckmateError, match="no data-parallel dimension"):
        place_in_mesh(np.arange(4).reshape(2, 2), ("pp", "tp"), 0)


def test_each_group_is_a_job_of_its_own_on_the_wire():
    assert wire.group_job_id(7, 0, 1) == 7  # a plain data-parallel job keeps its id
    ids = {wire.group_job_id(7, g, 4) for g in range(4)}
    assert len(ids) == 4 and 7 not in ids
    assert all(i & ((1 << wire.GROUP_SHIFT) - 1) == 7 for i in ids)
    with pytest.raises(CheckmateError, match="job id below"):
        wire.group_job_id(1 << wire.GROUP_SHIFT, 0, 2)
    with pytest.raises(CheckmateError, match="at most"):
        wire.group_job_id(1, 0, wire.MAX_GROUPS + 1)


def test_one_restore_point_for_every_group_or_one_line_naming_the_group():
    a = ("127.0.0.1", 1)
    g0 = [Holding(0, a, memory=[4, 5, 6]), Holding(1, a, memory=[5, 6])]
    g1 = [Holding(0, a, memory=[3, 4, 5], disk=[]), Holding(1, a, memory=[2], disk=[5])]
    point, sources = choose_groups([g0, g1])
    assert point.iteration == 5  # the newest iteration every partition of every group holds
    assert sources == [["memory", "memory"], ["memory", "disk"]]
    assert "group 1 partition 1 from disk" in point.line
    with pytest.raises(CheckmateError, match="group 1 partition 1"):
        choose_groups([g0, [Holding(0, a, memory=[5]), Holding(1, a, memory=[1])]])


def test_a_resume_onto_another_mesh_shape_is_one_line():
    from checkmate.train import world

    pp2 = place_in_mesh(np.arange(4).reshape(2, 2), ("pp", "dp"), 2)
    saved = {"mesh": world.mesh_of(pp2)}
    world.check_mesh(saved, pp2)  # the same group of the same mesh
    world.check_mesh({}, None)  # a plain job
    pp1 = place_in_mesh(np.arange(4).reshape(1, 4), ("pp", "dp"), 2)
    with pytest.raises(CheckmateError, match=r"hold group 1 of 2 \(pp\) and this rank is "
                                             r"group 0 of 1 \(pp\)"):
        world.check_mesh(saved, pp1)
    with pytest.raises(CheckmateError, match="a plain data-parallel job"):
        world.check_mesh(saved, None)
    with pytest.raises(CheckmateError, match="a plain data-parallel job"):
        world.check_mesh({}, pp2)


def test_a_tensor_parallel_shard_is_placed_in_the_whole_tensor_by_the_spec():
    from checkmate.shadow.torch_layout import Piece
    from checkmate.spec.model import ModelSpec, SpecError

    spec = ModelSpec.build(1, [("up.weight", (4, 3))], "sgd", [{"params": ["up.weight"],
                           "lr": 0.1}], 1, shards={"up.weight": ((8, 3), (4, 0))},
                           state_keys="fqn")
    again = ModelSpec.from_json(spec.dumps())
    assert again == spec and again.params[0].whole == (8, 3) and again.state_keys == "fqn"
    piece = Piece((4, 3), 2, 12, np.arange(10, dtype=np.float32), (8, 3), (4, 0))
    # flat elements 2..11 of the shard: the rest of row 0, rows 1..3, at row 4 of the whole
    assert [tuple(c.offsets) for c in piece.chunks()] == [(4, 2), (5, 0)]
    assert piece.view((5, 0)).tolist()[0] == [1.0, 2.0, 3.0]
    doc = spec.to_json()
    doc["params"][0]["global_offset"] = [6, 0]  # rows 6..9 of an 8-row tensor
    with pytest.raises(SpecError, match="does not fit in the global shape"):
        ModelSpec.from_json(doc)
    del doc["params"][0]["global_offset"]
    with pytest.raises(SpecError, match="come together"):
        ModelSpec.from_json(doc)


def test_a_pipeline_stage_that_lost_a_peer_says_so_in_one_line():
    from checkmate.train.run_script import _gloo_cause

    gloo = RuntimeError("[/x/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:1: "
                        "Connection reset by peer. This is typically caused by ...")
    try:
        try:
            raise gloo
        except RuntimeError as e:  # torch.distributed.pipelining's stage wraps it
            raise RuntimeError("[Stage 1] failed to run forward") from e
    except RuntimeError as wrapped:
        assert _gloo_cause(wrapped) == str(gloo)
    assert _gloo_cause(RuntimeError("a bug of the script")) is None


# ----------------------------------------------------------------------------- launches
def _launch(tmp: Path, name: str, args: list[str], script: list[str],
            env: dict[str, str] | None = None, example: Path = PP) -> tuple[int, str]:
    dims = {PP: ["--pp", "2"], TP: ["--tp", "2"], THREE_D: ["--pp", "2", "--tp", "2"]}
    world = 8 if example == THREE_D else WORLD
    argv = [sys.executable, "-m", "checkmate.launch.cli", "launch", "--nproc-per-node",
            str(world), *dims[example], "--progress-every", "0", *args, str(example), *script]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "NUMBA_NUM_THREADS": "1", **(env or {})})
    out = p.stdout + p.stderr
    (tmp / f"{name}.log").write_text(out)
    return p.returncode, out


def _states(prefix: Path, world: int = WORLD) -> list[dict]:
    return [torch.load(f"{prefix}.{r}", weights_only=False) for r in range(world)]


@pytest.fixture(scope="module")
def clean_pp(tmp_path_factory):
    """Every rank's final stage state after STEPS iterations without Checkmate."""
    tmp = tmp_path_factory.mktemp("clean_pp")
    rc, out = _launch(tmp, "clean", ["--mode", "off"],
                      ["--steps", str(STEPS), "--out", str(tmp / "state")])
    assert rc == 0, out[-4000:]
    assert "rank 0 of 4 (2 data-parallel groups of 2: pp x dp)" in out, out
    return _states(tmp / "state")


def test_a_pipeline_job_killed_anywhere_restarts_bit_identically(tmp_path, clean_pp):
    # GPipe here; 1F1B in the 3-D job below (both accumulate the micro-batches in order)
    schedule = "gpipe"
    rank, at = random.randrange(WORLD), random.randrange(2, STEPS)
    rc, out = _launch(tmp_path, "killed", ["--shadows", "1", "--max-restarts", "1",
                                           "--dir", str(tmp_path / "logs")],
                      ["--steps", str(STEPS), "--schedule", schedule,
                       "--out", str(tmp_path / "state")],
                      env={"CHECKMATE_KILL_AT": f"{rank}:{at}"})
    assert rc == 0, f"rank {rank} killed at {at}:\n{out[-4000:]}"
    assert "Traceback" not in out, out[-4000:]
    assert "starting 2 shadow(s) (1 per data-parallel group)" in out, out
    resumed = [ln for ln in out.splitlines() if "(all 2 data-parallel groups)" in ln]
    assert len(resumed) == 1, out[-3000:]
    # the killed rank's step was done but not its control message: at, or the one before
    assert int(re.search(r"resuming at iteration (\d+) ", resumed[0])[1]) in (at, at - 1), \
        resumed[0]
    assert "attempt 1: resumed from the shadows" in out, out[-3000:]
    for r, (got, want) in enumerate(zip(_states(tmp_path / "state"), clean_pp, strict=True)):
        assert same_state(got, want), f"rank {r} (stage {r // 2}) differs after a kill of " \
                                 f"rank {rank} at {at}"
    assert out.count("the shadows hold iteration 8 (per shadow: [8, 8])") == 1, out[-2000:]
    # each group's shadow holds that group's stage under the group's own wire job id
    for g in range(2):
        log = (tmp_path / "logs" / f"shadow-{g}.log").read_text()
        assert f"partition 0 of job {wire.group_job_id(1, g, 2)} state installed" in log, log


def test_a_mesh_the_launcher_did_not_size_the_shadows_for_is_one_line(tmp_path):
    argv = [sys.executable, "-m", "checkmate.launch.cli", "launch", "--nproc-per-node",
            str(WORLD), "--progress-every", "0", "--shadows", "1", str(PP), "--steps", "2"]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "NUMBA_NUM_THREADS": "1"})
    out = p.stdout + p.stderr
    assert p.returncode != 0 and "Traceback" not in out, out[-3000:]
    assert "the DeviceMesh has 2 data-parallel groups (pp), the launcher started shadows " \
           "for 1: launch with --pp/--tp giving 2 groups" in out, out[-3000:]


@pytest.fixture(scope="module")
def clean_tp(tmp_path_factory):
    """Every rank's final state (local shards) after STEPS iterations without Checkmate."""
    tmp = tmp_path_factory.mktemp("clean_tp")
    rc, out = _launch(tmp, "clean", ["--mode", "off"],
                      ["--steps", str(STEPS), "--out", str(tmp / "state")], example=TP)
    assert rc == 0, out[-4000:]
    assert "rank 0 of 4 (2 data-parallel groups of 2: tp x dp)" in out, out
    return _states(tmp / "state")


def test_a_tensor_parallel_job_killed_anywhere_restarts_bit_identically(tmp_path, clean_tp):
    rank, at = random.randrange(WORLD), random.randrange(2, STEPS)
    rc, out = _launch(tmp_path, "killed", ["--shadows", "1", "--max-restarts", "1"],
                      ["--steps", str(STEPS), "--out", str(tmp_path / "state")],
                      env={"CHECKMATE_KILL_AT": f"{rank}:{at}"}, example=TP)
    assert rc == 0, f"rank {rank} killed at {at}:\n{out[-4000:]}"
    assert "Traceback" not in out, out[-4000:]
    resumed = [ln for ln in out.splitlines() if "(all 2 data-parallel groups)" in ln]
    assert len(resumed) == 1, out[-3000:]
    assert int(re.search(r"resuming at iteration (\d+) ", resumed[0])[1]) in (at, at - 1), \
        resumed[0]
    for r, (got, want) in enumerate(zip(_states(tmp_path / "state"), clean_tp, strict=True)):
        assert same_state(got, want), f"rank {r} (tp {r % 2}) differs after a kill of rank " \
                                 f"{rank} at {at}"


@pytest.fixture(scope="module")
def clean_fsdp_tp(tmp_path_factory):
    """FSDP2 + TP: every rank's final state (its rows of its TP part) without Checkmate."""
    tmp = tmp_path_factory.mktemp("clean_fsdp_tp")
    rc, out = _launch(tmp, "clean", ["--mode", "off"],
                      ["--fsdp", "--steps", str(STEPS), "--out", str(tmp / "state")],
                      example=TP)
    assert rc == 0, out[-4000:]
    return _states(tmp / "state")


def test_fsdp2_beside_tensor_parallel_killed_anywhere_restarts_bit_identically(tmp_path,
                                                                               clean_fsdp_tp):
    """torchtitan's 2-D layout: blocks split by parallelize_module over tp, everything
    fully_shard-ed over dp, FSDPSession per TP rank: each rank sends its rows of its TP
    part, a random kill restarts bit-identically."""
    rank, at = random.randrange(WORLD), random.randrange(2, STEPS)
    rc, out = _launch(tmp_path, "killed", ["--shadows", "1", "--max-restarts", "1"],
                      ["--fsdp", "--steps", str(STEPS), "--out", str(tmp_path / "state")],
                      env={"CHECKMATE_KILL_AT": f"{rank}:{at}"}, example=TP)
    assert rc == 0, f"rank {rank} killed at {at}:\n{out[-4000:]}"
    assert "Traceback" not in out and "UserWarning" not in out, out[-4000:]
    resumed = [ln for ln in out.splitlines() if "(all 2 data-parallel groups)" in ln]
    assert len(resumed) == 1, out[-3000:]
    got = _states(tmp_path / "state")
    # FSDP's rows of the TP part: blocks.0.up.weight is (4*32 / TP 2 / DP 2) x 32 here
    assert got[0]["model"]["blocks.0.up.weight"].shape == (32, 32)
    for r, (a, b) in enumerate(zip(got, clean_fsdp_tp, strict=True)):
        assert same_state(a, b), f"rank {r} differs after a kill of rank {rank} at {at}"


NORM = textwrap.dedent("""
    import os, sys
    import torch, torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    from checkmate.optim.clip import clip_mesh
    from checkmate.train.tensor_parallel import counts_in_norm, local

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(6), nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 6))
    parallelize_module(model, mesh["tp"], {"1": ColwiseParallel(), "3": RowwiseParallel()})
    x = torch.randn(4, 6)
    model(x).pow(2).sum().backward()
    params = list(model.parameters())
    # the reference: the norm of the whole model's gradient, each DTensor gathered whole
    full = [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            for p in params]
    whole = float(torch.stack([g.double().pow(2).sum() for g in full]).sum().sqrt())
    first = mesh.get_local_rank("tp") == 0
    max_norm = whole / 4  # clips: the factor shows the norm used
    coef = clip_mesh([local(p.grad) for p in params], [counts_in_norm(p, first)
                     for p in params], max_norm, mesh["tp"].get_group())
    print(f"rank {dist.get_rank()} whole {whole:.6f} coef {coef:.6f}", flush=True)
    # Leave at once (as checkmate.fastexit does for workers): gloo's teardown of the mesh's
    # subgroups can abort the process after its answer is out.
    dist.barrier()
    os._exit(0)
""")


def test_the_tensor_parallel_clip_norm_counts_every_shard_and_every_copy_once(tmp_path):
    script = tmp_path / "norm.py"
    script.write_text(NORM)
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc-per-node", "2", str(script)], capture_output=True, text=True,
                       timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    got = re.findall(r"rank (\d) whole ([0-9.]+) coef ([0-9.]+)", p.stdout)
    assert len(got) == 2, p.stdout
    for _, _whole, coef in got:
        # max_norm / (norm + 1e-6) with max_norm a quarter of the whole norm: 0.25 exactly
        # when the norm is the whole model's (a copy counted twice, or a shard left out,
        # moves it)
        assert float(coef) == pytest.approx(0.25, rel=1e-5), got


PLAIN_LOAD = textwrap.dedent("""
    # The whole model (TP 1 x PP 1) in one process with plain torch: no checkmate imported.
    import sys
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    sys.path.insert(0, sys.argv[1])
    import train_3d

    assert not any(m.split(".")[0] == "checkmate" for m in sys.modules), "checkmate imported"
    ckpt, prefix, pp_n, tp_n, world = sys.argv[2], sys.argv[3], 2, 2, 8
    model = train_3d.LM()
    opt = torch.optim.AdamW(model.parameters(), lr=1.0)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()  # state to load into, and values unlike the trained ones
    msd, osd = model.state_dict(), get_optimizer_state_dict(model, opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=ckpt)
    bad, checked = [], 0
    for r in range(world):  # every rank's own final state: a shard or a copy of the whole
        pp, tp = r // (world // pp_n), r % tp_n
        saved = torch.load(f"{prefix}.{r}", weights_only=False)
        names = [n for n, _ in train_3d.stage_of(pp, pp_n).named_parameters()]
        want = {("model", k, ""): v for k, v in saved["model"].items()}
        for i, st in saved["optimizer"]["state"].items():
            want.update({("optim", names[i], k): v for k, v in st.items()})
        for (kind, name, slot), mine in want.items():
            whole = msd[name] if kind == "model" else osd["state"][name][slot]
            if whole.shape != mine.shape:  # a TP shard: its chunk of the whole tensor
                d = [a != b for a, b in zip(whole.shape, mine.shape)].index(True)
                whole = whole.chunk(tp_n, d)[tp]
            checked += 1
            if not torch.equal(whole, mine):
                bad.append((r, kind, name, slot))
    grouped = sum(len(g["params"]) for g in osd["param_groups"])
    print(f"checked {checked} differ {bad} params {grouped} of {len(list(model.parameters()))}")
""")


def test_a_3d_job_killed_anywhere_restarts_bit_identically_and_its_files_reshard(tmp_path):
    """PP 2 x DP 2 x TP 2 (8 ranks, 1F1B, AdamW): a random rank killed at a random
    iteration, then the four groups' shadows' disk checkpoints joined by ``shadow export``
    load with plain ``dcp.load`` into the whole model in one process (TP 1 x PP 1, no
    checkmate imported) and into the same mesh, with the values the run ended with."""
    rank, at = random.randrange(8), random.randrange(2, STEPS)
    # --verify-every 1: every group's data-parallel copies agree after every step
    rc, out = _launch(tmp_path, "killed", ["--shadows", "1", "--max-restarts", "1",
                                           "--persist-every", "4", "--verify-every", "1",
                                           "--dir", str(tmp_path / "run")],
                      ["--steps", str(STEPS), "--out", str(tmp_path / "state")],
                      env={"CHECKMATE_KILL_AT": f"{rank}:{at}"}, example=THREE_D)
    assert rc == 0, f"rank {rank} killed at {at}:\n{out[-4000:]}"
    assert "Traceback" not in out, out[-4000:]
    assert "rank 0 of 8 (4 data-parallel groups of 2: pp x tp x dp)" in out, out
    resumed = [ln for ln in out.splitlines() if "(all 4 data-parallel groups)" in ln]
    assert len(resumed) == 1, out[-3000:]
    assert int(re.search(r"resuming at iteration (\d+) ", resumed[0])[1]) in (at, at - 1), \
        resumed[0]
    assert "error:" not in out, out[-3000:]  # the other ranks lost a peer, said as such
    ckpt = tmp_path / "whole"
    p = subprocess.run([sys.executable, "-m", "checkmate.shadow.cli", "export", "--out",
                        str(ckpt), *map(str, sorted((tmp_path / "run" / "checkpoints")
                                                    .glob("group*")))],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert f"exported iteration {STEPS} of 4 data-parallel groups (4 partitions)" in p.stdout
    script = tmp_path / "plain_load.py"
    script.write_text(PLAIN_LOAD)
    p = subprocess.run([sys.executable, str(script), str(ROOT / "examples"), str(ckpt),
                        str(tmp_path / "state")], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    got = re.search(r"checked (\d+) differ (.*) params (\d+) of (\d+)", p.stdout)
    assert got and got[2] == "[]" and int(got[1]) > 100, p.stdout
    assert got[3] == got[4], p.stdout  # every parameter in the joined optimizer groups
    # the same mesh: a run without Checkmate ends with the same bits, then loads the files
    rc, clean = _launch(tmp_path, "clean", ["--mode", "off"],
                        ["--steps", str(STEPS), "--out", str(tmp_path / "clean"),
                         "--load", str(ckpt)], example=THREE_D)
    assert rc == 0, clean[-4000:]
    assert clean.count("the saved values") == 8 and "DIFFERENT" not in clean, clean[-3000:]
    for r, (a, b) in enumerate(zip(_states(tmp_path / "state", 8),
                                   _states(tmp_path / "clean", 8), strict=True)):
        assert same_state(a, b), f"rank {r} differs after a kill of rank {rank} at {at}"
