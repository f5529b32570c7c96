"""``shadow export``: partition dirs copied anywhere, joined into one loadable checkpoint.

Why a module of its own: shadow/merge.py joins the partitions of one data-parallel group as
the shadows write them; exporting also verifies every partition against its manifest first,
picks the newest iteration every partition holds, and joins a mesh job's groups (pipeline
stages, tensor-parallel ranks, each with shadows of its own) into one checkpoint of the whole
model, which plain ``dcp.load`` reshards into any layout.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from checkmate.shadow.merge import (
    Joined,
    MergeError,
    SeedPoint,
    check_coverage,
    collect,
    iter_name,
    merge,
    write_joined,
)

log = logging.getLogger("checkmate.shadow")


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

    joined = [collect(parts, prefix=f"group{g}-") for g, parts in enumerate(groups)]
    first = joined[0].first
    for g, j in enumerate(joined):
        if j.first["iteration"] != first["iteration"] or j.first["step"] != first["step"]:
            raise MergeError(f"mesh group {g} holds iteration {j.first['iteration']} step "
                             f"{j.first['step']}, group 0 iteration {first['iteration']} "
                             f"step {first['step']}")
        if ModelSpec.from_json(j.first["spec"]).state_keys != "fqn":
            raise MergeError(f"{groups[g][0]} is not a mesh job's checkpoint (its optimizer "
                             "state is keyed by index): join it alone")
    all_ = Joined(first, {}, {}, [], {})
    owner: dict[str, int] = {}  # fqn -> the group whose chunks of it are kept
    for g, j in enumerate(joined):
        kept: set[str] = set()
        for fqn, m in j.sdm.items():
            have = all_.sdm.get(fqn)
            if have is None:
                all_.sdm[fqn] = (m if isinstance(m, BytesStorageMetadata) else
                                 dataclasses.replace(m, chunks=list(m.chunks)))
                kept.add(fqn)
                owner[fqn] = g
            elif isinstance(m, BytesStorageMetadata) or isinstance(have, BytesStorageMetadata):
                continue  # group 0's (param_groups: joined below)
            elif have.size != m.size or have.properties != m.properties:
                raise MergeError(f"{fqn}: mesh groups disagree on its global size or dtype")
            elif sorted((tuple(c.offsets), tuple(c.sizes)) for c in m.chunks) == sorted(
                    (tuple(c.offsets), tuple(c.sizes)) for c in have.chunks):
                # a copy every group holds alike (a TP-replicated norm), or one name in two
                # stages (a parameter tied across stages): kept once, so it must be equal
                _same_copy(fqn, joined[owner[fqn]], owner[fqn], j, g)
                continue
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
            check_coverage(fqn, m)
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
        return write_joined(out, all_, info, link=False)


def _chunks_of(j: Joined, fqn: str) -> dict[tuple[int, ...], Any]:
    """``fqn``'s chunks in group ``j``'s files, by offset: each as the tensor DCP's reader
    would load (a torch.save'd tensor at the item's offset and length in its file)."""
    import io

    import torch

    out = {}
    for r in j.results:
        if r.index.fqn != fqn:
            continue
        info = r.storage_data
        if info.transform_descriptors:
            raise MergeError(f"{fqn}: its data is stored transformed "
                             f"({info.transform_descriptors}); cannot compare copies")
        with open(j.files[info.relative_path][0], "rb") as f:
            f.seek(info.offset)
            raw = f.read(info.length)
        out[tuple(r.index.offset)] = torch.load(io.BytesIO(raw), map_location="cpu",
                                                weights_only=True)
    return out


def _same_copy(fqn: str, a: Joined, ga: int, b: Joined, gb: int) -> None:
    """Two groups store ``fqn`` alike in place: their values must be equal too, or the
    joined checkpoint would silently hold one group's (one line naming both)."""
    import torch

    mine, theirs = _chunks_of(a, fqn), _chunks_of(b, fqn)
    if mine.keys() != theirs.keys() or not all(
            torch.equal(mine[k], theirs[k]) for k in mine):
        raise MergeError(f"{fqn}: mesh groups {ga} and {gb} hold different values of it (a "
                         "parameter tied across two stages whose copies were not kept equal?)"
                         ": not joined")


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
                spec = json.loads((d / iter_name(its[-1]) / "ckm.json").read_text())["spec"]
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
        parts = [[d / iter_name(it) for d in g] for g in groups]
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
