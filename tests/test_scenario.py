"""Scenario files: every key parsed, every mistake one clear error naming what is wrong."""

from __future__ import annotations

import random

import pytest

from checkmate.errors import CheckmateError
from checkmate.testbed.scenario import (
    Attack,
    Fault,
    ShadowKill,
    load_scenario,
    parse_scenario,
    scenario_names,
)


def test_shipped_scenarios_parse():
    names = scenario_names()
    assert {"replica-loss", "shadow-restart", "kill-restore"} <= set(names)
    for n in names:
        sc = load_scenario(n, random.Random(0))
        assert sc.name == n and sc.steps >= 2
    assert load_scenario("gockpt-kill-restore").gockpt == (5, 3)
    rl = load_scenario("replica-loss")
    assert rl.faults == [Fault("s1", 0.05, 0.0, 0, 0)] and rl.kill_at == 30 and rl.chaos


def test_full_scenario():
    sc = parse_scenario({
        "name": "x", "steps": 50, "kill_at": 40,
        "faults": [{"port": "s0", "drop": 0.1, "corrupt": 0.01, "from": 5, "until": 9}],
        "shadow_kills": [{"partition": 1, "at": 7, "disk": True, "restart": False}],
        "persist_every": 5, "keep": 2, "controller_restart_at": 12, "finish_timeout": 4,
        "disk_limit": {"partition": 0, "kib": 900}}, "x")
    assert sc.faults == [Fault("s0", 0.1, 0.01, 5, 9)]
    assert sc.shadow_kills == [ShadowKill(1, 7, True, False)]
    assert (sc.persist_every, sc.keep, sc.controller_restart_at) == (5, 2, 12)
    assert sc.finish_timeout == 4.0 and sc.disk_limit == (0, 900) and sc.chaos
    assert not parse_scenario({"steps": 10, "kill_at": 5}, "y").chaos


def test_random_iterations_come_from_the_seeded_draw():
    body = {"steps": 40, "shadow_kills": [{"partition": 0, "at": "random"}]}
    a = parse_scenario(body, "r", random.Random(7)).shadow_kills[0].at
    assert a == parse_scenario(body, "r", random.Random(7)).shadow_kills[0].at
    assert 10 <= a <= 30


@pytest.mark.parametrize("body,msg", [
    ({"faults": [{"port": "s0", "drop": 2}]}, "drop must be a probability"),
    ({"faults": [{"port": "s0", "from": 9, "until": 3}]}, "from 9 is after until 3"),
    ({"faults": [{"drop": 0.1}]}, "port must be a host name"),
    ({"faults": [{"port": "s0", "jitter": 1}]}, r"faults\[0\]: unknown key\(s\) jitter"),
    ({"shadow_kills": [{"partition": 0, "at": 3, "disk": True}]}, "disk: true needs"),
    ({"shadow_kills": [{"partition": 0, "at": 99}]}, "at must be an integer"),
    ({"disk_limit": {"partition": 0, "kib": 100}}, "disk_limit needs persist_every"),
    ({"finish_timeout": 0}, "finish_timeout"),
    ({"bogus": 1}, "unknown key"),
    ({"gockpt": {"every": 2, "steps": 3}}, "steps must be at most every"),
    ({"gockpt": {"every": 4}}, "gockpt.steps"),
    ({"gockpt": {"every": 4, "steps": 2}, "persist_every": 3}, "gockpt runs without shadows"),
    ({"attacks": [{"kind": "arp_storm", "from": "t3", "target": "s0"}]},
     "kind must be one of mac_hijack, conn_flood"),
    ({"attacks": [{"kind": "mac_hijack", "from": "t3", "target": "s0", "at": 99}]},
     r"attacks\[0\].at must be an integer"),
    ({"attacks": [{"kind": "mac_hijack", "target": "s0"}]}, "from"),
])
def test_bad_scenarios_are_one_clear_error(body, msg):
    with pytest.raises(CheckmateError, match=msg):
        parse_scenario({"steps": 20, **body}, "bad")


def test_attacks_parse_and_make_the_run_a_chaos_run():
    sc = parse_scenario({"steps": 20, "attacks": [
        {"kind": "conn_flood", "from": "s1", "target": "s0", "at": "random"},
        {"kind": "mac_hijack", "from": "t3", "target": "s0"}]}, "x", random.Random(1))
    assert sc.chaos
    flood, hijack = sc.attacks
    assert hijack == Attack("mac_hijack", "t3", "s0", 1)
    assert flood.kind == "conn_flood" and 5 <= flood.at <= 15
