"""``checkmate launch --controller`` starts only with a shadow for every partition.

Shadows started beside the launcher register within seconds (tens under load); a launcher
that asked the controller before the last one registered used to take the partial answer
(the chaos suite's `multinode-kill-node` then failed: "--shadow number 1 must serve 0/1").
Here a real handshake service (control/service.py, conftest's ``service``) programs the
P4Runtime test double of tests/fakes.py; requests are real authenticated datagrams over
loopback.
"""

from __future__ import annotations

import argparse
import socket
import threading

import pytest
from handshake_service import reg_body, req

from checkmate.errors import CheckmateError
from checkmate.launch.launcher import shadows_from_controller


def _register_later(addr: tuple[str, int], partition: int, delay: float) -> threading.Timer:
    def send() -> None:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.sendto(req(7, 50 + partition, reg_body(partition, f"s{partition}"), partition),
                     addr)
    t = threading.Timer(delay, send)
    t.start()
    return t


def _args(svc) -> argparse.Namespace:  # noqa: ANN001
    host, port = svc.sock.getsockname()
    return argparse.Namespace(controller=f"{host}:{port}")


def test_launcher_waits_for_the_last_shadow_to_register(service, capsys):
    addr = service.sock.getsockname()
    _register_later(addr, 0, 0.0).join()
    late = _register_later(addr, 1, 1.5)
    tcp, udp = shadows_from_controller(_args(service), 7, wait=20)
    late.join()
    assert [h for h, _ in tcp] == ["10.77.0.100", "10.77.0.101"]
    assert [p for _, p in udp] == [47001, 47001]
    assert "waiting up to 20s for the controller to register shadows for partition(s) [1]" \
        in capsys.readouterr().out


def test_launcher_names_the_partitions_still_missing(service):
    _register_later(service.sock.getsockname(), 1, 0.0).join()
    with pytest.raises(CheckmateError, match=r"partitions \[1\] of job 7; its config has 2 "
                                             r"partition\(s\)"):
        shadows_from_controller(_args(service), 7, wait=1.5)


def test_the_session_answer_says_how_many_partitions_the_config_has(service):
    """query_registrations (the launcher's and the trainers' view) reads ``expected`` from the
    controller's config, not from how many shadows happen to be registered."""
    from checkmate.train.layout import query_registrations, query_sessions

    addr = service.sock.getsockname()
    _register_later(addr, 1, 0.0).join()
    regs, expected, groups = query_registrations(addr, 7, timeout=2.0, tries=2)
    assert expected == 2 and sorted(regs) == [1] and groups == 1
    assert query_sessions(addr, 7, timeout=2.0, tries=2) == regs


def test_a_launch_with_other_groups_than_the_controllers_config_is_one_line(service):
    """``--pp``/``--tp`` in switch mode: the controller's config must cut its shadows into
    as many data-parallel groups (job.groups); the default config has one."""
    addr = service.sock.getsockname()
    for p in (0, 1):
        _register_later(addr, p, 0.0).join()
    args = _args(service)
    args.pp, args.tp = 2, 1
    tcp, _ = shadows_from_controller(args, 7, wait=5, groups=1)  # the same: nothing said
    assert len(tcp) == 2
    with pytest.raises(CheckmateError, match=r"^the controller's config has 1 data-parallel "
                       r"group\(s\) \(job.groups\), this launch 2 \(--pp 2 --tp 1\): set "
                       r"job.groups to 2 and give each group its shadows$"):
        shadows_from_controller(args, 7, wait=5, groups=2)
