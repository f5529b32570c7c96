"""Reading what shadows persisted: one partition's checkpoint verified and loaded, the
newest valid one, the newest iteration every partition holds, and partitions joined into
the full model and optimizer state."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from checkmate.shadow import torch_layout
from checkmate.shadow.disk import (
    _ITER_PREFIX,
    FORMAT,
    VERIFIED,
    PersistError,
    _fatal,
    _read_latest,
    _sha256,
    describe_error,
    list_iterations,
    log,
    part_dir,
)
from checkmate.spec.model import ModelSpec


def _keys(spec: ModelSpec, start: int, end: int) -> list[tuple[str, int, int, int, int]]:
    """(param, lo, hi, a, b): param slice [lo, hi) is partition-local [a, b)."""
    return [(p.name, lo, hi, p.offset + lo - start, p.offset + hi - start)
            for p, lo, hi in spec.pieces(start, end)]


def newest_common(root: str | Path, partitions: int) -> int | None:
    """Newest iteration that every partition dir ``root/part0..part<n-1>`` holds complete.

    Complete means the manifest is there (it is written before the rename), as in
    :func:`list_iterations`; None if a partition dir is missing or nothing is shared.
    """
    common: set[int] | None = None
    for q in range(partitions):
        d = part_dir(root, q)
        if not d.is_dir():
            return None
        its = set(list_iterations(d))
        common = its if common is None else common & its
        if not common:
            return None
    return max(common) if common else None


def verify(ckpt: Path) -> dict[str, Any]:
    """ckm.json of a checkpoint after checking every file against the manifest."""
    try:
        manifest = json.loads((ckpt / "manifest.json").read_text())
        files = sorted(f for f in os.listdir(ckpt) if f not in ("manifest.json",
                                                                  VERIFIED))
    except (OSError, ValueError) as e:
        raise PersistError(f"checkpoint {ckpt} has no readable manifest: {e}") from None
    if sorted(manifest) != files:
        raise PersistError(f"checkpoint {ckpt}: files {files} do not match the manifest")
    for f, digest in manifest.items():
        if _sha256(ckpt / f) != digest:
            raise PersistError(f"checkpoint {ckpt}: {f} fails its sha256 check")
    meta = json.loads((ckpt / "ckm.json").read_text())
    if meta.get("format") != FORMAT:
        raise PersistError(f"checkpoint {ckpt} is not in {FORMAT} format")
    return meta


@dataclass


class PartitionCheckpoint:
    meta: dict[str, Any]
    spec: ModelSpec
    slots: dict[str, np.ndarray]  # partition-local fp32 arrays


def load_partition(ckpt: Path) -> PartitionCheckpoint:
    """One verified partition checkpoint, read with dcp.load into views of its arrays."""
    meta = verify(ckpt)
    spec = ModelSpec.from_json(meta["spec"])
    if [meta["start"], meta["end"]] != list(spec.bounds(meta["partition"])):
        raise PersistError(f"checkpoint {ckpt}: bounds [{meta['start']}, {meta['end']}) are "
                           f"not partition {meta['partition']}'s")
    try:
        slots = torch_layout.read_slots(ckpt, spec, meta["partition"], meta["step"])
    except BaseException as e:  # DCP raises assorted types, CheckpointException too
        if _fatal(e):
            raise
        raise PersistError(f"checkpoint {ckpt} cannot be loaded: "
                           f"{describe_error(e)}") from None
    return PartitionCheckpoint(meta, spec, slots)


def latest_valid(pdir: Path) -> PartitionCheckpoint | None:
    """The newest checkpoint of a partition directory that verifies (``latest`` first)."""
    names = []
    latest = _read_latest(pdir)
    if latest:
        names.append(latest)
    names += [f"{_ITER_PREFIX}{it:012d}" for it in reversed(list_iterations(pdir))]
    seen = set()
    for name in names:
        if name in seen:
            continue
        seen.add(name)
        try:
            return load_partition(pdir / name)
        except (PersistError, OSError, ValueError, KeyError) as e:
            log.warning("skipping checkpoint %s: %s", pdir / name, e)
    return None


def _part_dirs(paths: str | Path | Iterable[str | Path]) -> list[Path]:
    items = [paths] if isinstance(paths, (str, Path)) else list(paths)
    out: list[Path] = []
    for item in items:
        p = Path(item)
        subs = sorted(d for d in p.glob("part*") if d.is_dir()) if p.is_dir() else []
        if subs:
            out += subs
        elif p.is_dir():
            out.append(p)
        else:
            raise PersistError(f"no checkpoint directory at {p}")
    return out


@dataclass


class FullCheckpoint:
    iteration: int
    step: int
    spec: ModelSpec
    slots: dict[str, np.ndarray]  # full-length fp32 arrays
    buffers: dict[str, str]
    extra: dict[str, Any]
    lrs: list[float] | None


def load_full_state(paths: str | Path | Iterable[str | Path],
                    iteration: int | None = None) -> FullCheckpoint:
    """All partitions at their newest common verified iteration (or at ``iteration``),
    joined."""
    dirs = _part_dirs(paths)
    its = [set(list_iterations(d)) for d in dirs]
    common = sorted(set.intersection(*its), reverse=True) if its else []
    if iteration is not None:
        common = [iteration] if iteration in common else []
    if not common:
        raise PersistError(f"no iteration is checkpointed by every partition in "
                           f"{[str(d) for d in dirs]}")
    last_err: Exception | None = None
    for it in common:
        try:
            parts = [load_partition(d / f"{_ITER_PREFIX}{it:012d}") for d in dirs]
        except PersistError as e:
            last_err = e
            log.warning("iteration %d unusable: %s", it, e)
            continue
        seeded = [p.meta["partition"] for p in parts if p.meta.get("seeded")]
        if seeded:  # as merge.SeedPoint: a sibling may still hold another run's iteration
            last_err = PersistError(f"iteration {it} is where partition(s) {seeded} were "
                                    "seeded, not restored from")
            continue
        return _join(parts, it)
    raise PersistError(f"no common iteration verifies: {last_err}")


def _join(parts: list[PartitionCheckpoint], it: int) -> FullCheckpoint:
    spec = parts[0].spec
    if any(p.spec.dumps() != spec.dumps() for p in parts):
        raise PersistError("partition checkpoints were written for different specs")
    got = sorted(p.meta["partition"] for p in parts)
    if got != list(range(spec.partitions)):
        raise PersistError(f"need partitions 0..{spec.partitions - 1}, found {got}")
    steps = {p.meta["step"] for p in parts}
    if len(steps) != 1:
        raise PersistError(f"partitions disagree on the step at iteration {it}: {steps}")
    slots = {s: np.zeros(spec.total, np.float32) for s in spec.slots}
    for p in parts:
        a, b = p.meta["start"], p.meta["end"]
        for s in spec.slots:
            slots[s][a:b] = p.slots[s]
    m = parts[0].meta
    return FullCheckpoint(it, steps.pop(), spec, slots, m["buffers"], m["extra"], m["lrs"])


def load_full(paths: str | Path | Iterable[str | Path]) -> tuple[dict, dict, int]:
    """(model_sd, optim_sd, iteration) from the partitions' DCP checkpoints.

    ``paths`` is a root holding part<p>/ directories, or the partition directories
    themselves. The state dicts load into a torch module and a torch.optim optimizer.
    """
    full = load_full_state(paths)
    buffers = full.spec.decode_buffers(full.buffers)
    model_sd, optim_sd = full.spec.state_dicts(full.slots, full.step, buffers, full.lrs)
    return model_sd, optim_sd, full.iteration
