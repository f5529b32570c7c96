"""The layout of a shadow's checkpoint directory (names, the format tag), its atomic-write
helpers and the one-line wording of disk errors, shared by the writer (persist) and the
reader (checkpoint_load)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

from checkmate.errors import CheckmateError

log = logging.getLogger("checkmate.shadow")

FORMAT = "checkmate-shadow-dcp/2"
_TMP_PREFIX = ".tmp-"
_ITER_PREFIX = "iter-"


class PersistError(CheckmateError):
    """A checkpoint that cannot be written or read; the message names the path."""


def _fsync_path(p: Path) -> None:
    fd = os.open(p, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json(p: Path, obj: Any) -> None:
    with open(p, "w") as f:
        json.dump(obj, f, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def _sha256(p: Path) -> str:
    h = hashlib.sha256()
    with open(p, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()


def part_dir(root: str | Path, partition: int) -> Path:
    return Path(root) / f"part{partition}"


#: A checkpoint whose iteration passed the state check (shadow/state_check.py) holds this
#: file; not in its manifest (written after the checkpoint, maybe long after).
VERIFIED = "verified"


def iter_dir(pdir: Path, iteration: int) -> Path:
    return pdir / f"{_ITER_PREFIX}{iteration:012d}"


def mark_verified(pdir: Path, iteration: int) -> bool:
    """Mark the checkpoint of ``iteration`` verified, if it is on disk; whether it was."""
    d = iter_dir(pdir, iteration)
    if not (d / "manifest.json").is_file():
        return False
    try:
        (d / VERIFIED).write_text(f"{iteration}\n")
    except OSError:
        return False  # pruned or purged meanwhile
    return True


def is_verified(pdir: Path, iteration: int) -> bool:
    return (iter_dir(pdir, iteration) / VERIFIED).is_file()


def _fatal(e: BaseException) -> bool:
    """Exceptions that must stop the process, not be counted as a failed write."""
    return isinstance(e, (KeyboardInterrupt, SystemExit))


def describe_error(e: BaseException) -> str:
    """One line naming the root cause of a failed read or write.

    torch.distributed.checkpoint wraps the real error of each rank in a CheckpointException
    (a BaseException, not an Exception) whose str() is a multi-line traceback; status and
    logs want just the cause.
    """
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        inner = next(iter(failures.values()))
        inner = inner[0] if isinstance(inner, tuple) and inner else inner
        if isinstance(inner, BaseException) and inner is not e:
            return describe_error(inner)
    if isinstance(e, OSError) and e.strerror:
        text = e.strerror
    else:
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        text = f"{type(e).__name__}: {lines[0] if lines else repr(e)}"
    return text if len(text) <= 300 else text[:297] + "..."


def _discard(*paths: Path) -> None:
    """Remove what a failed write left behind (temp dir, temp ``latest``), best effort."""
    for p in paths:
        try:
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
        except OSError as e:
            log.warning("cannot remove %s after a failed write: %s", p, e)


def _read_latest(pdir: Path) -> str | None:
    try:
        return (pdir / "latest").read_text().strip() or None
    except OSError:
        return None


def list_iterations(pdir: Path) -> list[int]:
    """Iterations with a complete (manifest written) checkpoint, ascending."""
    out = []
    if pdir.is_dir():
        for e in pdir.iterdir():
            if e.name.startswith(_ITER_PREFIX) and (e / "manifest.json").is_file():
                try:
                    out.append(int(e.name[len(_ITER_PREFIX):]))
                except ValueError:
                    continue
    return sorted(out)
