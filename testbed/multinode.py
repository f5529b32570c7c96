"""Multi-node scenarios: one ``checkmate launch`` per node, a node lost mid-run.

    testbed run --scenario multinode-kill-node|multinode-shrink|multinode-colocate-kill-node|
        multinode-colocate-kill-replica|multinode-colocate-kill-replicas-and-node
        [--mode switch|host]

Nodes are the config's trainer hosts (testbed/multinode.yaml: n0..n3 and shadows s0, s1
around the kernel switch); each runs one launcher with ``--nproc-per-node`` workers of
examples/train_elastic.py, all meeting at a c10d rendezvous hosted by n0's launcher. In
switch mode every node is a namespace behind the eBPF switch, the shadows register with
the controller and the launchers run ``--mode switch --controller``: each rendezvous
programs the switch (checkmate.train.attempt). In host mode the nodes are loopback
addresses and the workers send the copies themselves.

multinode-kill-node: 3 nodes and a spare; at a random iteration every process of one node
(not n0, which hosts the rendezvous store) is SIGKILLed; the spare takes its place and the
job must end bit-identical to a run without shadows or failure (one node, as many ranks:
``checkmate launch --mode off``). multinode-shrink: 3 nodes, ``--nnodes 2:3``, no spare;
the job continues on 2 nodes, and the state the new attempt restored must equal the
shadows' checkpoint of that iteration on disk, and training must reach the last step.
multinode-colocate-kill-node: as kill-node, with no shadow hosts: ``--colocate`` puts two
replicas of each of two partitions on n0..n2 themselves (switch mode, on
testbed/multinode-colocated.yaml: the switch copies to where each attempt placed them;
host mode: the trainers send the copies), so the lost node takes its shadows with it; the
resume must come from the surviving replicas in memory, with no iteration repeated beyond
the one in flight, and the rendezvous that lets the spare in places the lost replicas anew
(on the spare), each re-seeded from its sibling and current at the end.
multinode-colocate-kill-replica: the same nodes, no spare; one shadow process of a random
node is SIGKILLed: its launcher starts it again, it takes its state from its sibling on
another node, and the job never restarts. multinode-colocate-kill-replicas-and-node: the
shadows persist every iteration; one replica of a partition is killed, then the node that
holds its other replica: the resume comes from disk and says so.
"""

from __future__ import annotations

import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from checkmate.errors import CheckmateError

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train_elastic.py"
CONFIG = Path(__file__).resolve().parent / "multinode.yaml"
COLOCATED_CONFIG = Path(__file__).resolve().parent / "multinode-colocated.yaml"
RDZV_PORT = 29400


@dataclass(frozen=True)
class MultiNode:
    name: str
    description: str
    nodes: int  # nodes the job starts on
    per_node: int  # workers per node
    nnodes: str  # --nnodes
    spare: bool  # a spare node waits in the rendezvous
    steps: int = 30
    sleep: float = 0.3  # seconds per iteration, so that a kill lands mid-run
    #: the shadows run on the nodes (`checkmate launch --colocate`, two replicas per
    #: partition, host mode): a node's loss takes its shadows with it
    colocate: bool = False
    #: what is killed: a whole node, or one co-located shadow process of a node
    kill: str = "node"


SCENARIOS = {
    "multinode-kill-node": MultiNode(
        "multinode-kill-node", "3 nodes x 2 workers, one node killed, a spare replaces it; "
        "bit-identical to a failure-free run", 3, 2, "3", True),
    "multinode-shrink": MultiNode(
        "multinode-shrink", "3 nodes x 2 workers, one node killed, no spare: the job goes "
        "on with 2 nodes from the shadows' checkpoint", 3, 2, "2:3", False),
    "multinode-colocate-kill-node": MultiNode(
        "multinode-colocate-kill-node", "3 nodes x 2 workers with two replicas of each of 2 "
        "partitions on the nodes themselves, one node killed with its shadows, a spare "
        "replaces it: resumed from memory, bit-identical", 3, 2, "3", True, colocate=True),
    "multinode-colocate-kill-replica": MultiNode(
        "multinode-colocate-kill-replica", "3 nodes x 2 workers with co-located replicas, one "
        "shadow process killed: its launcher starts it again, it re-seeds from its sibling, "
        "training never pauses, bit-identical", 3, 2, "3", False, colocate=True,
        kill="shadow"),
    "multinode-colocate-kill-replicas-and-node": MultiNode(
        "multinode-colocate-kill-replicas-and-node", "3 nodes x 2 workers with co-located "
        "replicas persisting every iteration; a partition's replica on one node killed, then "
        "the node holding its other replica: resumed from disk, said so, bit-identical", 3,
        2, "3", True, colocate=True, kill="replicas-and-node"),
}


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (from /proc), children first."""
    kids: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        for k in kids.get(todo.pop(), []):
            out.append(k)
            todo.append(k)
    return out


class Node:
    """One launcher (and what runs under it) on one node of the cluster."""

    def __init__(self, cl: Any, host: str, argv: list[str], env: dict[str, str],
                 log: Path) -> None:
        self.host, self.log = host, log
        with open(log, "wb") as f:
            self.proc = cl.popen(host, argv, env, stdout=f, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def kill(self) -> None:
        """SIGKILL the launcher and every process under it: the node is lost."""
        for pid in [*descendants(self.proc.pid), self.proc.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()


def _launch_argv(sc: MultiNode, cl: Any, host: str, rdzv: str, shadows: list[str],
                 out: Path, restored: Path, first: bool) -> list[str]:
    argv = [sys.executable, "-m", "checkmate.launch.cli", "launch", "--nnodes", sc.nnodes,
            "--nproc-per-node", str(sc.per_node), "--rdzv-endpoint", rdzv,
            "--rdzv-id", f"{sc.name}-{out.parent.parent.name}", "--max-restarts", "3",
            "--progress-every", "1", "--job-id", str(cl.cfg.job_id),
            "--rdzv-conf", f"last_call_timeout=5,is_host={'1' if first else '0'}"]
    if sc.colocate:  # every node's launcher gets the same list, the spare's address too:
        # the rendezvous that lets it in places the lost node's replicas anew (on it). A
        # config of co-located shadows (testbed/multinode-colocated.yaml): the switch copies
        # to them, each attempt telling the controller where they are; else host mode's
        # copies (the trainers send them), in namespaces through the switch or on loopback
        nodes = [h.name for h in cl.cfg.trainers][:sc.nodes + sc.spare]
        local = cl.ip[host] if cl.mode == "switch" else "127.0.0.1"
        argv += ["--local-addr", local, "--shadows", "2", "--replicas", "2",
                 "--colocate", ",".join(f"{n}={cl.ip[n]}" for n in nodes), "--node", host,
                 "--worker-ip", cl.ip[host]]
        if switch_copies(cl):
            argv += ["--mode", "switch", "--controller", cl.cfg.switch.ip]
        if sc.kill == "replicas-and-node":  # every node's shadows keep their checkpoints
            argv += ["--persist-every", "1", "--dir", str(out.parent / f"{host}-run")]
    elif cl.mode == "switch":
        argv += ["--mode", "switch", "--controller", cl.cfg.switch.ip,
                 "--worker-ip", cl.ip[host], "--local-addr", cl.ip[host]]
    else:
        argv += ["--local-addr", "127.0.0.1"]
        for ip in shadows:
            argv += ["--shadow", ip]
    return argv + [str(SCRIPT), "--steps", str(sc.steps), "--sleep", str(sc.sleep),
                   "--out", str(out), "--restored-out", str(restored)]


def switch_copies(cl: Any) -> bool:
    """The switch copies to the co-located shadows: namespaces behind the switch, and a
    config whose shadows are co-located (each attempt places them at the controller)."""
    return cl.mode == "switch" and cl.cfg.colocated


def _iterations(nodes: list[Node]) -> int:
    done = [int(m) for n in nodes for m in re.findall(r"iteration (\d+) loss", n.text())]
    return max(done, default=0)


def _wait_port(cl: Any, host: str, port: int, proc: Any, timeout: float = 120) -> None:
    code = "import socket,sys;socket.create_connection((sys.argv[1],int(sys.argv[2])),0.5)"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise CheckmateError(f"the launcher on {host} exited ({proc.returncode})")
        if cl.mode == "host":
            try:
                socket.create_connection((cl.ip[host], port), 0.5).close()
                return
            except OSError:
                pass
        elif cl.run(host, [sys.executable, "-c", code, cl.ip[host], str(port)]).returncode == 0:
            return
        time.sleep(0.3)
    raise CheckmateError(f"the rendezvous store on {host} did not come up")


def reference(sc: MultiNode, workdir: Path) -> dict:
    """The same job on one node with all its ranks, no shadows, no failure."""
    import torch

    out = workdir / "reference.pt"
    p = subprocess.run([sys.executable, "-m", "checkmate.launch.cli", "launch",
                        "--nproc-per-node", str(sc.nodes * sc.per_node), "--mode", "off",
                        "--progress-every", "0", str(SCRIPT), "--steps", str(sc.steps),
                        "--out", str(out)], capture_output=True, text=True, timeout=900,
                       env={**os.environ, "NUMBA_NUM_THREADS": "1"})
    if p.returncode != 0:
        raise CheckmateError(f"the reference run failed: {(p.stdout + p.stderr)[-500:]}")
    return torch.load(out)


def execute(sc: MultiNode, cl: Any, workdir: Path, progress: Any,
            rng: random.Random) -> dict[str, Any]:
    """Run the scenario on the cluster; the report (``ok``, ``problems``, figures)."""
    import torch

    from checkmate.testbed.comparison import compare_states
    from checkmate.testbed.runner import Run
    from checkmate.testbed.scenario import Scenario

    cfg = cl.cfg
    hosts = [h.name for h in cfg.trainers]
    need = sc.nodes + (1 if sc.spare else 0)
    if len(hosts) < need:
        raise CheckmateError(f"{sc.name} needs {need} trainer hosts in the config "
                             f"(testbed/multinode.yaml has them)")
    report: dict[str, Any] = {"scenario": sc.name, "mode": cl.mode, "nodes": sc.nodes,
                              "per_node": sc.per_node, "nnodes": sc.nnodes,
                              "spare": sc.spare, "steps": sc.steps,
                              "shadows": cfg.num_partitions}
    problems: list[str] = []
    run = Run(cl, Scenario(sc.name, "gpt", sc.steps, persist_every=1, keep=sc.steps),
              workdir, "multinode", progress)
    ckpt = run.dir / "ckpt"
    t0 = time.perf_counter()
    nodes: list[Node] = []
    try:
        if sc.colocate:  # the launchers start them on the nodes
            shadows = []
        else:
            run.start_shadows()
            shadows = [cl.ip[h.name] for h in cfg.shadows]
        rdzv = f"{cl.ip[hosts[0]]}:{RDZV_PORT}" if cl.mode == "switch" \
            else f"127.0.0.1:{_free_port()}"
        # a killed launcher cannot remove its own log folder: it is left in the run's
        env = {"NUMBA_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "TMPDIR": str(run.dir)}

        def start(i: int) -> Node:
            h = hosts[i]
            e = dict(env)
            if cl.mode == "switch":
                e["GLOO_SOCKET_IFNAME"] = cl.ifname(h)
            argv = _launch_argv(sc, cl, h, rdzv, shadows, run.dir / f"{h}.pt",
                                run.dir / f"{h}.restored", i == 0)
            return Node(cl, h, argv, e, run.dir / f"launch-{h}.log")

        nodes.append(start(0))
        _wait_port(cl, hosts[0], int(rdzv.rsplit(":", 1)[1]), nodes[0].proc)
        nodes += [start(i) for i in range(1, sc.nodes)]
        kill_at = rng.randrange(max(2, sc.steps // 4), max(3, 3 * sc.steps // 4))
        report["kill_at"] = kill_at
        deadline = time.monotonic() + 900
        while _iterations(nodes) < min(3, kill_at):
            _alive_or_fail(nodes, deadline)
        if sc.spare:
            nodes.append(start(sc.nodes))
            time.sleep(3)
        while _iterations(nodes) < kill_at:
            _alive_or_fail(nodes, deadline)
        if sc.kill == "shadow":  # one shadow process of any node; its launcher lives on
            victim = nodes[rng.randrange(sc.nodes)]
            pids = [p for p in descendants(victim.proc.pid) if b"checkmate.shadow.cli"
                    in Path(f"/proc/{p}/cmdline").read_bytes()]
            if not pids:
                raise CheckmateError(f"{victim.host} runs no shadow to kill")
            report["killed_node"] = f"a shadow of {victim.host}"
            report["killed_at"] = _iterations(nodes)
            os.kill(rng.choice(pids), signal.SIGKILL)
            victim = None
        else:
            victim = nodes[1 + rng.randrange(sc.nodes - 1)]  # never n0: it hosts the store
            report["killed_node"] = victim.host
            report["killed_at"] = _iterations(nodes)
            if sc.kill == "replicas-and-node":  # first a replica elsewhere of a partition
                other = _sibling_on_another_node(cl, sc, nodes, victim)  # the node holds
                report["killed_node"] += f" and {other[0]}'s replica of partition {other[1]}"
                os.kill(other[2], signal.SIGKILL)
            victim.kill()
        for n in nodes:
            if n is victim:
                continue
            left = max(1.0, deadline - time.monotonic())
            try:
                n.proc.wait(left)
            except subprocess.TimeoutExpired:
                n.kill()
                problems.append(f"the launcher on {n.host} did not finish")
            if n.proc.returncode not in (0, None):
                problems.append(f"the launcher on {n.host} failed ({n.proc.returncode}): "
                                f"{n.text().strip().splitlines()[-1][:300]}")
        text = "".join(n.text() for n in nodes)
        m = re.search(r"resuming at iteration (\d+)", text)
        report["restored_from"] = int(m.group(1)) if m else None
        if sc.kill == "shadow":  # the job never paused: the shadow came back from a sibling
            if m is not None or "restarting the worker group" in text:
                problems.append("the worker group restarted after a shadow's loss")
            if "exited (signal SIGKILL): started it again" not in text:
                problems.append("no launcher started the killed shadow again")
            if not re.search(r"re-seeding the shadow of partition \d replica \d from its "
                             r"sibling replica \d \(the trainers send nothing\)", text):
                problems.append("the restarted shadow was not re-seeded from its sibling")
            if "the shadows hold iteration" not in text or "(checked)" not in text:
                problems.append("the shadows were not checked equal to the trainers at "
                                "the end")
        elif m is None:
            problems.append("no node resumed from the shadows")
        elif sc.kill == "replicas-and-node" and not re.search(
                r"resuming at iteration \d+: .*from disk", text):
            problems.append("the resume did not come from disk, or did not say so")
        elif sc.colocate and sc.kill == "node":  # the surviving replicas held it in memory
            report["repeated_iterations"] = report["killed_at"] - int(m.group(1))
            if report["repeated_iterations"] > 1:
                problems.append(f"{report['repeated_iterations']} iterations repeated after "
                                "the node loss (at most the one in flight)")
            if "from disk" in text:
                problems.append("a partition was resumed from disk, not from a replica")
        if sc.colocate and sc.spare:
            problems += _check_replaced(text, victim.host if victim else "", sc.steps,
                                        report)
        report["epochs"] = sorted({int(e) for e in re.findall(r"under epoch (\d+)", text)})
        if sc.colocate:
            report["copies_by"] = "switch" if switch_copies(cl) else "trainers"
        if sc.colocate and switch_copies(cl):
            problems += _check_switch_copies(cl, text, sc, report)
        finals = final_states(run.dir, [n.host for n in nodes])
        if not finals:
            problems.append("no final state was written")
        else:
            got = torch.load(finals[0])
            report["final_world"] = got["world"]
            if sc.spare or sc.kill == "shadow":
                ref = reference(sc, workdir)
                diffs = compare_states(ref, got, ("model", "optimizer"))
                report["bit_identical"] = not diffs
                if diffs:
                    problems.append(f"final state differs from the failure-free run at "
                                    f"{diffs[:5]}")
            else:
                problems += _check_restored(run.dir, ckpt, sc, report)
    finally:
        for n in nodes:
            if n.proc.poll() is None:
                n.kill()
        run.stop()
    report["seconds"] = round(time.perf_counter() - t0, 1)
    report["ok"] = not problems
    report["problems"] = problems
    return report


def _sibling_on_another_node(cl: Any, sc: MultiNode, nodes: list[Node],
                             victim: Node) -> tuple[str, int, int]:
    """(node, partition, PID) of the shadow, on a node other than ``victim``, of a
    partition whose other replica is on ``victim``: the placement every launcher computed
    (checkmate.launch.shadow_placement), the process found by its TCP port among that
    node's launcher's descendants."""
    from checkmate.launch import shadow_placement

    names = [n.host for n in nodes][:sc.nodes]
    spread = shadow_placement.place(names, 2, 2)
    where = shadow_placement.slots(spread, {n: cl.ip[n] for n in names})
    for p, reps in enumerate(spread.nodes):
        if victim.host in reps:
            other = next(n for n in reps if n != victim.host)
            k = reps.index(other)
            node, _ip, _udp, tcp = where[k * len(spread.nodes) + p]
            launcher = next(n for n in nodes if n.host == node)
            for pid in descendants(launcher.proc.pid):
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                if b"checkmate.shadow.cli" in cmd and str(tcp).encode() in cmd:
                    return node, p, pid
    raise CheckmateError(f"no partition has replicas on {victim.host} and another node")


def _check_replaced(text: str, lost: str, steps: int, report: dict) -> list[str]:
    """The lost node's replicas were placed anew when the spare came in, each took its
    state from a sibling, and every shadow held the last iteration at the end."""
    out = []
    moved = set(re.findall(rf"(partition \d replica \d): {re.escape(lost)} -> \w+", text))
    report["replaced"] = len(moved)
    if not moved:
        out.append(f"no shadow of {lost} was placed anew")
    adopted = len(re.findall(r"re-seeding the shadow of partition \d replica \d from its "
                             r"sibling replica \d \(the trainers send nothing\)", text))
    if adopted < len(moved):
        out.append(f"{len(moved)} shadow(s) placed anew, {adopted} re-seeded from a sibling")
    return out + _every_shadow_at(text, steps)


def _every_shadow_at(text: str, steps: int) -> list[str]:
    """Each launcher asks every shadow at its end, its own still running (it stops them
    after): every shadow must have been seen at the last iteration by one of them."""
    ends = re.findall(r"the shadows hold iteration \d+ \(per shadow: \[([^]]*)\]\)", text)
    rows = [per.split(",") for per in ends]
    seen = [max((int(x) for x in col if x.strip() != "None"), default=None)
            for col in zip(*rows, strict=True)] if rows and len({len(r) for r in rows}) == 1 \
        else []
    if not seen or seen != [steps] * len(seen):
        return [f"not every shadow held iteration {steps} at the end: {ends}"]
    return []


def _check_switch_copies(cl: Any, text: str, sc: MultiNode, report: dict) -> list[str]:
    """Switch mode with co-located shadows: the switch copied to them (its entries'
    counters), every attempt was programmed (a placement change too: one epoch more per
    rendezvous), and the shadows took each attempt's session."""
    out = []
    report["switch_replicated_packets"] = cl.testbed.replicated_packets()
    if report["switch_replicated_packets"] <= 0:
        out.append("the switch copied nothing to the co-located shadows")
    if not report["epochs"]:
        out.append("no attempt was programmed at the controller")
    elif sc.kill != "shadow" and len(report["epochs"]) < 2:
        out.append(f"the attempt after the loss was not programmed anew: epochs "
                   f"{report['epochs']}")
    if sc.kill == "shadow":  # the one started again took its session: it got its copies
        out += _every_shadow_at(text, sc.steps)
    return out


def final_states(d: Path, hosts: list[str]) -> list[Path]:
    """The final states the nodes' rank 0 wrote (``--out``: ``<host>.pt``), not what a
    restore wrote beside them (``<host>.restored.<attempt>.<pid>.pt``): a glob for
    ``n*.pt`` took either, in directory order, and once compared the iteration-15 restore
    with the failure-free run's end."""
    return [d / f"{h}.pt" for h in hosts if (d / f"{h}.pt").is_file()]


def _check_restored(d: Path, ckpt: Path, sc: MultiNode, report: dict) -> list[str]:
    """The shrunk job's restored state equals the shadows' checkpoint on disk."""
    import torch

    from checkmate.shadow.checkpoint_load import load_full_state

    restored = sorted(d.glob("*.restored.*.pt"))
    if len(restored) != 1:
        return [f"expected one restore after the shrink, found {len(restored)}"]
    r = torch.load(restored[0])
    report["restored_world"] = r["world"]
    full = load_full_state(ckpt, iteration=r["iteration"])
    model_sd, optim_sd = full.spec.state_dicts(
        full.slots, full.step, full.spec.decode_buffers(full.buffers), full.lrs)
    bad = [k for k in model_sd if not torch.equal(model_sd[k], r["model"][k])]
    bad += [f"optimizer {i}/{k}" for i, st in optim_sd["state"].items() for k, v in st.items()
            if not torch.equal(torch.as_tensor(v), torch.as_tensor(
                r["optimizer"]["state"][i][k]))]
    report["restored_equals_checkpoint"] = not bad
    out = [f"restored state differs from the shadows' checkpoint at {bad[:5]}"] if bad else []
    if r["world"] != (sc.nodes - 1) * sc.per_node:
        out.append(f"the shrunk job runs {r['world']} ranks")
    if r["extra"] != {"samples": 12 * r["iteration"]}:
        out.append(f"restored data position {r['extra']}")
    return out


def _alive_or_fail(nodes: list[Node], deadline: float) -> None:
    for n in nodes:
        if n.proc.poll() is not None:
            raise CheckmateError(f"the launcher on {n.host} exited ({n.proc.returncode}): "
                                 f"{n.text().strip()[-400:]}")
    if time.monotonic() > deadline:
        raise CheckmateError("the job made no progress")
    time.sleep(0.3)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_config(scenario: str | None = None) -> Path:
    """testbed/multinode.yaml: nodes n0..n3, shadows s0 and s1; for a co-located scenario
    testbed/multinode-colocated.yaml: the same nodes, and two replicas of each of two
    partitions that run on them (the switch copies to where each attempt placed them)."""
    sc = SCENARIOS.get(scenario or "")
    return COLOCATED_CONFIG if sc is not None and sc.colocate else CONFIG
