"""Cluster config validation: every mistake is one ConfigError naming its key."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import yaml

from checkmate.config import cluster as config

BASE = yaml.safe_load(config.default_path().read_text())


def test_default_config_loads() -> None:
    cfg = config.load(config.default_path())
    assert [h.rank for h in cfg.trainers] == [0, 1, 2, 3]
    assert [h.partition for h in cfg.shadows] == [0, 1]
    assert cfg.shadow_for(1).name == "s1" and cfg.shadow_for(2) is None
    assert cfg.host("t2").mac == "02:00:0a:4d:00:0c"
    assert len(cfg.switch_ifname("t0")) <= 15 and len(cfg.netns("s1")) <= 15


def _broken(path: str, value) -> dict:
    d = copy.deepcopy(BASE)
    keys = path.split(".")
    node = d
    for k in keys[:-1]:
        node = node[int(k)] if isinstance(node, list) else node[k]
    last = keys[-1]
    if value is KeyError:
        del node[last]
    else:
        node[last] = value
    return d


@pytest.mark.parametrize(
    "path, value, message",
    [
        ("job", KeyError, "job must be a mapping"),
        ("job.id", "seven", "job.id must be an integer"),
        ("switch.target", "fpga", "switch.target must be one of"),
        ("hosts.0.ip", "10.99.0.1", "outside network.subnet"),
        ("hosts.1.ip", "10.77.0.10", "used twice"),
        ("hosts.0.role", "worker", "role must be one of"),
        ("hosts.1.rank", 0, "ranks must be 0..3"),
        ("hosts.5.partition", 5, "partitions must be 0..1"),
        ("hosts.0.mac", "zz:zz", "not a MAC"),
        ("hosts", [], "non-empty list"),
        ("network.prefix", "much-too-long", "network.prefix"),
    ],
)
def test_bad_configs_are_rejected_with_their_key(path: str, value, message: str) -> None:
    with pytest.raises(config.ConfigError, match=message):
        config.parse(_broken(path, value))


def test_unknown_top_level_key() -> None:
    with pytest.raises(config.ConfigError, match="unknown top-level"):
        config.parse({**BASE, "swtich": {}})


def test_unreadable_and_invalid_files(tmp_path) -> None:
    with pytest.raises(config.ConfigError, match="cannot read config"):
        config.load(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("job: [1, 2\n")
    with pytest.raises(config.ConfigError, match="not valid YAML"):
        config.load(bad)


def test_testbed_cli_rejects_unknown_commands_in_one_line() -> None:
    for argv in (["frobnicate"], ["bench", "nonexistent"],
                 ["bench", "restart", "--kill-at", "10", "--steps", "10"]):
        r = subprocess.run([sys.executable, "-m", "checkmate.testbed.cli", *argv],
                           capture_output=True, text=True)
        assert r.returncode == 2
        assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


# ------------------------------------------------ co-located shadows (switch mode)

def _colocated() -> dict:
    """The default's trainers and two co-located replicas of each of two partitions."""
    d = copy.deepcopy(BASE)
    d["hosts"] = [h for h in d["hosts"] if h["role"] == "trainer"] + [
        {"name": f"c{i}", "role": "shadow", "partition": i % 2, "colocated": True}
        for i in range(4)]
    return d


def test_colocated_shadows_have_no_address_nor_port_of_their_own() -> None:
    from checkmate.testbed.topology import config_to_dict

    cfg = config.parse(_colocated())
    assert cfg.colocated and (cfg.num_partitions, cfg.replicas) == (2, 2)
    assert [h.name for h in cfg.port_hosts] == ["t0", "t1", "t2", "t3"]
    assert [(h.name, h.ip, h.mac, h.colocated) for h in cfg.shadow_hosts] == [
        ("c0", "", "", True), ("c2", "", "", True), ("c1", "", "", True), ("c3", "", "", True)]
    assert config.parse(yaml.safe_load(yaml.safe_dump(config_to_dict(cfg)))) == cfg
    default = config.load(config.default_path())
    assert not default.colocated and default.port_hosts == list(default.hosts)


@pytest.mark.parametrize("host, change, message", [
    (4, {"ip": "10.77.0.100"}, "hosts[4].ip: a co-located shadow has no address of its own "
                               "(the launcher's attempt places it)"),
    (5, {"mac": "02:00:00:00:00:01"}, "hosts[5].mac: a co-located shadow has no address of "
                                      "its own (the launcher's attempt places it)"),
    (6, {"switch_port": 9}, "hosts[6].switch_port: a co-located shadow has no port of its "
                            "own (the launcher's attempt places it)"),
    (0, {"colocated": True}, "hosts[0].colocated: only a shadow may be co-located, not a "
                             "trainer"),
    (5, {"colocated": False, "ip": "10.77.0.101"},
     "hosts[5].colocated: every shadow of a config is co-located or none is (c0 is, c1 is "
     "not)"),
    (4, {"colocated": "yes"}, "hosts[4].colocated must be true or false, got 'yes'"),
    (7, {"colocated": False}, "hosts[7].ip is required"),
])
def test_colocated_mistakes_are_one_line_naming_the_key(host: int, change: dict,
                                                         message: str) -> None:
    d = _colocated()
    d["hosts"][host].update(change)
    with pytest.raises(config.ConfigError) as e:
        config.parse(d)
    assert str(e.value) == message
