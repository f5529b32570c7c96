"""Prometheus metrics
==================

Export a shadow's ``status`` and a trainer's ``protection()`` state to Prometheus.

Nothing here runs on a hot path: the collectors hold only a callable and call it once per
scrape, so a training step or a datagram never touches a metric object. Each exporter gets
its own :class:`~prometheus_client.CollectorRegistry` (never the global default one), so a
shadow and a trainer, or several shadows, can export from one process without clashing.

Every field of the status dicts may be missing or ``None`` (an older peer, a feature that is
off, nothing committed yet); such a metric is left out of the scrape, never reported as 0 and
never an exception. An exception raised by the status callable itself is not swallowed: the
scrape fails, and Prometheus marks the target down instead of storing stale numbers.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Final, NamedTuple
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, generate_latest, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from checkmate.errors import CheckmateError

#: Environment variable naming the metrics port. When set (non-empty) it wins over the
#: default passed by the constructor or CLI, so a deployment can move the port without
#: touching code; ``0`` asks for any free port.
METRICS_PORT_ENV: Final[str] = "CHECKMATE_METRICS_PORT"

_MAX_PORT: Final[int] = 65535

SHADOW_PREFIX: Final[str] = "checkmate_shadow_"
TRAINER_PREFIX: Final[str] = "checkmate_trainer_"

Status = Callable[[], Mapping[str, Any] | None]


def _num(value: Any) -> float | None:
    """A sample value, or None when the field is absent or not a number (metric left out)."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, int | float):
        return float(value)
    return None


def _sub(status: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    """A nested status dict, or an empty one when it is missing, None or malformed."""
    value = status.get(key)
    return value if isinstance(value, Mapping) else {}


def _by_key(mapping: Mapping[Any, Any]) -> list[tuple[Any, Any]]:
    """Items in a stable order (keys may mix int and str), so scrapes diff cleanly."""
    return sorted(mapping.items(), key=lambda kv: str(kv[0]))


def _label(value: Any) -> str:
    """A label value; an unknown partition or rank becomes the empty label."""
    return "" if value is None else str(value)


class _Families:
    """Builds metric families sharing one prefix and one set of base labels.

    Families without a sample are dropped, so a missing field yields no empty
    ``# TYPE`` stanza in the exposition.
    """

    def __init__(self, prefix: str, labels: Mapping[str, str]) -> None:
        self._prefix = prefix
        self._names = list(labels)
        self._values = list(labels.values())
        self._out: list[Metric] = []

    def _add(
        self,
        kind: type[GaugeMetricFamily] | type[CounterMetricFamily],
        name: str,
        doc: str,
        samples: list[tuple[Mapping[str, str], Any]],
    ) -> None:
        rows = [(extra, _num(raw)) for extra, raw in samples]
        rows = [(extra, v) for extra, v in rows if v is not None]
        if not rows:
            return
        extra_names = list(rows[0][0])
        family = kind(self._prefix + name, doc, labels=self._names + extra_names)
        for extra, value in rows:
            family.add_metric(self._values + [extra[n] for n in extra_names], value)
        self._out.append(family)

    def gauge(self, name: str, doc: str, value: Any, **extra: str) -> None:
        self._add(GaugeMetricFamily, name, doc, [(extra, value)])

    def counter(self, name: str, doc: str, value: Any, **extra: str) -> None:
        """A counter; ``name`` ends in ``_total``, which prometheus_client strips and re-adds."""
        self._add(CounterMetricFamily, name, doc, [(extra, value)])

    def gauges(self, name: str, doc: str, samples: list[tuple[Mapping[str, str], Any]]) -> None:
        self._add(GaugeMetricFamily, name, doc, samples)

    def counters(self, name: str, doc: str, samples: list[tuple[Mapping[str, str], Any]]) -> None:
        self._add(CounterMetricFamily, name, doc, samples)

    def __iter__(self) -> Iterator[Metric]:
        return iter(self._out)


class ShadowCollector(Collector):
    """Metrics of one shadow, read from its ``status`` op at scrape time."""

    def __init__(self, status: Status) -> None:
        self._status = status

    def collect(self) -> Iterator[Metric]:
        """Call ``status()`` once and yield one family per field that is present."""
        st = self._status() or {}
        f = _Families(SHADOW_PREFIX, {"partition": _label(st.get("partition"))})
        latest, seen = _num(st.get("latest")), _num(st.get("newest_seen"))
        f.gauge("committed_iteration", "Newest iteration this shadow has committed.", latest)
        if latest is not None and seen is not None:
            f.gauge(
                "lag_iterations",
                "Iterations seen on the wire but not yet committed (newest_seen - latest).",
                max(0.0, seen - latest),
            )
        f.counter("commits_total", "Iterations committed.", st.get("committed"))
        f.counter("datagrams_total", "ckm datagrams received.", st.get("received"))
        drops = _sub(st, "drops")
        f.counters(
            "drops_total",
            "Datagrams dropped, by reason.",
            [({"reason": str(reason)}, n) for reason, n in _by_key(drops)],
        )
        f.counter("gaps_total", "Holes found in an iteration's gradient.", st.get("gap_count"))
        rx = _sub(st, "receiver")
        f.gauge("receiver_alive", "1 while the receive thread runs (0: it failed for good).",
                rx.get("alive"))
        f.counter("receiver_restarts_total", "Restarts of the receive thread after a failure.",
                  rx.get("restarts"))
        repair = _sub(st, "repair")
        f.counter("repair_requests_total", "Repair requests sent.", repair.get("requests"))
        f.counter("repair_ranges_total", "Element ranges asked for.", repair.get("ranges"))
        f.counter(
            "repair_control_requests_total",
            "Repair requests for a control message.",
            repair.get("control_requests"),
        )
        f.counter("repair_answers_total", "Repair answers received.", repair.get("answers"))
        f.counter(
            "repair_gone_total",
            "Repairs the trainer could no longer answer (iteration not retained).",
            repair.get("gone"),
        )
        reseed = _sub(st, "reseed")
        f.counter("reseeds_total", "Live re-seeds of this shadow.", reseed.get("count"))
        f.gauge("reseed_active", "1 while a re-seed is in progress.", reseed.get("active"))
        persist = _sub(st, "persist")
        f.counter("persist_errors_total", "Failed checkpoint writes.", persist.get("errors"))
        f.counter("persist_written_total", "Checkpoints written to disk.", persist.get("written"))
        f.gauge(
            "persist_last_iteration",
            "Iteration of the newest checkpoint on disk.",
            persist.get("last_iteration"),
        )
        last_error = persist.get("last_error")
        if isinstance(last_error, str) and last_error:
            f.gauge(
                "persist_last_error",
                "1, with the most recent failed checkpoint write's error (one line) as the "
                "'error' label; absent before any failure.",
                1,
                error=last_error[:200],
            )
        yield from f


class TrainerCollector(Collector):
    """Metrics of one trainer rank, read from its ``protection()`` state at scrape time."""

    def __init__(self, protection: Status, rank: int) -> None:
        self._protection = protection
        self._rank = rank

    def collect(self) -> Iterator[Metric]:
        """Call ``protection()`` once and yield one family per field that is present."""
        st = self._protection() or {}
        f = _Families(TRAINER_PREFIX, {"rank": _label(self._rank)})
        f.gauge("iteration", "The trainer's current iteration.", st.get("iteration"))
        f.gauge(
            "newest_consistent_iteration",
            "Newest iteration every shadow has committed (what a restore can return to).",
            st.get("newest_consistent"),
        )
        prot = st.get("protected_now")
        f.gauge("protected", "1 while every shadow answers and holds current state.",
                None if prot is None else int(bool(prot)))
        f.gauge(
            "unprotected_since_iteration",
            "First iteration no complete checkpoint covers, while protection is lost "
            "(absent while protected).",
            st.get("unprotected_since"),
        )
        shadows = _by_key(_sub(st, "shadows"))
        per = [({"partition": str(p)}, v if isinstance(v, Mapping) else {}) for p, v in shadows]
        f.gauges(
            "shadow_up",
            "1 while the shadow answers status polls (0: unreachable or silent for 2 s).",
            [(lab, None if v.get("up") is None else int(bool(v.get("up")))) for lab, v in per],
        )
        f.gauges(
            "shadow_silent_seconds",
            "Seconds since the shadow last answered a status poll.",
            [(lab, v.get("silent_seconds")) for lab, v in per],
        )
        f.gauges(
            "shadow_committed_iteration",
            "Newest iteration each shadow has committed.",
            [(lab, v.get("latest")) for lab, v in per],
        )
        f.gauges(
            "shadow_lag_iterations",
            "Iterations each shadow is behind the trainer.",
            [(lab, v.get("lag")) for lab, v in per],
        )
        f.gauges(
            "shadow_reseeding",
            "1 while the shadow is being re-seeded.",
            [(lab, v.get("reseeding")) for lab, v in per],
        )
        repair = _sub(st, "repair")
        f.counter("repair_requests_total", "Repair requests received.", repair.get("requests"))
        f.counter(
            "repair_elements_total", "Gradient elements resent.", repair.get("answered_elements")
        )
        f.counter("repair_bytes_total", "Bytes resent.", repair.get("answered_bytes"))
        f.counter(
            "repair_gone_total", "Requests for iterations no longer retained.", repair.get("gone")
        )
        f.counter(
            "repair_rate_limited_total",
            "Repair requests refused by the rate limit.",
            repair.get("rate_limited"),
        )
        f.counter("reseeds_total", "Live re-seeds this trainer started.", st.get("reseeds"))
        yield from f


def _registry(collector: Collector) -> CollectorRegistry:
    """A private registry: the process-wide default one would clash across exporters."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return registry


def render(collector: Collector) -> str:
    """The text exposition of one collector (what a scrape returns), for tests and the CLI."""
    return generate_latest(_registry(collector)).decode("utf-8")


def _check_port(port: Any, what: str) -> int:
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= _MAX_PORT:
        raise CheckmateError(f"{what}: {port!r} is not a port (an integer 0..{_MAX_PORT})")
    return port


def port_from_env(default: int | None) -> int | None:
    """The metrics port: :data:`METRICS_PORT_ENV` when set and non-empty, else ``default``."""
    raw = os.environ.get(METRICS_PORT_ENV, "").strip()
    if not raw:
        return default
    try:
        port = int(raw, 10)
    except ValueError:
        raise CheckmateError(
            f"{METRICS_PORT_ENV}={raw!r} is not a port (an integer 0..{_MAX_PORT})"
        ) from None
    return _check_port(port, METRICS_PORT_ENV)


class MetricsServer(NamedTuple):
    """What :func:`serve` returns: unpacks as ``(server, thread)``; ``port`` is the bound port."""

    server: WSGIServer
    thread: threading.Thread

    @property
    def port(self) -> int:
        """The real port, also when port 0 was asked for."""
        return int(self.server.server_port)

    def close(self) -> None:
        """Stop serving, release the socket and wait for the thread."""
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


def serve(collector: Collector, port: int, bind: str = "127.0.0.1") -> MetricsServer:
    """Serve ``collector`` over HTTP on ``bind:port`` from a daemon thread.

    Loopback by default: the numbers say little, but a scrape endpoint should be exposed on
    purpose. A bad or taken port raises :class:`CheckmateError` with one line.
    """
    port = _check_port(port, f"metrics port for {bind}")
    try:
        server, thread = start_http_server(port, addr=bind, registry=_registry(collector))
    except (OSError, OverflowError, ValueError) as e:
        reason = getattr(e, "strerror", None) or str(e)
        raise CheckmateError(f"cannot serve metrics on {bind}:{port}: {reason}") from e
    return MetricsServer(server, thread)
