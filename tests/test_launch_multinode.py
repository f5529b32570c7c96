"""`checkmate launch` across nodes: torchrun's flags on torch's elastic engine, on loopback.

Several launchers on one machine play the nodes of one job: a c10d rendezvous at
127.0.0.1:PORT, each launcher its own loopback addresses for its workers, real shadows,
real training (examples/train_elastic.py). A node is lost by SIGKILLing its launcher
and every worker under it. With a spare launcher waiting, the rendezvous takes it and the
job ends bit-identical to a run without the loss; without one, and --nnodes MIN:MAX
allowing it, the job continues on fewer nodes from the shadows' checkpoint, which the
restored state must equal exactly. Fast tests cover the command line (torchrun's meanings,
compared with torch.distributed.run's own parsing) and the store agreement.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from fakes import same_state

from checkmate.errors import CheckmateError
from checkmate.launch import cli, launcher, options
from checkmate.testbed.multinode import descendants
from checkmate.train import agreement
from checkmate.train import env as envmod

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train_elastic.py"
EXAMPLE = ROOT / "examples" / "train.py"


# ----- command line -------------------------------------------------------------------
@pytest.mark.parametrize("argv,needle", [
    (["--nnodes", "2", "EX"], "needs --rdzv-endpoint"),
    (["--nnodes", "3:2", "--rdzv-endpoint", "127.0.0.1", "EX"], "0 < MIN <= MAX"),
    (["--nnodes", "x", "EX"], "N or MIN:MAX"),
    (["--standalone", "--rdzv-endpoint", "127.0.0.1", "EX"], "--standalone is one node"),
    (["--nnodes", "1:2", "--rdzv-backend", "static", "--rdzv-endpoint", "127.0.0.1", "EX"],
     "fixed number of nodes"),
    (["--nnodes", "2", "--rdzv-backend", "static", "--node-rank", "2", "--rdzv-endpoint",
      "127.0.0.1", "EX"], "not below --nnodes 2"),
    (["--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:29400", "EX"], "shadows every node"),
    (["--nnodes", "2", "--rdzv-endpoint", "10.0.0.1", "--shadow", "127.0.0.1", "EX"],
     "give --worker-ip"),
    (["--worker-ip", "10.0.0.5", "EX"], "jobs of several nodes"),
    (["--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:x", "--shadow", "127.0.0.1", "EX"],
     "HOST[:PORT]"),
    (["--controller", "127.0.0.1", "--shadow", "127.0.0.1", "EX"], "not both"),
    (["--nnodes", "2", "--rdzv-endpoint", "127.0.0.1", "--mode", "gockpt", "--dir", "d",
      "EX"], "runs on one node"),
])
def test_bad_multinode_command_lines_are_one_line_errors(capsys, argv, needle):
    argv = [str(EXAMPLE) if a == "EX" else a for a in argv]
    assert cli.main(["launch", "--nproc-per-node", "1", *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1, err


def test_a_rendezvous_that_never_completes_is_one_line(tmp_path):
    """A node whose peers never come: torch's RendezvousTimeoutError, as one line."""
    p = subprocess.run([sys.executable, "-m", "checkmate.launch.cli", "launch", "--nnodes",
                        "2", "--rdzv-endpoint", f"127.0.0.1:{_free_port()}", "--rdzv-conf",
                        "join_timeout=2", "--mode", "off", "--nproc-per-node", "1",
                        str(SCRIPT)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stdout + p.stderr
    assert p.stderr.strip().splitlines() == [p.stderr.strip()], p.stderr
    assert "did not complete in time: fewer than 2 node(s) joined" in p.stderr


def test_a_rendezvous_host_that_never_answers_is_one_line_without_cpp_frames(tmp_path):
    """A node that is not the rendezvous host and cannot reach its store: torch's C++ side
    logged the failed connection with its whole stack (some 40 lines, `frame #0: ...`)
    before the exception the launcher turns into one line; the launcher's torch now logs
    nothing below FATAL from C++ (its workers keep torch's default)."""
    p = subprocess.run([sys.executable, "-m", "checkmate.launch.cli", "launch", "--nnodes",
                        "2", "--rdzv-endpoint", f"127.0.0.1:{_free_port()}", "--rdzv-conf",
                        "is_host=0,read_timeout=2", "--mode", "off", "--nproc-per-node", "1",
                        str(SCRIPT)], capture_output=True, text=True, timeout=120,
                       env={k: v for k, v in os.environ.items()
                            if k != "TORCH_CPP_LOG_LEVEL"})
    assert p.returncode == 2, p.stdout + p.stderr
    assert "frame #" not in p.stdout + p.stderr, p.stderr
    assert p.stderr.strip().splitlines() == [p.stderr.strip()], p.stderr
    assert "failed: RendezvousConnectionError" in p.stderr


def test_a_restart_after_peers_went_silent_names_another_node(tmp_path, monkeypatch):
    """The launcher's restart line reads this node's failure records since the last one:
    every local worker saw a peer go silent -> a trainer on another node went silent;
    anything else (a crash, a worker that recorded nothing, one node) -> a trainer failed."""
    from checkmate.launch import restart_line as rl

    monkeypatch.setattr(rl, "_since", rl._since)  # restored after the test
    msg = "[default] Worker group FAILED. 2/3 attempts left; will restart worker group"
    d = tmp_path / "failures"
    d.mkdir()
    assert 0 < rl._process_start() <= time.time()  # records of this process count
    assert rl.restart_line(msg, "L", tmp_path, 2) == ("L: a trainer failed; restarting the "
                                                   "worker group (2/3 attempts left); it "
                                                   "resumes from its checkpoints")
    stall = ("checkmate: rank 1: RingError: no progress on bucket 0 of iteration 5 for 15 s: "
             "a peer is gone at train_elastic.py:40")
    (d / "attempt-0-rank-1.txt").write_text(f"{time.time():.6f} {stall}\n")
    (d / "attempt-0-rank-0.txt").write_text(
        f"{time.time():.6f} checkmate: rank 0: a peer of the process group is gone\n")
    assert "a trainer failed" in rl.restart_line(msg, "L", tmp_path, 0)  # one node
    monkeypatch.setattr(rl, "_since", 0.0)
    # a third local worker recorded nothing: killed here, so this node's own failure
    assert "a trainer failed" in rl.restart_line(msg, "L", tmp_path, 3)
    monkeypatch.setattr(rl, "_since", 0.0)
    line = rl.restart_line(msg, "L", tmp_path, 2)
    assert line.startswith("L: a trainer on another node went silent (a lost node, or a "
                           "failed trainer there); this node's workers stopped waiting for "
                           "it (rank 0: a peer of the process group is gone)"), line
    assert len(rl.recent_failures(tmp_path, 0.0)) == 2
    assert rl.recent_failures(tmp_path, time.time() + 1) == []  # older than the last line
    (d / "attempt-1-rank-0.txt").write_text(
        f"{time.time():.6f} checkmate: rank 0: ValueError: bad batch at train.py:3\n")
    assert "a trainer failed" in rl.restart_line(msg, "L", tmp_path, 1)  # a crash of its own


def test_multinode_flags_mean_what_torchrun_makes_of_them(tmp_path):
    """The LaunchConfig of `checkmate launch` equals torchrun's for the same flags."""
    from torch.distributed.run import config_from_args, parse_args

    flags = ["--nnodes", "2:3", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
             "--rdzv-endpoint", "127.0.0.1:29555", "--rdzv-id", "job7", "--max-restarts",
             "3", "--rdzv-conf", "last_call_timeout=5,join_timeout=90"]
    ours = launcher.launch_config(
        options.parser(0).parse_args([*flags, "--shadow", "127.0.0.1", str(EXAMPLE)]), tmp_path)
    torchs, _, _ = config_from_args(parse_args([*flags, str(EXAMPLE)]))
    for f in ("min_nodes", "max_nodes", "nproc_per_node", "run_id", "rdzv_backend",
              "rdzv_endpoint", "rdzv_configs", "max_restarts"):
        assert getattr(ours, f) == getattr(torchs, f), f
    assert (ours.min_nodes, ours.max_nodes, ours.run_id) == (2, 3, "job7")
    static = ["--nnodes", "2", "--node-rank", "1", "--rdzv-backend", "static",
              "--rdzv-endpoint", "127.0.0.1:29556", "--nproc-per-node", "1"]
    ours = launcher.launch_config(
        options.parser(0).parse_args([*static, "--shadow", "127.0.0.1", str(EXAMPLE)]), tmp_path)
    torchs, _, _ = config_from_args(parse_args([*static, str(EXAMPLE)]))
    assert ours.rdzv_configs["rank"] == torchs.rdzv_configs["rank"] == 1


def test_node_worker_addresses_share_one_ip_on_ports_of_their_own():
    from checkmate.launch.local_shadows import node_worker_addrs
    from checkmate.train.layout import JobLayout
    from checkmate.train.replicate import ShadowTarget

    addrs = node_worker_addrs("10.0.0.5", 2) + node_worker_addrs("10.0.0.6", 2)
    lay = JobLayout(1, 0, 4, addrs, [ShadowTarget(0, "10.0.0.9", 47001)],
                    [("10.0.0.9", 47100)], mode="host")
    ports = [p for _, p in addrs] + [lay.repair_addr(r)[1] for r in range(4)]
    assert addrs[0] == ("10.0.0.5", 47000) and lay.repair_addr(0) == ("10.0.0.5", 47002)
    assert len({(addrs[r][0], p) for r, p in enumerate(ports[:4])}
               | {lay.repair_addr(r) for r in range(4)}) == 8  # no two sockets collide
    assert all(47000 <= p < 47008 for p in ports)  # in the ckm range every switch parses


def test_env_local_trainers_replace_the_global_list():
    base = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", envmod.MODE: "off",
            envmod.LOCAL_TRAINERS: "10.0.0.6:47000,10.0.0.6:47004",
            envmod.RDZV_STORE: "10.0.0.1:29400"}
    job = envmod.read(base)
    assert job.trainers == [] and job.local_trainer == ("10.0.0.6", 47004)
    assert job.rdzv_store == ("10.0.0.1", 29400)
    with pytest.raises(CheckmateError, match="LOCAL_RANK is 2"):
        envmod.read({**base, "LOCAL_RANK": "2"})


# ----- agreement through torch's store -----------------------------------------------
def test_rank0_decides_and_every_rank_reads_that_answer():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10))
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False,
                           timeout=timedelta(seconds=10))
    asked = []
    # rank 1 asks first: it waits for rank 0's answer, never computes one of its own
    got = agreement.decide(server, "point", 0, 2, lambda: asked.append(0) or {"it": 7})
    assert agreement.decide(client, "point", 1, 2, lambda: asked.append(1) or {"it": 9}) \
        == got == {"it": 7}
    assert asked == [0]
    # the second decision on the key is a new one: rank 1 does not read the first answer
    agreement.decide(server, "point", 0, 2, lambda: {"it": 8})
    assert agreement.decide(client, "point", 1, 2, lambda: None) == {"it": 8}

    def refuse() -> None:
        raise CheckmateError("resume: nothing to resume from")

    # rank 0 raises a refusal only once rank 1 has read it: rank 0 runs in a thread here
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(agreement.decide, server, "point", 0, 2, refuse)
        time.sleep(0.3)
        assert not first.done()  # published, but not yet read
        with pytest.raises(CheckmateError, match="nothing to resume from"):
            agreement.decide(client, "point", 1, 2, lambda: {"it": 1})
        with pytest.raises(CheckmateError, match="nothing to resume from"):
            first.result(10)
    with pytest.raises(CheckmateError, match="published no 'late/1'"):
        agreement.decide(client, "late", 1, 2, lambda: None, timeout=0.5)
    # a rank that never reads holds rank 0 back no longer than read_timeout
    t0 = time.monotonic()
    with pytest.raises(CheckmateError, match="nothing to resume from"):
        agreement.decide(server, "unread", 0, 2, refuse, read_timeout=0.5)
    assert time.monotonic() - t0 < 5


def test_job_store_marks_outlive_the_client():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10))
    one = agreement.job_store(("127.0.0.1", server.port), "run-a")
    assert not agreement.marked(one, "seeded")
    agreement.mark(one, "seeded")
    assert agreement.marked(agreement.job_store(("127.0.0.1", server.port), "run-a"),
                            "seeded")
    assert not agreement.marked(agreement.job_store(("127.0.0.1", server.port), "run-b"),
                                "seeded")  # another job's runs are apart
    with pytest.raises(CheckmateError, match="cannot reach the job's rendezvous store"):
        agreement.job_store(("127.0.0.1", _free_port()), "run-a", timeout=1.0)


# ----- nodes on loopback --------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Node:
    """One `checkmate launch` of a multi-node job (a process group of its own)."""

    def __init__(self, tmp: Path, name: str, argv: list[str]) -> None:
        self.log = tmp / f"{name}.log"
        with open(self.log, "wb") as f:
            # a lost peer is noticed after 6 s of ring stall (the launcher's default: 15);
            # a killed launcher's own log folder (it had no time to remove it) stays in tmp
            self.proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT,
                                         start_new_session=True,
                                         env={**os.environ, "NUMBA_NUM_THREADS": "1",
                                              envmod.STALL_TIMEOUT: "6", "TMPDIR": str(tmp)})

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def kill(self) -> None:
        """SIGKILL the launcher and every process under it (the node is lost)."""
        pids = descendants(self.proc.pid) + [self.proc.pid]
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.kill()


def _launcher(port: int, run: str, nnodes: str, shadows: list[str], out: Path,
              steps: int, *extra: str) -> list[str]:
    argv = [sys.executable, "-m", "checkmate.launch.cli", "launch", "--nnodes", nnodes,
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run,
            "--nproc-per-node", "1", "--max-restarts", "2", "--progress-every", "1", *extra]
    for ip in shadows:
        argv += ["--shadow", ip]
    return argv + [str(SCRIPT), "--steps", str(steps), "--sleep", "0.3", "--out", str(out),
                   "--restored-out", str(out.with_suffix(".restored"))]


def _store_up(node: Node, port: int, timeout: float = 120) -> None:
    """Wait until ``node`` (started first) hosts the rendezvous store at ``port``: a node
    started later is then a client of it, and the test knows which node it may lose."""
    deadline = time.monotonic() + timeout
    while True:
        assert node.proc.poll() is None, node.text()[-3000:]
        try:
            socket.create_connection(("127.0.0.1", port), 0.5).close()
            return
        except OSError:
            assert time.monotonic() < deadline, node.text()[-3000:]
            time.sleep(0.2)


def _reached(nodes: list[Node], iteration: int, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done = [int(m) for n in nodes for m in re.findall(r"iteration (\d+) loss", n.text())]
        if done and max(done) >= iteration:
            return
        for n in nodes:
            assert n.proc.poll() is None, n.text()[-3000:]
        time.sleep(0.3)
    raise AssertionError("no progress: " + nodes[0].text()[-3000:])


def _finish(node: Node, timeout: float = 400) -> str:
    try:
        node.proc.wait(timeout)
    except subprocess.TimeoutExpired:
        node.stop()
    text = node.text()
    assert node.proc.returncode == 0, text[-4000:]
    return text


class _Reference:
    """The same job without shadows and without a failure, on one node with 2 workers.

    Started at once, in the background: the multi-node job it is compared with spends its
    time sleeping between steps and waiting for nodes, so the two overlap for free."""

    def __init__(self, tmp: Path, steps: int) -> None:
        self.out = tmp / "reference.pt"
        self.log = open(tmp / "reference.log", "w+")  # noqa: SIM115 -- closed by stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "checkmate.launch.cli", "launch", "--nproc-per-node", "2",
             "--mode", "off", "--progress-every", "0", str(SCRIPT), "--steps", str(steps),
             "--out", str(self.out)], stdout=self.log, stderr=subprocess.STDOUT,
            env={**os.environ, "NUMBA_NUM_THREADS": "1"})

    def result(self) -> dict:
        """Its final state, once it has ended successfully."""
        try:
            self.proc.wait(300)
        finally:
            self.stop()
        self.log.seek(0)
        text = self.log.read()
        self.log.close()
        assert self.proc.returncode == 0, text[-3000:]
        return torch.load(self.out)

    def stop(self) -> None:
        if self.proc.poll() is None:  # ours, by PID (its workers end with their launcher)
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.mark.slow
def test_a_node_lost_with_its_colocated_shadows_resumes_from_their_replicas_in_memory(
        tmp_path, monkeypatch):
    """A lost node replaced by a spare, the job ending bit-identical to one without shadows
    or failure; here with issue 38's co-located shadows (the same spare path with shadows
    elsewhere is the shrink test's and the multinode-kill-node scenario's): two nodes run
    the job and its shadows themselves (`--shadows 2 --replicas 2 --colocate`: each
    partition has a replica on each node), a spare waits. Node b is SIGKILLed with its
    worker and its two shadows; the restart on a and the spare resumes from a's replicas in
    memory at the newest iteration (no checkpoint on disk exists). The rendezvous that lets
    the spare in places b's two replicas anew on it (the spare is in --colocate's address
    book, not in the first round): they come up empty, take their state from a's replicas
    (the trainers send nothing), and hold the last iteration when the job ends."""
    from checkmate.protocol import auth

    monkeypatch.setenv(auth.SECRET_ENV, str(auth.create_secret(tmp_path / "job.key")))
    steps, port = 16, _free_port()
    net = f"127.83.{os.getpid() % 250 + 1}"
    ips = {"a": f"{net}.10", "b": f"{net}.11", "spare": f"{net}.12"}
    colocate = f"a={ips['a']},b={ips['b']},spare={ips['spare']}"
    reference = _Reference(tmp_path, steps)
    try:
        argv = lambda name: _launcher(  # noqa: E731
            port, "colocate", "2", [], tmp_path / f"{name}.pt", steps, "--shadows", "2",
            "--replicas", "2", "--colocate", colocate, "--node", name, "--worker-ip",
            ips[name])
        a = Node(tmp_path, "a", argv("a"))  # first: it hosts the rendezvous store
        _store_up(a, port)
        b = Node(tmp_path, "b", argv("b"))
        nodes = [a, b]
        try:
            _reached(nodes, 4)
            spare = Node(tmp_path, "spare", argv("spare"))
            nodes.append(spare)
            time.sleep(3)  # the spare waits in the rendezvous: the job is full
            _reached(nodes, 7)
            b.kill()  # node b is lost: its launcher, its worker and its shadows
            text = _finish(a)
            _finish(spare)
        finally:
            for n in nodes:
                n.stop()
        assert "partition 0: a, b\npartition 1: a, b" in text, text[:2000]
        assert "starting 2 of them on a" in text, text[:2000]
        moved = ("the job's nodes are now a, spare: placed 2 shadow(s) anew (partition 0 "
                 "replica 1: b -> spare; partition 1 replica 1: b -> spare)")
        assert moved in text and moved in spare.text(), text[-3000:]
        assert "starting 2 of them on spare" in spare.text(), spare.text()[-3000:]
        assert len(re.findall(r"re-seeding the shadow of partition \d replica \d from its "
                              r"sibling replica \d \(the trainers send nothing\)", text
                              + spare.text())) == 2, text[-3000:]
        ends = re.findall(r"the shadows hold iteration (\d+) \(per shadow: \[([^]]*)\]\)",
                          text + spare.text())
        # each launcher asks every shadow at its end, its own still running (it stops them
        # after): every shadow, the new ones too, was seen at the last iteration by one
        seen = [max((int(x) for x in col if x.strip() != "None"), default=None)
                for col in zip(*(per.split(",") for _, per in ends), strict=True)]
        assert seen == [steps] * 4, ends
        assert re.search(r"partition \d is down to its last current replica of 2", text), \
            text[-3000:]
        # the survivor says a trainer elsewhere went silent, not that one of its own failed
        assert "a trainer on another node went silent (a lost node" in text, text[-3000:]
        m = re.search(r"resuming at iteration (\d+): every shadow holds it in memory", text)
        assert m, text[-3000:]
        lost = max(int(x) for x in re.findall(r"iteration (\d+) loss", text.split(
            "resuming at iteration")[0]))
        assert lost - int(m.group(1)) <= 1, (lost, m.group(1))  # at most the one in flight
        got = torch.load(tmp_path / ("a.pt" if (tmp_path / "a.pt").exists() else "spare.pt"))
        ref = reference.result()
        assert same_state(ref["model"], got["model"]), "model"
        assert same_state(ref["optimizer"], got["optimizer"]), "optimizer"
        assert got["world"] == 2
    finally:
        reference.stop()


@pytest.mark.slow
def test_job_shrinks_to_two_nodes_from_the_shadows_checkpoint(tmp_path, serve_shadows):
    from checkmate.shadow.checkpoint_load import load_full_state

    steps, port = 16, _free_port()
    net = f"127.85.{os.getpid() % 250 + 1}"
    ckpt = tmp_path / "ckpt"
    with serve_shadows([f"{net}.100", f"{net}.101"], "--dir", str(ckpt), "--persist-every",
                       "1", "--keep", "100", config=False) as ips:
        argv = lambda name: _launcher(  # noqa: E731
            port, "shrink", "2:3", ips, tmp_path / f"{name}.pt", steps,
            "--rdzv-conf", "last_call_timeout=3")
        nodes = [Node(tmp_path, "a", argv("a"))]
        _store_up(nodes[0], port)
        nodes += [Node(tmp_path, n, argv(n)) for n in ("b", "c")]
        try:
            _reached(nodes, 5)
            assert "rank 0 of 3" in "".join(n.text() for n in nodes)
            nodes[2].kill()  # node c is lost, no spare: the job goes on with a and b
            text = _finish(nodes[0]) + _finish(nodes[1])
        finally:
            for n in nodes:
                n.stop()
    assert "resuming a job of 3 ranks on 2" in text, text[-3000:]
    restored = [torch.load(p) for p in tmp_path.glob("*.restored.*.pt")]
    assert len(restored) == 1, sorted(p.name for p in tmp_path.iterdir())
    r = restored[0]
    assert r["world"] == 2 and r["extra"] == {"samples": 12 * r["iteration"]}
    full = load_full_state(ckpt, iteration=r["iteration"])
    model_sd, optim_sd = full.spec.state_dicts(
        full.slots, full.step, full.spec.decode_buffers(full.buffers), full.lrs)
    assert same_state(dict(model_sd), dict(r["model"])), \
        "restored model vs the shadows' checkpoint"
    assert same_state(optim_sd["state"], r["optimizer"]["state"]), "restored optimizer state"
    final = torch.load(next(p for p in (tmp_path / "a.pt", tmp_path / "b.pt") if p.exists()))
    assert final["world"] == 2  # and it trained on to the last step (the run exited 0)
    assert not torch.equal(final["model"]["0.weight"], r["model"]["0.weight"])
