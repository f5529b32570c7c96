"""Fixtures shared by test files: real shadow processes on loopback, and one job secret
for the whole session."""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from checkmate.config import cluster as cfgmod
from checkmate.launch.local_shadows import stop_processes
from checkmate.protocol import auth

_SECRET_DIR: str | None = None
_CHILD_TMP: str | None = None


def pytest_configure(config: pytest.Config) -> None:
    """Every process the tests start (shadows, controllers, trainers, the testbed) finds the
    same job secret through the environment, as `checkmate launch` arranges for a job; and a
    temporary directory of the session's own (TMPDIR), removed at its end, so what they
    leave there (a failed launch keeps its logs by design; torch elastic's own directories;
    whatever a SIGKILLed process could not remove) never accumulates in /tmp."""
    global _SECRET_DIR, _CHILD_TMP
    tempfile.gettempdir()  # this process keeps the system's (pytest's tmp_path lives there)
    if not os.environ.get("CKM_TEST_CHILD_TMP"):
        _CHILD_TMP = tempfile.mkdtemp(prefix="ckm-test-tmp-")
        os.environ["TMPDIR"] = os.environ["CKM_TEST_CHILD_TMP"] = _CHILD_TMP
    if os.environ.get(auth.SECRET_ENV):
        return
    _SECRET_DIR = tempfile.mkdtemp(prefix="ckm-test-secret-")
    os.environ[auth.SECRET_ENV] = str(auth.create_secret(Path(_SECRET_DIR) / "job.key"))


#: Test files whose scenarios race wall-clock deadlines (a repair given up after seconds, a
#: live re-seed that must finish before the run ends): scripts/test.sh runs them alone,
#: after the rest has run two files at a time, so that their timing is what one job on
#: the machine sees.
SERIAL_FILES = ("test_e2e_host.py", "test_e2e_switch.py", "test_mesh_switch.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.name in SERIAL_FILES:
            item.add_marker(pytest.mark.serial)


def pytest_unconfigure(config: pytest.Config) -> None:
    for d in (_SECRET_DIR, _CHILD_TMP):
        if d is not None:
            shutil.rmtree(d, ignore_errors=True)


@contextlib.contextmanager
def _serve_shadows(tmp_path: Path, ips: list[str], *extra: str,
                   config: bool = True) -> Iterator[list[str]]:
    """Real ``shadow serve --partition p/len(ips) --bind ips[p]`` processes in host mode
    (default ports; with the default config and no registration, or with no config at
    all), up and answering on TCP; terminated by PID at exit. Logs: tmp_path/shadow<p>.log.
    """
    procs: list[subprocess.Popen] = []
    cfg = (["--config", str(cfgmod.default_path()), "--no-register", "--window", "64"]
           if config else [])
    try:
        for p, ip in enumerate(ips):
            with open(tmp_path / f"shadow{p}.log", "wb") as log:
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "checkmate.shadow.cli", "serve", "--partition",
                     f"{p}/{len(ips)}", "--bind", ip, *cfg, *extra], stdout=log, stderr=log))
        deadline = time.monotonic() + 60
        for p, (ip, proc) in enumerate(zip(ips, procs, strict=True)):
            log_path = tmp_path / f"shadow{p}.log"
            while True:
                assert proc.poll() is None, log_path.read_text()[-2000:]
                try:
                    socket.create_connection((ip, cfgmod.RESTORE_PORT), 0.5).close()
                    break
                except OSError:
                    assert time.monotonic() < deadline, (f"shadow {p} did not start: "
                                                         + log_path.read_text()[-2000:])
                    time.sleep(0.2)
        yield ips
    finally:
        stop_processes(procs)


@pytest.fixture
def serve_shadows(tmp_path: Path):
    """``with serve_shadows(ips, *extra_args, config=True) as ips:`` -- real shadow
    processes for the addresses given (see _serve_shadows)."""
    return functools.partial(_serve_shadows, tmp_path)


def worker_octet() -> int:
    """A random address octet (1-254) that no other pytest-xdist worker of this run draws:
    tests of several files share 127.81.x, and two workers' shadows on one address would
    take each other's trainers (one job's spec refused by the other's shadow)."""
    n = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    k = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:] or 0)
    return random.choice([o for o in range(1, 255) if o % n == k % n])


@pytest.fixture
def loopback_shadows(tmp_path: Path) -> Iterator[tuple[str, list[str]]]:
    """Two real ``shadow serve`` processes (partitions 0/2 and 1/2) in host mode on a random
    loopback /24 (127.81.x.100 and .101, the default ports); yields ``(net, shadow ips)``.
    Trainers of the test take other addresses of ``net`` (e.g. .10, .11)."""
    net = f"127.81.{worker_octet()}"
    with _serve_shadows(tmp_path, [f"{net}.100", f"{net}.101"]) as ips:
        yield net, ips


# ----- ring allreduce on loopback -------------------------------------------------------
_ring_net = itertools.count(1)
# A random second octet per run, so two suite runs on one machine never share addresses.
_RING_OCTET = random.randrange(100, 200)


class RingKit:
    """Builds rings of RingAllreduce over real UDP sockets on loopback (127.R.x.y).

    Loss and corruption come from ``LossyLink``, a test double of a lossy network applied to
    outgoing datagrams (loopback has no switch).
    """

    @staticmethod
    def make(world: int, total: int, partitions: int = 2, chunk: int = 512,
             link: float = 0.0, corrupt: float = 0.0, on_reduced=None, nonce: int = 99,
             node_of: list[int] | None = None):
        """``node_of``: each rank's node; the ranks of a node share its address (ports
        47000, 47001, ...), as a node's ranks do, and the ring follows the schedule."""
        from checkmate.train.ring import RingAllreduce
        from checkmate.train.ring_schedule import RingSchedule
        from checkmate.train.transport import LossyLink, open_socket

        net = f"127.{_RING_OCTET}.{next(_ring_net)}"
        nodes = list(range(world)) if node_of is None else node_of
        seen: dict[int, int] = {}
        addrs = []
        for nd in nodes:
            seen[nd] = seen.get(nd, -1) + 1
            addrs.append((f"{net}.{10 + nd}", 47000 + seen[nd]))
        sched = RingSchedule.build(world, node_of)
        socks = [open_socket(*a) for a in addrs]
        rings = []
        for r in range(world):
            lk = LossyLink(link, corrupt, seed=r) if (link or corrupt) else None
            cb = (lambda *a, r=r: on_reduced(r, *a)) if on_reduced else None
            rings.append(RingAllreduce(r, world, socks[r], addrs[sched.right(r)],
                                       addrs[sched.left(r)], 7, nonce, total, partitions,
                                       chunk=chunk, link=lk, rto=0.03, on_reduced=cb,
                                       stall_timeout=20, node_of=node_of))
        return rings

    @staticmethod
    def close_all(rings) -> None:
        for r in rings:
            r.close(timeout=1.0)


@pytest.fixture
def ring_kit() -> RingKit:
    return RingKit()


@contextlib.contextmanager
def _testbed(prefix: str) -> Iterator[object]:
    """The default cluster as a namespace testbed under ``prefix`` (no controller), torn
    down even if the test fails."""
    from checkmate.testbed.topology import Testbed

    bed = Testbed(cfgmod.with_prefix(cfgmod.load(cfgmod.default_path()), prefix))
    try:
        bed.up()
        yield bed
    finally:
        bed.down()


# ----- the NCCL net plugin -------------------------------------------------------------
NCCL_PLUGIN = Path(__file__).resolve().parents[1] / "build" / "nccl" / "libnccl-net-ckm.so"


@pytest.fixture(scope="session")
def nccl_plugin() -> Path:
    """The plugin as `make setup` builds it (gcc -Wall -Wextra -Werror; rebuilt if stale)."""
    p = subprocess.run(["make", "-s", "-C", str(NCCL_PLUGIN.parents[2] / "nccl_plugin"),
                        f"OUT={NCCL_PLUGIN.parent}"], capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr
    return NCCL_PLUGIN


@pytest.fixture(scope="session")
def testbed_of():
    """``with testbed_of("ta") as tb:`` -- a module's own testbed (needs root)."""
    return _testbed


@pytest.fixture
def switch():
    """The P4Runtime switch double (fakes.FakeSwitch) with the compiled v1model program loaded
    (handshake and attempt tests)."""
    from fakes import FakeSwitch, compiled_p4info

    sw = FakeSwitch(compiled_p4info("v1model"))
    try:
        yield sw
    finally:
        sw.stop()


@pytest.fixture
def service(tmp_path: Path, switch):
    """A controller's handshake service on loopback over the P4Runtime switch double, serving
    in a thread (shadow registration tests)."""
    from handshake_service import make_service

    svc = make_service(switch, tmp_path / "state.json")
    svc.deploy()
    svc.bind()
    t = threading.Thread(target=svc.serve_forever, daemon=True)
    t.start()
    try:
        yield svc
    finally:
        svc.stop_event.set()
        t.join(5)
        svc.driver.close()  # the switch fixture stops the double
