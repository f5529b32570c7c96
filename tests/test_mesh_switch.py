"""A tensor-parallel job in switch mode on two nodes: one ring per data-parallel group
through the kernel switch, each group copied to its own shadows (issue 34, item 5).

Everything is real: namespaces, veths and the tc-eBPF switch (checkmate.testbed.topology,
prefix "tm"), the controller's handshake service programming it, four shadow processes
registered with it (config ``job.groups: 2``, two per group), and one ``checkmate launch``
per node (2 nodes x 2 ranks, ``--tp 2``: the TP pairs inside a node, each data-parallel
group's two ranks on two nodes, so every ring hop of both groups crosses the switch). A
random rank is SIGKILLed at a random iteration; the next attempt programs the switch anew
and resumes from the shadows.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fakes import same_state

from checkmate.config import cluster as cfgmod

pytestmark = [
    pytest.mark.netns,
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root for network namespaces and BPF"),
]

ROOT = Path(__file__).resolve().parents[1]
TP = ROOT / "examples" / "train_tp.py"
STEPS = 8

CONFIG = """\
job: {id: 9, name: tm, groups: 2}
switch: {name: sw0, target: kernel}
network: {subnet: 10.75.0.0/24, mtu: 9000, prefix: PREFIX}
hosts:
  - {name: n0, role: trainer, rank: 0, ip: 10.75.0.10}
  - {name: n1, role: trainer, rank: 1, ip: 10.75.0.11}
  - {name: s0, role: shadow, partition: 0, ip: 10.75.0.100}
  - {name: s1, role: shadow, partition: 1, ip: 10.75.0.101}
  - {name: s2, role: shadow, partition: 2, ip: 10.75.0.102}
  - {name: s3, role: shadow, partition: 3, ip: 10.75.0.103}
"""

# Run inside a namespace: every shadow's status, as JSON on stdout.
STATUS = """
import json, sys
from checkmate.train.shadow_client import ShadowClient
out = []
for ip in sys.argv[1:]:
    with ShadowClient((ip, 47100), 5) as c:
        out.append(c.status())
print(json.dumps(out))
"""


WAIT_STORE = """
import socket, sys, time
for _ in range(400):
    try:
        socket.create_connection((sys.argv[1], 29400), 0.5).close()
        break
    except OSError:
        time.sleep(0.2)
"""


def _reference(tmp: Path) -> list[dict]:
    """Every rank's final state of the same job on one node, without Checkmate."""
    p = subprocess.run([sys.executable, "-m", "checkmate.launch.cli", "launch",
                        "--nproc-per-node", "4", "--tp", "2", "--mode", "off",
                        "--progress-every", "0", str(TP), "--steps", str(STEPS), "--out",
                        str(tmp / "ref")], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "NUMBA_NUM_THREADS": "1"})
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    return [torch.load(tmp / f"ref.{r}") for r in range(4)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[dict]:
    return _reference(tmp_path_factory.mktemp("reference"))


def _run(tmp: Path, kill: tuple[int, int] | None) -> dict:
    """The job on two nodes through the kernel switch (``kill``: rank and iteration of a
    SIGKILL in the first attempt); what the launchers said, every shadow's status after,
    the switch's replication counters."""
    from checkmate.testbed.topology import Testbed

    path = tmp / "tm.yaml"
    path.write_text(CONFIG.replace("PREFIX", f"tm{random.randrange(1000):03d}"))
    cfg = cfgmod.load(path)
    nodes = [cfg.host("n0"), cfg.host("n1")]
    env = {**os.environ, "NUMBA_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    faults = {} if kill is None else {"CHECKMATE_KILL_AT": f"{kill[0]}:{kill[1]}"}
    with Testbed(cfg, controller=True, config_path=path) as tb:
        for h in cfg.shadows:
            with open(tmp / f"shadow-{h.name}.log", "wb") as log:
                tb.spawn(h.name, [sys.executable, "-m", "checkmate.shadow.cli", "serve",
                                  "--partition", f"{h.partition}/4", "--config", str(path),
                                  "--host", h.name, "--bind", h.ip],
                         h.name, env=env, stdout=log, stderr=subprocess.STDOUT,
                         stdin=subprocess.DEVNULL)
        launchers = []
        for i, h in enumerate(nodes):
            argv = [sys.executable, "-m", "checkmate.launch.cli", "launch", "--nnodes", "2",
                    "--nproc-per-node", "2", "--rdzv-endpoint", f"{nodes[0].ip}:29400",
                    "--rdzv-id", "tm", "--rdzv-conf",
                    f"last_call_timeout=5,is_host={1 - i}", "--max-restarts", "2",
                    "--job-id", "9", "--mode", "switch", "--controller", cfg.switch.ip,
                    "--worker-ip", h.ip, "--local-addr", h.ip, "--tp", "2",
                    "--progress-every", "1", str(TP), "--steps", str(STEPS), "--out",
                    str(tmp / "state")]
            with open(tmp / f"launch-{h.name}.log", "wb") as log:
                launchers.append(tb.spawn(h.name, argv, f"launch-{h.name}", env={
                    **env, "GLOO_SOCKET_IFNAME": cfg.host_ifname(h.name), **faults},
                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
            if i == 0:  # the first launcher hosts the rendezvous store
                tb.run_in(h.name, [sys.executable, "-c", WAIT_STORE, h.ip], timeout=90)
        for p in launchers:
            try:
                p.wait(400)
            finally:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        got = tb.run_in("n0", [sys.executable, "-c", STATUS, *[h.ip for h in cfg.shadows]],
                        capture_output=True, text=True, timeout=60)
        counters = tb.switch.counters()
    text = "".join((tmp / f"launch-{h.name}.log").read_text(errors="replace") for h in nodes)
    assert all(p.returncode == 0 for p in launchers), text[-6000:]
    assert "Traceback" not in text, text[-6000:]
    assert "in 2 data-parallel groups under epoch" in text, text[-6000:]
    assert f"the shadows hold iteration {STEPS}" in text and "(checked)" in text, text[-3000:]
    return {"text": text, "shadows": json.loads(got.stdout), "counters": counters,
            "nodes": [h.ip for h in nodes]}


def _same_as(reference: list[dict], tmp: Path) -> None:
    """Every rank's final state (its TP shards and copies) equals the failure-free run's."""
    for r in range(4):
        mine = torch.load(tmp / f"state.{r}")
        for part in ("model", "optimizer", "scheduler"):
            assert same_state(reference[r][part], mine[part]), f"rank {r} {part}"


def test_each_group_is_copied_to_its_own_shadows_every_element_once(tmp_path, reference):
    from checkmate.protocol.wire import group_job_id

    run = _run(tmp_path, None)
    # the switch copies each group's two node-crossing hops to its own two shadows, under the
    # group's wire job id: an entry per (group, hop, partition), each hop and each partition
    # of each group carrying copies (a hop carries the partitions its tagged segments fall in)
    jobs = [group_job_id(9, g, 2) for g in (0, 1)]
    entries = {(e["job_id"], e["src_ip"], e["dst_ip"], e["partition"]): e["packets"]
               for e in run["counters"]["entries"]}
    a, b = run["nodes"]
    hops = ((a, b), (b, a))
    assert set(entries) == {(j, s, d, p) for j in jobs for s, d in hops for p in (0, 1)}, \
        sorted(entries)
    for j in jobs:
        assert all(sum(entries[j, s, d, p] for p in (0, 1)) > 0 for s, d in hops), entries
        assert all(sum(entries[j, s, d, p] for s, d in hops) > 0 for p in (0, 1)), entries
    # every element of every group reached its shadow: each shadow of each group committed
    # every iteration from the switch's copies alone (no gap, no repair asked of a trainer),
    # and a copy that came twice (a ring hop resent) was dropped, never applied twice
    for q, st in enumerate(run["shadows"]):
        assert (st["job"], st["partition"], st["partitions"]) == (jobs[q // 2], q % 2, 2), st
        assert st["latest"] == STEPS and st["committed"] >= STEPS, (q, st)
        assert st["repair"]["requests"] == 0 and st["gap_count"] == 0, (q, st)
    _same_as(reference, tmp_path)


def test_a_rank_killed_anywhere_restarts_through_a_new_attempt_bit_identically(
        tmp_path, reference):
    rng = random.Random()
    kill = (rng.randrange(4), rng.randrange(2, STEPS - 1))
    run = _run(tmp_path, kill)
    text = run["text"]
    epochs = sorted({int(e) for e in re.findall(r"under epoch (\d+)", text)})
    assert len(epochs) >= 2, (kill, text[-4000:])  # the restart programmed the switch anew
    assert "resumed from the shadows" in text, (kill, text[-4000:])
    _same_as(reference, tmp_path)
