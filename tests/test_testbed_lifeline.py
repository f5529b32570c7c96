"""A testbed command killed mid-run leaves nothing behind (checkmate.testbed.lifeline).

Real `testbed run` in host mode (loopback, real shadow and trainer processes): once its 2
shadows and 4 trainers run, the command is SIGKILLed (the kernel's parent-death signal must
take every child with it) or SIGTERMed (it must clean up and exit).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pytest
from fakes import alive, children

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_killed_testbed_command_takes_its_children_with_it(tmp_path, sig):
    net = f"127.78.{random.randrange(1, 255)}"
    sc = tmp_path / "long.yaml"
    sc.write_text("name: long\nmodel: gpt\nsteps: 100000\nseed: 1\n")
    log = tmp_path / "out.log"
    tmp = tmp_path / "tmp"  # the command's TMPDIR: its leftovers list lives there
    tmp.mkdir()
    with open(log, "wb") as f:
        cmd = subprocess.Popen(
            [sys.executable, "-m", "checkmate.testbed.cli", "run", "--scenario", str(sc),
             "--mode", "host", "--loopback-net", net, "--workdir", str(tmp_path / "w")],
            stdout=f, stderr=subprocess.STDOUT, env={**os.environ, "TMPDIR": str(tmp)})
    kids: list[int] = []
    try:
        deadline = time.monotonic() + 240
        # 2 shadows and 4 trainers, and the trainers past their start (logs written).
        while len(kids := children(cmd.pid)) < 6 or not list(
                (tmp_path / "w").glob("run-*/failure-free/trainer-t3.log")):
            assert cmd.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        time.sleep(2)
        kids = children(cmd.pid)
        assert len(kids) == 6, kids
        registry = tmp / f"checkmate-run-{net}.json"  # the leftovers list, while it runs
        assert registry.exists(), list(tmp.iterdir())
        cmd.send_signal(sig)
        rc = cmd.wait(120)
        if sig == signal.SIGKILL:
            assert rc == -signal.SIGKILL
        else:
            assert rc == 128 + signal.SIGTERM, (rc, log.read_text()[-3000:])
        t0 = time.monotonic()
        while any(alive(k) for k in kids):
            assert time.monotonic() - t0 < 30, [k for k in kids if alive(k)]
            time.sleep(0.1)
        if sig == signal.SIGTERM:  # its own cleanup ran: the leftovers list is gone
            assert not registry.exists()
            assert "Traceback" not in log.read_text()
    finally:
        if cmd.poll() is None:
            cmd.kill()
            cmd.wait()
        for k in kids:
            if alive(k):
                os.kill(k, signal.SIGKILL)


FORKED_CHILD = """
import os, signal, sys, time
from pathlib import Path
from checkmate.testbed import lifeline
lifeline.exit_on_signals()
marks = Path(sys.argv[1])
try:
    pid = os.fork()  # as pyroute2 forks its netns helpers: no exec, handlers inherited
    if pid == 0:
        time.sleep(30)
        os._exit(0)
    time.sleep(0.3)
    os.kill(pid, signal.SIGTERM)
    _, status = os.waitpid(pid, 0)
    print(os.waitstatus_to_exitcode(status))
finally:
    with marks.open("a") as f:  # the command's cleanup: once, by the command only
        f.write(f"{os.getpid()}\\n")
"""


def test_a_forked_child_that_gets_sigterm_does_not_run_the_commands_cleanup(tmp_path):
    marks = tmp_path / "cleanups"
    p = subprocess.run([sys.executable, "-c", FORKED_CHILD, str(marks)], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == str(128 + signal.SIGTERM)
    # one cleanup, the command's own: the forked child died without unwinding its stack
    assert len(marks.read_text().split()) == 1, marks.read_text()
