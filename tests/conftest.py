"""Fixtures shared by test files: real shadow processes on loopback."""

from __future__ import annotations

import random
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from checkmate import config as cfgmod


@pytest.fixture
def loopback_shadows(tmp_path: Path) -> Iterator[tuple[str, list[str]]]:
    """Two real ``shadow serve`` processes (partitions 0/2 and 1/2) in host mode on a random
    loopback /24 (127.81.x.100 and .101, the default ports); yields ``(net, shadow ips)``.
    Trainers of the test take other addresses of ``net`` (e.g. .10, .11)."""
    net = f"127.81.{random.randrange(1, 255)}"
    ips = [f"{net}.100", f"{net}.101"]
    procs: list[subprocess.Popen] = []
    try:
        for p, ip in enumerate(ips):
            log = open(tmp_path / f"shadow{p}.log", "wb")  # noqa: SIM115
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "checkmate.shadow.cli", "serve", "--partition",
                 f"{p}/2", "--config", str(cfgmod.default_path()), "--bind", ip,
                 "--no-register", "--window", "64"], stdout=log, stderr=log))
            log.close()
        deadline = time.monotonic() + 60
        for p, (ip, proc) in enumerate(zip(ips, procs, strict=True)):
            while True:
                assert proc.poll() is None, (tmp_path / f"shadow{p}.log").read_text()[-2000:]
                try:
                    socket.create_connection((ip, cfgmod.RESTORE_PORT), 0.5).close()
                    break
                except OSError:
                    assert time.monotonic() < deadline, f"shadow {p} did not start"
                    time.sleep(0.2)
        yield net, ips
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
