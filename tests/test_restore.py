"""Restore: from shadow memory, from disk after a shadow restart, and the `shadow` CLI."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from shadow_cluster import JOB, LRS, Cluster, assert_state, make_spec, run_iterations

from checkmate.shadow.cli import main as shadow_main
from checkmate.train.shadow_client import ShadowClient, restore_state_dicts

CONFIG = f"""\
job: {{id: {JOB}, name: td}}
switch: {{name: sw0, target: kernel}}
network: {{subnet: 10.77.0.0/24, prefix: td}}
hosts:
  - {{name: t0, role: trainer, rank: 0, ip: 10.77.0.10}}
  - {{name: s0, role: shadow, partition: 0, ip: 10.77.0.100}}
  - {{name: s1, role: shadow, partition: 1, ip: 10.77.0.101}}
"""


@pytest.fixture
def cfg(tmp_path):
    p = tmp_path / "cluster.yaml"
    p.write_text(CONFIG)
    return p


def test_restart_serves_from_disk_and_continues(tmp_path):
    spec = make_spec()
    c = Cluster(spec, dir=str(tmp_path), persist_every=2)
    try:
        c.seed()
        grads = run_iterations(c, range(1, 6))
        c.wait(lambda sts: all(s["latest"] == 5 and s["persist"]["last_iteration"] == 4
                               for s in sts))
        model_sd, optim_sd, it, _, extra = restore_state_dicts(c.addrs)
        assert it == 5 and extra == {"it": 5}
        assert_state(spec, model_sd, optim_sd, c.refs[5], 5)
    finally:
        for n in c.nodes:
            n.stop()
    refs = c.refs
    # fresh shadows on the same directory: they load iteration 4 and serve it
    c2 = Cluster(spec, dir=str(tmp_path), persist_every=2)
    try:
        sts = [ShadowClient(a).status() for a in c2.addrs]
        assert all(s["seeded"] and s["latest"] == 4 and s["retained"] == [4] for s in sts)
        assert all(s["restored_from"] for s in sts)
        model_sd, optim_sd, it, _, extra = restore_state_dicts(c2.addrs)
        assert it == 4 and extra == {"it": 4}
        assert_state(spec, model_sd, optim_sd, refs[4], 4)
        # trainers restored at 4 replay iteration 5: the shadows step on from disk state
        c2.ref.load(refs[4], 4)
        run_iterations(c2, [5], grads)
        c2.wait(lambda sts: all(s["latest"] == 5 for s in sts))
        model_sd, optim_sd, it, _, _ = restore_state_dicts(c2.addrs)
        assert_state(spec, model_sd, optim_sd, c2.refs[5], 5)
        np.testing.assert_array_equal(c2.refs[5]["param"], refs[5]["param"])
    finally:
        c2.close()


def test_cli_restore_from_shadows_and_from_disk(tmp_path, cfg, capsys):
    spec = make_spec()
    c = Cluster(spec, dir=str(tmp_path / "ck"), persist_every=3)
    try:
        c.seed()
        run_iterations(c, range(1, 5))
        c.wait(lambda sts: all(s["latest"] == 4 and s["persist"]["last_iteration"] == 3
                               for s in sts))
        addr_args = [x for a in c.addrs for x in ("--addr", f"{a[0]}:{a[1]}")]
        out = tmp_path / "state.pt"
        assert shadow_main(["restore", "--config", str(cfg), *addr_args,
                            "--out", str(out)]) == 0
        assert "consistent point: iteration 4" in capsys.readouterr().out
        st = torch.load(out)
        assert st["iteration"] == 4 and st["extra"] == {"it": 4}
        assert_state(spec, st["model"], st["optim"], c.refs[4], 4)
        assert [g["lr"] for g in st["optim"]["param_groups"]] == LRS
    finally:
        c.close()
    out2 = tmp_path / "disk.pt"
    assert shadow_main(["restore", "--config", str(cfg), "--from-disk", str(tmp_path / "ck"),
                        "--out", str(out2)]) == 0
    assert "consistent point: iteration 3" in capsys.readouterr().out
    st = torch.load(out2)
    assert_state(spec, st["model"], st["optim"], c.refs[3], 3)


@pytest.mark.parametrize("args, msg", [
    (["serve", "--config", "CFG"], "required: --partition"),
    (["serve", "--partition", "2/2", "--config", "CFG"], "out of range"),
    (["serve", "--partition", "x", "--config", "CFG"], "INDEX/COUNT"),
    (["serve", "--partition", "0/3", "--config", "CFG"], "config has 2 shadows"),
    (["serve", "--partition", "0/2", "--config", "/nonexistent.yaml"], "cannot read config"),
    (["serve", "--partition", "0/2", "--config", "CFG", "--bind", "1.2.3"], "IPv4"),
    (["serve", "--partition", "0/2", "--config", "CFG", "--persist-every", "-1"],
     "non-negative integer"),
    (["serve", "--partition", "0/2", "--config", "CFG", "--persist-seconds", "soon"],
     "number"),
    (["serve", "--partition", "0/2", "--config", "CFG", "--persist-every", "5",
      "--persist-seconds", "2"], "only without --persist-every"),
    (["serve", "--partition", "1/2", "--config", "CFG", "--host", "s0"],
     "not the shadow of partition 1"),
    (["serve", "--partition", "0/2", "--config", "CFG", "--host", "nope"], "no host named"),
    (["serve", "--partition", "0/2", "--config", "CFG", "--epoch", "3"], "--no-register"),
    (["restore", "--config", "CFG", "--from-disk", "/nonexistent-td"], "no checkpoint"),
    (["restore", "--config", "CFG", "--addr", "127.0.0.1:1"], "shadow 127.0.0.1:1"),
    (["restore", "--config", "CFG", "--addr", "host:port"], "bad shadow address"),
    (["frobnicate"], "invalid choice"),
])
def test_cli_bad_input_is_one_line(args, msg, cfg, capsys):
    args = [str(cfg) if a == "CFG" else a for a in args]
    assert shadow_main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("shadow: error: "), err
    assert msg in err[0], err


def test_cli_serve_process_seeds_steps_and_stops_on_sigterm(tmp_path, cfg):
    proc = subprocess.Popen(
        [sys.executable, "-m", "checkmate.shadow.cli", "serve", "--partition", "0/2",
         "--config", str(cfg), "--no-register", "--bind", "127.0.0.1", "--port", "0",
         "--restore-port", "0", "--dir", str(tmp_path), "--persist-every", "1",
         "--epoch", "9", "--token", "3"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        assert ready, "shadow serve printed no ready line"
        line = proc.stdout.readline()
        assert line.startswith("shadow: partition 0/2 serving"), line
        udp = int(line.split("udp ")[1].split()[0].rsplit(":", 1)[1])
        tcp = int(line.split("tcp ")[1].split()[0].rsplit(":", 1)[1])
        spec = make_spec()
        a, b = spec.bounds(0)
        with ShadowClient(("127.0.0.1", tcp)) as cl:
            cl.send_spec(spec)
            cl.seed(0, "param", a, np.ones(b - a, np.float32), 0)
            for s in spec.slots[1:]:
                cl.seed(0, s, a, np.zeros(b - a, np.float32), 0)
            import socket

            from checkmate.shadow.feed import control_body, send_iteration

            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as tx:
                send_iteration(tx, ("127.0.0.1", udp), JOB, 1, 0, a,
                               np.full(b - a, 0.5, np.float32), control_body(1, LRS),
                               epoch=9, token=3)
            end = time.monotonic() + 20
            while cl.status()["latest"] != 1 and time.monotonic() < end:
                time.sleep(0.05)
            st = cl.status()
            assert st["latest"] == 1 and st["epoch"] == 9, st
            f = cl.fetch(1)
            assert f.step == 1 and not np.array_equal(f.slots["param"], np.ones(b - a))
        end = time.monotonic() + 20
        while not (Path(tmp_path) / "part0" / "iter-000000000001").exists():
            assert time.monotonic() < end, "iteration 1 was not persisted"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert "Traceback" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
