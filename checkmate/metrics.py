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

The endpoint is unauthenticated, so it must not be a way to exhaust the process: requests
are served by a fixed pool of ``METRICS_WORKERS`` threads from a queue of
``METRICS_QUEUE``; a source address may hold ``METRICS_PER_SOURCE`` connections at once,
and a request not answered within ``METRICS_DEADLINE`` seconds of its accept is cut off.
What does not fit is closed at once and counted (``MetricsServer.refused``). (prometheus-
client's own server starts a thread per connection with no bound: 600 slow connections made
501 threads.)
"""

from __future__ import annotations

import queue
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Final, NamedTuple
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from checkmate.errors import CheckmateError
from checkmate.extras import needs
from checkmate.metrics_port import METRICS_PORT_ENV, check_port, port_from_env

with needs("metrics"):
    from prometheus_client import CollectorRegistry, generate_latest, make_wsgi_app
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
    from prometheus_client.metrics_core import Metric
    from prometheus_client.registry import Collector

__all__ = ["METRICS_PORT_ENV", "port_from_env"]  # re-exported: callers read them from here

#: Threads serving scrapes, connections waiting for one, connections per source address,
#: and seconds a request may take from its accept to its answer.
METRICS_WORKERS: Final[int] = 4
METRICS_QUEUE: Final[int] = 16
METRICS_PER_SOURCE: Final[int] = 2
METRICS_DEADLINE: Final[float] = 5.0

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
        check = _sub(st, "state_check")
        f.gauge("verified_iteration",
                "Newest iteration whose committed state equals the trainers' (state check).",
                check.get("verified_iteration"))
        f.gauge("diverged", "1 while the committed state differs from the trainers' (a state "
                "check failed; until the re-seed installs theirs).",
                None if not check else bool(check.get("diverged")))
        f.counter("state_checks_total", "State checks against the trainers' digests.",
                  check.get("checks"))
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
        f.gauges(
            "shadow_current_replicas",
            "Replicas of the partition holding the newest iterations (several per partition: "
            "checkmate launch --replicas; protected while at least 1).",
            [(lab, v.get("current")) for lab, v in per],
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


class _Handler(WSGIRequestHandler):
    """prometheus-client's handler, quiet; every read bounded by the request's deadline."""

    timeout = METRICS_DEADLINE

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base's name)
        pass


class BoundedWSGIServer(WSGIServer):
    """A WSGI server whose requests run on a fixed pool (see the module docstring)."""

    request_queue_size = 128  # the listen backlog: a burst waits in the kernel, not here

    def __init__(self, addr: tuple[str, int], workers: int = METRICS_WORKERS,
                 backlog: int = METRICS_QUEUE, per_source: int = METRICS_PER_SOURCE,
                 deadline: float = METRICS_DEADLINE) -> None:
        self.per_source, self.deadline = per_source, deadline
        self.refused: Counter[str] = Counter()  # reason -> connections closed unserved
        self._queue: queue.Queue = queue.Queue(backlog)
        self._lock = threading.Lock()
        self._open: dict[socket.socket, tuple[str, float]] = {}  # queued or being served
        self._workers: list[threading.Thread] = []
        super().__init__(addr, _Handler)  # binds (server_close on failure)
        self._workers = [threading.Thread(target=self._work, name="metrics-worker",
                                          daemon=True) for _ in range(workers)]
        for w in self._workers:
            w.start()

    def process_request(self, request: Any, client_address: Any) -> None:
        source = client_address[0]
        with self._lock:
            mine = sum(1 for src, _ in self._open.values() if src == source)
            if mine < self.per_source:
                self._open[request] = (source, time.monotonic())
        if mine >= self.per_source:
            self.refused["per_source"] += 1
            self.shutdown_request(request)
            return
        try:
            self._queue.put_nowait(request)
        except queue.Full:
            self.refused["queue_full"] += 1
            self._done(request)

    def _done(self, request: Any) -> None:
        with self._lock:
            self._open.pop(request, None)
        self.shutdown_request(request)

    def _work(self) -> None:
        while True:
            request = self._queue.get()
            if request is None:
                return
            try:
                self.finish_request(request, request.getpeername())
            except Exception:  # a broken or cut-off connection: nothing to report
                pass
            finally:
                self._done(request)

    def service_actions(self) -> None:
        """Cut off requests past their deadline (called by serve_forever twice a second):
        a peer trickling a header cannot keep a worker."""
        now = time.monotonic()
        with self._lock:
            late = [r for r, (_, t) in self._open.items() if now - t > self.deadline]
        for r in late:
            self.refused["deadline"] += 1
            try:
                r.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def server_close(self) -> None:
        super().server_close()
        while True:  # what still waits is closed unserved
            try:
                request = self._queue.get_nowait()
            except queue.Empty:
                break
            if request is not None:
                self._done(request)
        for _ in self._workers:
            self._queue.put(None)
        for w in self._workers:
            w.join(self.deadline + 1)


class MetricsServer(NamedTuple):
    """What :func:`serve` returns: unpacks as ``(server, thread)``; ``port`` is the bound port."""

    server: BoundedWSGIServer
    thread: threading.Thread

    @property
    def port(self) -> int:
        """The real port, also when port 0 was asked for."""
        return int(self.server.server_port)

    def health(self) -> dict[str, Any]:
        """For the owner's status: the accepting thread alive (False: scrapes go unanswered)
        and the connections closed unserved, by reason."""
        return {"alive": self.thread.is_alive(), "refused": dict(self.server.refused)}

    def close(self) -> None:
        """Stop serving, release the socket and wait for the threads."""
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


def serve(collector: Collector, port: int, bind: str = "127.0.0.1") -> MetricsServer:
    """Serve ``collector`` over HTTP on ``bind:port`` from daemon threads (one accepting, a
    bounded pool answering).

    Loopback by default: the numbers say little, but a scrape endpoint should be exposed on
    purpose. A bad or taken port raises :class:`CheckmateError` with one line.
    """
    port = check_port(port, f"metrics port for {bind}")
    try:
        server = BoundedWSGIServer((bind, port))
    except (OSError, OverflowError, ValueError) as e:
        reason = getattr(e, "strerror", None) or str(e)
        raise CheckmateError(f"cannot serve metrics on {bind}:{port}: {reason}") from e
    server.set_app(make_wsgi_app(_registry(collector)))
    thread = threading.Thread(target=server.serve_forever, name="metrics", daemon=True)
    thread.start()
    return MetricsServer(server, thread)
