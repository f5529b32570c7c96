"""Client of the shadow TCP service (docs/protocol.md, "Shadow TCP service").

Frames in both directions: a 4-byte big-endian length, that many bytes of JSON header, then
``nbytes`` raw bytes (from the header). On connecting, the shadow speaks first with a
challenge; the client's first request is ``auth`` with its proof (checkmate.protocol.auth), and the
shadow's answer carries the shadow's own proof, so each side knows the other holds the job
secret before anything else is said. Trainers use this module to send the spec and seed
their share of the initial state; restore uses it to find the consistent point (the newest
iteration every partition still retains) and to fetch that iteration from every shadow, so
a restore never mixes iterations across partitions.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from checkmate.config.cluster import RESTORE_PORT
from checkmate.errors import CheckmateError
from checkmate.protocol import auth
from checkmate.protocol.frames import (  # noqa: F401
    MAX_HEADER,
    SEED_CHUNK,
    Addr,
    ShadowError,
    recv_exact,
    recv_frame,
    send_frame,
)
from checkmate.spec.model import ModelSpec


def parse_addr(text: str, default_port: int = RESTORE_PORT) -> Addr:
    """'host[:port]' -> (host, port), CheckmateError for anything else."""
    host, sep, port = text.rpartition(":")
    if not sep:
        host, port = text, str(default_port)
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise CheckmateError(f"bad shadow address {text!r}: expected HOST[:PORT]")
    return host, int(port)


# ----- one shadow -------------------------------------------------------------------------
@dataclass
class Fetched:
    """One partition's slots at one iteration, as the shadow sent them."""

    iteration: int
    offset: int
    count: int
    step: int
    slots: dict[str, np.ndarray]
    buffers: dict[str, str]
    extra: dict[str, Any]
    lrs: list[float] | None = None


class ShadowClient:
    """A connection to one shadow's TCP service; connects (and authenticates) lazily, one
    request at a time. ``secret``: the job secret (default: $CHECKMATE_SECRET_FILE's)."""

    def __init__(self, addr: Addr, timeout: float = 30.0, secret: bytes | None = None) -> None:
        self.addr = addr
        self.timeout = timeout
        self._key = auth.service_key(secret if secret is not None else auth.load_secret())
        self._sock: socket.socket | None = None
        self._used = False  # the open connection already carried a request

    def _connect(self) -> socket.socket:
        sock = socket.create_connection(self.addr, timeout=self.timeout)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            hello, _ = recv_frame(sock, 0, 4096)
            challenge = hello.get("challenge")
            if not isinstance(challenge, str):
                raise ShadowError("no challenge from the shadow (not a Checkmate shadow?)")
            nonce = auth.new_nonce()
            send_frame(sock, {"op": "auth", "nonce": nonce,
                              "proof": auth.client_proof(self._key, challenge, nonce)})
            reply, _ = recv_frame(sock, 0, 4096)
            if not reply.get("ok"):
                raise ShadowError(f"refused the connection: {reply.get('error')}")
            if not auth.same(reply.get("proof"), auth.server_proof(self._key, challenge,
                                                                   nonce)):
                raise ShadowError("could not prove it holds the job secret")
        except BaseException:
            sock.close()
            raise
        return sock

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def __enter__(self) -> ShadowClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def request(self, header: Mapping[str, Any], payload: Any = b"") -> tuple[dict, memoryview]:
        """Send one request, return the reply; ShadowError for a refusal or a dead shadow."""
        where = f"shadow {self.addr[0]}:{self.addr[1]}"
        for attempt in (0, 1):
            reused = self._sock is not None and self._used
            try:
                if self._sock is None:
                    self._sock, self._used = self._connect(), False
                self._used = True
                self._sock.settimeout(self.timeout)
                send_frame(self._sock, header, payload)
                reply, data = recv_frame(self._sock)
                break
            except ConnectionError as e:
                self.close()
                # The shadow closes connections idle past its limit; a request on such a
                # connection never reached it: one fresh connection may send it.
                if reused and attempt == 0:
                    continue
                raise ShadowError(f"{where}: {e}") from None
            except OSError as e:
                self.close()
                raise ShadowError(f"{where}: {getattr(e, 'strerror', None) or e}") from None
            except ShadowError as e:
                self.close()
                raise ShadowError(f"{where}: {e}") from None
        if not reply.get("ok"):
            raise ShadowError(f"{where} refused {header.get('op')}: "
                              f"{reply.get('error', 'no reason given')}")
        return reply, data

    def send_spec(self, spec: ModelSpec) -> None:
        self.request({"op": "spec", "spec": spec.to_json()})

    def get_spec(self) -> ModelSpec:
        """The spec the shadow holds (extension: ``spec`` op without a spec)."""
        reply, _ = self.request({"op": "spec"})
        return ModelSpec.from_json(reply["spec"])

    def seed(self, iteration: int, slot: str, offset: int, data: np.ndarray, step: int,
             context: dict[str, Any] | None = None) -> None:
        """Seed ``data`` (fp32) at flat ``offset`` of ``slot``; split into bounded requests.
        ``context``: the seeded version's ``buffers`` and ``extra`` (a rewind's: what its
        control message held), sent with the first request."""
        arr = np.ascontiguousarray(data, dtype="<f4").reshape(-1)
        per = SEED_CHUNK // 4
        for a in range(0, len(arr), per):
            part = arr[a:a + per]
            head = {"op": "seed", "iteration": iteration, "slot": slot,
                    "offset": offset + a, "count": len(part), "step": step}
            if context and a == 0:
                head.update(context)
            self.request(head, part)

    def status(self) -> dict[str, Any]:
        reply, _ = self.request({"op": "status"})
        return reply

    def check(self, iteration: int, digests: list[list[str]]) -> dict[str, Any]:
        """The state check of the newest committed ``iteration`` against ``digests``
        (checkmate.train.shadow_check): ``verified``, else ``diverged``'s line."""
        reply, _ = self.request({"op": "check", "iteration": iteration, "digests": digests})
        return reply

    def holdings(self) -> dict[str, Any]:
        """Iterations this shadow can serve: ``memory`` (retained) and ``disk``."""
        reply, _ = self.request({"op": "holdings"})
        return reply

    def fetch(self, iteration: int, source: str = "memory") -> Fetched:
        """This partition at ``iteration``, from the shadow's memory or its checkpoint."""
        head: dict[str, Any] = {"op": "fetch", "iteration": iteration}
        if source != "memory":
            head["source"] = source
        reply, data = self.request(head)
        count, names = int(reply["count"]), list(reply["slots"])
        if len(data) != 4 * count * len(names):
            raise ShadowError(f"shadow {self.addr[0]}:{self.addr[1]} sent {len(data)} bytes "
                              f"for {len(names)} slots of {count} elements")
        flat = np.frombuffer(data, dtype="<f4")
        slots = {n: flat[i * count:(i + 1) * count] for i, n in enumerate(names)}
        return Fetched(int(reply["iteration"]), int(reply["offset"]), count,
                       int(reply["step"]), slots, dict(reply.get("buffers") or {}),
                       dict(reply.get("extra") or {}), reply.get("lrs"))


# ----- all shadows ------------------------------------------------------------------------
def addrs_from_config(cfg: Any, port: int = RESTORE_PORT) -> list[Addr]:
    """Restore addresses of the config's shadows, in partition order."""
    return [(h.ip, port) for h in cfg.shadows]


def _statuses(addrs: Sequence[Addr], timeout: float) -> list[dict[str, Any]]:
    out = []
    for a in addrs:
        with ShadowClient(a, timeout) as c:
            out.append(c.status())
    return out


#: Seconds to wait for a shadow's kernels: a cold Numba cache (the first run after an
#: install) takes up to ~2 minutes on a loaded 2-core machine; an unloaded one, 30-60 s.
READY_TIMEOUT = 600.0


def kernels_state(status: Mapping[str, Any]) -> tuple[str, float, str]:
    """(``ready`` | ``compiling`` | ``failed``, seconds, error) from a status reply; a shadow
    that does not report its kernels compiled them before it answered (ready)."""
    k = status.get("kernels")
    if not isinstance(k, Mapping):
        return "ready", 0.0, ""
    return str(k.get("state", "ready")), float(k.get("seconds") or 0.0), str(k.get("error", ""))


def wait_ready(addrs: Sequence[Addr], timeout: float = READY_TIMEOUT,
               on_wait: Any = None, check: Any = None, poll: float = 0.5,
               silent_timeout: float | None = None) -> float:
    """Block until every shadow answers and its kernels are compiled; returns the seconds
    waited. ``on_wait(seconds)`` is called on every poll while one still compiles (for a
    progress line), ``check()`` on every poll (it may raise: a local shadow that exited).

    Training must not start before: a seed sent to a compiling shadow waits for the
    compiler and times out, and the job fails with nothing to restore. A shadow still
    compiling at ``timeout`` is one ShadowError line that says so (and that a cold Numba
    cache is why), one that does not answer is a line with its address and error -- after
    ``silent_timeout`` seconds (default: ``timeout``) of not answering: a wrong address
    need not wait as long as a compile."""
    t0 = time.monotonic()
    deadline = t0 + timeout
    silent_deadline = t0 + (timeout if silent_timeout is None else silent_timeout)
    pending = list(addrs)
    while True:
        if check is not None:
            check()
        still: list[Addr] = []
        last = ""
        for a in pending:
            try:
                with ShadowClient(a, max(1.0, min(10.0, deadline - time.monotonic()))) as c:
                    state, secs, err = kernels_state(c.status())
            except (CheckmateError, OSError) as e:
                if time.monotonic() >= silent_deadline:
                    raise ShadowError(f"shadow {a[0]}:{a[1]} does not answer: {e}; waited "
                                      f"{time.monotonic() - t0:.0f}s") from None
                still.append(a)
                last = f"shadow {a[0]}:{a[1]} does not answer: {e}"
                continue
            if state == "failed":
                raise ShadowError(f"shadow {a[0]}:{a[1]} could not compile its kernels: {err}")
            if state != "ready":
                still.append(a)
                last = (f"shadow {a[0]}:{a[1]} is still compiling its Numba kernels after "
                        f"{secs:.0f}s (a cold Numba cache: the first run after an install "
                        "compiles them once; `checkmate doctor` caches them ahead of a run)")
        pending = still
        waited = time.monotonic() - t0
        if not pending:
            return waited
        if time.monotonic() >= deadline:
            raise ShadowError(f"{last}; waited {timeout:.0f}s")
        if on_wait is not None:
            on_wait(waited)
        time.sleep(poll)


def consistent_point(addrs: Sequence[Addr], timeout: float = 10.0) -> int:
    """The newest iteration every partition retains: the only safe restore point.

    Each shadow retains its last few committed iterations, so the newest common one exists
    as long as no shadow is more than that many iterations ahead of the slowest.
    """
    if not addrs:
        raise CheckmateError("no shadow addresses given")
    sts = _statuses(addrs, timeout)
    parts = [s.get("partition") for s in sts]
    if sorted(parts) != list(range(len(addrs))):
        raise ShadowError(f"shadows report partitions {parts}; expected each of "
                          f"0..{len(addrs) - 1} once")
    common = set(sts[0].get("retained", []))
    for s in sts[1:]:
        common &= set(s.get("retained", []))
    if not common:
        have = {s["partition"]: s.get("retained", []) for s in sts}
        raise ShadowError(f"no iteration is retained by every shadow (retained: {have})")
    return max(common)


@dataclass
class FullState:
    """Every partition's slots at one iteration joined into flat arrays of length total."""

    iteration: int
    step: int
    slots: dict[str, np.ndarray]
    buffers: dict[str, str]
    extra: dict[str, Any]
    lrs: list[float] | None = None
    per_partition: list[Fetched] = field(default_factory=list, repr=False)


def fetch_all(addrs: Sequence[Addr], iteration: int, timeout: float = 60.0,
              spec: ModelSpec | None = None,
              sources: Sequence[str] | None = None) -> FullState:
    """Fetch ``iteration`` from every shadow and join the partitions.

    ``sources``: per shadow, ``memory`` (default) or ``disk`` (its checkpoint of that
    iteration). Checks that the partitions tile [0, total) exactly and agree on the step,
    so the result is one consistent state, never a mix.
    """
    got: list[Fetched] = []
    for i, a in enumerate(addrs):
        with ShadowClient(a, timeout) as c:
            got.append(c.fetch(iteration, sources[i] if sources else "memory"))
    got.sort(key=lambda f: f.offset)
    pos = 0
    for f in got:
        if f.offset != pos:
            raise ShadowError(f"partitions do not tile the flat space: gap or overlap at {pos}")
        pos += f.count
    if spec is not None and pos != spec.total:
        raise ShadowError(f"partitions cover {pos} elements, the spec has {spec.total}")
    steps = {f.step for f in got}
    if len(steps) != 1:
        raise ShadowError(f"shadows disagree on the optimizer step at {iteration}: {steps}")
    names = list(got[0].slots)
    if any(list(f.slots) != names for f in got):
        raise ShadowError("shadows hold different optimizer slots")
    slots = {n: np.concatenate([f.slots[n] for f in got]) for n in names}
    # Buffers and extra come from the control message, identical at every shadow.
    first = got[0]
    return FullState(iteration, first.step, slots, first.buffers, first.extra, first.lrs, got)


@dataclass
class Restored:
    """A job's state at one iteration, as torch state_dicts (see restore_state_dicts)."""

    model_sd: dict[str, Any]
    optim_sd: dict[str, Any]
    iteration: int
    step: int  # optimizer steps taken (the shadows' step count)
    buffers: dict[str, Any]
    extra: dict[str, Any]


def restore_point(addrs: Sequence[Addr], spec: ModelSpec | None = None,
                  iteration: int | None = None, timeout: float = 60.0,
                  sources: Sequence[str] | None = None) -> Restored:
    """The state at ``iteration`` (default: the consistent point) from every shadow;
    ``sources`` as in :func:`fetch_all`."""
    if spec is None:
        with ShadowClient(addrs[0], timeout) as c:
            spec = c.get_spec()
    if iteration is None:
        iteration = consistent_point(addrs, timeout)
    full = fetch_all(addrs, iteration, timeout, spec, sources)
    buffers = spec.decode_buffers(full.buffers)
    model_sd, optim_sd = spec.state_dicts(full.slots, full.step, buffers, full.lrs)
    return Restored(model_sd, optim_sd, iteration, full.step, buffers, full.extra)


def restore_state_dicts(
    addrs: Sequence[Addr], spec: ModelSpec | None = None, iteration: int | None = None,
    timeout: float = 60.0,
) -> tuple[dict[str, Any], dict[str, Any], int, dict[str, Any], dict[str, Any]]:
    """(model_sd, optim_sd, iteration, buffers, extra) at the consistent point.

    ``model_sd`` holds parameters and buffers (torch tensors), ``optim_sd`` is in
    torch.optim's format; ``buffers`` are the decoded buffer tensors, ``extra`` the trainer's
    opaque state from the control message of that iteration.
    """
    r = restore_point(addrs, spec, iteration, timeout)
    return r.model_sd, r.optim_sd, r.iteration, r.buffers, r.extra


def seed_share(
    addrs: Sequence[Addr], spec: ModelSpec, flat: Mapping[str, np.ndarray], rank: int,
    world: int, iteration: int = 0, step: int = 0, timeout: float = 60.0,
    context: dict[str, Any] | None = None,
) -> None:
    """Send this trainer's share of the initial state to every shadow.

    Each partition's range is cut into ``world`` contiguous pieces; rank r sends piece r of
    every slot, so the trainers together cover every partition once. ``context``: the
    version's buffers and extra (a rewind seeds an iteration that had a control message).
    """
    from checkmate.spec.partition import partition_bounds, share_bounds

    for p, (start, end) in enumerate(partition_bounds(spec.total, spec.partitions)):
        a, b = share_bounds(start, end, rank, world)
        with ShadowClient(addrs[p], timeout) as c:
            c.send_spec(spec)  # idempotent: whichever rank arrives first sets it
            for s in spec.slots:
                c.seed(iteration, s, a, flat[s][a:b], step, context)


def wait_seeded(addrs: Sequence[Addr], timeout: float = 60.0, poll: float = 0.05) -> None:
    """Block until every shadow reports seeded; ShadowError after ``timeout`` seconds."""

    deadline = time.monotonic() + timeout
    while True:
        sts = _statuses(addrs, timeout)
        if all(s.get("seeded") for s in sts):
            return
        if time.monotonic() > deadline:
            waiting = [s.get("partition") for s in sts if not s.get("seeded")]
            raise ShadowError(f"partitions {waiting} not seeded after {timeout:.0f}s")
        time.sleep(poll)
