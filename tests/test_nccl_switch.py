"""The ckm NCCL plugin through the kernel switch to real shadows (root): 4 harness ranks
(the NCCL stand-in, checkmate.testbed.nccl_harness) in the testbed's trainer namespaces, 4
channels, buckets that are not chunk multiples, 3 iterations; 2 `shadow serve` processes
registered with the controller, which installs the replication entries. The switch copies
each REPLICATE datagram the plugin sends; rank 0's control messages come from the test.

The switch drops and corrupts 3% of the ckm frames it sends to ranks 1 and 2 (the plugin's
transport resends) and to both shadows (the copies: the shadows ask the ranks' repair
services, which answer from the pieces the plugin kept); it counts the plugin's datagrams
under DSCP 24 (the PFC lossless class).
Checks: every rank's allreduce is exact, the transport resent what was lost or damaged,
and each shadow commits, bit for bit, the state of an optimizer fed the Python ring's
reduced gradients for the same inputs."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from fakes import BUCKETS, BUFFSIZE, ITERATIONS, python_ring_replicas

from checkmate.config import cluster as cfgmod
from checkmate.testbed import nccl_harness as H

pytestmark = [
    pytest.mark.netns,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root for network namespaces and BPF"),
]

REPO = Path(__file__).resolve().parents[1]
JOB = 7
LR = 0.01
CONFIG = """\
job: {id: 7, name: ckn}
switch: {name: sw0, target: kernel}
network: {subnet: 10.78.0.0/24, mtu: 9000, prefix: PREFIX}
hosts:
  - {name: t0, role: trainer, rank: 0, ip: 10.78.0.10}
  - {name: t1, role: trainer, rank: 1, ip: 10.78.0.11}
  - {name: t2, role: trainer, rank: 2, ip: 10.78.0.12}
  - {name: t3, role: trainer, rank: 3, ip: 10.78.0.13}
  - {name: s0, role: shadow, partition: 0, ip: 10.78.0.100}
  - {name: s1, role: shadow, partition: 1, ip: 10.78.0.101}
"""



def _wait(what: str, fn, timeout: float = 60.0):
    end = time.monotonic() + timeout
    while True:
        try:
            v = fn()
            if v:
                return v
        except Exception as e:  # noqa: BLE001 - not up yet
            err = e
        else:
            err = None
        if time.monotonic() > end:
            raise AssertionError(f"{what} timed out ({err!r})")
        time.sleep(0.2)


@pytest.mark.parametrize("profiler", ["off", "callback"])
def test_nccl_plugin_through_kernel_switch_shadows_bit_identical(nccl_plugin, tmp_path, ring_kit,
                                                                 profiler):
    """profiler off: tagging by the schedule model; callback: by profiler events (the
    harness plays NCCL's profiler core, the plugin asks through the profiler callback)."""
    from checkmate.shadow.feed import control_body, control_datagrams
    from checkmate.shadow.kernels import make_optimizer
    from checkmate.spec.model import ModelSpec
    from checkmate.testbed.netsock import call_in_netns, udp_socket_in
    from checkmate.testbed.topology import Testbed
    from checkmate.train.layout import query_sessions
    from checkmate.train.repair import owners_body
    from checkmate.train.shadow_client import ShadowClient, seed_share

    cfg_path = tmp_path / "ckn.yaml"
    cfg_path.write_text(CONFIG.replace("PREFIX", f"cn{random.randrange(1000):03d}"))
    cfg = cfgmod.load(cfg_path)
    world, parts, seed = 4, 2, 23
    total = sum(BUCKETS)
    spec = ModelSpec.build(JOB, [("w", (total,))], "sgd",
                           [{"params": ["w"], "lr": LR, "momentum": 0.9}], parts)
    rng = np.random.default_rng(seed)
    flat = {s: np.zeros(total, np.float32) for s in spec.slots}
    flat["param"][:] = rng.standard_normal(total).astype(np.float32)
    tns = None
    with Testbed(cfg, controller=True, config_path=cfg_path) as tb:
        tns = tb.netns_of("t0")
        for h in cfg.shadows:
            log = open(tmp_path / f"shadow-{h.name}.log", "wb")  # noqa: SIM115
            tb.spawn(h.name, [sys.executable, "-m", "checkmate.shadow.cli", "serve",
                              "--partition", f"{h.partition}/{parts}", "--config",
                              str(cfg_path), "--host", h.name, "--bind", h.ip, "--window",
                              "64"], f"shadow-{h.name}", stdout=log, stderr=log,
                     stdin=subprocess.DEVNULL, env={**os.environ, "NUMBA_NUM_THREADS": "1"})
            log.close()
        shadows = [(h.ip, cfgmod.RESTORE_PORT) for h in cfg.shadows]
        ctl = (cfg.switch.ip, cfgmod.CONTROLLER_PORT)
        sess = _wait("shadow registration", lambda: (
            s if len(s := call_in_netns(tns, lambda: query_sessions(ctl, JOB))) == parts
            else None))
        for r in range(world):
            call_in_netns(tns, lambda r=r: seed_share(shadows, spec, flat, r, world))
        # the shadows learn the ranks' repair addresses (no owners: they ask every rank)
        peers = owners_body([(h.ip, cfgmod.REPAIR_PORT) for h in cfg.trainers], [])
        for a in shadows:
            call_in_netns(tns, lambda a=a: ShadowClient(a, 5).request(peers))
        # a lossy path between ranks (frames leaving towards t1 and t2) and towards the
        # shadows (the switch's copies): dropped and corrupted ckm frames
        for h in ("t1", "t2", "s0", "s1"):
            tb.switch.set_fault(cfg.switch_ifname(h), drop=0.03, corrupt=0.03)
        logs = []

        def popen(r, argv, env):
            logs.append(open(tmp_path / f"rank{r}.out", "wb"))  # noqa: SIM115
            return tb.popen_in(f"t{r}", argv, env=env, stdout=logs[-1], stderr=logs[-1],
                               cwd=REPO)

        linger, ran = tmp_path / "linger", {}

        def run() -> None:  # the ranks stay up after their allreduces: repair is served
            try:
                ran["outs"] = H.launch(world, tmp_path / "run", str(nccl_plugin),
                                       [h.ip for h in cfg.trainers], channels=4,
                                       buffsize=BUFFSIZE, buckets=BUCKETS,
                                       iterations=ITERATIONS, seed=seed, partitions=parts,
                                       job=JOB, popen=popen, profiler=profiler, linger=linger)
            except Exception as e:  # noqa: BLE001 - raised in the test below
                ran["error"] = e

        runner = threading.Thread(target=run)
        runner.start()
        _wait("the ranks' allreduces", lambda: "error" in ran or all(
            (tmp_path / "run" / f"out-{r}.npy").exists() for r in range(world)), timeout=150)
        # rank 0's control message per iteration, to each shadow's current session; sent
        # again every 2 s until committed, standing in for rank 0's answers to the shadows'
        # control repair requests and its session refresh
        tx = udp_socket_in(tns, (cfg.trainers[0].ip, 0))
        last: list = []
        sent_at = [0.0]

        def committed():
            if time.monotonic() - sent_at[0] > 2.0:
                sent_at[0] = time.monotonic()
                # a shadow that re-registered has a new epoch: ask, as trainers do
                sess.update(call_in_netns(tns, lambda: query_sessions(ctl, JOB)))
                for it in range(1, ITERATIONS + 1):
                    for p, (ip, _) in enumerate(shadows):
                        for d in control_datagrams(JOB, it, control_body(it, [LR]),
                                                   epoch=sess[p]["epoch"],
                                                   token=sess[p]["token"], partition=p):
                            tx.sendto(d, (ip, cfgmod.SHADOW_PORT))
            st = [call_in_netns(tns, lambda a=a: ShadowClient(a, 5).status()) for a in shadows]
            last[:] = st
            return st if all(s["latest"] == ITERATIONS for s in st) else None

        try:
            sts = _wait("shadows committing every iteration", committed, timeout=60)
        except AssertionError as e:
            raise AssertionError(f"{e}; shadow status: {last}") from None
        finally:
            tx.close()
            linger.touch()
            runner.join(60)
            for f in logs:
                f.close()
        if "error" in ran:
            raise ran["error"]
        outs = ran["outs"]
        got = [call_in_netns(tns, lambda a=a: ShadowClient(a, 10).fetch(ITERATIONS))
               for a in shadows]
        counters = tb.switch.counters()
    # every rank's result is exact
    for r in range(world):
        for i, it in enumerate(range(1, ITERATIONS + 1)):
            exp = np.concatenate([H.expected(seed, it, b, world, n)
                                  for b, n in enumerate(BUCKETS)])
            assert np.array_equal(outs[r][i], exp), (r, it)
    # each shadow's state = an optimizer fed the Python ring's reduced gradients
    py = python_ring_replicas(ring_kit, seed, world, parts)
    ref = make_optimizer(spec, 0, total)
    ref.load(flat, 0)
    for it in range(1, ITERATIONS + 1):
        ref.step(py[it], [LR], None)
    for p, g in enumerate(got):
        a, b = spec.bounds(p)
        for s in spec.slots:
            assert np.array_equal(g.slots[s], ref.state[s][a:b]), (p, s)
    # the faults were there, and the transport repaired them
    ports = counters["ports"]
    assert sum(ports[cfg.switch_ifname(h)]["dropped"] for h in ("t1", "t2")) > 0
    assert sum(ports[cfg.switch_ifname(h)]["corrupted"] for h in ("t1", "t2")) > 0
    stats = [s for per in H.stats(tmp_path / "run", world) for s in per]
    assert sum(s["resent"] for s in stats) > 0 and sum(s["corrupt"] for s in stats) > 0
    # the copies came from the switch, and every datagram the shadows took had a good MAC
    assert sum(v.get("replicated", 0) for v in counters["ports"].values()) > 0, counters
    for st in sts:
        assert st["drops"].get("mac", 0) == 0, st["drops"]
    # copies were lost on the way to the shadows and repaired from the ranks' kept pieces,
    # not by a re-seed
    ports = counters["ports"]
    assert sum(ports[cfg.switch_ifname(h)]["dropped"] for h in ("s0", "s1")) > 0
    repaired = H.repair_stats(tmp_path / "run", world)
    assert sum(r.get("answered", 0) for r in repaired) > 0, repaired
    assert sum(st["repair"]["answers"] for st in sts) > 0, [st["repair"] for st in sts]
    assert all(st["reseed"]["count"] == 0 and not st["reseed"]["wanted"] for st in sts)
    # the plugin's datagrams are in the lossless class: the switch counts every well-formed
    # ckm datagram from ranks 1-3 under DSCP 24 (rank 0's port also carries the test's own
    # unmarked control messages)
    from checkmate.control import pfc

    dscp = counters["dscp"]
    for r in range(1, world):
        per = dscp[cfg.switch_ifname(f"t{r}")]
        assert set(per) == {pfc.CKM_DSCP} and per[pfc.CKM_DSCP] > 0, (r, per)
    assert dscp[cfg.switch_ifname("t0")].get(pfc.CKM_DSCP, 0) > 0
