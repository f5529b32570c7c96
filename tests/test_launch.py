"""`checkmate launch`: real shadows, real trainers under torch's elastic agent, on loopback.

The main test launches examples/train.py twice with 4 trainers and 2 shadows: once without
failures, once with one trainer SIGKILLing itself at a random iteration (CHECKMATE_KILL_AT,
a test-only knob). The agent restarts the group, ``from_env`` resumes it from the shadows,
and rank 0's final model, optimizer and scheduler state must equal the failure-free run's
bit for bit. The other tests cover the command line, the worker's environment and
``shadow serve`` without a config.
"""

from __future__ import annotations

import os
import random
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from fakes import alive, children, same_state

from checkmate.config import cluster as cfgmod
from checkmate.launch.cli import main as launch_main
from checkmate.spec.model import ModelSpec
from checkmate.train.shadow_client import ShadowClient

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train.py"


def _launch(tmp_path: Path, name: str, steps: int, env: dict[str, str] | None = None
            ) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / f"{name}.pt"
    argv = [sys.executable, "-m", "checkmate.launch.cli", "launch", "--nproc-per-node", "4",
            "--shadows", "2", "--max-restarts", "1", "--progress-every", "4",
            "--dir", str(tmp_path / name), str(EXAMPLE), "--steps", str(steps),
            "--out", str(out)]
    tmp = tmp_path / f"{name}-tmp"  # the launch's TMPDIR: it must leave nothing there
    tmp.mkdir()
    p = subprocess.run(argv, capture_output=True, text=True, timeout=400,
                       env={**os.environ, "NUMBA_NUM_THREADS": "1", "TMPDIR": str(tmp),
                            **(env or {})})
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    assert not list(tmp.glob("torchelastic_*")), "the elastic agent's files were left in /tmp"
    return p, torch.load(out, weights_only=False)


def _shadows_gone(output: str) -> None:
    """The launcher's shadows (it prints their /24) no longer answer: stopped at exit."""
    net = re.search(r"shadow\(s\) on (127\.\d+\.\d+)\.100\+", output).group(1)
    for p in range(2):
        with pytest.raises(OSError):
            socket.create_connection((f"{net}.{100 + p}", cfgmod.RESTORE_PORT), 1).close()


@pytest.mark.slow
def test_launch_restarts_a_killed_trainer_bit_identical(tmp_path):
    steps = 12
    rank, at = random.randrange(4), random.randrange(3, 10)
    why = f"rank {rank} killed at iteration {at}"
    clean, ref = _launch(tmp_path, "clean", steps)
    assert "restarting the worker group" not in clean.stdout, why
    killed, got = _launch(tmp_path, "killed", steps, {"CHECKMATE_KILL_AT": f"{rank}:{at}"})
    out = killed.stdout + killed.stderr
    assert "restarting the worker group" in out, (why, out[-3000:])
    m = re.search(r"attempt 1: resumed from the shadows at iteration (\d+)", out)
    assert m and at - 1 <= int(m.group(1)) <= at, (why, out[-3000:])
    assert "Traceback" not in out, (why, out[-3000:])
    # progress lines: iteration, loss and the shadows' state, every 4 iterations
    assert re.search(r"checkmate: iteration 12 loss \d+\.\d+ \| shadows hold iteration",
                     killed.stdout), killed.stdout
    assert f"the shadows hold iteration {steps} " in killed.stdout, killed.stdout
    for part in ("model", "optimizer", "scheduler"):
        assert same_state(ref[part], got[part]), f"{part} ({why})"
    assert ref["scheduler"]["last_epoch"] == steps
    for p in (clean, killed):
        _shadows_gone(p.stdout)


@pytest.mark.slow
@pytest.mark.parametrize("argv,needle", [
    ([], "--nproc-per-node"),
    (["--nproc-per-node", "0", "x.py"], "expected an integer 1.."),
    (["--nproc-per-node", "two", "x.py"], "expected an integer 1.."),
    (["--nproc-per-node", "2", "--shadows", "2", "--shadow", "127.0.0.1", "EX"],
     "not allowed with argument"),
    (["--nproc-per-node", "2", "--mode", "bogus", "EX"], "invalid choice"),
    (["--nproc-per-node", "2", "--mode", "switch", "EX"], "needs --controller"),
    (["--nproc-per-node", "2", "no/such/script.py"], "no such script"),
    (["--nproc-per-node", "2", "--persist-every", "5", "EX"], "give --dir"),
    (["--nproc-per-node", "2", "--mode", "off", "--shadows", "2", "EX"], "without shadows"),
    (["--nproc-per-node", "2", "--mode", "gockpt", "EX"], "give --dir"),
    (["--nproc-per-node", "2", "--mode", "gockpt", "--dir", "d", "--gockpt", "2,3", "EX"],
     "1 <= STEPS <= EVERY"),
    (["--nproc-per-node", "2", "--mode", "gockpt", "--shadows", "2", "EX"], "without shadows"),
    (["--nproc-per-node", "2", "--shadow", "nohost:x", "EX"], "bad shadow address"),
    (["--nproc-per-node", "2", "--shadow", "127.0.0.1:1", "EX"], "does not answer"),
    (["--nproc-per-node", "2", "--shadow-cores", "4096", "EX"], "not on this machine"),
    (["--nproc-per-node", "2", "--shadow-cores", "1-0", "EX"], "expected a CPU list"),
    (["--nproc-per-node", "2", "--shadow-cores", "0", "--shadow", "127.0.0.1", "EX"],
     "pins the shadows started here"),
    (["--nproc-per-node", "2", "--colocate", "a=10.0.0.300", "--node", "a", "EX"],
     "is not an IPv4 address"),
    (["--nproc-per-node", "2", "--colocate", "a=10.0.0.1,a=10.0.0.2", "--node", "a", "EX"],
     "with each name once"),
    (["--nproc-per-node", "2", "--colocate", "a=10.0.0.1", "EX"], "needs --node"),
    (["--nproc-per-node", "2", "--node", "a", "EX"], "name the nodes of --colocate"),
    (["--nproc-per-node", "2", "--colocate", "a=10.0.0.1", "--node", "a", "--mode", "off",
      "EX"], "places the shadows this job starts, in host or switch mode"),
    (["--nproc-per-node", "2", "--colocate", "a=10.0.0.1", "--node", "a", "--mode", "switch",
      "EX"], "needs --controller"),
    (["--nproc-per-node", "2", "--colocate", "a=10.0.0.1", "--node", "a", "--controller",
      "10.0.0.9", "EX"], "in host mode has no controller"),
    (["--nproc-per-node", "2", "--replicas", "2", "--mode", "switch", "--controller",
      "10.0.0.9", "EX"], "in switch mode with --colocate"),
    (["--nproc-per-node", "1", "--nnodes", "2", "--rdzv-backend", "static", "--node-rank",
      "0", "--rdzv-endpoint", "127.0.0.1:29400", "--colocate", "a=10.0.0.1,b=10.0.0.2",
      "--node", "a", "EX"], "not with --rdzv-backend static"),
])
def test_bad_command_lines_are_one_line_errors(capsys, argv, needle):
    argv = [str(EXAMPLE) if a == "EX" else a for a in argv]
    assert launch_main(["launch", *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1, err
    assert err.startswith("checkmate launch: error: ")


def test_unknown_command_is_one_line_error(capsys):
    assert launch_main(["run", "--nproc-per-node", "2", str(EXAMPLE)]) == 2
    err = capsys.readouterr().err
    assert "unknown command 'run'" in err and len(err.strip().splitlines()) == 1, err


def test_console_script_and_worker_errors_are_one_line(tmp_path):
    """The `checkmate` entry point answers; a script run outside the launcher learns in one
    line (exit 2, no traceback) what the environment lacks."""
    exe = Path(sys.executable).with_name("checkmate")
    p = subprocess.run([str(exe), "launch", "--nproc-per-node", "1", "--mode", "sideways",
                        "x.py"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "invalid choice" in p.stderr and "Traceback" not in p.stderr
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE") and not k.startswith("CHECKMATE_")}
    tiny = tmp_path / "tiny.py"  # from_env reads the environment before anything else
    tiny.write_text("from checkmate.train import CheckmateSession\n"
                    "CheckmateSession.from_env(None, None)\n")
    for script, extra, needle in (
            (EXAMPLE, {}, "RANK is not set"),
            (tiny, {"RANK": "0", "WORLD_SIZE": "1"}, "CHECKMATE_TRAINERS must be"),
            (tiny, {"RANK": "0", "WORLD_SIZE": "1", "CHECKMATE_MODE": "sideways",
                    "CHECKMATE_TRAINERS": "127.0.0.1:47000"}, "CHECKMATE_MODE must"),
            (tiny, {"RANK": "0", "WORLD_SIZE": "1", "CHECKMATE_MODE": "switch",
                    "CHECKMATE_TRAINERS": "127.0.0.1:47000"}, "needs CHECKMATE_CONTROLLER")):
        p = subprocess.run([sys.executable, "-m", "checkmate.train.run_script", str(script),
                            "--steps", "1"], capture_output=True, text=True, timeout=120,
                           env={**env, **extra})
        assert p.returncode == 2, p.stderr
        assert needle in p.stderr and "Traceback" not in p.stderr, p.stderr
        assert len(p.stderr.strip().splitlines()) == 1, p.stderr


def test_a_worker_that_succeeds_ends_as_python_would(tmp_path):
    """The worker skips the interpreter's teardown (gloo can abort in it) but nothing the
    script left to it is lost: an open file is flushed, a non-daemon thread finishes, an
    atexit handler runs, and sys.exit's status is the worker's."""
    out = tmp_path / "out.txt"
    script = tmp_path / "ends.py"
    script.write_text(textwrap.dedent(f"""
        import atexit, sys, threading, time
        import torch.distributed  # its deprecated reduce_op warns if asked for __class__
        log = open({str(out)!r}, "w")
        log.write("unflushed;")
        def late():
            time.sleep(0.3)
            log.write("thread;")
        threading.Thread(target=late).start()
        atexit.register(lambda: print("atexit ran", flush=True))
        if len(sys.argv) > 1:
            sys.exit(int(sys.argv[1]))
        """))
    for args, code in (([], 0), (["0"], 0), (["3"], 3)):
        out.unlink(missing_ok=True)
        p = subprocess.run([sys.executable, "-m", "checkmate.train.run_script", str(script),
                            *args], capture_output=True, text=True, timeout=60,
                           env={**os.environ, "RANK": "0"})
        assert p.returncode == code, p.stderr
        assert p.stderr == "" and "atexit ran" in p.stdout, (p.stdout, p.stderr)
        assert out.read_text() == "unflushed;thread;"


@pytest.mark.slow
def test_restart_before_any_seed_starts_fresh(tmp_path):
    """The first attempt dies before the shadows were seeded (rank 1 exits at once): the
    restarted group has nothing to resume from, says so, and trains from iteration 1."""
    script = tmp_path / "flaky.py"
    script.write_text(
        "import os\nimport runpy\n"
        "if os.environ['TORCHELASTIC_RESTART_COUNT'] == '0' and os.environ['RANK'] == '1':\n"
        "    os._exit(5)\n"
        f"runpy.run_path({str(EXAMPLE)!r}, run_name='__main__')\n")
    p = subprocess.run([sys.executable, "-m", "checkmate.launch.cli", "launch", "--nproc-per-node",
                        "2", "--shadows", "1", "--max-restarts", "1", "--progress-every", "3",
                        str(script), "--steps", "3"], capture_output=True, text=True,
                       timeout=300)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:]
    assert "restarting the worker group" in out, out[-3000:]
    assert "no shadow was seeded before the restart: starting fresh" in p.stdout, p.stdout
    assert "attempt 1: seeded 1 shadow(s)" in p.stdout, p.stdout
    assert "the shadows hold iteration 3 " in p.stdout, p.stdout


@pytest.mark.parametrize("start", ["forkserver", "exec"])
def test_failed_group_without_restarts_is_one_line_per_process(tmp_path, start):
    """Rank 1 exits after the rendezvous; rank 0's collective fails in gloo: one line from
    rank 0 (not a traceback), and one from the launcher naming both ranks, exit 2 -- with
    workers forked from the launcher's server (where torch's agent itself reports only the
    first worker it saw fail) and with every worker a fresh Python."""
    script = tmp_path / "dies.py"
    script.write_text(
        "import os\nimport torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "if dist.get_rank() == 1:\n    os._exit(3)\n"
        "dist.barrier()\ndist.barrier()\n")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    p = subprocess.run([sys.executable, "-m", "checkmate.launch.cli", "launch", "--nproc-per-node",
                        "2", "--mode", "off", "--worker-start", start, str(script)],
                       capture_output=True, text=True,
                       timeout=300, env={**os.environ, "TMPDIR": str(tmp)})
    out = p.stdout + p.stderr
    assert p.returncode == 2 and "Traceback" not in out, out
    assert "checkmate: rank 0: a peer of the process group is gone" in out, out
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("checkmate launch: error: the trainers failed after 0 restart(s)")
    assert "rank 1 (exit code 3)" in last, last
    # a failed job keeps its log directory, with the agent's files in it
    kept = list(tmp.glob("checkmate-launch-*"))
    assert len(kept) == 1 and (kept[0] / "elastic").is_dir(), list(tmp.rglob("*"))


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL])
def test_launcher_stopped_or_killed_leaves_no_process(tmp_path, sig):
    """Ctrl-C stops workers and shadows and exits 130; a SIGKILLed launcher takes its
    shadows (parent-death signal) and its workers (they watch their parent) with it."""
    log = tmp_path / "out.log"
    with open(log, "wb") as f:
        launcher = subprocess.Popen(
            [sys.executable, "-m", "checkmate.launch.cli", "launch", "--nproc-per-node", "2",
             "--shadows", "2", "--shadow-cores", "0", "--progress-every", "5", str(EXAMPLE),
             "--steps", "100000"],
            stdout=f, stderr=subprocess.STDOUT,
            env={**os.environ, "TMPDIR": str(tmp_path)})  # the kept logs stay in tmp_path
    kids: list[int] = []
    try:
        deadline = time.monotonic() + 240
        while "checkmate: iteration 5 " not in log.read_text():
            assert launcher.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        kids = children(launcher.pid)
        assert len(kids) == 4, kids  # 2 shadows, 2 workers
        # --shadow-cores: the shadows keep to core 0, the workers to the launcher's cores
        shadows = [k for k in kids
                   if b"checkmate.shadow.cli" in Path(f"/proc/{k}/cmdline").read_bytes()]
        assert len(shadows) == 2 and all(os.sched_getaffinity(k) == {0} for k in shadows)
        assert all(os.sched_getaffinity(k) == os.sched_getaffinity(0)
                   for k in set(kids) - set(shadows))
        assert "pinned to core(s) 0" in log.read_text()
        launcher.send_signal(sig)
        rc = launcher.wait(120)
        assert rc == (130 if sig == signal.SIGINT else -signal.SIGKILL), log.read_text()
        deadline = time.monotonic() + 60
        while any(alive(k) for k in kids):
            assert time.monotonic() < deadline, [k for k in kids if alive(k)]
            time.sleep(0.2)
        text = log.read_text()
        assert "Traceback" not in text, text[-3000:]
        if sig == signal.SIGINT:
            assert "checkmate launch: stopped by SIGINT" in text, text[-3000:]
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        for k in kids:
            if alive(k):
                os.kill(k, signal.SIGKILL)


def test_stock_torch_optimizer_is_refused():
    """torch.optim.AdamW's arithmetic differs from the shadows' in the last bits: refused,
    never silent drift."""
    from checkmate.errors import CheckmateError
    from checkmate.optim import AdamW
    from checkmate.train import CheckmateSession, JobLayout, ShadowTarget

    model = torch.nn.Linear(4, 2)
    lay = JobLayout(job_id=3, rank=0, world=1, trainers=[("127.0.0.1", 1)],
                    shadows=[ShadowTarget(0, "127.0.0.1", 1)], shadow_tcp=[("127.0.0.1", 1)],
                    mode="host")
    with pytest.raises(CheckmateError, match="checkmate.optim.SGD, Adam or AdamW"):
        CheckmateSession(model, torch.optim.AdamW(model.parameters()), None, lay)
    sess = CheckmateSession(model, AdamW(model.parameters()), None, lay)  # the drop-in is fine
    sess.close()


def _configless_net(count: int) -> list[str]:
    """Shadow addresses on a random loopback /24 (127.82.x.100, .101, ...)."""
    net = f"127.82.{random.randrange(1, 255)}"
    return [f"{net}.{100 + p}" for p in range(count)]


@pytest.mark.slow
def test_launch_with_running_shadows_and_resume(tmp_path, capsys, serve_shadows):
    """`--shadow` shadows started by hand without a config: the launcher checks their
    partitions, the job seeds them (they learn its id), and a second launch with --resume
    continues where the first stopped."""
    with serve_shadows(_configless_net(2), config=False) as ips:
        assert launch_main(["launch", "--nproc-per-node", "2", "--shadow", ips[1],
                            "--shadow", ips[0], str(EXAMPLE)]) == 2
        err = capsys.readouterr().err
        assert "serves partition 1/2, shadow number 1 must serve 0/2" in err, err
        base = [sys.executable, "-m", "checkmate.launch.cli", "launch", "--nproc-per-node", "2",
                "--shadow", ips[0], "--shadow", f"{ips[1]}:{cfgmod.RESTORE_PORT}",
                "--progress-every", "4"]
        p = subprocess.run([*base, str(EXAMPLE), "--steps", "8"], capture_output=True,
                           text=True, timeout=300)
        assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
        assert "attempt 0: seeded 2 shadow(s)" in p.stdout, p.stdout
        for p_, ip in enumerate(ips):
            with ShadowClient((ip, cfgmod.RESTORE_PORT)) as c:
                st = c.status()
            assert (st["partition"], st["job"], st["latest"]) == (p_, 1, 8), st
        p = subprocess.run([*base, "--resume", str(EXAMPLE), "--steps", "12"],
                           capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
        assert "attempt 0: resumed from the shadows at iteration 8" in p.stdout, p.stdout
        assert "the shadows hold iteration 12 " in p.stdout, p.stdout


def test_shadow_serve_without_config_learns_the_job_from_the_spec(tmp_path, serve_shadows):
    with serve_shadows(_configless_net(2), config=False) as ips:
        ip = ips[0]
        log = tmp_path / "shadow0.log"
        model = torch.nn.Linear(8, 4)
        from checkmate.optim import SGD

        spec = ModelSpec.from_torch(5, model, SGD(model.parameters(), lr=0.1), 2)
        with ShadowClient((ip, cfgmod.RESTORE_PORT)) as c:
            st = c.status()
            assert (st["partition"], st["partitions"], st["job"], st["seeded"]) == (0, 2, 0,
                                                                                   False)
            c.send_spec(spec)
            assert c.status()["job"] == 5 and c.status()["range"] == list(spec.bounds(0))
            other = ModelSpec.from_torch(6, model, SGD(model.parameters(), lr=0.1), 2)
            from checkmate.errors import CheckmateError

            with pytest.raises(CheckmateError, match="different spec"):
                c.send_spec(other)
        assert "serving udp" in log.read_text()


def test_shadow_serve_without_config_rejects_what_needs_one(capsys):
    from checkmate.shadow.cli import main as shadow_main

    for argv, needle in ((["--host", "s0"], "--host names a host"),
                         (["--controller", "127.0.0.1:47999"], "needs --config"),
                         # a placed (co-located, switch mode) shadow: found by its address
                         (["--placed", "--job", "3"], "--placed needs --controller"),
                         (["--placed", "--controller", "127.0.0.1"], "needs --job"),
                         (["--job", "3"], "--job applies with --placed"),
                         (["--placed", "--controller", "127.0.0.1", "--job", "3",
                           "--no-register"], "not with --config, --host, --no-register"),
                         (["--placed", "--controller", "127.0.0.1", "--job", "3"],
                          "--placed needs --bind IP")):
        assert shadow_main(["serve", "--partition", "0/2", *argv]) == 2
        err = capsys.readouterr().err
        assert needle in err and len(err.strip().splitlines()) == 1, err


def test_each_attempts_store_port_is_picked_below_the_ephemeral_range(tmp_path):
    """torch's agent picks rank 0's store port by binding port 0 and closing it; the worker
    listens seconds later, and any outgoing connection meanwhile can take that ephemeral
    port (EADDRINUSE, seen twice in the suite). The launcher has the agent's rendezvous
    pick below the kernel's ephemeral range instead: checked through torch's own
    RendezvousStoreInfo.build, as the agent calls it."""
    import socket

    from torch.distributed import HashStore
    from torch.distributed.elastic.rendezvous import api

    from checkmate.launch import master_port

    low = master_port.ephemeral_low()
    (tmp_path / "range").write_text("32768\t60999\n")
    assert master_port.ephemeral_low(tmp_path / "range") == 32768
    assert master_port.ephemeral_low(tmp_path / "none") == 32768
    before = api.get_free_port
    try:
        master_port.use()
        ports = {api.RendezvousStoreInfo.build(0, HashStore(), "127.0.0.1").master_port
                 for _ in range(20)}
    finally:
        api.get_free_port = before
    assert all(master_port.BAND[0] <= p < min(master_port.BAND[1], low) for p in ports), ports
    assert len(ports) > 1  # random in the band, not one fixed number
    # a taken port is never picked: with the whole band but one port bound, that one is
    held = []
    try:
        for port in range(master_port.BAND[0], master_port.BAND[0] + 3):
            s = socket.socket()
            s.bind(("", port))
            held.append(s)
        got = {master_port.pick(tries=200, low=master_port.BAND[0] + 4) for _ in range(5)}
        assert got == {master_port.BAND[0] + 3}, got
    finally:
        for s in held:
            s.close()
