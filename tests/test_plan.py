"""checkmate plan: the Young/Daly interval and the shadow sizing, against the formulas
worked by hand, and its CLI."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from checkmate.errors import CheckmateError
from checkmate.launch.plan import Scheme, plan, size, waste


def test_the_interval_is_the_whole_number_next_to_young_daly():
    # T_ckpt 20 s, T_step 1.5 s, MTBF 3 h: N* = sqrt(2*20 / (p * 1.5^2)) = 438.2
    pl = plan(Scheme("torch.save", 20.0, 60.0), 1.5, 3 * 3600)
    assert pl.n_star == pytest.approx(math.sqrt(2 * 20 * 10800 / 1.5 ** 2))
    assert pl.interval == 438
    p = 1 / 10800
    assert pl.waste == pytest.approx(20 / (438 * 1.5) + p * 438 * 1.5 / 2 + p * 60)
    assert pl.lost_per_failure_s == pytest.approx(438 * 1.5 / 2 + 60)
    assert pl.throughput == pytest.approx(1 / (1 + pl.waste))
    # no whole number does better
    assert all(waste(n, 1.5, 20, 60, 10800) >= pl.waste for n in range(1, 2000))


def test_cheap_checkpoints_and_checkmate_are_every_step():
    assert plan(Scheme("tiny", 1e-6, 0.0), 2.0, 3600).interval == 1  # N* < 1 clamps to 1
    cm = plan(Scheme("checkmate", 0.005, 30.0, every_step=True), 1.5, 10800)
    assert cm.interval == 1 and cm.lost_per_failure_s == pytest.approx(0.75 + 30)
    slow = plan(Scheme("dcp", 2.0, 30.0), 1.5, 10800)
    assert cm.throughput > slow.throughput


def test_sizing_names_the_requirement_that_binds():
    # 7B bf16 in 1.5 s: 14 GB per step at 2 GB/s per shadow -> 5 shadows, ingest-bound
    sz = size(7_000_000_000, 1.5, grad_bytes=2)
    assert (sz.shadows, sz.bound) == (5, "ingest")
    assert sz.partition_params == 1_400_000_000 and sz.ingest_util <= 1.0
    # a tight memory budget binds instead
    sz = size(7_000_000_000, 1.5, grad_bytes=2, shadow_memory=64e9)
    assert sz.bound == "memory" and sz.memory_bytes <= 64e9
    # an end-to-end capacity, given, binds when it is the lowest: 100 M params/s per shadow
    # (the measured one) -> 7e9 / 1.5e8 = 46.7 -> 47
    sz = size(7_000_000_000, 1.5, grad_bytes=2, capacity=1e8)
    assert (sz.shadows, sz.bound) == (47, "capacity")
    assert sz.capacity_util <= 1.0 < 7_000_000_000 / 46 / (1e8 * 1.5)
    with pytest.raises(CheckmateError, match="optimizer must be one of"):
        size(10, 1.0, optimizer="lion")


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "checkmate.launch.cli", "plan", *args],
                          capture_output=True, text=True, timeout=60)


def test_cli_prints_a_row_per_scheme_and_refuses_bad_input_in_one_line():
    r = _cli("--mtbf", "3h", "--step-time", "1.5", "--ckpt-cost", "torch.save=20s,60s",
             "--checkmate-cost", "5ms", "--params", "7B", "--grad-dtype", "bfloat16")
    assert r.returncode == 0, r.stderr
    rows = {ln.split()[0]: ln.split() for ln in r.stdout.splitlines()
            if ln.startswith(("torch.save", "checkmate"))}
    assert rows["torch.save"][2] == "438" and rows["checkmate"][2] == "1"
    assert "shadows for 7e+09 params" in r.stdout and "set by ingest" in r.stdout
    assert "measured 100 M params/s here" in r.stdout and ": 47 processes for" in r.stdout
    r = _cli("--mtbf", "3h", "--step-time", "1.5", "--params", "7B", "--grad-dtype",
             "bfloat16", "--shadow-capacity", "100M")
    assert r.returncode == 0 and ": 47, set by capacity" in r.stdout, r.stdout + r.stderr
    r = _cli("--mtbf", "3h", "--step-time", "1.5")
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].endswith(
        "give at least one --ckpt-cost NAME=COST, --checkmate-cost or --params")
    assert len(r.stderr.strip().splitlines()) == 1
    r = _cli("--mtbf", "soon", "--step-time", "1")
    assert r.returncode == 2 and "not a duration: 'soon'" in r.stderr
    assert "Traceback" not in r.stderr


# ----- scale: --gpus (docs/scale.md) -------------------------------------------------------
def _tna_size(table: str) -> int:
    """The size the TNA program declares for ``table``, read here from the source."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "p4" / "checkmate_tna.p4").read_text()
    block = text[text.index(f"table {table} {{"):]
    return int(block[block.index("size = ") + 7:block.index(";", block.index("size = "))])


def _scale_lines(capsys, gpus: int, per_node: int, params: str = "7B") -> list[str]:
    from checkmate.launch.plan import main

    assert main(["--mtbf", "3h", "--step-time", "1.5", "--params", params, "--grad-dtype",
                 "bfloat16", "--shadow-ingest", "2G", "--shadow-step-rate", "2.3G",
                 "--gpus", str(gpus), "--gpus-per-node", str(per_node)]) == 0
    return capsys.readouterr().out.splitlines()[-5:]


@pytest.mark.parametrize("gpus,per_node", [(64, 8), (4096, 8), (20, 8), (8, 8)])
def test_scale_figures_follow_from_the_inputs(gpus, per_node, capsys):
    """Worked here from first principles: a ring of nodes of consecutive ranks leaves each
    node once (N hops for N >= 2 nodes); one replication entry per (hop, partition); a
    group per (destination node, partition) of two replicas, and the flood group; the
    controller withdraws and installs all of them and re-stamps each shadow's rewrite."""
    job, shadow, switch, ctl, jobs = _scale_lines(capsys, gpus, per_node)
    nodes = -(-gpus // per_node)
    params, gb, step = 7e9, 2, 1.5
    p = math.ceil(max(params * gb / (2e9 * step), params / (2.3e9 * step)))  # 14e9/3e9 -> 5
    hops = nodes if nodes > 1 else 0
    entries, groups = hops * p, hops * p + 1
    assert f"= {nodes} node(s), {p} shadow(s); the ring crosses the switch on {hops} hop" in job
    per_shadow = math.ceil(params / p) * gb / step
    assert f"into each shadow: {per_shadow / 1e9:.3f} GB/s" in shadow
    assert f"({per_shadow * 8 / 1e9:.1f} Gb/s" in shadow
    size = _tna_size("ckm_replicate")
    assert size == 4096
    assert f"ckm_replicate entries {entries} of {size}" + (" (EXCEEDS)" if entries > size
                                                            else ";") in switch
    assert f"multicast groups {groups} of {65536 - 0x1000}" in switch
    assert f"{2 * (groups - 1)} replicas" in switch
    if 1 < nodes <= 240:  # control/plan.py: GROUP_BASE + destination * 256 + partition
        assert f"ids 4096..{4096 + (nodes - 1) * 256 + p - 1}" in switch
    elif nodes > 240:
        assert "EXCEEDS control/plan.py's id encoding" in switch
    ports = nodes + p
    assert f"ports {ports} of 64" + (" (EXCEEDS)" if ports > 64 else "") in switch
    bind = min(_tna_size("port_bind"), _tna_size("l2_fwd"))  # one per host port + CPU port
    assert f"port_bind and l2_fwd entries {ports + 1} of {bind}" + (
        " (EXCEEDS)" if ports + 1 > bind else "") in switch
    assert f"shadow_rewrite entries {p} of {_tna_size('shadow_rewrite')}" in switch
    assert f"controller per rendezvous: {2 * entries + 2 * hops * p + p} writes" in ctl
    fit = min(size // max(1, entries), _tna_size("shadow_rewrite") // p,
              (65536 - 0x1000) // max(1, hops * p), 65535 // p, 64 // ports)
    assert f"one switch with disjoint group and rid ranges: {fit} " in jobs


def test_replicas_count_in_the_switch_state_ports_and_copies(capsys):
    """Two shadows per partition, worked by hand for 64 GPUs on 8 nodes (5 partitions): the
    entries stay one per (hop, partition); every multicast group gains a member per replica
    (3 instead of 2), each shadow has a port and a rewrite of its own, and the switch copies
    every byte twice."""
    from checkmate.launch.plan import main

    args = ["--mtbf", "3h", "--step-time", "1.5", "--params", "7B", "--grad-dtype",
            "bfloat16", "--gpus", "64"]
    assert main(args) == 0
    one = capsys.readouterr().out
    assert main([*args, "--replicas", "2"]) == 0
    two = capsys.readouterr().out
    assert "5 shadow(s) x 2 replicas = 10 shadow processes" in two
    assert "ckm_replicate entries 40 of 4096" in one and "ckm_replicate entries 40 of" in two
    assert "multicast groups 41 of 61440" in two and "120 replicas" in two  # 40 x 3
    assert "80 replicas" in one  # 40 x 2
    assert "shadow_rewrite entries 10 of" in two and "ports 18 of 64" in two  # 8 + 10
    assert "controller per rendezvous: 170 writes" in two  # 2 x 40 + 2 x 40 + 10
    copies = [float(t.split("the switch copies ")[1].split(" GB/s")[0]) for t in (one, two)]
    assert abs(copies[1] - 2 * copies[0]) < 0.002, copies  # each printed to 3 decimals
    # co-located (checkmate launch --colocate): the same switch state, no port per shadow
    assert main([*args, "--replicas", "2", "--colocated"]) == 0
    colo = capsys.readouterr().out
    assert "ports 8 of 64" in colo and "120 replicas" in colo
    assert "shadow_rewrite entries 10 of" in colo
    with pytest.raises(CheckmateError, match="--colocated plans a data-parallel job"):
        main([*args, "--colocated", "--tp", "2"])


def test_scale_needs_params_and_sane_counts():
    r = _cli("--mtbf", "3h", "--step-time", "1.5", "--checkmate-cost", "5ms", "--gpus", "64")
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].endswith(
        "--gpus needs --params (the shadows set the partitions)")
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    from checkmate.launch.plan import main

    with pytest.raises(CheckmateError, match="need --gpus >= 1 and --gpus-per-node >= 1"):
        main(["--mtbf", "3h", "--step-time", "1.5", "--params", "7B", "--gpus", "64",
              "--gpus-per-node", "0"])


def test_docs_scale_shows_what_plan_prints_now(capsys):
    """Every ``$ checkmate plan ...`` block of docs/scale.md is the command's output today."""
    import shlex
    from pathlib import Path

    from checkmate.launch.plan import main

    doc = (Path(__file__).resolve().parents[1] / "docs" / "scale.md").read_text()
    blocks = [b.split("```")[0] for b in doc.split("```\n$ checkmate plan ")[1:]]
    assert {b.split("--gpus ")[1].split()[0] for b in blocks} >= {"64", "512", "4096"}
    for b in blocks:
        cmd, _, shown = b.partition("\n")
        assert main(shlex.split(cmd)) == 0
        assert capsys.readouterr().out.strip() == shown.strip(), \
            f"docs/scale.md is stale for: checkmate plan {cmd}"


def test_a_mesh_job_is_sized_per_data_parallel_group(capsys):
    from checkmate.control import plan as plan_mod
    from checkmate.launch import scale
    from checkmate.launch.plan import main

    # torchtitan's layout: TP fills a node, so a data-parallel group has a rank per node
    assert scale.group_nodes(64, 8, 8, 2) == [0, 1, 2, 3]
    assert scale.group_nodes(64, 8, 2, 2) == [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3]
    assert main(["--mtbf", "3h", "--step-time", "1.5", "--params", "64B", "--gpus", "64",
                 "--tp", "4", "--pp", "2"]) == 0
    out = capsys.readouterr().out
    # 64B over 8 groups: 8B each, 32 GB/s of float32 gradient per group per 1.5 s step at
    # 2 GB/s per shadow: ceil(10.67) = 11 shadows per group, 88 in all
    assert "8 data-parallel groups, each protecting 1/8 of the model (8e+09 params)" in out
    assert "8 data-parallel groups of 8 ranks, each with its own 11 shadow(s) (88 in all)" \
        in out
    # TP 4 on nodes of 8: two data-parallel ranks of a group per node (ranks 0, 4 | 8, 12 ...)
    assert "its ring: 8 ranks on 4 node(s), crossing the switch on 4 hop(s)" in out
    # the job's entries are the groups' together: 8 x (4 hops x 11 partitions)
    assert "the whole job (64 GPUs on 8 node(s)): ckm_replicate entries 352 of" in out
    # one controller numbers every group's shadows as the job's partitions: 8 x 11 = 88
    # replication ids; a group's multicast ids follow the group before it (11 per group)
    assert "one controller programs every group (config job.groups: 8; its 88 shadows are " \
           "the job's partitions, 11 per group" in out
    top = plan_mod.group_id(3, 10) + 7 * 11  # destination node 3, the last partition
    assert f"group ids 4096..{top}, replication ids 1..88" in out
    with pytest.raises(CheckmateError, match="not a multiple of --tp 4 x --pp 2"):
        main(["--mtbf", "3h", "--step-time", "1.5", "--params", "7B", "--gpus", "60",
              "--tp", "4", "--pp", "2"])
