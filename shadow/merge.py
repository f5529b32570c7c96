"""One loadable torch checkpoint per iteration, joined from the partitions' DCP checkpoints.

Why: each shadow writes only its partition (``DIR/part<p>/iter-N/``, chunks of full tensors
in DCP's sharded-save layout), and a plain ``dcp.load`` needs one directory whose
``.metadata`` lists every chunk. Joining is cheap: the partitions' data files are hard-linked
(copied where a link is impossible) into ``DIR/iter-N/`` as ``part<p>-<file>`` and DCP's own
FileSystemWriter writes the merged ``.metadata`` (the union of the partitions' entries, data
paths renamed). A join never produces a checkpoint with a gap: every tensor must be covered
exactly once by the chunks of the partitions, all for the same iteration, step and spec.

Shadows sharing ``DIR`` (one host, or a shared filesystem): whichever shadow completes the
last partition of an iteration publishes ``DIR/iter-N`` and points ``DIR/latest`` at the
newest (:func:`publish`, serialized by a lock file). Shadows with separate disks: copy their
``part<p>`` dirs anywhere and run ``shadow export --out OUT DIR...`` (:func:`export`), which
verifies every partition against its manifest before joining.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import logging
import math
import os
import shutil
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from checkmate.errors import CheckmateError

log = logging.getLogger("checkmate.shadow")

MERGED_FORMAT = "checkmate-dcp-merged/1"
_TMP = ".tmp-"
_ITER = "iter-"


class MergeError(CheckmateError):
    """Partition checkpoints that cannot be joined into one; the message says why."""


class SeedPoint(MergeError):
    """An iteration at which some partition was (re)seeded: never joined.

    A shadow seeded by a new run removes its own checkpoints from the seed iteration on,
    but until every shadow is seeded a sibling dir may still hold that iteration from the
    run before; the seed state is the trainers' own anyway.
    """


def iter_name(iteration: int) -> str:
    return f"{_ITER}{iteration:012d}"


def _fsync(p: Path) -> None:
    fd = os.open(p, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check_coverage(fqn: str, md: Any, region: tuple[tuple[int, ...], tuple[int, ...]] | None = None
              ) -> None:
    """Every element of the tensor (or of ``region``: offsets, sizes, a tensor-parallel
    shard's place in it) in exactly one chunk, and no chunk outside, else MergeError."""
    size = tuple(md.size)
    at, box = region if region is not None else ((0,) * len(size), size)
    hit = np.zeros(box, np.uint8)
    for c in md.chunks:
        rel = [o - a for o, a in zip(c.offsets, at, strict=True)]
        if any(o < 0 or o + z > n for o, z, n in zip(rel, c.sizes, box, strict=True)):
            raise MergeError(f"{fqn}: chunk at {list(c.offsets)} lies outside "
                             f"{list(box)} at {list(at)} of {list(size)}")
        hit[tuple(slice(o, o + z) for o, z in zip(rel, c.sizes, strict=True))] += 1
    if hit.size and (hit.min() != 1 or hit.max() != 1):
        missing, double = int((hit == 0).sum()), int((hit > 1).sum())
        raise MergeError(f"{fqn}: {missing} of {math.prod(box)} elements are in no "
                         f"partition's chunk, {double} in more than one")


def _regions(spec: Any) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """fqn -> (offsets, sizes) of every stored tensor that is a shard of a larger one."""
    from checkmate.spec.model import ModelSpec

    spec = ModelSpec.from_json(spec)
    out: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}
    slots = spec.slots[1:]
    for idx, name in enumerate(spec.state_order()):
        p = spec.param(name)
        if p.global_shape is None:
            continue
        out[f"model.{name}"] = (p.origin, p.shape)
        key = name if spec.state_keys == "fqn" else idx
        out.update({f"optim.state.{key}.{s}": (p.origin, p.shape) for s in slots})
    for alias, name in spec.aliases:
        if f"model.{name}" in out:
            out[f"model.{alias}"] = out[f"model.{name}"]
    return out


def _place(src: Path, dst: Path, link: bool) -> None:
    if link:
        try:
            os.link(src, dst)
            return
        except OSError:
            pass  # another filesystem, or links not allowed: copy
    shutil.copyfile(src, dst)
    with open(dst, "rb") as f:
        os.fsync(f.fileno())


@dataclasses.dataclass
class Joined:
    """One iteration's partitions of one group, read and joined in memory (not yet written)."""

    first: dict[str, Any]  # partition 0's ckm.json
    sdm: dict[str, Any]  # fqn -> DCP storage metadata, chunks of every partition
    planner: dict[str, Any]
    results: list[Any]  # DCP WriteResults, data paths renamed
    files: dict[str, tuple[Path, str]]  # new data file name -> (source, sha256)


def collect(parts: list[Path], prefix: str = "") -> Joined:
    """Read the partition dirs of one group at one iteration; MergeError unless they are
    partitions 0..n-1 of one iteration, step and spec, and cover their tensors once."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata
    from torch.distributed.checkpoint.storage import WriteResult

    metas = []
    for d in parts:
        try:
            metas.append((d, json.loads((d / "ckm.json").read_text()),
                          json.loads((d / "manifest.json").read_text()),
                          dcp.FileSystemReader(d).read_metadata()))
        except (OSError, ValueError) as e:
            raise MergeError(f"cannot read partition checkpoint {d}: {e}") from None
    metas.sort(key=lambda m: m[1]["partition"])
    first = metas[0][1]
    n = first["partitions"]
    if [m[1]["partition"] for m in metas] != list(range(n)):
        raise MergeError(f"need partitions 0..{n - 1} once each, got "
                         f"{[m[1]['partition'] for m in metas]}")
    seeded = [m[1]["partition"] for m in metas if m[1].get("seeded")]
    if seeded:
        raise SeedPoint(f"iteration {first['iteration']} is where partition(s) {seeded} "
                        "were seeded: not joined (it may meet another run's partitions)")
    for key in ("iteration", "step", "spec"):
        if any(m[1][key] != first[key] for m in metas):
            raise MergeError(f"partition checkpoints disagree on {key}: "
                             f"{[str(m[0]) for m in metas]}")
    out = Joined(first, {}, {}, [], {})
    for d, meta, manifest, md in metas:
        p = meta["partition"]
        for fqn, m in md.state_dict_metadata.items():
            have = out.sdm.get(fqn)
            if isinstance(m, BytesStorageMetadata) or isinstance(have, BytesStorageMetadata):
                if have is not None:
                    raise MergeError(f"{fqn} is written by more than one partition")
                out.sdm[fqn] = m
            elif have is None:
                out.sdm[fqn] = dataclasses.replace(m, chunks=list(m.chunks))
            elif have.size != m.size or have.properties != m.properties:
                raise MergeError(f"{fqn}: partitions disagree on its size or dtype")
            else:
                have.chunks.extend(m.chunks)
        out.planner.update(md.planner_data or {})
        for idx, info in md.storage_data.items():
            rel = f"{prefix}part{p}-{info.relative_path}"
            if info.relative_path not in manifest:
                raise MergeError(f"{d}: data file {info.relative_path} is not in its manifest")
            out.files[rel] = (d / info.relative_path, manifest[info.relative_path])
            out.results.append(WriteResult(index=idx, size_in_bytes=info.length,
                                           storage_data=dataclasses.replace(
                                               info, relative_path=rel)))
    regions = _regions(first["spec"])
    for fqn, m in out.sdm.items():
        if not isinstance(m, BytesStorageMetadata):
            check_coverage(fqn, m, regions.get(fqn))
    return out


def write_joined(out: Path, j: Joined, info: dict[str, Any], link: bool) -> Path:
    """Publish ``j`` as the loadable checkpoint ``out``: atomically (temp dir, fsync,
    rename); left as it is if it exists (another shadow published it first). Data files
    are verified against the partitions' manifests when copied; linked files are the very
    files the manifests cover."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import Metadata

    from checkmate.shadow.disk import _sha256

    if out.exists():
        return out
    tmp = out.parent / f"{_TMP}{out.name}-{os.getpid()}-{threading.get_ident()}"
    try:
        tmp.mkdir(parents=True)
        digests = {}
        for rel, (src, digest) in j.files.items():
            _place(src, tmp / rel, link)
            if not link and _sha256(tmp / rel) != digest:
                raise MergeError(f"{src} fails its sha256 check")
            digests[rel] = digest
        writer = dcp.FileSystemWriter(tmp, sync_files=True)
        writer.finish(Metadata(state_dict_metadata=j.sdm, planner_data=j.planner),
                      [j.results])
        digests[".metadata"] = _sha256(tmp / ".metadata")
        info = {"format": MERGED_FORMAT, **info, "manifest": digests}
        with open(tmp / "checkmate.json", "w") as f:
            json.dump(info, f, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        _fsync(tmp)
        try:
            os.rename(tmp, out)
        except OSError:
            if not out.exists():
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # published by another shadow meanwhile
        _fsync(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def merge(parts: list[Path], out: Path, link: bool = True) -> Path:
    """Join partition checkpoint dirs of one iteration into the loadable checkpoint ``out``
    (see :func:`_write`)."""
    j = collect(parts)
    f = j.first
    return write_joined(out, j, {"iteration": f["iteration"], "step": f["step"],
                           "partitions": f["partitions"], "spec": f["spec"]}, link)


def list_merged(root: Path) -> list[int]:
    """Iterations with a published checkpoint under ``root``, ascending."""
    out = []
    if root.is_dir():
        for e in root.iterdir():
            if e.name.startswith(_ITER) and (e / "checkmate.json").is_file():
                try:
                    out.append(int(e.name[len(_ITER):]))
                except ValueError:
                    continue
    return sorted(out)


@contextmanager
def root_lock(root: Path) -> Iterator[None]:
    """Exclusive flock on ``root/.publish.lock``: joins, ``latest`` moves, purges and the
    renames of partition checkpoints into place happen one at a time per root."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".publish.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def set_latest(root: Path, iteration: int | None) -> None:
    """Point ``root/latest`` at a join (atomically), or remove it (None)."""
    latest = root / "latest"
    if iteration is None:
        latest.unlink(missing_ok=True)
    else:
        tmp = root / f"{_TMP}latest-{os.getpid()}-{threading.get_ident()}"
        with open(tmp, "w") as f:
            f.write(iter_name(iteration) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, latest)
    _fsync(root)


def read_latest(root: Path) -> int | None:
    try:
        return int((root / "latest").read_text().strip()[len(_ITER):])
    except (OSError, ValueError):
        return None


def publish(root: Path, partitions: int, iteration: int, keep: int) -> Path | None:
    """Join iteration ``iteration`` under ``root`` once every partition dir holds it.

    Returns the published dir, or None while some partition is missing or when the
    iteration is a seed point (:class:`SeedPoint`). Under :func:`root_lock`: leftovers of
    interrupted joins are removed, ``latest`` never moves back, and only the newest ``keep``
    joined checkpoints stay (``keep`` <= 0: all).
    """
    name = iter_name(iteration)
    parts = [root / f"part{q}" / name for q in range(partitions)]
    with root_lock(root):
        if not all((d / "manifest.json").is_file() for d in parts):
            return None
        for e in root.iterdir():
            if e.name.startswith(_TMP) and e.is_dir():
                shutil.rmtree(e, ignore_errors=True)
            elif e.name.startswith(_TMP):
                e.unlink(missing_ok=True)
        try:
            out = merge(parts, root / name, link=True)
        except SeedPoint:
            return None
        cur = read_latest(root)
        if cur is None or iteration > cur:
            set_latest(root, iteration)
        its = list_merged(root)
        if keep > 0:
            newest = max(its[-1], cur if cur is not None else -1)
            for it in its[:-keep]:
                if it != newest:
                    shutil.rmtree(root / iter_name(it), ignore_errors=True)
    return out


def drop_joins(root: Path, since: int) -> list[int]:
    """Remove the joins of iterations >= ``since`` (caller holds :func:`root_lock`) and point
    ``latest`` at the newest one left; returns the iterations removed."""
    gone = [it for it in list_merged(root) if it >= since]
    for it in gone:
        shutil.rmtree(root / iter_name(it), ignore_errors=True)
    cur = read_latest(root)
    if gone or (cur is not None and cur >= since):
        left = list_merged(root)
        set_latest(root, left[-1] if left else None)
    return gone
