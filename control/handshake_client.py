"""The client of the controller's handshake service (control/service.py): one
authenticated request, retried within a timeout; the trainers ask it for sessions and
attempts, `control status` for its counters.
"""

from __future__ import annotations

import secrets
import socket
from typing import Any

from checkmate.control.pfc import mark_ckm
from checkmate.errors import CheckmateError
from checkmate.protocol import auth, handshake, wire


def controller_request(controller: tuple[str, int], job_id: int, body: dict[str, Any],
                       timeout: float = 2.0, tries: int = 5, secret: bytes | None = None
                       ) -> dict[str, Any]:
    """One authenticated handshake request to the controller (retried ``tries`` times
    within ``timeout``); its reply body, or one CheckmateError (refused, no answer).
    ``secret`` defaults to $CHECKMATE_SECRET_FILE's."""
    key = auth.handshake_key(secret if secret is not None else auth.load_secret())
    with mark_ckm(socket.socket(socket.AF_INET, socket.SOCK_DGRAM)) as s:
        seq, nonces = secrets.randbits(31), []
        for _ in range(tries):
            req, nonce = handshake.request(key, job_id, seq, {**body, "job": job_id})
            nonces.append(nonce)  # a late answer to an earlier try counts too
            s.sendto(req, controller)
            m = handshake.await_reply(s, seq, key, nonces, timeout / tries)
            if m is None:
                continue
            if not m.header.flags & wire.Flags.ACK:
                raise CheckmateError(f"controller refused {body.get('op')} request: "
                                     f"{m.body.get('reason')}")
            return m.body
    raise CheckmateError(f"controller {controller[0]}:{controller[1]} did not answer")
