"""Why a worker failed, in one line, for the worker's own output and for the launcher.

Every worker of ``checkmate launch`` ends a failure with one line on stderr
(checkmate.train.run_script) and records the same line in the job's log directory
(``$CHECKMATE_LOG_DIR/failures/attempt-A-rank-R.txt``), so that the launcher's last line can
name the rank that failed first and why -- the other ranks mostly fail because it did ("a
peer of the process group is gone"). An exception the script raised is one line too; its
traceback goes to a file beside it, which the line names.
"""

from __future__ import annotations

import os
import signal
import time
import traceback
from pathlib import Path
from typing import Any

#: The launcher's log directory, where workers record their failures (set by the launcher).
LOG_DIR = "CHECKMATE_LOG_DIR"
#: The restart count torch's agent gives each worker.
RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"
#: Failures that only follow another rank's: its peers lost it, or the agent stopped them.
CONSEQUENCES = ("a peer of the process group is gone", "killed by signal SIGTERM")


#: Frames here are not the script's line (checkmate's, the standard library's; and any
#: installed package's, under site-packages).
_LIBRARIES = tuple(str(Path(m).resolve().parent) + os.sep for m in (
    __import__("checkmate").__file__, __import__("runpy").__file__))


def _dir() -> Path | None:
    d = os.environ.get(LOG_DIR)
    return Path(d) / "failures" if d else None


def _name(rank: str | int, attempt: str | int) -> str:
    return f"attempt-{attempt}-rank-{rank}"


def record(line: str, rank: str) -> None:
    """Keep this worker's failure line for the launcher (nothing without a log dir)."""
    d = _dir()
    if d is None:
        return
    try:
        d.mkdir(parents=True, exist_ok=True)
        attempt = os.environ.get(RESTART_COUNT, "0")
        (d / f"{_name(rank, attempt)}.txt").write_text(f"{time.time():.6f} {line}\n")
    except OSError:
        pass  # the line is on stderr anyway


STOPPED = "stopped.txt"


def record_stop(line: str) -> None:
    """The job is to end, not restart (a divergence under ``--on-divergence stop``): every
    rank that found it writes ``line``. The ranks still fail (a clean exit would leave the
    ranks of other mesh groups waiting in their collectives), the next attempt's workers see
    the file and end at once without training (``stop_recorded``), and the launcher says the
    line and exits non-zero. Nothing without a log dir: the ranks' lines are all there is."""
    d = _dir()
    if d is None:
        return
    try:
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / f"{STOPPED}.{os.getpid()}.tmp"
        tmp.write_text(f"{line}\n")
        tmp.replace(d / STOPPED)
    except OSError:
        pass


def stop_recorded() -> bool:
    """Whether an earlier attempt of this launch recorded a stop (``record_stop``)."""
    d = _dir()
    return d is not None and (d / STOPPED).is_file()


def stopped(log_dir: Path | str) -> str | None:
    """The line a rank left with ``record_stop`` under ``log_dir``, or None."""
    try:
        return (Path(log_dir) / "failures" / STOPPED).read_text().strip() or None
    except OSError:
        return None


def record_rewind(iteration: int) -> None:
    """Make the launcher's next attempt resume at ``iteration`` rather than at the newest
    iteration the shadows hold (the data-parallel copies diverged after it: the newer ones
    may carry the corruption, checkmate.train.replica_check). Every rank writes it, so rank 0
    of the next attempt finds it on whichever node it runs; nothing without a log dir."""
    d = _dir()
    if d is None:
        return
    attempt = int(os.environ.get(RESTART_COUNT, "0")) + 1
    try:
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / f"rewind-attempt-{attempt}.{os.getpid()}.tmp"
        tmp.write_text(f"{iteration}\n")
        tmp.replace(d / f"rewind-attempt-{attempt}.txt")
    except OSError:
        pass  # the next attempt resumes at the newest iteration, as without a log dir


def rewind_for(attempt: int) -> int | None:
    """The iteration attempt ``attempt`` must resume at (``record_rewind``), or None."""
    d = _dir()
    if d is None:
        return None
    try:
        return int((d / f"rewind-attempt-{attempt}.txt").read_text())
    except (OSError, ValueError):
        return None


def describe(exc: BaseException, rank: str) -> str:
    """One line for an exception the script raised: its type, message and innermost frame
    of the script; the traceback is written to a file the line names (or, without a log
    directory, the line says so)."""
    msg = " ".join(str(exc).split()) or "(no message)"
    if len(msg) > 300:
        msg = msg[:297] + "..."
    frames = traceback.extract_tb(exc.__traceback__)
    mine = [f for f in frames if not f.filename.startswith(_LIBRARIES)
            and f"{os.sep}site-packages{os.sep}" not in f.filename] or frames
    where = f" at {os.path.basename(mine[-1].filename)}:{mine[-1].lineno}" if mine else ""
    d = _dir()
    tail = "; rerun with the checkmate launch --dir option to keep its traceback"
    if d is not None:
        try:
            d.mkdir(parents=True, exist_ok=True)
            path = d / f"{_name(rank, os.environ.get(RESTART_COUNT, '0'))}.traceback"
            path.write_text("".join(traceback.format_exception(exc)))
            tail = f"; traceback in {path}"
        except OSError:
            pass
    return f"{type(exc).__name__}: {msg}{where}{tail}"


def first_failure(log_dir: Path | str, attempt: int, failures: dict[int, Any]
                  ) -> tuple[int, str] | None:
    """(rank, reason) of the rank whose failure set off the others in ``attempt``: a rank
    whose reason is not only the loss of a peer (its line, or the signal or exit code it
    died with), the earliest such; None when nothing failed."""
    d = Path(log_dir) / "failures"
    found = []
    for rank, f in failures.items():
        when, reason = float(getattr(f, "timestamp", 0) or 0), _exit(f)
        path = d / f"{_name(rank, attempt)}.txt"
        try:
            stamp, _, line = path.read_text().strip().partition(" ")
            when, reason = float(stamp), line.removeprefix(f"checkmate: rank {rank}: ")
        except (OSError, ValueError):
            pass
        found.append((any(c in reason for c in CONSEQUENCES), when, rank, reason))
    if not found:
        return None
    _, _, rank, reason = min(found)
    return rank, reason


def _exit(f: Any) -> str:
    code = getattr(f, "exitcode", None)
    if isinstance(code, int) and code < 0 and -code in signal.valid_signals():
        return f"killed by signal {signal.Signals(-code).name}"
    return f"exit code {code}"
