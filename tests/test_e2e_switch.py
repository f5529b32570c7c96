"""Namespace tests (root): the ring through the eBPF switch, and kill-restore in switch mode.

Everything is real: namespaces and veths built by checkmate.testbed.topology.Testbed under
the test prefix "te", the tc-eBPF switch, its drop/corrupt fault knobs, trainer and shadow
processes in their namespaces. Testbed's context manager removes everything, even when a
test fails.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from checkmate.config import cluster as cfgmod

pytestmark = [
    pytest.mark.netns,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root for network namespaces and BPF"),
]

# The prefix gets a random suffix so that two suite runs at once do not share namespaces.
CONFIG = """\
job: {id: 7, name: te}
switch: {name: sw0, target: kernel}
network: {subnet: 10.79.0.0/24, mtu: 9000, prefix: PREFIX}
hosts:
  - {name: t0, role: trainer, rank: 0, ip: 10.79.0.10}
  - {name: t1, role: trainer, rank: 1, ip: 10.79.0.11}
  - {name: t2, role: trainer, rank: 2, ip: 10.79.0.12}
  - {name: t3, role: trainer, rank: 3, ip: 10.79.0.13}
  - {name: s0, role: shadow, partition: 0, ip: 10.79.0.100}
  - {name: s1, role: shadow, partition: 1, ip: 10.79.0.101}
"""

# One ring rank: allreduce three known tensors, write the results.
RANK_PROGRAM = textwrap.dedent("""
    import sys, torch
    from checkmate.train.ring import RingAllreduce
    from checkmate.train.transport import open_socket
    rank, world, n, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    ips = sys.argv[6:]
    s = open_socket(ips[rank], 47000)
    ring = RingAllreduce(rank, world, s, (ips[(rank + 1) % world], 47000),
                         (ips[(rank - 1) % world], 47000), 7, 4242, n, 2, rto=0.03,
                         stall_timeout=60, chunk=int(sys.argv[5]))
    res = []
    for it in range(1, 4):
        g = torch.Generator().manual_seed(1000 * it + rank)
        res.append(ring.allreduce(torch.randn(n, generator=g), 0, it, 0).clone())
    torch.save({"res": res, "stats": ring.stats}, out)
    ring.close(timeout=3)
""")


@pytest.fixture
def cfg_path(tmp_path: Path) -> Path:
    p = tmp_path / "te.yaml"
    p.write_text(CONFIG.replace("PREFIX", f"te{random.randrange(1000):03d}"))
    return p


def _ring_order_sum(xs, world):
    n = xs[0].numel()
    out = torch.empty(n)
    for g in range(world):
        s, e = g * n // world, (g + 1) * n // world
        acc = xs[g][s:e].clone()
        for k in range(1, world):
            acc += xs[(g + k) % world][s:e]
        out[s:e] = acc
    return out


@pytest.mark.parametrize("chunk", [2229, 16_000])
def test_ring_exact_through_switch_with_drop_and_corrupt(cfg_path, tmp_path, chunk):
    """chunk 2229: every ring datagram is one frame; 16000: plain hops are IP-fragmented,
    and the fault knobs hit the fragments too (one draw per datagram), so every kind of
    ring datagram meets the knobs either way."""
    from checkmate.testbed.topology import Testbed

    cfg = cfgmod.load(cfg_path)
    world, n = 4, 60_013
    ips = [h.ip for h in cfg.trainers]
    with Testbed(cfg) as tb:
        for h in cfg.trainers:
            tb.switch.set_fault(cfg.switch_ifname(h.name), drop=0.03, corrupt=0.03)
        procs = [tb.popen_in(h.name, [sys.executable, "-c", RANK_PROGRAM, str(h.rank),
                                      str(world), str(n), str(tmp_path / f"r{h.rank}.pt"),
                                      str(chunk), *ips], stderr=subprocess.PIPE)
                 for h in cfg.trainers]
        errs = []
        for p in procs:
            try:
                _, err = p.communicate(timeout=120)
            finally:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            errs.append(err.decode()[-2000:])
        counters = tb.switch.counters()
    assert all(p.returncode == 0 for p in procs), errs
    got = [torch.load(tmp_path / f"r{r}.pt") for r in range(world)]
    for it in range(1, 4):
        xs = [torch.randn(n, generator=torch.Generator().manual_seed(1000 * it + r))
              for r in range(world)]
        expect = _ring_order_sum(xs, world)
        for r in range(world):
            assert torch.equal(got[r]["res"][it - 1], expect)
    ports = counters["ports"]
    dropped = sum(ports[cfg.switch_ifname(h.name)]["dropped"] for h in cfg.trainers)
    corrupted = sum(ports[cfg.switch_ifname(h.name)]["corrupted"] for h in cfg.trainers)
    assert dropped > 0 and corrupted > 0
    assert sum(g["stats"]["resent"] for g in got) > 0
    assert sum(g["stats"]["corrupt"] for g in got) > 0


def _run_scenario(cfg_path: Path, tmp_path: Path, text: str) -> dict:
    """`testbed run` of a scenario given as YAML text in switch mode; its JSON report."""
    sc = tmp_path / "scenario.yaml"
    sc.write_text(text)
    out = tmp_path / "report.json"
    wd = tmp_path / "runs"  # kept by pytest: the logs of a failed run stay readable
    p = subprocess.run([sys.executable, "-m", "checkmate.testbed.cli", "run", "--scenario",
                        str(sc), "--config", str(cfg_path), "--mode", "switch", "--json",
                        str(out), "--workdir", str(wd)], capture_output=True, text=True,
                       timeout=500)
    if p.returncode != 0:
        logs = "".join(f"\n--- {f.relative_to(wd)}\n{f.read_text()[-800:]}"
                       for f in sorted(wd.rglob("*.log")))
        raise AssertionError((p.stderr + p.stdout)[-1500:] + logs[-12000:])
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.slow
def test_chaos_replica_loss_trainer_loss_shadow_restart_and_kill(cfg_path, tmp_path):
    """The fast chaos case: 5% of one shadow's copies dropped, 1% of one trainer's frames
    (fragments included) dropped, the other shadow SIGKILLed and restarted empty, and every
    trainer killed near the end. Every hole is repaired, the restarted shadow is re-seeded
    live, and the restored job finishes bit-identical to failure-free (switch mode's
    kill-restore: the launcher's restart from the shadows, the switch's copies)."""
    # A restarted shadow needs a few seconds (process start, registration) before it can be
    # re-seeded; this model's iterations take tens of milliseconds, hence the many steps.
    report = _run_scenario(cfg_path, tmp_path,
                           "name: chaos\nmodel: gpt\nsteps: 150\nseed: 1\nkill_at: 140\n"
                           "faults: [{port: s1, drop: 0.05}, {port: t2, drop: 0.01}]\n"
                           "shadow_kills: [{partition: 0, at: 3}]\n")
    chaos = report["runs"]["chaos"]
    assert report["ok"] and report["bit_identical"] is True
    assert chaos["shadows_match_trainers"] is True and chaos["protected"] is True
    assert chaos["repair_answers"] > 0 and chaos["reseeds"] >= 1
    assert chaos["rejoins"][0]["rejoined_at"] is not None
    # the faults were really there: the lossy shadow and trainer ports dropped frames
    assert report["faults_dropped"]["s1"] > 0 and report["faults_dropped"]["t2"] > 0
    # switch mode: the switch copied the gradient; the trainers sent the shadows no gradient
    # bytes themselves; one registration per shadow start (the restarted one's too)
    assert report["switch_replicated_packets"] > 0
    for name, run in report["runs"].items():
        assert all(r["copy_bytes"] == 0 for r in run["ring"]), name
    assert report["runs"]["failure-free"]["epochs_minted"] == 2
    assert chaos["epochs_minted"] == 3
    # nothing of the testbed is left behind
    prefix = cfgmod.load(cfg_path).network.prefix
    ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(line.startswith(f"{prefix}-") for line in ns.splitlines())


@pytest.mark.slow
def test_one_iteration_blacked_out_for_good_ends_protected(cfg_path, tmp_path):
    """Every datagram of iteration 30 to shadow s0 is dropped by the switch, repair answers
    included (they carry that iteration): the shadow gives up on repair within
    REPAIR_ESCALATE seconds, asks for a re-seed, is re-seeded live, and the job ends
    protected and bit-identical to failure-free.

    The run must outlast the escalation: the gap shows when iteration 30 + 64 (the
    shadow's window) arrives, the re-seed is asked REPAIR_ESCALATE (5 s) later and needs a
    few iterations of its own. An idle machine trains this GPT at about 34 iterations/s, so
    250 steps ended 4.6 s after the gap showed, before the re-seed could start (the job
    then ends unprotected, rightly); 600 leave about 15 s."""
    report = _run_scenario(cfg_path, tmp_path,
                           "name: blackout\nmodel: gpt\nsteps: 600\nseed: 4\n"
                           "faults: [{port: s0, drop: 1.0, from: 30, until: 30}]\n")
    chaos = report["runs"]["chaos"]
    assert report["ok"] and report["bit_identical"] is True, report.get("problems")
    assert chaos["protected"] is True and chaos["shadows_match_trainers"] is True
    assert chaos["reseeds"] >= 1 and report["faults_dropped"]["s0"] > 0
    # Repair asked a bounded number of times before escalating (not thousands).
    assert chaos["repair_answers"] < 200, chaos
