"""Job credentials: the per-job secret and the proofs built from it (docs/security.md).

Every component of one job shares a 32-byte secret, kept in a file (mode 0600) that
``testbed up`` and ``checkmate launch`` create. Processes find it through the environment
variable ``CHECKMATE_SECRET_FILE`` (a path, so the secret itself never appears on a command
line or in a log) or an explicit path. Nothing uses the secret directly: each use gets its
own key, HMAC-SHA256(secret, label), so a proof made for one protocol is worthless in
another.

- Handshake (UDP, to the controller): a request carries a nonce and a timestamp in its JSON
  and ends with HMAC-SHA256(handshake key, "req1" | ckm header but its CRC | JSON);
  the controller refuses timestamps more than ``SKEW`` seconds off and nonces it has seen
  (``ReplayGuard``). The reply ends with a MAC bound to the request's nonce.
- Shadow TCP service: challenge and response on each connection (``hello``), both ways, so
  neither side can be replayed (docs/protocol.md, "Shadow TCP service").
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
import time
from pathlib import Path

from checkmate.errors import CheckmateError

#: Environment variable naming the job secret's file.
SECRET_ENV = "CHECKMATE_SECRET_FILE"
SECRET_BYTES = 32
MAC_BYTES = 32
#: Largest clock difference a handshake timestamp may show, seconds.
SKEW = 30.0
#: Most nonces the controller remembers (one per request within the window).
REPLAY_CAP = 65536

_HS_LABEL = b"checkmate handshake v1"
_TCP_LABEL = b"checkmate shadow service v1"
#: Bytes of the ckm header a handshake MAC covers: all of it but the CRC (which covers the
#: payload, MAC included).
HEADER_COVERED = 52


class AuthError(CheckmateError):
    """A proof did not verify; the message says which and never includes key material."""


# ----- the secret ------------------------------------------------------------------------
def create_secret(path: Path | str) -> Path:
    """Write a fresh secret to ``path`` (mode 0600) unless one is already there."""
    p = Path(path)
    if p.exists():
        load_secret(p)  # an existing file must be a valid secret, not silently replaced
        return p
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, secrets.token_hex(SECRET_BYTES).encode() + b"\n")
    finally:
        os.close(fd)
    os.replace(tmp, p)
    return p


def secret_path(path: Path | str | None = None) -> Path:
    """The secret file: ``path`` if given, else ``$CHECKMATE_SECRET_FILE``."""
    if path is None:
        path = os.environ.get(SECRET_ENV)
    if not path:
        raise CheckmateError(f"no job secret: set {SECRET_ENV} to the job's secret file "
                             "(created by `testbed up` and `checkmate launch`, or by "
                             "`checkmate secret new FILE`; docs/security.md)")
    return Path(path)


def load_secret(path: Path | str | None = None) -> bytes:
    """The 32-byte job secret; one clear CheckmateError if it is missing or unsafe."""
    p = secret_path(path)
    try:
        st = p.stat()
        text = p.read_text().strip()
    except OSError as e:
        raise CheckmateError(f"job secret {p}: {e.strerror or e}") from None
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise CheckmateError(f"job secret {p} is readable by others (mode "
                             f"{stat.S_IMODE(st.st_mode):o}): chmod 600 it")
    try:
        key = bytes.fromhex(text)
    except ValueError:
        key = b""
    if len(key) != SECRET_BYTES:
        raise CheckmateError(f"job secret {p} must hold {2 * SECRET_BYTES} hex digits")
    return key


def _derive(secret: bytes, label: bytes) -> bytes:
    return hmac.new(secret, label, hashlib.sha256).digest()


def handshake_key(secret: bytes) -> bytes:
    return _derive(secret, _HS_LABEL)


def service_key(secret: bytes) -> bytes:
    return _derive(secret, _TCP_LABEL)


# ----- handshake MACs --------------------------------------------------------------------
def request_mac(key: bytes, header: bytes, body: bytes) -> bytes:
    """MAC of a handshake request: ``header`` is its first HEADER_COVERED bytes."""
    return hmac.new(key, b"req1" + header[:HEADER_COVERED] + body, hashlib.sha256).digest()


def reply_mac(key: bytes, header: bytes, nonce: str, body: bytes) -> bytes:
    """MAC of a reply, bound to the request's ``nonce``."""
    return hmac.new(key, b"rep1" + header[:HEADER_COVERED] + nonce.encode() + body,
                    hashlib.sha256).digest()


def new_nonce() -> str:
    return secrets.token_hex(16)


def now_ms() -> int:
    return int(time.time() * 1000)


class ReplayGuard:
    """Refuses handshake requests that are stale, from the future, or seen before.

    Remembers each accepted nonce for ``2 * skew`` seconds (a request older than ``skew``
    is refused anyway), at most ``cap`` of them: memory stays bounded under a flood.
    """

    def __init__(self, skew: float = SKEW, cap: int = REPLAY_CAP) -> None:
        self.skew, self.cap = skew, cap
        self._seen: dict[str, float] = {}

    def check(self, nonce: object, ts: object, now: float | None = None) -> None:
        now = time.time() if now is None else now
        if not isinstance(nonce, str) or not 16 <= len(nonce) <= 64:
            raise AuthError("request has no valid nonce")
        if not isinstance(ts, int) or isinstance(ts, bool):
            raise AuthError("request has no valid timestamp")
        if abs(ts / 1000 - now) > self.skew:
            raise AuthError(f"request timestamp is {ts / 1000 - now:+.0f}s off this clock "
                            f"(at most {self.skew:.0f}s)")
        if nonce in self._seen:
            raise AuthError("request replayed (nonce seen before)")
        if len(self._seen) >= self.cap:
            horizon = now - 2 * self.skew
            self._seen = {n: t for n, t in self._seen.items() if t >= horizon}
            if len(self._seen) >= self.cap:
                raise AuthError("too many requests in the replay window")
        self._seen[nonce] = now


# ----- shadow service proofs -------------------------------------------------------------
def client_proof(key: bytes, challenge: str, nonce: str) -> str:
    """What a client shows: it knows the key and saw this connection's challenge."""
    return hmac.new(key, b"client|" + challenge.encode() + b"|" + nonce.encode(),
                    hashlib.sha256).hexdigest()


def server_proof(key: bytes, challenge: str, nonce: str) -> str:
    """What the shadow shows back: it knows the key too (a client's fresh nonce in it)."""
    return hmac.new(key, b"server|" + challenge.encode() + b"|" + nonce.encode(),
                    hashlib.sha256).hexdigest()


def same(a: object, b: str) -> bool:
    """Constant-time comparison of a received proof with the expected one."""
    return isinstance(a, str) and hmac.compare_digest(a.encode(), b.encode())
