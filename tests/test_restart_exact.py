"""Every path restores bit for bit at world sizes 2 to 5, and every failure is one line.

The model is examples/train_lm.py: a small causal language model whose output layer is tied
to its input embedding (``lm_head.weight = emb.weight``), SGD nesterov with StepLR, two
micro-batches per step (the first under ``no_sync()``), on Checkmate's own wrapper, stock
DDP with the hook, and FSDP2. Each restart test runs it under ``checkmate launch`` with two
shadows and one rank SIGKILLed at a random iteration, and compares it with a run without
Checkmate (``--mode off``: our ring without shadows, stock DDP, stock FSDP2); the final
model, optimizer and scheduler state must be equal bit for bit, and the killed run's log
must hold no traceback. The runs without Checkmate of one world size are one launch whose
workers train the script once per path in turn (``clean_runs``): each is the script's own
``main`` from a fresh model and seed, bit for bit a launch of its own, at a third of the
process starts. 2 to 5 ranks, three sizes per path (``MATRIX``): with 3 or more the
allreduce's summation order shows in the last bits, which is what broke stock DDP's
restarts (checkmate.train.ddp_buckets).
"""

from __future__ import annotations

import importlib.util
import os
import random
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from checkmate.spec.model import ModelSpec, difference

ROOT = Path(__file__).resolve().parents[1]
LM = ROOT / "examples" / "train_lm.py"
STEPS = 10
PATHS = ("own", "ddp", "fsdp")
#: The world sizes each path restarts at: three of 2-5 each, every size at least twice but 4
#: (the own wrapper; test_launch.py restarts it at 4 too, and test_fsdp2.py HSDP at 2 x 2),
#: 3 and 5 -- where the allreduce's summation order shows -- for the library paths.
MATRIX = {"own": (2, 4, 5), "ddp": (2, 3, 5), "fsdp": (2, 3, 5)}


def _lm_module():  # noqa: ANN202
    spec = importlib.util.spec_from_file_location("train_lm", LM)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _launch(tmp: Path, name: str, world: int, args: list[str], script_args: list[str],
            env: dict[str, str] | None = None, ok: bool = True
            ) -> tuple[subprocess.CompletedProcess, str]:
    argv = [sys.executable, "-m", "checkmate.launch.cli", "launch", "--nproc-per-node", str(world),
            "--progress-every", "0", *args, str(LM), *script_args]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "NUMBA_NUM_THREADS": "1", **(env or {})})
    out = p.stdout + p.stderr
    (tmp / f"{name}.log").write_text(out)
    if ok:
        assert p.returncode == 0, out[-4000:]
    return p, out


# One worker process trains the script once per path, each from its own ``main`` (a fresh
# model, seed and process group), so one launch per world size replaces three. Rank 0 hosts
# each group's store on MASTER_PORT: the other ranks join the next group only once rank 0
# has closed the last one (a client that reached the old store would be dropped with it).
EVERY_PATH = textwrap.dedent("""
    import os, runpy, sys, time
    from pathlib import Path
    lm, out, steps = sys.argv[1:4]
    rank = int(os.environ["RANK"])
    for k, path in enumerate(sys.argv[4:]):
        gate = Path(out, f"closed-{k - 1}")
        deadline = time.monotonic() + 300
        while k and rank and not gate.exists():
            if time.monotonic() > deadline:
                sys.exit(f"rank {rank}: rank 0 did not close the group of run {k - 1}")
            time.sleep(0.05)
        sys.argv = [lm, "--path", path, "--steps", steps, "--out", f"{out}/{path}.pt"]
        runpy.run_path(lm, run_name="__main__")
        if rank == 0:
            Path(out, f"closed-{k}").touch()
""")


@pytest.fixture(scope="module")
def clean_runs(tmp_path_factory):
    """``clean_runs(world)``: path -> the final state of a run of STEPS iterations without
    Checkmate (``--mode off``) on ``world`` ranks; one launch per world size, shared by
    the tests of that size."""
    done: dict[int, dict[str, dict]] = {}

    def get(world: int) -> dict[str, dict]:
        if world not in done:
            tmp = tmp_path_factory.mktemp(f"clean{world}")
            script = tmp / "every_path.py"
            script.write_text(EVERY_PATH)
            paths = [p for p in PATHS if world in MATRIX[p]]
            argv = [sys.executable, "-m", "checkmate.launch.cli", "launch", "--nproc-per-node",
                    str(world), "--progress-every", "0", "--mode", "off", str(script), str(LM),
                    str(tmp), str(STEPS), *paths]
            p = subprocess.run(argv, capture_output=True, text=True, timeout=600,
                               env={**os.environ, "NUMBA_NUM_THREADS": "1"})
            out = p.stdout + p.stderr
            (tmp / "clean.log").write_text(out)
            assert p.returncode == 0, out[-4000:]
            assert out.count(f"rank 0 of {world}, attempt 0: no shadows (mode off)") == \
                len(paths), out
            done[world] = {path: torch.load(tmp / f"{path}.pt", weights_only=False)
                           for path in paths}
        return done[world]

    return get


def _differences(a: object, b: object, where: str = "") -> list[str]:
    """Paths where two saved states differ (tensors bit for bit, the rest by ==)."""
    if torch.is_tensor(a):
        same = torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
        return [] if same else [where]
    if isinstance(a, dict):
        if not isinstance(b, dict) or a.keys() != b.keys():
            return [f"{where} (keys)"]
        return [d for k in a for d in _differences(a[k], b[k], f"{where}/{k}")]
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return [f"{where} (length)"]
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True))
                for d in _differences(x, y, f"{where}/{i}")]
    return [] if a == b else [where]


# ----------------------------------------------------------------------------- fast
def test_a_tied_parameter_is_one_parameter_restored_under_every_name():
    from checkmate.optim import SGD

    lm = _lm_module()
    model = lm.TiedLM()
    opt = SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True)
    spec = ModelSpec.from_torch(1, model, opt, 2)
    names = [p.name for p in spec.params]
    assert "emb.weight" in names and "lm_head.weight" not in names
    assert spec.aliases == (("lm_head.weight", "emb.weight"),)
    assert spec.total == sum(p.numel() for p in model.parameters())  # counted once
    assert ModelSpec.from_json(spec.dumps()) == spec
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    flat = spec.flat_from_state_dicts(model.state_dict(), opt.state_dict())
    msd, osd = spec.state_dicts(flat, 1)
    assert msd.keys() == model.state_dict().keys()  # both names of the tie
    assert msd["lm_head.weight"] is msd["emb.weight"]
    fresh = lm.TiedLM()
    fresh.load_state_dict(msd, strict=True)
    assert fresh.lm_head.weight is fresh.emb.weight
    assert torch.equal(fresh.emb.weight, model.emb.weight)
    assert len(osd["state"]) == len(list(model.parameters()))
    # a model with another tie (or none) is a different job, named in one line
    untied = lm.TiedLM()
    untied.lm_head.weight = torch.nn.Parameter(untied.emb.weight.detach().clone())
    other = ModelSpec.from_torch(1, untied, SGD(untied.parameters(), lr=0.1, momentum=0.9,
                                                nesterov=True), 2)
    why = difference(spec, other)
    assert why is not None and "lm_head.weight" in why, why
    # an untied model's spec has no aliases key: specs of earlier jobs are unchanged
    assert "aliases" not in other.to_json()
    bad = {**spec.to_json(), "aliases": {"lm_head.weight": "nope"}}
    with pytest.raises(ValueError, match="unknown parameter 'nope'"):
        ModelSpec.from_json(bad)


def test_the_first_failure_is_the_rank_that_set_the_others_off(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from checkmate.train import failures

    monkeypatch.setenv(failures.LOG_DIR, str(tmp_path))
    monkeypatch.setenv(failures.RESTART_COUNT, "1")
    failures.record("checkmate: rank 0: a peer of the process group is gone (reset); "
                    "exiting for the launcher to restart the group", "0")
    failures.record("checkmate: rank 2: error: restore: the shadows are gone", "2")
    died = {r: SimpleNamespace(exitcode=c, timestamp=0) for r, c in ((0, 1), (1, -9), (2, 2))}
    # rank 1 was SIGKILLed and wrote nothing: it is the one whose failure is not a consequence
    # with the earliest time (its agent timestamp 0)
    assert failures.first_failure(tmp_path, 1, died) == (1, "killed by signal SIGKILL")
    del died[1]
    assert failures.first_failure(tmp_path, 1, died) == (
        2, "error: restore: the shadows are gone")
    try:
        raise ValueError("bad batch\nsecond line")
    except ValueError as e:
        line = failures.describe(e, "3")
    assert line.startswith("ValueError: bad batch second line at test_restart_exact.py:"), line
    assert "\n" not in line
    tb = Path(line.rsplit("traceback in ", 1)[1])
    assert "Traceback" in tb.read_text() and tb.parent == tmp_path / "failures"


# ----------------------------------------------------------------------------- restarts
@pytest.mark.slow
@pytest.mark.parametrize("path,world", [(p, w) for p, sizes in MATRIX.items() for w in sizes])
def test_kill_and_restore_is_bit_identical_to_a_run_without_checkmate(tmp_path, clean_runs,
                                                                      path, world):
    rank, at = random.randrange(world), random.randrange(2, STEPS)
    why = f"{path}, {world} ranks, rank {rank} killed after iteration {at}"
    script = ["--path", path, "--steps", str(STEPS)]
    _, out = _launch(tmp_path, "killed", world, ["--shadows", "2", "--max-restarts", "1"],
                     [*script, "--out", str(tmp_path / "killed.pt")],
                     {"CHECKMATE_KILL_AT": f"{rank}:{at}"})
    m = re.search(r"attempt 1: resumed from the shadows at iteration (\d+)", out)
    assert m and at - 1 <= int(m.group(1)) <= at, (why, out[-3000:])
    assert "Traceback" not in out and "warning" not in out, (why, out[-3000:])
    clean = clean_runs(world)[path]
    killed = torch.load(tmp_path / "killed.pt", weights_only=False)
    assert "lm_head.weight" in killed["model"], why
    diff = _differences(clean, killed)
    assert not diff, (why, diff[:5])


@pytest.mark.slow
def test_gockpt_mode_restores_a_tied_model_bit_identically(tmp_path, clean_runs):
    rank, at = random.randrange(2), random.randrange(7, STEPS)  # after checkpoint 5 (3 + 2)
    why = f"rank {rank} killed after iteration {at}"
    script = ["--steps", str(STEPS)]  # the clean run: the own path's of the matrix, 2 ranks
    _, out = _launch(tmp_path, "killed", 2, ["--mode", "gockpt", "--gockpt", "3,2",
                                             "--max-restarts", "1", "--dir",
                                             str(tmp_path / "run")],
                     [*script, "--out", str(tmp_path / "killed.pt")],
                     {"CHECKMATE_KILL_AT": f"{rank}:{at}"})
    # the launcher's lines, and the newest window that ended before the kill (checkpoints
    # of 5 and 8: every 3 iterations, spread over 2 steps)
    assert "attempt 0: GoCkpt checkpoints every 3 iterations over 2 steps" in out, out[-3000:]
    m = re.search(r"attempt 1: resumed from GoCkpt checkpoint (\d+)", out)
    assert m and int(m[1]) == max(c for c in (5, 8) if c < at), (why, out[-3000:])
    assert "the newest GoCkpt checkpoint is of iteration 8" in out, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    diff = _differences(clean_runs(2)["own"],
                        torch.load(tmp_path / "killed.pt", weights_only=False))
    assert not diff, (why, diff[:5])


LOADER = textwrap.dedent("""
    import importlib.util, sys
    sys.path[:0] = [TORCH_SITE]
    import torch
    import torch.distributed.checkpoint as dcp

    spec = importlib.util.spec_from_file_location("train_lm", LM)
    lm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lm)
    model = lm.TiedLM()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.7)
    osd = opt.state_dict()  # no state before a step: give dcp.load the slots
    osd["state"] = {i: {"momentum_buffer": torch.zeros_like(p)}
                    for i, p in enumerate(model.parameters())}
    sd = {"model": model.state_dict(), "optim": osd, "scheduler": sched.state_dict()}
    dcp.load(sd, checkpoint_id=CKPT)
    model.load_state_dict(sd["model"])
    opt.load_state_dict(osd)
    assert model.lm_head.weight is model.emb.weight
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, OUT)
    print("LOADED", "checkmate" in sys.modules)
""")


@pytest.mark.slow
def test_the_durable_checkpoint_of_a_tied_model_loads_with_plain_dcp(tmp_path):
    """The shadows' checkpoint on disk, loaded by a Python without checkmate into the tied
    model's own state_dict (both names), equals a run of as many steps without Checkmate."""
    run = tmp_path / "run"
    _launch(tmp_path, "persist", 2, ["--shadows", "2", "--dir", str(run), "--persist-every",
                                     "2"], ["--steps", "6"])
    ckpt = run / "checkpoints"
    name = (ckpt / "latest").read_text().strip()
    iteration = int(name.rsplit("-", 1)[1])
    assert iteration >= 2, name
    _launch(tmp_path, "clean", 2, ["--mode", "off"],
            ["--steps", str(iteration), "--out", str(tmp_path / "clean.pt")])
    work = tmp_path / "plain"
    work.mkdir()
    script = (f"TORCH_SITE = {str(Path(torch.__file__).parents[1])!r}\nLM = {str(LM)!r}\n"
              f"CKPT = {str(ckpt / name)!r}\nOUT = {str(tmp_path / 'loaded.pt')!r}\n" + LOADER)
    r = subprocess.run([sys.executable, "-S", "-c", script], cwd=work, capture_output=True,
                       text=True, timeout=120, env={"PATH": os.environ.get("PATH", "")})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "LOADED False" in r.stdout, r.stdout + r.stderr
    got = torch.load(tmp_path / "loaded.pt")
    ref = torch.load(tmp_path / "clean.pt", weights_only=False)
    assert "lm_head.weight" in got["model"]
    assert not _differences(ref["model"], got["model"])
    assert not _differences(ref["optimizer"]["state"], got["optim"]["state"])


# ----------------------------------------------------------------------------- world size
@pytest.mark.slow
def test_a_world_size_change_is_announced_on_every_rank_or_refused(tmp_path, serve_shadows):
    net = f"127.{random.randrange(120, 200)}.{random.randrange(1, 255)}"
    with serve_shadows([f"{net}.100", f"{net}.101"], config=False) as ips:
        base = ["--shadow", ips[0], "--shadow", ips[1]]
        _launch(tmp_path, "three", 3, base, ["--steps", "4"])
        p, out = _launch(tmp_path, "fixed", 2, [*base, "--resume", "--fixed-world"],
                         ["--steps", "6"], ok=False)
        assert p.returncode == 2 and "Traceback" not in out, out[-3000:]
        for r in range(2):
            assert (f"checkmate: rank {r}: error: the checkpoint was written by a job of 3 "
                    f"ranks and this one has 2") in out, out[-3000:]
        last = p.stderr.strip().splitlines()[-1]
        assert "failed first" in last and "job of 3 ranks" in last, last
        _, out = _launch(tmp_path, "two", 2, [*base, "--resume"], ["--steps", "6"])
        for r in range(2):
            assert f"checkmate: rank {r}: resuming a job of 3 ranks on 2" in out, out[-3000:]
        assert "resumed from the shadows at iteration 4" in out, out[-3000:]


# ----------------------------------------------------------------------------- failures
@pytest.mark.slow
def test_a_script_error_is_one_line_per_rank_and_the_launcher_names_the_first(tmp_path):
    """A script bug on rank 1 from iteration 3 on (the restart fails the same way): one
    line from rank 1 naming the error and where its traceback is, one line from each other
    rank, and the launcher's last line names rank 1 and the error. No traceback anywhere."""
    script = tmp_path / "buggy.py"
    script.write_text(textwrap.dedent(f"""
        import runpy, sys
        import torch
        sys.argv = [{str(LM)!r}, "--steps", "5"]
        import checkmate.train.session as S
        step = S.CheckmateSession.step
        def buggy(self, extra=None):
            if self.layout.rank == 1 and self.iteration >= 3:
                {{}}["no such key"]
            return step(self, extra)
        S.CheckmateSession.step = buggy
        runpy.run_path({str(LM)!r}, run_name="__main__")
    """))
    argv = [sys.executable, "-m", "checkmate.launch.cli", "launch", "--nproc-per-node", "3",
            "--shadows", "2", "--max-restarts", "1", "--dir", str(tmp_path / "run"),
            str(script)]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "NUMBA_NUM_THREADS": "1"})
    out = p.stdout + p.stderr
    assert p.returncode == 2 and "Traceback" not in out, out[-4000:]
    assert re.search(r"checkmate: rank 1: error: KeyError: 'no such key' at buggy\.py:\d+; "
                     r"traceback in \S+attempt-1-rank-1\.traceback", out), out[-4000:]
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("checkmate launch: error: the trainers failed after 1 restart(s): "
                           "rank 1 (error: KeyError: 'no such key'"), last
    assert "failed first" in last, last
    tb = (tmp_path / "run" / "failures" / "attempt-1-rank-1.traceback").read_text()
    assert "KeyError" in tb and "buggy.py" in tb


def test_a_restored_ddp_bucket_is_cut_into_the_recorded_buckets():
    from checkmate.train.ddp_buckets import BucketPlan, fits, parse_layout

    recorded = [[5, 4], [3, 2, 1], [0]]
    assert parse_layout(recorded, 6) == recorded
    for bad in (None, [[0, 1], [1]], [[0, 1, 2, 3, 4]], "0 1", [[0, 1.0]]):
        assert parse_layout(bad, 6) is None, bad
    one = [[0, 1, 2, 3, 4, 5]]  # DDP's first iteration: every parameter in one bucket
    assert fits(one, recorded) is None
    assert "spans" in fits([[0, 1, 2], [3, 4, 5]], recorded)
    plan = BucketPlan(recorded)
    assert plan.pieces([0, 1, 2, 3, 4, 5]) == recorded  # in the recorded order
    assert plan.pieces([3, 2, 1]) is None  # a recorded bucket as it is: reduced whole
    assert plan.pieces([0, 5, 4]) == [[5, 4], [0]]
    with pytest.raises(ValueError):
        plan.pieces([5, 3])
