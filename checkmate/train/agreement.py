"""Decisions every rank of an attempt must share, made once and read through torch's store.

Rank 0 decides (where to resume, whether there is anything to resume from) and publishes
the answer in the c10d store of the rendezvous; every other rank reads that answer
instead of computing its own. So no two ranks can resume from different iterations, and
a refusal is the same one line on every rank. A rank that refuses exits, and when rank 0
exits torch's agent may take the attempt's store (and the other ranks) down with it: so
rank 0 publishes a refusal and waits until every rank has read it (each adds one to a
count of readers) before it raises, bounded by READ_TIMEOUT. Under ``checkmate launch``
(checkmate.train.run_script) a rank counts itself only once it has printed its line about
the refusal (``said``): when rank 0 exits, the agent stops the other ranks at once, and a
rank stopped before its line would say nothing. Two stores are used, both torch's:

* the attempt's store (the default process group's TCPStore, which torch's elastic agent
  makes anew for every rendezvous round): the restore point of this attempt;
* the job's rendezvous store (the c10d TCPStore at ``--rdzv-endpoint``, which lives as
  long as the job, across attempts and membership changes): the fact that the job's
  shadows were seeded, so that a worker group started again for any reason -- a failure,
  a node that joined, a spare that replaced a lost node, whose agent counts no restarts
  -- resumes instead of seeding the shadows anew over the job's checkpoints.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from checkmate.errors import CheckmateError

#: Seconds a rank waits for rank 0's answer (rank 0 may wait for restarting shadows).
ANSWER_TIMEOUT = 300.0
#: Seconds rank 0 waits, after publishing a refusal, for every rank to have read it.
READ_TIMEOUT = 60.0
#: Seconds a rank that read a refusal waits for ``said`` before counting itself anyway
#: (a script that catches the refusal and goes on must not hold rank 0 back for long).
SAY_GRACE = 2.0
#: Key prefix of Checkmate's entries in the job's rendezvous store (torch's own keys
#: live under ``torch.rendezvous.``).
PREFIX = "checkmate"


def attempt_store() -> Any:
    """The default process group's store: torch's TCPStore of this rendezvous round."""
    import torch.distributed as dist

    return dist.distributed_c10d._get_default_store()


def job_store(addr: tuple[str, int], run_id: str, timeout: float = 60.0) -> Any:
    """A client of the job's c10d rendezvous store at ``addr``, scoped to this run."""
    import torch.distributed as dist

    try:
        store = dist.TCPStore(addr[0], addr[1], is_master=False,
                              timeout=timedelta(seconds=timeout), use_libuv=True)
    except (RuntimeError, ValueError) as e:
        raise CheckmateError(f"cannot reach the job's rendezvous store at {addr[0]}:{addr[1]}"
                             f": {' '.join(str(e).split())[:200]}") from None
    return dist.PrefixStore(f"{PREFIX}/{run_id}/", store)


def decide(store: Any, key: str, rank: int, world: int, compute: Callable[[], Any],
           timeout: float = ANSWER_TIMEOUT, read_timeout: float = READ_TIMEOUT) -> Any:
    """Rank 0 runs ``compute`` and publishes its JSON result (or its CheckmateError) under
    ``key``; every one of the ``world`` ranks returns that one answer, or raises that one
    error -- rank 0 only once every other rank has read it (see the module docstring).

    The ranks of a process group make the same decisions in the same order, so the n-th
    decision on ``key`` of each rank is the same one: the published key carries n (counted
    per rank in the store), and a later decision never reads an earlier one's answer."""
    if rank == 0:
        key = f"{key}/{store.add(f'{key}/asked/{rank}', 1)}"
        try:
            answer: dict[str, Any] = {"ok": compute()}
        except CheckmateError as e:
            answer = {"error": str(e)}
        store.set(key, json.dumps(answer))
        if "error" in answer and world > 1:
            _wait_read(store, key, world, read_timeout)
    else:
        store.set_timeout(timedelta(seconds=timeout))
        asked = time.monotonic()
        try:
            key = f"{key}/{store.add(f'{key}/asked/{rank}', 1)}"
            raw = store.get(key)
        except RuntimeError as e:  # torch's DistStoreError derives from RuntimeError
            why = ' '.join(str(e).split())[:200]
            if time.monotonic() - asked < timeout / 2:  # the store is gone, not slow
                raise CheckmateError(f"the attempt's store closed before rank 0 published "
                                     f"{key!r} (rank 0 ended; its line says why): {why}"
                                     ) from None
            raise CheckmateError(f"rank 0 published no {key!r} within {timeout:.0f} s: "
                                 f"{why}") from None
        answer = json.loads(raw)
        if "error" in answer:
            _owe(lambda: _count_read(store, key, world))
    if "error" in answer:
        raise CheckmateError(answer["error"])
    return answer["ok"]


def _count_read(store: Any, key: str, world: int) -> None:
    """This rank has read (and said) the refusal under ``key``; the last one lets rank 0 go."""
    with contextlib.suppress(RuntimeError):  # rank 0 gone already: nobody waits
        if store.add(f"{key}/read", 1) == world - 1:
            store.set(f"{key}/read-by-all", "1")


_owed: list[Callable[[], None]] = []
_say_first = False


def say_first() -> None:
    """checkmate.train.run_script, at start: count this rank as a reader of a refusal only
    once ``said`` (after its line is printed), or SAY_GRACE seconds after reading it."""
    global _say_first
    _say_first = True


def said() -> None:
    """This rank's line about a refusal is out: count it as read now."""
    while _owed:
        _owed.pop()()


def _owe(count: Callable[[], None]) -> None:
    if not _say_first:
        count()
        return
    lock, done = threading.Lock(), [False]

    def once() -> None:
        with lock:
            if not done[0]:
                done[0] = True
                count()

    _owed.append(once)
    timer = threading.Timer(SAY_GRACE, once)
    timer.daemon = True
    timer.start()


def _wait_read(store: Any, key: str, world: int, timeout: float) -> None:
    """Rank 0, after publishing a refusal under ``key``: return once the other ``world - 1``
    ranks have read it, or after ``timeout`` seconds (a rank that never comes is the
    agent's to notice; the refusal is still this rank's line)."""
    try:
        store.wait([f"{key}/read-by-all"], timedelta(seconds=timeout))
    except RuntimeError:  # timed out (DistStoreError) or the store is gone
        pass


def mark(store: Any, key: str) -> None:
    """Record ``key`` in the job's store (e.g. ``seeded``)."""
    store.set(key, "1")


def marked(store: Any, key: str) -> bool:
    """Whether ``key`` was recorded (without waiting)."""
    return bool(store.check([key]))
