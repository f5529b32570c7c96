"""Sibling re-seed: a replica that came back empty takes its partition's state from another
replica of the same partition, so the trainers send nothing but the few iterations it
missed meanwhile (repairs from their replica logs, as for any hole).

The source is a retained version of the sibling (its newest commit: a consistent snapshot,
fetched over the authenticated TCP service, as a restore fetches it); after installing it
the replica's assembler expects the next iteration, and the iterations the trainers sent
while it was empty are holes it asks the trainers to repair. Where they no longer hold them
the replica asks for a re-seed, which the trainers then send (the fallback). The version is
trusted as the trainers' state only if the sibling's state check passed on it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from checkmate.errors import CheckmateError
from checkmate.shadow.state import ShadowState

log = logging.getLogger("checkmate.shadow")

Addr = tuple[str, int]


def adopt(state: ShadowState, source: Addr, secret: bytes, timeout: float = 60.0) -> int:
    """Install the sibling at ``source``'s newest version of this partition into ``state``
    (which holds no state); returns its iteration. CheckmateError when the sibling serves
    another job, partition or cut, or holds nothing."""
    from checkmate.train.shadow_client import ShadowClient

    with ShadowClient(source, timeout, secret=secret) as c:
        st = c.status()
        if st.get("partition") != state.partition or st.get("partitions") != state.partitions:
            raise CheckmateError(f"the sibling at {source[0]}:{source[1]} serves partition "
                                 f"{st.get('partition')}/{st.get('partitions')}, not "
                                 f"{state.partition}/{state.partitions}")
        it = st.get("latest")
        if not isinstance(it, int) or isinstance(it, bool):
            raise CheckmateError(f"the sibling at {source[0]}:{source[1]} holds no state")
        spec = c.get_spec()
        got = c.fetch(it)
    lo, hi = spec.bounds(state.partition)
    if (got.offset, got.count, got.iteration) != (lo, hi - lo, it):
        raise CheckmateError(f"the sibling at {source[0]}:{source[1]} sent elements "
                             f"{got.offset}..{got.offset + got.count} of iteration "
                             f"{got.iteration}, not {lo}..{hi} of {it}")
    state.set_spec(spec)  # checks the job and the partition count against this shadow's
    verified = (st.get("state_check") or {}).get("verified_iteration") == it
    state.install(it, got.step, {k: v.copy() for k, v in got.slots.items()}, got.buffers,
                  got.extra, got.lrs, trusted=verified)
    return it


class SiblingReseed:
    """At most one sibling re-seed at a time, in a thread of its own (a fetch of a large
    partition outlasts any status request); ``status()`` is what the shadow reports."""

    def __init__(self, state: ShadowState, secret: bytes,
                 on_done: Callable[[int, Addr], None] | None = None) -> None:
        self.state, self.secret, self.on_done = state, secret, on_done
        self.source: Addr | None = None  # while one runs
        self.count = 0
        self.last = ""  # the last outcome, one line
        self._lock = threading.Lock()

    def start(self, source: Addr) -> bool:
        """Begin taking the state from ``source``; False when one runs already or the
        shadow holds state (nothing to do)."""
        with self._lock:
            if self.source is not None or self.state.seeded_iteration is not None:
                return False
            self.source = source
        threading.Thread(target=self._run, args=(source,), name="shadow-sibling",
                         daemon=True).start()
        return True

    def _run(self, source: Addr) -> None:
        where = f"{source[0]}:{source[1]}"
        try:
            it = adopt(self.state, source, self.secret)
        except (CheckmateError, OSError) as e:
            self.last = f"from the sibling at {where} failed: {e}"
            log.warning("partition %d: re-seed %s", self.state.partition, self.last)
        else:
            self.count += 1
            self.last = f"from the sibling at {where} at iteration {it}"
            log.warning("partition %d: re-seeded %s (the trainers sent nothing)",
                        self.state.partition, self.last)
            if self.on_done is not None:
                self.on_done(it, source)
        finally:
            with self._lock:
                self.source = None

    def status(self) -> dict[str, Any]:
        return {"running": None if self.source is None else list(self.source),
                "count": self.count, "last": self.last}
