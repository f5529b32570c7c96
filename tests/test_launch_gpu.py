"""``checkmate launch`` on GPUs: the launcher's and the worker's decisions, on the CPU.

The default worker count depends on how many CUDA devices the launcher sees; that one
number comes from ``checkmate.launch.placement.cuda_device_count``, which these tests
replace with a double (``fake_cuda_devices``: "CUDA present with N devices") to check the
decision (checkmate.launch.placement.place, which the device check shares). It does not
model a GPU: nothing here runs on one. The binding of a worker to its GPU and the NCCL
process group need real devices; those tests skip without CUDA.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch

from checkmate.errors import CheckmateError
from checkmate.launch import cli as launch
from checkmate.launch import launcher, placement
from checkmate.train import env as envmod
from checkmate.train.run_script import bind_device

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_ddp.py"


def fake_cuda_devices(n: int):  # noqa: ANN201
    """A double of torch.cuda's device count as the launcher asks it: ``n`` devices."""
    return lambda: n


def _launch_env(monkeypatch: pytest.MonkeyPatch, gpus: int, argv: list[str]) -> dict:
    """Run the launcher's main up to the agent (replaced: no worker starts) on a machine
    that has ``gpus`` CUDA devices; returns what the agent would have been given."""
    seen: dict = {}

    def agent(args: object, logdir: Path, colo: object = None) -> None:
        seen["nproc"] = args.nproc_per_node
        seen["env"] = dict(os.environ)

    monkeypatch.setattr(placement, "cuda_device_count", fake_cuda_devices(gpus))
    monkeypatch.setattr(launcher, "_run_agent", agent)
    with mock.patch.dict(os.environ):
        assert launch.main(["launch", *argv]) == 0
    return seen


def test_one_worker_per_gpu_by_default(monkeypatch, capsys):
    seen = _launch_env(monkeypatch, 3, ["--mode", "off", str(EXAMPLE)])
    assert seen["nproc"] == 3 and seen["env"][envmod.DEVICE] == "cuda"
    assert "3 trainer(s)" in capsys.readouterr().out


def test_an_explicit_count_and_cpu_win(monkeypatch):
    seen = _launch_env(monkeypatch, 2, ["--nproc-per-node", "4", "--mode", "off",
                                        str(EXAMPLE)])
    assert seen["nproc"] == 4 and seen["env"][envmod.DEVICE] == "cuda"  # two per GPU
    seen = _launch_env(monkeypatch, 2, ["--device", "cpu", "--mode", "off", str(EXAMPLE)])
    assert seen["nproc"] == 2 and seen["env"][envmod.DEVICE] == "cpu"


def test_without_gpus_the_count_is_required_and_cuda_refused(monkeypatch, capsys):
    monkeypatch.setattr(placement, "cuda_device_count", fake_cuda_devices(0))
    assert launch.main(["launch", "--mode", "off", str(EXAMPLE)]) == 2
    err = capsys.readouterr().err
    assert "--nproc-per-node" in err and len(err.strip().splitlines()) == 1, err
    assert launch.main(["launch", "--nproc-per-node", "1", "--device", "cuda", "--mode",
                        "off", str(EXAMPLE)]) == 2
    err = capsys.readouterr().err
    assert "no CUDA device is visible" in err and len(err.strip().splitlines()) == 1, err


def test_the_placement_decision_the_launcher_and_the_device_check_share():
    from checkmate.launch.placement import Placement, place

    assert place("auto", None, 3) == Placement("cuda", 3, 3)
    assert place("auto", 4, 2).gpus_used == 2  # two workers per GPU
    assert place("auto", 1, 2).gpus_used == 1
    assert place("cpu", None, 2) == Placement("cpu", 2, 2) and place("cpu", 3, 2).gpus_used == 0
    assert place("auto", 2, 0) == Placement("cpu", 2, 0)
    with pytest.raises(CheckmateError, match="no CUDA device is visible"):
        place("cuda", 1, 0)
    with pytest.raises(CheckmateError, match="--nproc-per-node"):
        place("auto", None, 0)
    with pytest.raises(CheckmateError, match="--device must be one of auto, cuda, cpu"):
        place("tpu", 1, 1)
    with pytest.raises(CheckmateError, match="at least 1"):
        place("cpu", 0, 0)


def test_each_worker_binds_its_local_rank_and_sharing_workers_get_their_own_hostid():
    base = {envmod.DEVICE: "cuda", "LOCAL_WORLD_SIZE": "2"}
    env = {**base, "LOCAL_RANK": "1"}
    assert bind_device(env, 2) == 1 and "NCCL_HOSTID" not in env  # one GPU each
    ids = []
    for r in range(4):  # four workers on two GPUs
        env = {**base, "LOCAL_WORLD_SIZE": "4", "LOCAL_RANK": str(r)}
        assert bind_device(env, 2) == r % 2
        ids.append(env["NCCL_HOSTID"])
    assert len(set(ids)) == 4
    env = {**base, "LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "0", "NCCL_HOSTID": "mine"}
    assert bind_device(env, 1) == 0 and env["NCCL_HOSTID"] == "mine"  # set by the user
    assert bind_device({"LOCAL_RANK": "0"}, 2) is None  # cpu
    with pytest.raises(CheckmateError, match="sees no CUDA device"):
        bind_device({**base, "LOCAL_RANK": "0"}, 0)
    with pytest.raises(CheckmateError, match="LOCAL_RANK"):
        bind_device(dict(base), 1)


def test_env_device_and_backend():
    env = {"RANK": "0", "WORLD_SIZE": "1", envmod.TRAINERS: "127.0.0.1:1",
           envmod.MODE: "off"}
    assert envmod.read(env).device == "cpu"
    assert envmod.read({**env, envmod.DEVICE: "cuda"}).device == "cuda"
    with pytest.raises(CheckmateError, match="CHECKMATE_DEVICE must be one of cpu, cuda"):
        envmod.read({**env, envmod.DEVICE: "tpu"})
    assert envmod.backend_for("cpu") == "gloo"
    assert envmod.backend_for("cuda") == "cpu:gloo,cuda:nccl"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a CPU machine")
def test_a_cuda_worker_without_a_gpu_is_one_line(tmp_path):
    script = tmp_path / "s.py"
    script.write_text("print('ran')\n")
    env = {**os.environ, envmod.DEVICE: "cuda", "LOCAL_RANK": "0", "RANK": "0"}
    p = subprocess.run([sys.executable, "-m", "checkmate.train.run_script", str(script)],
                       capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 2 and "ran" not in p.stdout, p.stderr
    assert p.stderr.strip() == ("checkmate: rank 0: error: CHECKMATE_DEVICE=cuda but this "
                                "worker sees no CUDA device")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="binding a worker needs a GPU")
def test_a_cuda_worker_runs_on_its_gpu(tmp_path):
    script = tmp_path / "s.py"
    script.write_text("import torch\nprint('device', torch.cuda.current_device())\n")
    n = torch.cuda.device_count()
    env = {**os.environ, envmod.DEVICE: "cuda", "LOCAL_RANK": str(n), "RANK": "0",
           "LOCAL_WORLD_SIZE": str(n + 1)}
    p = subprocess.run([sys.executable, "-m", "checkmate.train.run_script", str(script)],
                       capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 0 and p.stdout.strip() == "device 0", p.stderr


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA model needs a GPU")
def test_the_ring_refuses_a_cuda_model(tmp_path):
    from checkmate.optim import SGD
    from checkmate.train.layout import JobLayout
    from checkmate.train.session import CheckmateSession

    model = torch.nn.Linear(4, 4).cuda()
    lay = JobLayout(job_id=1, rank=0, world=1, trainers=[("127.0.0.1", 0)], shadows=[],
                    shadow_tcp=[], mode="off")
    sess = CheckmateSession(model, SGD(model.parameters(), lr=0.1), None, lay)
    with pytest.raises(CheckmateError, match="DDPSession"):
        sess._start_comm(1)


# ----------------------------------------------------------------------------- end to end
GPU_EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_gpu.py"


def _launch_example(tmp_path: Path, name: str, amp: str, env: dict[str, str] | None = None
                    ) -> tuple[str, dict]:
    out = tmp_path / f"{name}.pt"
    p = subprocess.run(
        [sys.executable, "-m", "checkmate.launch.cli", "launch", "--nproc-per-node", "2",
         "--shadows", "2", "--max-restarts", "1", str(GPU_EXAMPLE), "--steps", "12",
         "--width", "64", "--batch", "16", "--amp", amp, "--out", str(out)],
        capture_output=True, text=True, timeout=400,
        env={**os.environ, "NUMBA_NUM_THREADS": "1", **(env or {})})
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    return p.stdout + p.stderr, torch.load(out, weights_only=False)


@pytest.mark.slow
def test_the_gpu_example_restarts_bit_identical_with_fp16_scaling(tmp_path):
    """examples/train_gpu.py as the launcher runs it (on the CPU here: gloo, CPU fp16
    autocast, GradScaler("cpu")): a SIGKILLed rank, the group restarted and resumed from the
    shadows, ends as the clean run -- model, optimizer, scheduler and scaler."""
    import random

    rank, at = random.randrange(2), random.randrange(3, 11)
    why = f"rank {rank} killed at iteration {at}"
    clean, ref = _launch_example(tmp_path, "clean", "fp16")
    killed, got = _launch_example(tmp_path, "killed", "fp16",
                                  {"CHECKMATE_KILL_AT": f"{rank}:{at}"})
    assert "restarting the worker group" in killed and "resumed from the shadows" in killed, \
        (why, killed[-3000:])
    assert ref["scaler"]["scale"] > 0 and got["scaler"] == ref["scaler"], why
    assert got["scheduler"] == ref["scheduler"] and got["steps"] == ref["steps"], why
    for k, v in ref["model"].items():
        assert torch.equal(got["model"][k], v), (why, k)
    for i, st in ref["optimizer"]["state"].items():
        for k, v in st.items():
            assert torch.equal(got["optimizer"]["state"][i][k], v), (why, i, k)
