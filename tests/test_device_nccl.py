"""The device check's real-NCCL run of the ckm plugin (checkmate.testbed.device_nccl), its
CPU-side parts: each rank's environment, the choice of identity path per release, and the
verdict over what a run leaves -- fed here by the harness on loopback instead of NCCL (no
GPU or NCCL on this machine; the run itself needs both and skips, saying why)."""

from __future__ import annotations

import os
import random

import pytest
import torch

from checkmate.protocol import auth, datamac
from checkmate.testbed import device_check, device_nccl
from checkmate.testbed import nccl_harness as H
from checkmate.testbed import nccl_replicas as R


def test_device_nccl_env_two_nodes_on_one_gpu_through_the_plugin(tmp_path):
    plugin = tmp_path / "libnccl-net-ckm.so"
    envs = [device_nccl.device_env(r, 2, plugin, tmp_path / "k", 7, tmp_path / f"s{r}",
                                   "profiler", 29500) for r in range(2)]
    assert envs[0]["NCCL_HOSTID"] != envs[1]["NCCL_HOSTID"]
    for r, e in enumerate(envs):
        assert e["NCCL_NET_PLUGIN"] == e["NCCL_TUNER_PLUGIN"] == e["NCCL_PROFILER_PLUGIN"] == \
            str(plugin)
        assert e["NCCL_NET"] == "ckm"  # NCCL fails instead of falling back to its sockets
        assert e["NCCL_P2P_DISABLE"] == e["NCCL_SHM_DISABLE"] == "1"
        assert e["CKM_NCCL_RANK"] == e["RANK"] == str(r) and e["WORLD_SIZE"] == "2"
        assert e["NCCL_MIN_NCHANNELS"] == e["NCCL_MAX_NCHANNELS"] == e["CKM_NCCL_CHANNELS"]
        assert e["CKM_NCCL_BUCKETS"] == ",".join(map(str, device_nccl.BUCKETS))
    model = device_nccl.device_env(0, 2, plugin, tmp_path / "k", 7, tmp_path / "s", "model", 1)
    assert "NCCL_PROFILER_PLUGIN" not in model


def test_device_nccl_identity_and_range_follow_the_release():
    assert device_nccl.identity_for((2, 28, 9)) == "model"
    assert device_nccl.identity_for((2, 29, 2)) == "profiler"
    assert device_nccl.supported((2, 28, 3)) and device_nccl.supported((2, 30, 7))
    assert not device_nccl.supported((2, 27, 7)) and not device_nccl.supported((2, 31, 0))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the skip line without CUDA")
def test_device_check_nccl_plugin_skips_with_the_reason_without_cuda(capsys):
    assert device_check.main(["--only", "nccl-plugin", "--no-doc"]) == 0
    out = capsys.readouterr().out
    assert "SKIP nccl-plugin: NCCL's own allreduce through the ckm plugin, 2 ranks on one " \
           "GPU: no CUDA device" in out


@pytest.mark.skipif(os.geteuid() != 0, reason="the tap on lo is an AF_PACKET socket (root)")
def test_device_nccl_verdict_on_a_harness_run(nccl_plugin, tmp_path, monkeypatch):
    """The verdict passes a correct run and fails one line per defect: a lost copy, a wrong
    result, a refusal, a run that never used the plugin; on an unchecked release it wants
    a clean refusal."""
    buckets, iters = [5_003, 3], 1
    monkeypatch.setattr(device_nccl, "BUCKETS", buckets)
    monkeypatch.setattr(device_nccl, "ITERATIONS", iters)
    job = random.randrange(1 << 20, 1 << 31)
    tap = R.ReplicaTap("lo", job)
    try:
        outs = H.launch(2, tmp_path / "run", str(nccl_plugin), ["127.0.0.1"] * 2, channels=2,
                        buffsize=1 << 15, buckets=buckets, iterations=iters,
                        seed=device_nccl.SEED, partitions=device_nccl.PARTITIONS, job=job)
    finally:
        datagrams = tap.close()
    stats = H.stats(tmp_path / "run", 2)
    logs = ["NCCL INFO Using network ckm\n"] * 2
    key = datamac.data_key(auth.load_secret())
    ok = device_nccl.verdict((2, 29, 7), outs, datagrams, stats, logs, key, job)
    assert ok.status == "PASS" and "2.29.7" in ok.reason and ok.figures["nccl"] == "2.29.7", ok
    lost = device_nccl.verdict((2, 29, 7), outs, datagrams[1:], stats, logs, key, job)
    assert lost.status == "FAIL" and "missing" in lost.reason
    wrong = [o.copy() for o in outs]
    wrong[1][0][5] += 1
    bad = device_nccl.verdict((2, 29, 7), wrong, datagrams, stats, logs, key, job)
    assert bad.status == "FAIL" and "rank 1" in bad.reason
    refused = [log + "ckm-nccl: not tagging communicator 0: x\n" for log in logs]
    r = device_nccl.verdict((2, 29, 7), outs, datagrams, stats, refused, key, job)
    assert r.status == "FAIL" and "refused to tag" in r.reason
    nonet = device_nccl.verdict((2, 29, 7), outs, datagrams, stats, ["", ""], key, job)
    assert nonet.status == "FAIL" and "did not report the ckm network" in nonet.reason
    zero = [[{**s, "repl_elems": 0} for s in per] for per in stats]
    old = device_nccl.verdict((2, 27, 7), outs, [], zero, refused, key, job)
    assert old.status == "PASS" and "outside the checked range" in old.reason
    assert device_nccl.verdict((2, 27, 7), outs, datagrams, stats, logs, key,
                               job).status == "FAIL"

