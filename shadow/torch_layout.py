"""A shadow partition as a piece of an ordinary torch checkpoint (DCP sharded-save layout).

Why: a user with only torch must be able to ``dcp.load`` the shadows' checkpoint into a plain
``model.state_dict()`` and ``optimizer.state_dict()``. So a partition is saved under the
keys ``dcp.save({"model": model_sd, "optim": optim_sd, ...})`` would use (full-tensor names,
torch.optim's ``state[i][slot]`` layout), and each tensor's piece is stored as DCP chunks at
its offsets inside the full tensor, as a sharded save writes them.

A partition owns a contiguous range of a parameter's flattened elements, which is not in
general one rectangular block; :func:`boxes` splits it into at most ``2 * ndim - 1``
rectangular blocks (the partial first row, whole rows, the partial last row, recursively),
each a contiguous flat range, so every chunk is a plain view of the partition's arrays.

What a partition writes: its chunks of every parameter (``model.<name>``, and again under
each further name of a tied parameter, as ``model.state_dict()`` lists it) and optimizer slot
(``optim.state.<i>.<slot>``, only once a step was taken, as torch has no state before);
the owner of a parameter's first element writes its ``optim.state.<i>.step``; partition 0
writes the rest whole: parameters without elements, buffers, ``optim.param_groups``,
``scheduler``, ``extra`` and ``checkmate`` (iteration, step, lrs, partitions).

A mesh job's spec (``state_keys`` "fqn") keys optimizer state by parameter name instead
(``optim.state.<name>.<slot>``, ``param_groups[*]["params"]`` names), the layout of
``torch.distributed.checkpoint.state_dict``, so that the checkpoints of its groups (pipeline
stages, TP ranks) join into one without two stages claiming one index. A parameter that is
a tensor-parallel shard (its spec has ``global_shape``) is stored as chunks of the whole
tensor at the shard's offsets, as DCP stores a DTensor: plain ``dcp.load`` reshards it.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from checkmate.errors import CheckmateError
from checkmate.spec.model import ModelSpec, ParamSpec

Box = tuple[tuple[int, ...], tuple[int, ...], int, int]  # offsets, sizes, flat [s, e)


class LayoutError(CheckmateError):
    """A partition checkpoint whose chunks are not the ones its spec implies."""


def boxes(shape: tuple[int, ...], lo: int, hi: int) -> list[Box]:
    """Rectangular blocks covering flat elements [lo, hi) of a row-major ``shape`` tensor.

    Each block is (offsets, sizes, s, e) and holds exactly flat elements [s, e); the blocks
    are in flat order and tile [lo, hi).
    """
    if lo >= hi:
        return []
    if not shape:
        return [((), (), 0, 1)]
    if len(shape) == 1:
        return [((lo,), (hi - lo,), lo, hi)]
    row = math.prod(shape[1:])
    rest = tuple(shape[1:])
    out: list[Box] = []

    def in_row(r: int, a: int, b: int) -> None:
        for off, sz, s, e in boxes(rest, a, b):
            out.append(((r, *off), (1, *sz), r * row + s, r * row + e))

    if lo % row:
        r = lo // row
        end = min(hi, (r + 1) * row)
        in_row(r, lo - r * row, end - r * row)
        lo = end
    if hi // row > lo // row and lo < hi:
        a, b = lo // row, hi // row
        out.append(((a, *([0] * len(rest))), (b - a, *rest), a * row, b * row))
        lo = b * row
    if lo < hi:
        r = lo // row
        in_row(r, 0, hi - r * row)
    return out


class Piece:
    """A partition's part of one full tensor: DCP chunks backed by a flat fp32 array.

    DCP's planners call ``__create_write_items__`` (save) and ``__create_chunk_list__``
    (load); :class:`SavePlanner` and :class:`LoadPlanner` resolve a chunk to its view.
    """

    def __init__(self, shape: tuple[int, ...], lo: int, hi: int, flat: np.ndarray,
                 whole: tuple[int, ...] | None = None,
                 origin: tuple[int, ...] | None = None) -> None:
        self.shape, self.flat = tuple(shape), flat
        self.lo = lo
        #: the stored tensor: ``shape`` itself, or the whole tensor a shard lies in at origin
        self.whole = tuple(whole) if whole is not None else self.shape
        origin = tuple(origin) if origin is not None else (0,) * len(self.shape)
        self.boxes = [(tuple(a + b for a, b in zip(o, origin, strict=True)), z, s, e)
                      for o, z, s, e in boxes(self.shape, lo, hi)]
        if len(flat) != hi - lo:
            raise LayoutError(f"piece [{lo}, {hi}) backed by {len(flat)} elements")

    def chunks(self) -> list[Any]:
        import torch
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return [ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(z))
                for o, z, _s, _e in self.boxes]

    def view(self, offsets: Any) -> Any:
        """The tensor view of the chunk that starts at ``offsets`` (in the whole tensor)."""
        import torch

        key = tuple(offsets)
        for o, z, s, e in self.boxes:
            if o == key:
                return torch.from_numpy(self.flat[s - self.lo:e - self.lo]).view(z)
        raise LayoutError(f"no chunk at offsets {key} in a piece of shape {self.whole}")

    def __create_write_items__(self, fqn: str, obj: Any) -> list[Any]:
        import torch
        from torch.distributed.checkpoint.metadata import MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        props = TensorProperties.create_from_tensor(torch.zeros(0, dtype=torch.float32))
        return [WriteItem(index=MetadataIndex(fqn, c.offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=c, properties=props,
                                                      size=torch.Size(self.whole)))
                for c in self.chunks()]

    def __create_chunk_list__(self) -> list[Any]:
        return self.chunks()


def _planners() -> tuple[type, type]:
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner

    class SavePlanner(DefaultSavePlanner):
        def lookup_object(self, index: Any) -> Any:
            obj = self.state_dict.get(index.fqn)
            if isinstance(obj, Piece):
                return obj.view(index.offset)
            return super().lookup_object(index)

    class LoadPlanner(DefaultLoadPlanner):
        def set_up_planner(self, state_dict: Any, metadata: Any = None,
                           is_coordinator: bool = False) -> None:
            # The default set-up replaces values it does not know (our pieces) by None;
            # ours is flat already and holds nothing but pieces.
            super().set_up_planner({}, metadata, is_coordinator)
            self.state_dict = self.original_state_dict = state_dict
            self.mappings = {k: (k,) for k in state_dict}

        def lookup_tensor(self, index: Any) -> Any:
            obj = self.state_dict.get(index.fqn)
            if isinstance(obj, Piece):
                return obj.view(index.offset)
            return super().lookup_tensor(index)

    return SavePlanner, LoadPlanner


def param_groups(spec: ModelSpec, lrs: list[float] | None, base_lrs: list[float] | None,
                 hyper: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """torch.optim ``param_groups`` with every key the torch optimizer of this kind has.

    A throwaway optimizer over one-element tensors supplies the keys (so a fresh optimizer's
    state_dict has no key the checkpoint lacks); the values are the spec's, then ``hyper``'s
    (the settings of the last step, when the control message carried them), ``lrs`` the
    rate, ``base_lrs`` a scheduler's ``initial_lr``.
    """
    import torch

    cls = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD}
    groups = []
    idx = 0
    for gi, g in enumerate(spec.groups):
        hp = g.hyper(spec.kind)
        opt = cls[spec.kind]([torch.zeros(1, requires_grad=True)], **hp)
        pg = dict(opt.state_dict()["param_groups"][0])
        pg.update(hp)
        if hyper is not None:
            pg.update({k: tuple(v) if k == "betas" else v for k, v in hyper[gi].items()
                       if k in pg})
        if lrs is not None:
            pg["lr"] = float(lrs[gi])
        if base_lrs is not None:
            pg["initial_lr"] = float(base_lrs[gi])
        pg["params"] = list(range(idx, idx + len(g.params)))
        idx += len(g.params)
        groups.append(pg)
    return groups


def _split_extra(extra: dict | None) -> tuple[Any, Any, Any]:
    """(scheduler state, user extra, per-group hyper) of a control message's ``extra``.

    CheckmateSession sends {"scheduler", "hyper", "user"}; any other extra is all user's.
    """
    extra = extra or {}
    if "user" in extra and "scheduler" in extra:
        return extra["scheduler"], extra["user"] or {}, extra.get("hyper")
    return None, extra, None


def _piece(p: ParamSpec, lo: int, hi: int, flat: np.ndarray) -> Any:
    """The value of a parameter (or slot) piece: an empty parameter is a plain tensor."""
    import torch

    if p.numel == 0:
        return torch.zeros(p.shape, dtype=torch.float32)
    return Piece(p.shape, lo, hi, flat, p.global_shape, p.global_offset)


def partition_state_dict(spec: ModelSpec, partition: int, iteration: int, step: int,
                         slots: dict[str, np.ndarray], buffers: dict[str, Any] | None,
                         extra: dict | None, lrs: list[float] | None) -> dict[str, Any]:
    """What one partition contributes to the torch-layout checkpoint (see the module doc)."""
    import torch

    start, end = spec.bounds(partition)
    pieces = {p.name: (p, lo, hi) for p, lo, hi in spec.pieces(start, end)}
    if step == 0 and any(np.any(slots[s]) for s in spec.slots[1:]):
        raise LayoutError("optimizer state is not zero at step 0: torch keeps no state "
                          "before the first step, so it cannot be written in torch layout")
    model: dict[str, Any] = {}
    state: dict[int, dict[str, Any]] = {}
    gof = spec.group_of()
    by_name = spec.state_keys == "fqn"
    for idx, name in enumerate(spec.state_order()):
        key: int | str = name if by_name else idx
        p = spec.param(name)
        if p.numel == 0 and partition == 0:  # no element to own: partition 0 writes it
            lo = hi = a = b = 0
        elif name in pieces:
            p, lo, hi = pieces[name]
            a, b = p.offset + lo - start, p.offset + hi - start
        else:
            continue
        model[name] = _piece(p, lo, hi, slots["param"][a:b])
        if step == 0:
            continue
        entry: dict[str, Any] = {}
        if spec.kind != "sgd" and lo == 0:
            entry["step"] = torch.tensor(float(step), dtype=torch.float32)
        for s in spec.group_slots(spec.groups[gof[name]]):
            entry[s] = _piece(p, lo, hi, slots[s][a:b])
        if entry:
            state[key] = entry
    for alias, name in spec.aliases:  # a tied parameter's other names: the same chunks,
        if name in model:             # so model.state_dict() of the tied model loads
            model[alias] = model[name]
    sd: dict[str, Any] = {"model": model, "optim": {"state": state}}
    if partition == 0:
        sched, user, hyper = _split_extra(extra)
        base = sched.get("base_lrs") if isinstance(sched, dict) else None
        # After its step a scheduler has set the groups to the *next* step's rate (torch's
        # optimizer state_dict holds that one); without a scheduler, the last step's.
        nxt = sched.get("_last_lr") if isinstance(sched, dict) else None
        model.update(buffers or {})
        sd["optim"]["param_groups"] = param_groups(spec, nxt or lrs, base, hyper)
        if by_name:
            for pg, g in zip(sd["optim"]["param_groups"], spec.groups, strict=True):
                pg["params"] = list(g.params)
        if sched is not None:
            sd["scheduler"] = sched
        sd["extra"] = user
        sd["checkmate"] = {"iteration": iteration, "step": step, "lrs": lrs,
                           "partitions": spec.partitions}
    return sd


def save(sd: dict[str, Any], path: Path, threads: int = 1) -> None:
    """dcp.save without a process group, chunks resolved to their views; ``threads``
    writer threads (DCP's FileSystemWriter splits the files among them)."""
    import torch.distributed.checkpoint as dcp

    save_planner, _ = _planners()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(path, sync_files=True,
                                                         thread_count=threads),
                 planner=save_planner(), no_dist=True)


def read_slots(path: Path, spec: ModelSpec, partition: int, step: int) -> dict[str, np.ndarray]:
    """A partition's flat slot arrays back from its checkpoint; LayoutError unless the stored
    chunks are exactly the ones :func:`partition_state_dict` writes."""
    import torch.distributed.checkpoint as dcp

    start, end = spec.bounds(partition)
    out = {s: np.zeros(end - start, np.float32) for s in spec.slots}
    sd = partition_state_dict(spec, partition, 0, step, out, None, None, None)
    want: dict[str, Piece] = {}
    for name, v in sd["model"].items():
        if isinstance(v, Piece):
            want[f"model.{name}"] = v
    for idx, entry in sd["optim"]["state"].items():
        for s, v in entry.items():
            if isinstance(v, Piece):
                want[f"optim.state.{idx}.{s}"] = v
    md = dcp.FileSystemReader(path).read_metadata()
    for fqn, piece in want.items():
        got = md.state_dict_metadata.get(fqn)
        chunks = getattr(got, "chunks", None)
        if chunks is None or tuple(getattr(got, "size", ())) != piece.whole:
            raise LayoutError(f"{path}: {fqn} is missing or not a tensor of shape "
                              f"{list(piece.whole)}")
        have = sorted((tuple(c.offsets), tuple(c.sizes)) for c in chunks)
        if have != sorted((o, z) for o, z, _s, _e in piece.boxes):
            raise LayoutError(f"{path}: {fqn} holds chunks {have}, not partition "
                              f"{partition}'s")
    _, load_planner = _planners()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(want, storage_reader=dcp.FileSystemReader(path), planner=load_planner(),
                 no_dist=True)
    return out
