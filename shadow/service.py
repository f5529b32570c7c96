"""The shadow's TCP service (docs/protocol.md, "Shadow TCP service"): spec, seed, status,
fetch, and the reliability ops: peers (who to ask for repairs), reseed and reseed_piece (a
live re-seed, checkmate.shadow.reseed).

One thread per connection; requests on a connection are answered in order. A bad request
gets ``{"ok": false, "error": ...}`` and the connection stays usable; a malformed frame
closes it. Fetch pins the retained version while its bytes are sent, so the version cannot
be recycled underneath the reply.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable
from typing import Any

from checkmate.errors import CheckmateError
from checkmate.shadow.osname import name_thread
from checkmate.shadow.state import ShadowState
from checkmate.shadow_client import ShadowError, recv_frame, send_frame
from checkmate.spec import ModelSpec

log = logging.getLogger("checkmate.shadow")

#: Largest payload a request may carry (seed chunks are 64 MiB by default).
MAX_REQUEST = 256 << 20


class Service:
    def __init__(self, state: ShadowState, status: Callable[[bool], dict[str, Any]],
                 bind: str, port: int,
                 on_peers: Callable[[dict[str, Any]], None] | None = None,
                 on_progress: Callable[[int], None] | None = None) -> None:
        self.state = state
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
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._accept, name="shadow-tcp", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
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
        if self._thread is not None:
            self._thread.join(5)

    def _accept(self) -> None:
        name_thread()
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="shadow-conn",
                             daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        name_thread()
        try:
            while True:
                try:
                    header, payload = recv_frame(conn, MAX_REQUEST)
                except (ConnectionError, OSError):
                    return
                except ShadowError as e:
                    send_frame(conn, {"ok": False, "error": str(e)})
                    return
                try:
                    reply, parts = self.handle(header, payload)
                except (CheckmateError, ValueError, KeyError, TypeError) as e:
                    reply, parts = {"ok": False, "error": str(e) or type(e).__name__}, b""
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
        if op == "reseed":
            if "spec" in h:
                st.set_spec(ModelSpec.from_json(h["spec"]))
            reason = str(h.get("reason", ""))[:200]
            if "iteration" in h:
                st.begin_reseed(_int(h, "iteration"), reason)
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
        if op == "fetch":
            it = h.get("iteration")
            if not isinstance(it, int) or isinstance(it, bool):
                raise CheckmateError("fetch needs an integer 'iteration'")
            v = st.pin(it)
            spec = st.spec
            assert spec is not None
            reply = {"ok": True, "iteration": v.iteration, "offset": st.start,
                     "count": st.size, "slots": list(spec.slots), "step": v.step,
                     "buffers": v.buffers, "extra": v.extra, "lrs": v.lrs,
                     "_release": lambda: st.unpin(v)}
            return reply, [v.slots[s] for s in spec.slots]
        raise CheckmateError(f"unknown op {op!r} (ops: spec, seed, status, fetch, peers, "
                             "reseed, reseed_piece)")


def _int(h: dict[str, Any], key: str) -> int:
    v = h.get(key)
    if not isinstance(v, int) or isinstance(v, bool):
        raise CheckmateError(f"{h.get('op')} needs an integer {key!r}")
    return v
