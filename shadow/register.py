"""Shadow side of the handshake: register with the controller, get the session epoch/token.

The controller may be starting at the same time as the shadow, so requests are retried
with exponential backoff until a deadline (each try a fresh nonce: the controller refuses
replays); a NACK is a definite refusal and is not retried. Replies must carry the MAC bound
to the request's nonce; a refusal without one can only say "not authenticated" (the
controller could not verify the request: a different job secret) and is reported as such.
"""

from __future__ import annotations

import logging
import socket
import time

from checkmate import auth, handshake, wire
from checkmate.control.pfc import mark_ckm
from checkmate.errors import CheckmateError

log = logging.getLogger("checkmate.shadow")


def register(
    secret: bytes,
    controller: tuple[str, int],
    job: int,
    partition: int,
    host: str,
    ip: str,
    mac: str,
    port: int,
    deadline_s: float = 30.0,
    first_wait: float = 0.2,
    max_wait: float = 2.0,
) -> tuple[int, int]:
    """(epoch, token) of a new registration of ``partition``; CheckmateError on failure."""
    body = {"op": "register", "job": job, "partition": partition, "host": host, "ip": ip,
            "mac": mac, "port": port}
    key = auth.handshake_key(secret)
    end = time.monotonic() + deadline_s
    wait, seq, tries = first_wait, int(time.time() * 1000) & 0x7FFFFFFF, 0
    with mark_ckm(socket.socket(socket.AF_INET, socket.SOCK_DGRAM)) as s:
        while True:
            tries += 1
            seq = (seq + 1) & 0xFFFFFFFF
            req, nonce = handshake.request(key, job, seq, body, partition)
            try:
                s.sendto(req, controller)
            except OSError as e:
                log.warning("register: cannot send to %s:%d: %s", *controller, e)
            reply = handshake.await_reply(s, seq, key, [nonce],
                                          min(wait, max(end - time.monotonic(), 0.01)))
            if reply is not None:
                h, rb = reply.header, reply.body
                if h.flags & wire.Flags.NACK:
                    raise CheckmateError(f"controller {controller[0]}:{controller[1]} refused "
                                         f"registration: {rb.get('reason', rb)}")
                if rb.get("op") == "registered" and isinstance(rb.get("epoch"), int) \
                        and isinstance(rb.get("token"), int):
                    log.info("registered partition %d: epoch %d", partition, rb["epoch"])
                    return rb["epoch"], rb["token"]
                raise CheckmateError(f"controller answered register with {rb!r}")
            if time.monotonic() >= end:
                raise CheckmateError(f"controller {controller[0]}:{controller[1]} did not "
                                     f"answer {tries} register attempts in {deadline_s:.0f}s")
            wait = min(wait * 2, max_wait)
