"""Tests of checkmate.metrics: what a scrape shows for full, partial and empty status dicts,
and the HTTP endpoint on an ephemeral loopback port."""

from __future__ import annotations

import socket
import urllib.request
from typing import Any

import pytest
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from checkmate import metrics
from checkmate.errors import CheckmateError
from checkmate.metrics import (
    METRICS_PORT_ENV,
    ShadowCollector,
    TrainerCollector,
    port_from_env,
    render,
    serve,
)

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def full_shadow_status() -> dict[str, Any]:
    return {
        "partition": 3,
        "job": 7,
        "latest": 120,
        "newest_seen": 124,
        "committed": 118,
        "received": 50_000,
        "drops": {"crc": 2, "stale_epoch": 5},
        "gap_count": 9,
        "repair": {"requests": 11, "ranges": 40, "control_requests": 1, "answers": 10, "gone": 1},
        "reseed": {"count": 2, "active": True, "reason": "gone"},
        "persist": {"errors": 1, "written": 30, "last_iteration": 110},
        "state_check": {"verified_iteration": 116, "checks": 58, "failures": 1,
                        "diverged": "partition 3: iteration 118: the committed state differs",
                        "restorable_until": 116},
    }


def full_protection() -> dict[str, Any]:
    return {
        "iteration": 125,
        "newest_consistent": 118,
        "shadows": {
            0: {"latest": 120, "lag": 5, "reseeding": False},
            "1": {"latest": 118, "lag": 7, "reseeding": True},
        },
        "repair": {
            "requests": 4,
            "answered_elements": 1000,
            "answered_bytes": 4000,
            "gone": 1,
            "rate_limited": 2,
        },
        "reseeds": 3,
    }


def samples(text: str) -> Samples:
    """Every sample of an exposition, keyed by (name, labels)."""
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def types(text: str) -> dict[str, str]:
    """Family name -> type, from the ``# TYPE`` lines."""
    return {f.name: f.type for f in text_string_to_metric_families(text)}


def key(name: str, **labels: Any) -> tuple[str, frozenset[tuple[str, str]]]:
    return name, frozenset((k, str(v)) for k, v in labels.items())


SHADOW_EXPECTED = {
    "committed_iteration": 120,
    "lag_iterations": 4,
    "commits_total": 118,
    "datagrams_total": 50_000,
    "gaps_total": 9,
    "repair_requests_total": 11,
    "repair_ranges_total": 40,
    "repair_control_requests_total": 1,
    "repair_answers_total": 10,
    "repair_gone_total": 1,
    "reseeds_total": 2,
    "reseed_active": 1,
    "persist_errors_total": 1,
    "persist_written_total": 30,
    "persist_last_iteration": 110,
    "verified_iteration": 116,
    "diverged": 1,
    "state_checks_total": 58,
}
SHADOW_GAUGES = {
    "verified_iteration",
    "diverged",
    "committed_iteration",
    "lag_iterations",
    "reseed_active",
    "persist_last_iteration",
}


def test_shadow_full_status_every_metric() -> None:
    got = samples(render(ShadowCollector(full_shadow_status)))
    want = {key(f"checkmate_shadow_{n}", partition=3): float(v) for n, v in SHADOW_EXPECTED.items()}
    want[key("checkmate_shadow_drops_total", partition=3, reason="crc")] = 2.0
    want[key("checkmate_shadow_drops_total", partition=3, reason="stale_epoch")] = 5.0
    assert got == want


def test_shadow_counters_are_counters_and_gauges_gauges() -> None:
    text = render(ShadowCollector(full_shadow_status))
    kinds = types(text)
    for name in SHADOW_EXPECTED:
        if name in SHADOW_GAUGES:
            assert kinds[f"checkmate_shadow_{name}"] == "gauge"
        else:
            assert name.endswith("_total")
            assert kinds[f"checkmate_shadow_{name.removesuffix('_total')}"] == "counter"
            assert f"\ncheckmate_shadow_{name}{{" in text
    assert kinds["checkmate_shadow_drops"] == "counter"
    assert "_created" not in text


def test_shadow_status_called_once_per_scrape() -> None:
    calls = []

    def status() -> dict[str, Any]:
        calls.append(1)
        return full_shadow_status()

    collector = ShadowCollector(status)
    assert calls == []  # nothing happens until a scrape
    render(collector)
    assert len(calls) == 1


@pytest.mark.parametrize("status", [{}, None, {k: None for k in full_shadow_status()}])
def test_shadow_empty_status_omits_everything(status: dict[str, Any] | None) -> None:
    text = render(ShadowCollector(lambda: status))
    assert "checkmate_shadow_" not in text


def test_shadow_partial_status_omits_only_missing() -> None:
    st = full_shadow_status()
    st["latest"] = None  # nothing committed yet: no committed_iteration and no lag
    st["persist"] = None  # persistence off
    del st["repair"]
    st["reseed"] = {"count": 0}  # active missing
    st["drops"] = {"crc": None, "short": 1}
    st["state_check"] = {"verified_iteration": None, "checks": 0, "failures": 0,
                         "diverged": "", "restorable_until": None}  # nothing checked yet
    got = samples(render(ShadowCollector(lambda: st)))
    assert got[key("checkmate_shadow_diverged", partition=3)] == 0.0
    assert {name for name, _ in got} == {
        "checkmate_shadow_diverged",
        "checkmate_shadow_state_checks_total",
        "checkmate_shadow_commits_total",
        "checkmate_shadow_datagrams_total",
        "checkmate_shadow_drops_total",
        "checkmate_shadow_gaps_total",
        "checkmate_shadow_reseeds_total",
    }
    drops = {k: v for k, v in got.items() if k[0] == "checkmate_shadow_drops_total"}
    assert drops == {key("checkmate_shadow_drops_total", partition=3, reason="short"): 1.0}


def test_shadow_lag_never_negative_and_partition_missing() -> None:
    st = {"latest": 10, "newest_seen": 8}
    got = samples(render(ShadowCollector(lambda: st)))
    assert got == {
        key("checkmate_shadow_committed_iteration", partition=""): 10.0,
        key("checkmate_shadow_lag_iterations", partition=""): 0.0,
    }


def test_shadow_malformed_nested_values_are_omitted() -> None:
    st = {"partition": 0, "drops": None, "repair": "n/a", "reseed": [], "committed": "many"}
    assert "checkmate_shadow_" not in render(ShadowCollector(lambda: st))


def test_status_exception_fails_the_scrape() -> None:
    def status() -> dict[str, Any]:
        raise RuntimeError("shadow gone")

    with pytest.raises(RuntimeError, match="shadow gone"):
        render(ShadowCollector(status))


def test_trainer_full_protection_every_metric() -> None:
    got = samples(render(TrainerCollector(full_protection, rank=1)))
    t = "checkmate_trainer_"
    want = {
        key(t + "iteration", rank=1): 125.0,
        key(t + "newest_consistent_iteration", rank=1): 118.0,
        key(t + "shadow_committed_iteration", rank=1, partition=0): 120.0,
        key(t + "shadow_committed_iteration", rank=1, partition=1): 118.0,
        key(t + "shadow_lag_iterations", rank=1, partition=0): 5.0,
        key(t + "shadow_lag_iterations", rank=1, partition=1): 7.0,
        key(t + "shadow_reseeding", rank=1, partition=0): 0.0,
        key(t + "shadow_reseeding", rank=1, partition=1): 1.0,
        key(t + "repair_requests_total", rank=1): 4.0,
        key(t + "repair_elements_total", rank=1): 1000.0,
        key(t + "repair_bytes_total", rank=1): 4000.0,
        key(t + "repair_gone_total", rank=1): 1.0,
        key(t + "repair_rate_limited_total", rank=1): 2.0,
        key(t + "reseeds_total", rank=1): 3.0,
    }
    assert got == want


def test_trainer_reports_current_replicas_per_partition() -> None:
    """With several replicas per partition, protection() says how many are current."""
    prot = {**full_protection(), "shadows": {
        0: {**full_protection()["shadows"][0], "current": 2},
        1: {**full_protection()["shadows"]["1"], "current": 1}}}
    got = samples(render(TrainerCollector(lambda: prot, rank=0)))
    t = "checkmate_trainer_shadow_current_replicas"
    assert got[key(t, rank=0, partition=0)] == 2.0 and got[key(t, rank=0, partition=1)] == 1.0
    # one shadow per partition: no such metric (protection() has no "current")
    assert not any(k[0] == t for k in samples(render(TrainerCollector(full_protection,
                                                                       rank=0))))


def test_trainer_types() -> None:
    kinds = types(render(TrainerCollector(full_protection, rank=0)))
    t = "checkmate_trainer_"
    for name in (
        "iteration",
        "newest_consistent_iteration",
        "shadow_committed_iteration",
        "shadow_lag_iterations",
        "shadow_reseeding",
    ):
        assert kinds[t + name] == "gauge"
    for name in ("requests", "elements", "bytes", "gone", "rate_limited"):
        assert kinds[f"{t}repair_{name}"] == "counter"
    assert kinds[t + "reseeds"] == "counter"


def test_trainer_partial_protection() -> None:
    prot = {
        "iteration": 5,
        "newest_consistent": None,  # no shadow has committed yet
        "shadows": {0: {"latest": None, "lag": None, "reseeding": False}, 1: None},
    }
    got = samples(render(TrainerCollector(lambda: prot, rank=2)))
    assert got == {
        key("checkmate_trainer_iteration", rank=2): 5.0,
        key("checkmate_trainer_shadow_reseeding", rank=2, partition=0): 0.0,
    }
    assert "checkmate_trainer_" not in render(TrainerCollector(dict, rank=0))
    assert "checkmate_trainer_" not in render(TrainerCollector(lambda: None, rank=0))


def test_two_collectors_in_one_process_do_not_clash() -> None:
    a = ShadowCollector(full_shadow_status)
    b = ShadowCollector(lambda: {**full_shadow_status(), "partition": 4, "latest": 121})
    t = TrainerCollector(full_protection, rank=0)
    assert samples(render(a))[key("checkmate_shadow_committed_iteration", partition=3)] == 120
    assert samples(render(b))[key("checkmate_shadow_committed_iteration", partition=4)] == 121
    render(t)
    render(a)  # rendering again re-registers nothing globally
    assert REGISTRY.get_sample_value("checkmate_shadow_commits_total", {"partition": "3"}) is None


def test_port_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(METRICS_PORT_ENV, raising=False)
    assert port_from_env(9100) == 9100
    assert port_from_env(None) is None
    monkeypatch.setenv(METRICS_PORT_ENV, "")
    assert port_from_env(9100) == 9100
    monkeypatch.setenv(METRICS_PORT_ENV, " 9200 ")
    assert port_from_env(9100) == 9200
    assert port_from_env(None) == 9200
    monkeypatch.setenv(METRICS_PORT_ENV, "0")
    assert port_from_env(9100) == 0


@pytest.mark.parametrize("raw", ["abc", "91.5", "-1", "65536", "0x10"])
def test_port_from_env_bad_value(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv(METRICS_PORT_ENV, raw)
    with pytest.raises(CheckmateError) as err:
        port_from_env(9100)
    msg = str(err.value)
    assert METRICS_PORT_ENV in msg and "\n" not in msg


def get(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        assert resp.status == 200
        return resp.read().decode("utf-8")


def test_serve_port_zero_real_http() -> None:
    state = full_shadow_status()
    shadow = serve(ShadowCollector(lambda: state), 0)
    trainer = serve(TrainerCollector(full_protection, rank=0), 0, bind="127.0.0.1")
    try:
        server, thread = shadow  # unpacks as (server, thread)
        assert thread.is_alive() and thread.daemon
        assert shadow.port == server.server_port > 0
        assert trainer.port > 0 and trainer.port != shadow.port
        got = samples(get(shadow.port))
        assert got[key("checkmate_shadow_commits_total", partition=3)] == 118
        state["committed"] = 119  # computed at scrape time
        got = samples(get(shadow.port))
        assert got[key("checkmate_shadow_commits_total", partition=3)] == 119
        # Each server has its own registry: no trainer metric on the shadow's port.
        assert not any(n.startswith("checkmate_trainer_") for n, _ in got)
        tgot = samples(get(trainer.port))
        assert tgot[key("checkmate_trainer_iteration", rank=0)] == 125
        assert not any(n.startswith("checkmate_shadow_") for n, _ in tgot)
    finally:
        shadow.server.shutdown()
        shadow.server.server_close()
        trainer.close()
    assert not trainer.thread.is_alive()


def test_serve_taken_port() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        port = held.getsockname()[1]
        with pytest.raises(CheckmateError) as err:
            serve(ShadowCollector(dict), port)
    msg = str(err.value)
    assert f"127.0.0.1:{port}" in msg and "\n" not in msg


@pytest.mark.parametrize("port", [-1, 65536, 1.5, "9100", True])
def test_serve_bad_port(port: Any) -> None:
    with pytest.raises(CheckmateError, match="not a port"):
        serve(ShadowCollector(dict), port)


def test_serve_bad_bind() -> None:
    with pytest.raises(CheckmateError, match="cannot serve metrics on"):
        serve(ShadowCollector(dict), 0, bind="192.0.2.1")  # TEST-NET: not on this host


def test_env_constant() -> None:
    assert metrics.METRICS_PORT_ENV == "CHECKMATE_METRICS_PORT"


def test_trainer_liveness_gauges() -> None:
    """Protection lost: the protected gauge is 0, the first unprotected iteration is there,
    each shadow says whether it answers and for how long it has been silent."""
    prot = {"iteration": 300, "newest_consistent": None, "protected_now": False,
            "unprotected_since": 47,
            "shadows": {0: {"latest": None, "lag": None, "up": False, "silent_seconds": 2.5},
                        1: {"latest": 299, "lag": 1, "up": True, "silent_seconds": 0.1}}}
    got = samples(render(TrainerCollector(lambda: prot, rank=0)))
    t = "checkmate_trainer_"
    assert got[key(t + "protected", rank=0)] == 0.0
    assert got[key(t + "unprotected_since_iteration", rank=0)] == 47.0
    assert got[key(t + "shadow_up", rank=0, partition=0)] == 0.0
    assert got[key(t + "shadow_up", rank=0, partition=1)] == 1.0
    assert got[key(t + "shadow_silent_seconds", rank=0, partition=0)] == 2.5
    assert key(t + "newest_consistent_iteration", rank=0) not in got
    back = {**prot, "protected_now": True, "unprotected_since": None}
    got = samples(render(TrainerCollector(lambda: back, rank=0)))
    assert got[key(t + "protected", rank=0)] == 1.0
    assert key(t + "unprotected_since_iteration", rank=0) not in got


def test_shadow_persist_last_error_is_a_labelled_gauge() -> None:
    st = {**full_shadow_status(), "persist": {"errors": 2, "written": 3,
                                              "last_error": "cannot write checkpoint: disk full"}}
    text = render(ShadowCollector(lambda: st))
    assert ('checkmate_shadow_persist_last_error{error="cannot write checkpoint: disk full",'
            'partition="3"} 1.0') in text
    assert "persist_last_error" not in render(ShadowCollector(full_shadow_status))


def _scrape_from(port: int, source: str) -> bytes:
    """One scrape over a socket bound to loopback address ``source``."""
    with socket.create_connection(("127.0.0.1", port), timeout=5,
                                  source_address=(source, 0)) as s:
        s.sendall(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


def test_slow_connections_cannot_exhaust_the_endpoint() -> None:
    """The issue's 600 slow connections (half a request line each) from one address: threads
    stay at the pool's size, a scrape from another address is answered at once, and the
    ones that got a worker are cut off at the deadline."""
    import threading
    import time

    state = full_shadow_status()
    srv = serve(ShadowCollector(lambda: state), 0)
    # No cut-off while the 600 arrive: on a loaded machine that takes seconds, and each
    # deadline that passed would free the source's slots for two more (CI counted 594).
    srv.server.deadline = 60.0
    base = threading.active_count()
    held = []
    try:
        for _ in range(600):
            s = socket.create_connection(("127.0.0.1", srv.port), timeout=5,
                                         source_address=("127.0.0.1", 0))
            s.sendall(b"GET /metr")
            held.append(s)
        assert threading.active_count() <= base  # the pool was started with the server
        t0 = time.monotonic()
        reply = _scrape_from(srv.port, "127.0.0.2")
        assert time.monotonic() - t0 < 1.0
        assert reply.startswith(b"HTTP/1.0 200") and b"checkmate_shadow_commits_total" in reply
        # Every connect returned once the kernel queued it; the accept loop may still be
        # taking the last few off the backlog, so give it a bounded moment to count them.
        want = 600 - metrics.METRICS_PER_SOURCE
        until = time.monotonic() + 5.0
        while srv.server.refused["per_source"] < want and time.monotonic() < until:
            time.sleep(0.05)
        refused = srv.server.refused
        assert refused["per_source"] >= want
        assert srv.server.refused["deadline"] == 0
        srv.server.deadline = 1.0
        time.sleep(2.0)  # past the deadline: the two that got a worker are cut off
        assert srv.server.refused["deadline"] >= 1
        assert _scrape_from(srv.port, "127.0.0.1").startswith(b"HTTP/1.0 200")
        assert threading.active_count() <= base
        health = srv.health()
        assert health["alive"] and health["refused"]["per_source"] == refused["per_source"]
    finally:
        for s in held:
            s.close()
        srv.close()
    assert not srv.health()["alive"]
