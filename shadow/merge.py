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
import warnings
from collections.abc import Callable, Iterable, Iterator
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


def _name(iteration: int) -> str:
    return f"{_ITER}{iteration:012d}"


def _fsync(p: Path) -> None:
    fd = os.open(p, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _coverage(fqn: str, md: Any, region: tuple[tuple[int, ...], tuple[int, ...]] | None = None
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
class _Joined:
    """One iteration's partitions of one group, read and joined in memory (not yet written)."""

    first: dict[str, Any]  # partition 0's ckm.json
    sdm: dict[str, Any]  # fqn -> DCP storage metadata, chunks of every partition
    planner: dict[str, Any]
    results: list[Any]  # DCP WriteResults, data paths renamed
    files: dict[str, tuple[Path, str]]  # new data file name -> (source, sha256)


def _collect(parts: list[Path], prefix: str = "") -> _Joined:
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
    out = _Joined(first, {}, {}, [], {})
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
            _coverage(fqn, m, regions.get(fqn))
    return out


def _write(out: Path, j: _Joined, info: dict[str, Any], link: bool) -> Path:
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
    j = _collect(parts)
    f = j.first
    return _write(out, j, {"iteration": f["iteration"], "step": f["step"],
                           "partitions": f["partitions"], "spec": f["spec"]}, link)


def _nest(flat: dict[str, Any]) -> dict[str, Any]:
    """Dotted DCP keys as the nested dicts DCP flattens into them."""
    out: dict[str, Any] = {}
    for fqn, v in flat.items():
        *path, leaf = fqn.split(".")
        node = out
        for k in path:
            node = node.setdefault(k, {})
        node[leaf] = v
    return out


def _load_objects(part: Path, fqns: list[str]) -> dict[str, Any]:
    """Non-tensor entries of a partition checkpoint by their flat DCP keys (DCP flattens a
    list as a dict of its indices, so ``optim.param_groups.0.params`` nests as dicts)."""
    import torch.distributed.checkpoint as dcp

    sd = _nest(dict.fromkeys(fqns))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(sd, storage_reader=dcp.FileSystemReader(part), no_dist=True)
    except Exception as e:  # noqa: BLE001 -- DCP's own errors: one line
        raise MergeError(f"cannot read {', '.join(fqns[:3])} from {part}: "
                         f"{' '.join(str(e).split())[-200:]}") from None
    out = {}
    for fqn in fqns:
        node = sd
        for k in fqn.split("."):
            node = node[k]
        out[fqn] = node
    return out


def _joined_param_groups(parts: list[Path], keys: list[str]) -> dict[str, Any]:
    """The whole model's ``optim.param_groups.<k>.params`` from each mesh group's (names:
    the "fqn" layout): every other setting must be the same in every group."""
    per = [_load_objects(p, keys) for p in parts]
    out = dict(per[0])
    for gi, theirs in enumerate(per[1:], start=1):
        for k in keys:
            if k.endswith(".params"):  # a stage's TP ranks name the same parameters
                out[k] = list(dict.fromkeys([*out[k], *theirs[k]]))
            elif theirs[k] != out[k]:
                raise MergeError(f"{k}: mesh group {gi} has {theirs[k]!r}, group 0 "
                                 f"{out[k]!r}")
    return {k: v for k, v in out.items() if k.endswith(".params")}


def merge_groups(groups: list[list[Path]], out: Path, link: bool = True) -> Path:
    """Join one iteration of every data-parallel group of a mesh job (its pipeline stages,
    TP ranks) into one checkpoint of the whole model ``out``.

    Each group's partitions join as :func:`merge` joins them; across groups a tensor is
    either a copy every group stores alike (a TP-replicated norm: the first group's is
    kept) or shards at different places that together cover it once; non-tensor entries
    are group 0's, except ``optim.param_groups``, whose params lists are concatenated.
    """
    import tempfile

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata
    from torch.distributed.checkpoint.storage import WriteResult

    from checkmate.shadow.disk import _sha256
    from checkmate.spec.model import ModelSpec

    joined = [_collect(parts, prefix=f"group{g}-") for g, parts in enumerate(groups)]
    first = joined[0].first
    for g, j in enumerate(joined):
        if j.first["iteration"] != first["iteration"] or j.first["step"] != first["step"]:
            raise MergeError(f"mesh group {g} holds iteration {j.first['iteration']} step "
                             f"{j.first['step']}, group 0 iteration {first['iteration']} "
                             f"step {first['step']}")
        if ModelSpec.from_json(j.first["spec"]).state_keys != "fqn":
            raise MergeError(f"{groups[g][0]} is not a mesh job's checkpoint (its optimizer "
                             "state is keyed by index): join it alone")
    all_ = _Joined(first, {}, {}, [], {})
    for j in joined:
        kept: set[str] = set()
        for fqn, m in j.sdm.items():
            have = all_.sdm.get(fqn)
            if have is None:
                all_.sdm[fqn] = (m if isinstance(m, BytesStorageMetadata) else
                                 dataclasses.replace(m, chunks=list(m.chunks)))
                kept.add(fqn)
            elif isinstance(m, BytesStorageMetadata) or isinstance(have, BytesStorageMetadata):
                continue  # group 0's (param_groups: joined below)
            elif have.size != m.size or have.properties != m.properties:
                raise MergeError(f"{fqn}: mesh groups disagree on its global size or dtype")
            elif sorted((tuple(c.offsets), tuple(c.sizes)) for c in m.chunks) == sorted(
                    (tuple(c.offsets), tuple(c.sizes)) for c in have.chunks):
                continue  # a copy every group holds alike
            else:
                have.chunks.extend(m.chunks)
                kept.add(fqn)
        results = [r for r in j.results if r.index.fqn in kept]
        used = {r.storage_data.relative_path for r in results}
        all_.results += results
        all_.files.update({k: v for k, v in j.files.items() if k in used})
        all_.planner.update(j.planner)
    for fqn, m in all_.sdm.items():
        if not isinstance(m, BytesStorageMetadata):
            _coverage(fqn, m)
    info = {"iteration": first["iteration"], "step": first["step"], "groups": len(groups),
            "partitions": [j.first["partitions"] for j in joined],
            "spec": [j.first["spec"] for j in joined]}
    with tempfile.TemporaryDirectory(prefix="ckm-join-") as tmp:
        keys = sorted(k for k in joined[0].sdm if k.startswith("optim.param_groups."))
        missing = [g for g, j in enumerate(joined) if sorted(
            k for k in j.sdm if k.startswith("optim.param_groups.")) != keys]
        if missing:
            raise MergeError(f"mesh group {missing[0]}'s optimizer param groups have other "
                             "settings than group 0's")
        pg = _joined_param_groups([parts[0] for parts in groups], keys)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.save(_nest(pg), storage_writer=dcp.FileSystemWriter(tmp), no_dist=True)
        md = dcp.FileSystemReader(tmp).read_metadata()
        all_.sdm.update(md.state_dict_metadata)
        all_.results = [r for r in all_.results if r.index.fqn not in pg]
        for idx, st in md.storage_data.items():
            rel = f"joined-{st.relative_path}"
            all_.files[rel] = (Path(tmp) / st.relative_path,
                               _sha256(Path(tmp) / st.relative_path))
            all_.results.append(WriteResult(index=idx, size_in_bytes=st.length,
                                            storage_data=dataclasses.replace(
                                                st, relative_path=rel)))
        used = {r.storage_data.relative_path for r in all_.results}
        all_.files = {k: v for k, v in all_.files.items() if k in used}
        return _write(out, all_, info, link=False)


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
            f.write(_name(iteration) + "\n")
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
    name = _name(iteration)
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
                    shutil.rmtree(root / _name(it), ignore_errors=True)
    return out


def drop_joins(root: Path, since: int) -> list[int]:
    """Remove the joins of iterations >= ``since`` (caller holds :func:`root_lock`) and point
    ``latest`` at the newest one left; returns the iterations removed."""
    gone = [it for it in list_merged(root) if it >= since]
    for it in gone:
        shutil.rmtree(root / _name(it), ignore_errors=True)
    cur = read_latest(root)
    if gone or (cur is not None and cur >= since):
        left = list_merged(root)
        set_latest(root, left[-1] if left else None)
    return gone


def _by_group(dirs: list[Path]) -> list[list[Path]]:
    """Partition dirs grouped by the job id their newest checkpoint's spec names (a mesh
    job's data-parallel groups have ids of their own: checkmate.protocol.wire
    group_job_id), in id order: group 0 first."""
    from checkmate.shadow.disk import list_iterations

    jobs: dict[int, list[Path]] = {}
    for d in dirs:
        its = list_iterations(d)
        job = -1
        if its:
            try:
                spec = json.loads((d / _name(its[-1]) / "ckm.json").read_text())["spec"]
                job = int((json.loads(spec) if isinstance(spec, str) else spec)["job"])
            except (OSError, ValueError, KeyError, TypeError):
                pass  # verify() says what is wrong with it
        jobs.setdefault(job, []).append(d)
    return [jobs[j] for j in sorted(jobs)]


def export(paths: str | Path | Iterable[str | Path], out: str | Path,
           iteration: int | None = None,
           on_skip: Callable[[str], None] | None = None) -> Path:
    """Verify and join partition dirs (e.g. copied from shadows with separate disks) into one
    loadable checkpoint ``out`` at ``iteration`` (default: the newest every partition holds,
    that verifies and is no seed point). ``out`` must not exist or be an empty directory.
    The dirs of a mesh job's data-parallel groups (``DIR/group*``) join into one checkpoint
    of the whole model (:func:`merge_groups`). ``on_skip`` hears why newer iterations were
    passed over (default: logged), only when one is exported; a failure is the one error
    line."""
    from checkmate.shadow.checkpoint_load import _part_dirs, verify
    from checkmate.shadow.disk import PersistError, list_iterations

    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise MergeError(f"{out} exists and is not an empty directory")
    dirs = _part_dirs(paths)
    groups = _by_group(dirs)
    common = set.intersection(*(set(list_iterations(d)) for d in dirs)) if dirs else set()
    if iteration is not None:
        common &= {iteration}
    if not common:
        what = f"iteration {iteration}" if iteration is not None else "an iteration"
        raise MergeError(f"no partition dir set in {[str(d) for d in dirs]} holds {what} "
                         f"in every partition")
    skipped: list[str] = []
    for it in sorted(common, reverse=True):
        parts = [[d / _name(it) for d in g] for g in groups]
        try:
            for d in (d for g in parts for d in g):
                verify(d)
        except PersistError as e:
            skipped.append(f"iteration {it} not exported: {e}")
            continue
        if out.exists():
            out.rmdir()
        try:
            done = (merge(parts[0], out, link=False) if len(parts) == 1
                    else merge_groups(parts, out))
        except SeedPoint as e:
            skipped.append(f"iteration {it} not exported: {e}")
            continue
        for text in skipped:  # said only beside a success; a failure is one line
            (on_skip or log.warning)(text)
        return done
    raise MergeError(f"no common iteration verifies: {skipped[-1].split(': ', 1)[1]}")
