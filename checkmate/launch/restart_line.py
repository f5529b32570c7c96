"""The launcher's one line when torch's agent restarts a failed worker group: what failed.

On several nodes a lost node leaves no trace on the survivors but their own workers'
failures: each stops because a peer went silent (the ring's stall timeout, or gloo's reset
connection), and records so (checkmate.train.failures). A restart whose every failure here
is of that kind is reported as a trainer on another node gone silent -- a lost node, or a
failed trainer there -- not as "a trainer failed", which would send the user looking for a
crash on this node that never happened.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from checkmate.train import failures

#: What a worker's failure line says when it stopped only because a peer went silent.
PEER_GONE = ("a peer is gone", "a peer of the process group is gone")


def _process_start() -> float:
    """When this process started (wall clock): records older than the launcher, in a
    reused --dir, are not this job's. 0.0 where /proc does not say."""
    try:
        with open("/proc/stat") as f:
            boot = next(int(ln.split()[1]) for ln in f if ln.startswith("btime"))
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return 0.0


#: Failure records after this time belong to the next restart line.
_since = _process_start()


def recent_failures(log_dir: str | Path | None, since: float) -> list[str]:
    """The failure lines this node's workers recorded after ``since``."""
    if not log_dir:
        return []
    out = []
    for path in sorted((Path(log_dir) / "failures").glob("attempt-*-rank-*.txt")):
        try:
            stamp, _, line = path.read_text().strip().partition(" ")
            if float(stamp) > since:
                out.append(line)
        except (OSError, ValueError):
            continue
    return out


def _local_workers() -> int:
    """This node's workers in a job of several nodes (the launcher's environment names
    their addresses); 0 on one node, where no peer is on another node."""
    from checkmate.train import env as envmod

    addrs = os.environ.get(envmod.LOCAL_TRAINERS, "")
    return len([a for a in addrs.split(",") if a])


def restart_line(agent_message: str, prog: str, log_dir: str | Path | None = None,
                 local_workers: int | None = None) -> str:
    """One line for torch's "Worker group FAILED. K/R attempts left; will restart worker
    group" (``agent_message``), from the failures recorded since the last restart: another
    node is named only when every one of this node's ``local_workers`` recorded that a
    peer went silent (a worker killed here records nothing)."""
    global _since
    left = agent_message.split(". ", 1)[1].split(";")[0] if ". " in agent_message else ""
    log_dir = log_dir if log_dir is not None else os.environ.get(failures.LOG_DIR)
    local_workers = _local_workers() if local_workers is None else local_workers
    lines = recent_failures(log_dir, _since)
    _since = time.time()
    if log_dir is not None and failures.stopped(log_dir) is not None:
        return (f"{prog}: the data-parallel copies diverged and the job stops "
                f"(--on-divergence stop): the next attempt ends without training")
    if (local_workers and len(lines) >= local_workers
            and all(any(p in ln for p in PEER_GONE) for ln in lines)):
        why = lines[0].removeprefix("checkmate: ")
        return (f"{prog}: a trainer on another node went silent (a lost node, or a failed "
                f"trainer there); this node's workers stopped waiting for it ({why}); "
                f"restarting the worker group ({left}); it resumes from its checkpoints")
    return (f"{prog}: a trainer failed; restarting the worker group ({left}); it resumes "
            "from its checkpoints")
