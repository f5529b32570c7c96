"""The shadow's TCP service (docs/protocol.md, "Shadow TCP service"): spec, seed, status,
fetch, and the reliability ops: peers (who to ask for repairs), reseed and reseed_piece (a
live re-seed, checkmate.shadow.reseed).

The shadow speaks first: a challenge. The first request must be ``auth`` with a proof made
from the job secret (checkmate.protocol.auth); the answer carries the shadow's proof. Until
then a connection lives in the gate (checkmate.shadow.gate): no thread, at most 4 KiB read,
``AUTH_SECONDS`` to prove the secret, slots bounded per source address and in total so that
a flood from other addresses cannot keep a real client out; anything else closes it and is
counted (``tcp_unauthenticated``, ``tcp_evicted``). Afterwards each op's payload is
checked against what that op can need for this partition before it is read, and read
into a buffer that grows with the bytes that arrive (a stalled sender pins only what it
sent).

At most ``MAX_CONNECTIONS`` authenticated connections are served at once, one thread each
(more are told "busy" and counted, ``tcp_conn_cap``); a connection idle for
``IDLE_SECONDS`` is closed. Requests on a connection are answered in order. A bad request
gets ``{"ok": false, "error": ...}`` and the connection stays usable (``tcp_refused``); a
malformed frame closes it (``tcp_malformed``). Every op checks all its fields before it
changes any state, so a refused request changes nothing. Fetch pins the retained version
while its bytes are sent, so the version cannot be recycled underneath the reply.
``health()`` says whether the gate's thread is alive and how often it was restarted (status
``tcp_service``).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from checkmate.errors import CheckmateError
from checkmate.protocol import auth
from checkmate.protocol.frames import SEED_CHUNK, ShadowError, recv_frame, send_frame
from checkmate.ratelog import RateLimitedLog
from checkmate.shadow import gate
from checkmate.shadow.osname import name_thread
from checkmate.shadow.state import ShadowState
from checkmate.spec.model import ModelSpec

log = logging.getLogger("checkmate.shadow")

#: Authenticated connections served at once.
MAX_CONNECTIONS = 32
#: Seconds an authenticated connection may wait between requests (and one request may take
#: to arrive).
IDLE_SECONDS = 600.0


class Service:
    def __init__(self, state: ShadowState, status: Callable[[bool], dict[str, Any]],
                 bind: str, port: int, secret: bytes, drops: Counter | None = None,
                 on_peers: Callable[[dict[str, Any]], None] | None = None,
                 on_progress: Callable[[int], None] | None = None,
                 disk_dir: Path | None = None,
                 on_session: Callable[[], dict[str, Any]] | None = None,
                 on_adopt: Callable[[tuple[str, int]], bool] | None = None) -> None:
        self.state = state
        #: ``adopt``: take this partition's state from a sibling replica (shadow.sibling)
        self.on_adopt = on_adopt
        #: ``session``: a launcher's new attempt was programmed under a new epoch; the
        #: shadow asks the controller itself (checkmate.shadow.node._on_session).
        self.on_session = on_session
        #: This partition's checkpoint directory (disk.part_dir): ``holdings`` lists what
        #: it holds and ``fetch`` with ``source: disk`` serves from it (a resume from disk).
        self.disk_dir = disk_dir
        #: The iteration the shadow reloaded from disk at start (None: none), so a resume
        #: from it is not reported as one from memory the shadow kept.
        self.reloaded: int | None = None
        self.key = auth.service_key(secret)
        self.drops = drops if drops is not None else Counter()
        self._bad_log = RateLimitedLog(log.warning)
        self.status = status
        self.on_peers = on_peers
        self.on_progress = on_progress
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.sock.bind((bind, port))
        except OSError as e:
            self.sock.close()
            raise CheckmateError(f"cannot bind TCP {bind}:{port}: {e.strerror or e}") from None
        self.sock.listen(128)
        self.port = self.sock.getsockname()[1]
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self.gate = gate.Gate(self.sock, self.key, self.drops, self._admit)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run_gate, name="shadow-tcp",
                                        daemon=True)
        self._thread.start()

    def _run_gate(self) -> None:
        name_thread()
        self.gate.run()

    def health(self) -> dict[str, Any]:
        """The service's threads as status shows them: the gate alive (False after start
        means no new client can get in), its restarts and last failure, connections."""
        with self._lock:
            served = len(self._conns)
        return {"alive": self._thread is not None and self._thread.is_alive(),
                "restarts": self.gate.restarts, "error": self.gate.error,
                "served": served, "authenticating": self.gate.pending}

    def stop(self) -> None:
        self._stop.set()
        self.gate.stop()
        if self._thread is not None:
            self._thread.join(5)
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        with self._lock:
            for c in list(self._conns):
                try:
                    c.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def _admit(self, conn: socket.socket, source: str, challenge: str, nonce: str) -> None:
        """An authenticated connection from the gate: served on a thread of its own, or
        told "busy" when ``MAX_CONNECTIONS`` are served already."""
        with self._lock:
            full = len(self._conns) >= MAX_CONNECTIONS
            if not full:
                self._conns.add(conn)
        try:
            if full:
                self.drops["tcp_conn_cap"] += 1
                self._bad_log(f"refused {source}: {MAX_CONNECTIONS} connections served")
                send_frame(conn, {"ok": False, "error": f"busy: {MAX_CONNECTIONS} "
                                  "connections served already"})
                conn.close()
                return
            send_frame(conn, {"ok": True, "proof": auth.server_proof(self.key, challenge,
                                                                     nonce)})
        except OSError:
            with self._lock:
                self._conns.discard(conn)
            conn.close()
            return
        threading.Thread(target=self._serve, args=(conn,), name="shadow-conn",
                         daemon=True).start()

    def _payload_limit(self, h: dict[str, Any]) -> int:
        """The most payload bytes ``h``'s op can need for this partition."""
        st = self.state
        if st.spec is None:
            if h.get("op") in ("seed", "reseed_piece"):
                raise ShadowError(f"{h.get('op')}: no spec yet: send the spec first")
            return 0
        if h.get("op") == "seed":
            return min(SEED_CHUNK, 4 * st.size)
        if h.get("op") == "reseed_piece":
            return 4 * st.size * len(st.spec.slots)
        return 0

    def _serve(self, conn: socket.socket) -> None:
        name_thread()
        try:
            while True:
                try:
                    conn.settimeout(IDLE_SECONDS)
                    header, payload = recv_frame(conn, self._payload_limit, deadline=(
                        time.monotonic() + IDLE_SECONDS))
                except (ConnectionError, OSError):
                    return
                except ShadowError as e:  # a malformed frame: refused, connection closed
                    self.drops["tcp_malformed"] += 1
                    self._bad_log(f"refused a frame: {e}")
                    send_frame(conn, {"ok": False, "error": str(e)})
                    return
                try:
                    reply, parts = self.handle(header, payload)
                except (CheckmateError, ValueError, KeyError, TypeError) as e:
                    # refused: the op checked everything before it changed anything
                    self.drops["tcp_refused"] += 1
                    self._bad_log(f"refused {str(header.get('op'))[:40]!r}: {e}")
                    reply, parts = {"ok": False, "error": str(e) or type(e).__name__}, b""
                except Exception as e:  # a bug, not the peer's mistake: said, not fatal
                    self.drops["tcp_internal_error"] += 1
                    log.exception("shadow service: %r failed", str(header.get("op"))[:40])
                    reply, parts = {"ok": False, "error": f"internal error: "
                                    f"{type(e).__name__}: {e}"}, b""
                release = reply.pop("_release", None)
                try:
                    send_frame(conn, reply, parts)
                except OSError:
                    return
                finally:
                    if release is not None:
                        release()
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def handle(self, h: dict[str, Any], payload: memoryview) -> tuple[dict[str, Any], Any]:
        op = h.get("op")
        st = self.state
        if op == "status":
            done = h.get("progress")
            if done is not None:
                if not isinstance(done, int) or isinstance(done, bool) or done < 0:
                    raise CheckmateError("status 'progress' must be a non-negative integer")
                if self.on_progress is not None:
                    self.on_progress(done)
            return {"ok": True, **self.status(h.get("commit_times") is True)}, b""
        if op == "peers":
            if self.on_peers is None:
                raise CheckmateError("this shadow takes no peers")
            self.on_peers(h)
            return {"ok": True}, b""
        if op == "session":
            if self.on_session is None:
                raise CheckmateError("this shadow has no controller session (--no-register)")
            return {"ok": True, **self.on_session()}, b""
        if op == "adopt":
            src = h.get("from")
            if not (isinstance(src, list) and len(src) == 2 and isinstance(src[0], str)
                    and isinstance(src[1], int) and not isinstance(src[1], bool)
                    and 0 < src[1] < 65536):
                raise CheckmateError("adopt needs 'from': [IP, PORT] of a sibling replica")
            if self.on_adopt is None:
                raise CheckmateError("this shadow takes no sibling re-seed")
            return {"ok": True, "started": self.on_adopt((src[0], src[1]))}, b""
        if op == "reseed":
            # Every field is checked before anything changes: a refused reseed leaves the
            # shadow as it was (its spec included).
            if "spec" not in h:
                raise CheckmateError("reseed needs 'spec': the job's spec")
            spec = ModelSpec.from_json(h["spec"])
            t0 = _int(h, "iteration") if "iteration" in h else None
            if t0 is not None and t0 < 0:
                raise CheckmateError("reseed iteration must be >= 0")
            reason = str(h.get("reason", ""))[:200]
            st.set_spec(spec)  # the same spec again, or the first: checked, then set
            if t0 is not None:
                st.begin_reseed(t0, reason)
            else:
                st.prepare_reseed(reason)
            return {"ok": True}, b""
        if op == "reseed_piece":
            it, step, off, cnt = (_int(h, k) for k in ("iteration", "step", "offset", "count"))
            spec = st.spec
            if spec is None:
                raise CheckmateError("no spec yet: send the reseed op first")
            slots = h.get("slots")
            if slots != list(spec.slots):
                raise CheckmateError(f"reseed_piece slots must be {list(spec.slots)}")
            if len(payload) != 4 * cnt * len(slots):
                raise CheckmateError(f"reseed_piece carries {len(payload)} bytes for {cnt} "
                                     f"elements x {len(slots)} slots")
            import numpy as np

            flat = np.frombuffer(payload, dtype="<f4")
            arrays = {s: flat[i * cnt:(i + 1) * cnt] for i, s in enumerate(slots)}
            done = st.reseed_piece(it, step, off, cnt, arrays)
            return {"ok": True, "committed": done}, b""
        if op == "spec":
            if "spec" not in h:
                if st.spec is None:
                    raise CheckmateError("no spec set yet")
                return {"ok": True, "spec": st.spec.to_json()}, b""
            st.set_spec(ModelSpec.from_json(h["spec"]))
            return {"ok": True}, b""
        if op == "seed":
            for k in ("iteration", "offset", "count", "step"):
                if not isinstance(h.get(k), int) or isinstance(h.get(k), bool):
                    raise CheckmateError(f"seed needs an integer {k!r}")
            seeded = st.seed(h["iteration"], str(h.get("slot")), h["offset"], h["count"],
                             h["step"], payload, h.get("buffers"), h.get("extra"))
            return {"ok": True, "seeded": seeded}, b""
        if op == "holdings":
            return {"ok": True, **self.holdings()}, b""
        if op == "check":
            from checkmate.shadow.state_check import check_newest

            return {"ok": True, **check_newest(st, _int(h, "iteration"), h.get("digests"))}, b""
        if op == "fetch":
            it = h.get("iteration")
            if not isinstance(it, int) or isinstance(it, bool):
                raise CheckmateError("fetch needs an integer 'iteration'")
            if h.get("source", "memory") == "disk":
                return self._fetch_disk(it)
            if h.get("source", "memory") != "memory":
                raise CheckmateError("fetch 'source' must be memory or disk")
            v = st.pin(it)
            spec = st.spec
            assert spec is not None
            reply = {"ok": True, "iteration": v.iteration, "offset": st.start,
                     "count": st.size, "slots": list(spec.slots), "step": v.step,
                     "buffers": v.buffers, "extra": v.extra, "lrs": v.lrs,
                     "_release": lambda: st.unpin(v)}
            return reply, [v.slots[s] for s in spec.slots]
        raise CheckmateError(f"unknown op {str(op)[:40]!r} (ops: spec, seed, status, fetch, "
                             "holdings, check, peers, reseed, reseed_piece)")

    def holdings(self) -> dict[str, Any]:
        """What a resume may restore from here: iterations in memory and on disk."""
        from checkmate.shadow import disk as ckpt_disk
        from checkmate.shadow import persist

        st = self.state
        disk = persist.restorable_iterations(self.disk_dir) if self.disk_dir else []
        verified = set(st.verified_retained())
        if self.disk_dir:
            verified |= {it for it in disk if ckpt_disk.is_verified(self.disk_dir, it)}
        return {"partition": st.partition, "partitions": st.partitions,
                "has_spec": st.spec is not None, "memory": st.retained(), "disk": disk,
                "verified": sorted(verified),
                "reloaded": self.reloaded,
                "latest": st.latest, "dir": str(self.disk_dir) if self.disk_dir else None}

    def _fetch_disk(self, it: int) -> tuple[dict[str, Any], Any]:
        """One iteration of this partition read from its checkpoint (verified against its
        manifest), for a resume whose consistent point no shadow holds in memory any more."""
        from checkmate.shadow import checkpoint_load

        st = self.state
        if self.disk_dir is None:
            raise CheckmateError("this shadow persists nothing (no --dir)")
        ck = checkpoint_load.load_partition(self.disk_dir / f"iter-{it:012d}")
        m = ck.meta
        if m.get("seeded"):
            raise CheckmateError(f"checkpoint of iteration {it} is a seed point, not "
                                 "restorable")
        if m["partition"] != st.partition:
            raise CheckmateError(f"checkpoint of iteration {it} holds partition "
                                 f"{m['partition']}, this shadow serves {st.partition}")
        if st.spec is not None and ck.spec.dumps() != st.spec.dumps():
            raise CheckmateError(f"checkpoint of iteration {it} was written for another "
                                 "spec than this shadow holds")
        reply = {"ok": True, "iteration": it, "offset": m["start"],
                 "count": m["end"] - m["start"], "slots": list(ck.spec.slots),
                 "step": m["step"], "buffers": m["buffers"], "extra": m["extra"],
                 "lrs": m["lrs"], "source": "disk"}
        return reply, [ck.slots[s] for s in ck.spec.slots]


def _int(h: dict[str, Any], key: str) -> int:
    v = h.get(key)
    if not isinstance(v, int) or isinstance(v, bool):
        raise CheckmateError(f"{h.get('op')} needs an integer {key!r}")
    return v
