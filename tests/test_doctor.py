"""`checkmate doctor` and the launcher's rendezvous-host check (issue 36, items 4 and 5).

Every check's pass and fail path on real parts: real shadows on loopback and a real
controller handshake service (over the P4Runtime switch double), a secret file with the
wrong mode, Numba's cache in a fresh folder, the built NCCL plugin and a library that is
not one, real sockets and routes; the hostname rule both as a pure function and, in a
network and UTS namespace whose hostname resolves to loopback, as the launcher stopping
before the rendezvous with the one line that says what to pass.
"""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from checkmate.errors import CheckmateError
from checkmate.launch import cli, doctor, hostcheck
from checkmate.launch import doctor_net as net
from checkmate.launch import doctor_node as node
from checkmate.launch.doctor import FAIL, PASS, WARN
from checkmate.protocol import auth

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train.py"
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root for namespaces")


def _facts(addrs: tuple[str, ...] = ("127.0.1.1",), local: bool = True,
           torch_hosts: bool = False) -> hostcheck.HostFacts:
    return hostcheck.HostFacts("node1", addrs, local, torch_hosts)


# ----- item 5: the rule -------------------------------------------------------------------
def test_a_debian_node_holding_the_endpoint_is_told_every_flag_it_lacks():
    found = hostcheck.problems(_facts(), "10.0.0.10", 2, "c10d", None, {}, None, None)
    assert len(found) == 2, found
    assert "pass --rdzv-conf is_host=1 on this node" in found[0]
    assert "hostname node1 resolves to loopback (127.0.1.1)" in found[1]
    assert "--local-addr THIS_NODE_IP and GLOO_SOCKET_IFNAME=IFACE" in found[1]


def test_the_flags_the_testbed_passes_satisfy_the_rule():
    assert hostcheck.problems(_facts(), "10.0.0.10", 2, "c10d", "10.0.0.10",
                              {"is_host": "1"}, "eth0") == []
    assert hostcheck.problems(_facts(local=False), "10.0.0.10", 2, "c10d", "10.0.0.11",
                              {"is_host": "0"}, "eth0") == []


def test_is_host_on_a_node_without_the_endpoint_is_refused():
    found = hostcheck.problems(_facts(("10.0.0.11",), local=False), "10.0.0.10", 2, "c10d",
                               None, {"is_host": "true"}, None)
    assert found == ["--rdzv-conf is_host=1 but 10.0.0.10 is not an address of this "
                     "machine: only the node that holds it hosts the store; drop it here"]


@pytest.mark.parametrize("endpoint,nodes,backend,addrs,local,torch_hosts", [
    ("127.0.0.1", 2, "c10d", ("127.0.1.1",), True, True),    # nodes on one machine
    ("localhost", 3, "c10d", (), True, True),
    ("10.0.0.10", 2, "static", ("127.0.1.1",), True, False),  # static: node rank 0 hosts
    ("10.0.0.10", 2, "c10d", ("10.0.0.10",), True, True),     # a hostname that resolves
    ("10.0.0.10", 1, "c10d", ("127.0.1.1",), False, False),   # one node, a remote store
])
def test_no_problem_where_torch_finds_the_node(endpoint, nodes, backend, addrs, local,
                                               torch_hosts):
    assert hostcheck.problems(_facts(addrs, local, torch_hosts), endpoint, nodes, backend,
                              None, {}, None) == []


def test_an_unresolvable_hostname_is_loopback_to_gloo():
    found = hostcheck.problems(_facts((), local=False), "10.0.0.10", 2, "c10d", None, {},
                               None, None)
    assert len(found) == 1 and "resolves to loopback (nothing)" in found[0]


def test_a_colocated_switch_node_that_would_drop_its_own_copies_is_told_the_sysctl(tmp_path):
    """Co-located shadows in switch mode: the copies of what a node sends come back with
    its own source address; with the interface's accept_local off the kernel drops them.
    The setting is read from a copy of /proc's tree (the launcher changes nothing)."""
    (tmp_path / "lo").mkdir()
    setting = tmp_path / "lo" / "accept_local"
    setting.write_text("0\n")
    with pytest.raises(CheckmateError, match=r"sysctl -w net\.ipv4\.conf\.lo\.accept_local"
                       r"=1` on n1$"):
        hostcheck.refuse_dropped_copies("n1", "127.0.0.1", tmp_path)
    setting.write_text("1\n")
    hostcheck.refuse_dropped_copies("n1", "127.0.0.1", tmp_path)
    hostcheck.refuse_dropped_copies("n1", "192.0.2.1", tmp_path)  # on no interface here


def test_gather_reads_this_machine():
    here = hostcheck.gather("127.0.0.1")
    assert here.endpoint_local and here.torch_hosts and here.hostname == socket.gethostname()
    away = hostcheck.gather("192.0.2.1")  # TEST-NET-1: on no machine
    assert not away.endpoint_local and not away.torch_hosts
    assert hostcheck.interface_of("127.0.0.1") == "lo"
    assert hostcheck.interface_of("192.0.2.1") is None


# ----- item 5: the launcher in a namespace ---------------------------------------------
@pytest.fixture
def node_ns():
    """A network namespace with 10.213.X.1/24 on a veth (MTU 1500), as a cluster node's
    NIC; yields (namespace, ip, interface)."""
    ns, x = f"ckdoc{os.getpid() % 100000}", random.randrange(1, 250)
    ip = f"10.213.{x}.1"
    subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    try:
        for cmd in (["netns", "add", ns],
                    ["-n", ns, "link", "add", "ckd0", "type", "veth", "peer", "name", "ckd1"],
                    ["-n", ns, "addr", "add", f"{ip}/24", "dev", "ckd0"],
                    ["-n", ns, "link", "set", "ckd0", "mtu", "1500", "up"],
                    ["-n", ns, "link", "set", "ckd1", "up"],
                    ["-n", ns, "link", "set", "lo", "up"]):
            subprocess.run(["ip", *cmd], check=True, capture_output=True)
        yield ns, ip, "ckd0"
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _in_node(ns: str, argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    """``argv`` inside ``ns`` with hostname ``localhost`` (a UTS namespace of its own): the
    hostname resolves to loopback only, as Debian's 127.0.1.1 entry makes it."""
    cmd = "hostname localhost && exec " + " ".join(f"'{a}'" for a in argv)
    return subprocess.run(["ip", "netns", "exec", ns, "unshare", "--uts", "sh", "-c", cmd],
                          capture_output=True, text=True, timeout=180, env=env)


@as_root
@pytest.mark.netns
def test_launch_stops_before_the_rendezvous_and_says_what_to_pass(node_ns):
    ns, ip, dev = node_ns
    env = {k: v for k, v in os.environ.items() if k != "GLOO_SOCKET_IFNAME"}
    launch = [sys.executable, "-m", "checkmate.launch.cli", "launch", "--nnodes", "2",
              "--nproc-per-node", "1", "--rdzv-endpoint", f"{ip}:29411", "--rdzv-id", "doc",
              "--worker-ip", ip, "--mode", "off"]
    t0 = time.monotonic()
    p = _in_node(ns, [*launch, str(EXAMPLE)], env)
    took = time.monotonic() - t0
    assert p.returncode == 2, p.stdout + p.stderr
    assert p.stderr.strip().splitlines() == [p.stderr.strip()], p.stderr  # one line
    assert f"this machine holds the rendezvous endpoint {ip}" in p.stderr
    assert "pass --rdzv-conf is_host=1 on this node" in p.stderr
    assert f"pass --local-addr {ip} and GLOO_SOCKET_IFNAME={dev} in the environment" \
        in p.stderr
    assert "trainer(s) on" not in p.stdout and took < 60  # no agent, no rendezvous
    # what the line says to pass is enough: torch hosts the store here, the rendezvous runs
    # (and, the other node never coming, times out as one line)
    p = _in_node(ns, [*launch, "--local-addr", ip, "--rdzv-conf", "is_host=1,join_timeout=2",
                      str(EXAMPLE)], {**env, "GLOO_SOCKET_IFNAME": dev})
    assert p.returncode == 2, p.stdout + p.stderr
    assert "did not complete in time: fewer than 2 node(s) joined" in p.stderr, p.stderr
    assert "trainer(s) on" in p.stdout


@as_root
@pytest.mark.netns
def test_doctor_hostname_and_mtu_checks_in_a_node(node_ns):
    ns, ip, dev = node_ns
    code = ("from checkmate.launch import doctor_net as n; "
            f'print(n.check_hostname("{ip}:29400", 2, "c10d", None, "", "{ip}").line()); '
            f'print(n.check_mtu(["{ip[:-1]}2"])[0].line())')
    p = _in_node(ns, [sys.executable, "-c", code],
                 {k: v for k, v in os.environ.items() if k != "GLOO_SOCKET_IFNAME"})
    host, mtu = p.stdout.strip().splitlines() or [p.stderr, ""]
    assert host.startswith("FAIL rendezvous host: ") and "is_host=1" in host, p.stdout
    assert mtu.startswith(f"WARN MTU to {ip[:-1]}2: 1500 on {dev}, below"), p.stdout


def test_launch_on_this_machine_refuses_a_loopback_hostname_without_local_addr(capsys,
                                                                            monkeypatch):
    """Here the hostname resolves to 127.0.0.1 (as on Debian): a remote rendezvous endpoint
    without --local-addr is one line naming it, before anything is started."""
    if not hostcheck.is_loopback((hostcheck.resolve(socket.gethostname()) or ("127.0.0.1",))[0]):
        pytest.skip("this machine's hostname resolves to a routable address")
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    rc = cli.main(["launch", "--nproc-per-node", "1", "--nnodes", "2", "--rdzv-endpoint",
                   "192.0.2.1:29400", "--worker-ip", "192.0.2.5", "--shadow", "127.0.0.1",
                   str(EXAMPLE)])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert "pass --local-addr 192.0.2.5 and GLOO_SOCKET_IFNAME=IFACE" in err


# ----- item 4: each check ------------------------------------------------------------------
def test_versions_against_the_requirements():
    got = {c.name: c for c in node.check_versions()}
    assert got["torch"].status == PASS and got["numba"].status == PASS, got
    bad = {c.name: c for c in node.check_versions({"torch": "<1.0", "numba": ">=0.60"})}
    assert bad["torch"].status == FAIL and "pip install 'torch<1.0'" in bad["torch"].detail
    assert bad["numba"].status == PASS
    import torch

    if torch.version.cuda is None:
        assert got["CUDA"].status == WARN and "CPU build" in got["CUDA"].detail


def test_secret_pass_wrong_mode_missing_and_unset(tmp_path, monkeypatch):
    good = auth.create_secret(tmp_path / "job.key")
    assert node.check_secret(str(good)).status == PASS
    bad = tmp_path / "open.key"
    bad.write_text(good.read_text())
    bad.chmod(0o644)
    c = node.check_secret(str(bad))
    assert c.status == FAIL and "readable by others (mode 644): chmod 600 it" in c.detail
    c = node.check_secret(str(tmp_path / "none.key"))
    assert c.status == FAIL and "No such file" in c.detail
    monkeypatch.delenv(auth.SECRET_ENV)
    assert node.check_secret().status == WARN


def test_kernels_that_do_not_build_fail():
    """Without Numba's compiler the shadow's kernels cannot be built: FAIL, not a pass."""
    c = node.check_kernels({**os.environ, "NUMBA_DISABLE_JIT": "1"})
    assert c.status == FAIL and "the kernels do not build" in c.detail, c


def test_optimizer_matches_the_shadow_kernels_or_fails_in_one_line():
    ok = node.check_optimizer("cpu")
    assert ok.status == PASS and "bit-identical" in ok.detail, ok
    bad = node.check_optimizer("nodevice")
    assert bad.status == FAIL and "AdamW could not run" in bad.detail
    assert "\n" not in bad.line()


def test_nccl_plugin_loads_or_says_why(tmp_path):
    if not node.PLUGIN.is_file():
        pytest.skip("make nccl has not built the plugin")
    got = node.check_nccl_plugin(node.PLUGIN, (2, 29, 7))
    assert [c.status for c in got] == [PASS, PASS], got
    assert "ncclNetPlugin_v12" in got[0].detail and "NCCL 2.29.7" in got[1].detail
    old = node.check_nccl_plugin(node.PLUGIN, (2, 27, 7))
    assert old[1].status == FAIL and "2.28.3-2.28.9, 2.29.2-2.30.7" in old[1].detail
    assert node.check_nccl_plugin(tmp_path / "none.so")[0].status == FAIL
    junk = tmp_path / "junk.so"
    junk.write_bytes(b"not an ELF file")
    c = node.check_nccl_plugin(junk)
    assert c[0].status == FAIL and "does not load" in c[0].detail
    standin = node.PLUGIN.with_name("libnccl-standin.so")  # a real library, no plugin symbols
    if standin.is_file():
        c = node.check_nccl_plugin(standin)
        assert c[0].status == FAIL and "lacks ncclNetPlugin_v10" in c[0].detail
    if node.nccl_version() is None:  # CPU: no NCCL to ask
        assert node.check_nccl_plugin(node.PLUGIN)[1].status == WARN


def test_shadows_reachable_authenticated_in_order(serve_shadows, tmp_path, monkeypatch):
    net24 = f"127.83.{random.randrange(1, 255)}"
    ips = [f"{net24}.100", f"{net24}.101"]
    with serve_shadows(ips):
        addrs = [(ip, 47100) for ip in ips]
        assert [c.status for c in net.check_shadows(addrs)] == [PASS, PASS]
        swapped = net.check_shadows(addrs[::-1])
        assert swapped[0].status == FAIL and "give --shadow in partition order" in \
            swapped[0].detail
        # a controller whose config cuts them into 2 groups: each group's one shadow is 0/1
        cut = net.check_shadows(addrs, groups=2)
        assert [c.status for c in cut] == [FAIL, FAIL]
        assert "must serve 0/1 of group 1" in cut[1].detail, cut[1]
        monkeypatch.setenv(auth.SECRET_ENV, str(auth.create_secret(tmp_path / "other.key")))
        wrong = net.check_shadows(addrs)
        assert [c.status for c in wrong] == [FAIL, FAIL]
        assert "same CHECKMATE_SECRET_FILE" in wrong[0].detail, wrong[0]
    gone = net.check_shadows([(ips[0], 47100)], timeout=2)
    assert gone[0].status == FAIL and "not reachable" in gone[0].detail


def test_controller_answers_with_its_shadows_or_fails(service, tmp_path, monkeypatch):
    from handshake_service import reg_body, req

    addr = service.sock.getsockname()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.sendto(req(7, 51, reg_body(1, "s1"), 1), addr)
        time.sleep(0.5)
        half, found, _ = net.check_controller(addr, 7)
        assert half.status == WARN and "partition(s) [0]" in half.detail and found == []
        s.sendto(req(7, 52, reg_body(0, "s0"), 0), addr)
        time.sleep(0.5)
    full, found, groups = net.check_controller(addr, 7)
    assert full.status == PASS and found == [("10.77.0.100", 47100), ("10.77.0.101", 47100)]
    assert groups == 1  # the default config's job is one data-parallel group
    monkeypatch.setenv(auth.SECRET_ENV, str(auth.create_secret(tmp_path / "other.key")))
    refused, _, _ = net.check_controller(addr, 7, timeout=1.0)
    assert refused.status == FAIL and "not authenticated" in refused.detail, refused
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as quiet:  # bound, never answers
        quiet.bind(("127.0.0.1", 0))
        silent, _, _ = net.check_controller(quiet.getsockname(), 7, timeout=1.0)
    assert silent.status == FAIL and "did not answer" in silent.detail, silent


def test_socket_buffers():
    assert net.check_buffers(1 << 20).status == PASS
    c = net.check_buffers(2**31 - 1)  # beyond what the kernel grants anyone
    assert c.status == WARN and "sysctl -w net.core.rmem_max=" in c.detail


def test_mtu_on_the_route_to_a_shadow():
    assert net.check_mtu(["127.0.0.1"])[0].line().startswith("PASS MTU to 127.0.0.1: 65536 "
                                                             "on lo")
    assert net.check_mtu(["127.0.0.1"], need=70000)[0].status == WARN
    assert net.check_mtu(["no-such-host.invalid"])[0].status == FAIL


def test_hostname_check_with_and_without_the_job_flags(monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    assert net.check_hostname("127.0.0.1:29400", 2, "c10d", None, "", None).status == PASS
    assert net.check_hostname("192.0.2.1", 2, "c10d", "192.0.2.5", "is_host=1", None
                              ).status == FAIL  # is_host where the endpoint is not
    plain = net.check_hostname(None, 2, "c10d", None, "", None)
    loop = hostcheck.is_loopback((hostcheck.resolve(socket.gethostname()) or ("::1",))[0])
    assert plain.status == (WARN if loop else PASS), plain


# ----- item 4: the command -----------------------------------------------------------------
@pytest.mark.slow
def test_doctor_command_exit_status(serve_shadows, capsys):
    ip = f"127.84.{random.randrange(1, 255)}.100"
    with serve_shadows([ip], config=False):
        assert cli.main(["doctor", "--device", "cpu", "--shadow", ip]) == 0
        out = capsys.readouterr().out
        assert f"PASS shadow {ip}:47100: answers, authenticated" in out
        assert "PASS optimizer on cpu" in out and "0 failed" in out.splitlines()[-1]
        lines = out.strip().splitlines()
        assert all(ln.split(" ", 1)[0] in (PASS, WARN, FAIL) for ln in lines[:-1]), out
    assert doctor.main(["--device", "cpu", "--shadow", ip]) == 1  # the shadow is gone
    out = capsys.readouterr().out
    assert f"FAIL shadow {ip}:47100: not reachable" in out and "1 failed" in out
    assert cli.main(["doctor", "--nnodes", "x"]) == 2
