"""The shadow TCP service's door: every new connection authenticates here, on one thread.

Without the job secret a peer must not be able to starve the service. So a connection gets
no thread and no buffer beyond ``AUTH_HEADER`` bytes until it has proven the secret: one
selector thread accepts, sends each connection its challenge, reads the ``auth`` frame
(length first: nothing longer than ``AUTH_HEADER`` is read, nothing is allocated for what
a peer merely announces) and checks it, all non-blocking. A connection that has not
authenticated within ``AUTH_SECONDS`` of its accept is closed (``tcp_unauthenticated``),
which frees its slot.

Slots for connections still authenticating are bounded per source address
(``PER_SOURCE_PENDING``) and in total (``MAX_PENDING``), and a new connection is never
turned away for lack of one: it takes the slot of the oldest connection of its own source
when that source is at its bound, else, when all are taken, the oldest of the source holding
the most (``tcp_evicted``). A flood from some addresses thus only ever displaces itself:
a client from another address always gets a slot, and a real client needs its slot for
one round trip. Authenticated connections are handed to ``on_auth`` (the service serves
them, at most ``MAX_CONNECTIONS`` at once, one thread each; more are told "busy" and
counted ``tcp_conn_cap``).
"""

from __future__ import annotations

import json
import logging
import selectors
import socket
import struct
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from checkmate.protocol import auth
from checkmate.ratelog import RateLimitedLog

log = logging.getLogger("checkmate.shadow")

#: Seconds a new connection has to authenticate.
AUTH_SECONDS = 5.0
#: Largest frame header before authentication.
AUTH_HEADER = 4096
#: Connections still authenticating, all sources together (a few KiB each, no thread).
MAX_PENDING = 256
#: Connections still authenticating from one source address.
PER_SOURCE_PENDING = 8
#: Longest the selector sleeps: how soon it notices a stop.
_TICK = 0.2

_LEN = struct.Struct("!I")


def _frame(obj: dict) -> bytes:
    text = json.dumps({**obj, "nbytes": 0}, separators=(",", ":")).encode()
    return _LEN.pack(len(text)) + text


@dataclass(eq=False)
class _Pending:
    sock: socket.socket
    source: str
    deadline: float
    challenge: str
    out: bytes
    inbuf: bytearray = field(default_factory=bytearray)


class Gate:
    """Accepts on ``listener`` and authenticates with ``key`` (auth.service_key) until
    stopped; ``on_auth(sock, source, challenge, nonce)`` gets each authenticated
    connection (blocking, nothing answered yet: it sends the proof, or refuses)."""

    def __init__(self, listener: socket.socket, key: bytes, drops: Counter,
                 on_auth: Callable[[socket.socket, str, str, str], None]) -> None:
        self.listener = listener
        self.key = key
        self.drops = drops
        self.on_auth = on_auth
        self._bad_log = RateLimitedLog(log.warning)
        self._by_source: dict[str, OrderedDict[_Pending, None]] = {}
        self._sel = selectors.DefaultSelector()
        self._stop = threading.Event()
        self.error = ""  # the last unexpected failure of the loop, for status
        self.restarts = 0

    # -- bookkeeping -----------------------------------------------------------------------
    @property
    def pending(self) -> int:
        return sum(len(v) for v in self._by_source.values())

    def pending_by_source(self) -> dict[str, int]:
        return {k: len(v) for k, v in self._by_source.items()}

    def _close(self, p: _Pending, reason: str | None = None, refusal: bytes = b"") -> None:
        group = self._by_source.get(p.source)
        if group is not None:
            group.pop(p, None)
            if not group:
                del self._by_source[p.source]
        try:
            self._sel.unregister(p.sock)
        except (KeyError, ValueError, OSError):
            pass
        if reason is not None:  # counted before the peer can see the close
            self.drops[reason] += 1
        if refusal:
            try:
                p.sock.send(refusal)  # best effort: a few bytes into an empty buffer
            except OSError:
                pass
        p.sock.close()

    def _make_room(self, source: str) -> None:
        """Free a slot for a new connection from ``source`` (see the module docstring)."""
        mine = self._by_source.get(source)
        if mine is not None and len(mine) >= PER_SOURCE_PENDING:
            victim = next(iter(mine))
        elif self.pending >= MAX_PENDING:
            worst = max(self._by_source.values(), key=len)
            victim = next(iter(worst))
        else:
            return
        self._bad_log(f"closed a connection from {victim.source} still authenticating: "
                      f"slots full")
        self._close(victim, "tcp_evicted")

    # -- the loop --------------------------------------------------------------------------
    def run(self) -> None:
        """Serve until stop(); an unexpected failure is logged, counted and the loop
        restarted (the state says so), never a silently dead door."""
        self.listener.setblocking(False)
        self._sel.register(self.listener, selectors.EVENT_READ)
        try:
            while not self._stop.is_set():
                try:
                    self._loop()
                except Exception as e:  # a bug, not input: say so loudly and go on
                    self.restarts += 1
                    self.error = f"{type(e).__name__}: {e}"
                    self.drops["tcp_gate_restarts"] += 1
                    log.exception("shadow service: authentication loop failed; restarting")
                    time.sleep(min(0.1 * self.restarts, 2.0))
        finally:
            for group in list(self._by_source.values()):
                for p in list(group):
                    self._close(p)
            self._sel.close()

    def stop(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        while not self._stop.is_set():
            now = time.monotonic()
            for group in list(self._by_source.values()):
                for p in list(group):
                    if p.deadline <= now:
                        self._bad_log(f"connection from {p.source} closed: not "
                                      f"authenticated within {AUTH_SECONDS:g}s")
                        self._close(p, "tcp_unauthenticated")
            first = min((next(iter(g)).deadline for g in self._by_source.values()),
                        default=now + _TICK)
            for key, mask in self._sel.select(max(0.0, min(first - now, _TICK))):
                if key.fileobj is self.listener:
                    self._accept()
                else:
                    self._io(key.data, mask)

    def _accept(self) -> None:
        for _ in range(64):  # a burst per wake-up; the rest on the next
            try:
                sock, peer = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                if self._stop.is_set():
                    return
                self._bad_log(f"accept failed: {e}")  # EMFILE and the like: try again later
                time.sleep(0.05)
                return
            source = peer[0]
            self._make_room(source)
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            challenge = auth.new_nonce()
            p = _Pending(sock, source, time.monotonic() + AUTH_SECONDS, challenge,
                         _frame({"ok": True, "service": "checkmate-shadow", "version": 1,
                                 "challenge": challenge}))
            self._by_source.setdefault(source, OrderedDict())[p] = None
            self._sel.register(sock, selectors.EVENT_READ | selectors.EVENT_WRITE, p)

    def _io(self, p: _Pending, mask: int) -> None:
        try:
            if mask & selectors.EVENT_WRITE and p.out:
                p.out = p.out[p.sock.send(p.out):]
                if not p.out:
                    self._sel.modify(p.sock, selectors.EVENT_READ, p)
            if mask & selectors.EVENT_READ:
                self._read(p)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            self._bad_log(f"connection from {p.source} failed before authenticating: {e}")
            self._close(p, "tcp_unauthenticated")

    def _read(self, p: _Pending) -> None:
        if len(p.inbuf) < _LEN.size:
            need = _LEN.size - len(p.inbuf)
        else:
            (n,) = _LEN.unpack_from(p.inbuf)
            if n > AUTH_HEADER:
                self._bad_log(f"connection from {p.source}: frame header of {n} bytes "
                              f"before authenticating (limit {AUTH_HEADER})")
                self._close(p, "tcp_unauthenticated")
                return
            need = _LEN.size + n - len(p.inbuf)
        chunk = p.sock.recv(need)
        if not chunk:
            self._bad_log(f"connection from {p.source} closed before authenticating")
            self._close(p, "tcp_unauthenticated")
            return
        p.inbuf += chunk
        if len(p.inbuf) >= _LEN.size:
            (n,) = _LEN.unpack_from(p.inbuf)
            if n <= AUTH_HEADER and len(p.inbuf) == _LEN.size + n:
                self._check(p, bytes(p.inbuf[_LEN.size:]))
            elif n > AUTH_HEADER:
                self._read(p)  # refuses it

    def _check(self, p: _Pending, text: bytes) -> None:
        refusal = _frame({"ok": False, "error": "not authenticated"})
        try:
            h = json.loads(text)
        except (ValueError, RecursionError):
            h = None
        if not isinstance(h, dict):
            self._bad_log(f"connection from {p.source}: not a JSON object before "
                          "authenticating")
            self._close(p, "tcp_unauthenticated", refusal)
            return
        nonce = h.get("nonce")
        if h.get("op") != "auth" or h.get("nbytes", 0) != 0 or not isinstance(nonce, str) \
                or not 16 <= len(nonce) <= 64 \
                or not auth.same(h.get("proof"), auth.client_proof(self.key, p.challenge,
                                                                   nonce)):
            self._bad_log(f"refused an unauthenticated {str(h.get('op'))[:40]!r} request "
                          f"from {p.source}")
            self._close(p, "tcp_unauthenticated", refusal)
            return
        # Authenticated: out of the door, into the service (which decides busy or served).
        group = self._by_source[p.source]
        group.pop(p, None)
        if not group:
            del self._by_source[p.source]
        self._sel.unregister(p.sock)
        p.sock.setblocking(True)
        p.sock.settimeout(AUTH_SECONDS)
        self.on_auth(p.sock, p.source, p.challenge, nonce)
