"""The model spec (docs/protocol.md, "Model spec"): the one description of the flat space.

Trainers send it to every shadow with the ``spec`` op; shadows, the restore client and the
persisted checkpoints all read it. It fixes three things everyone must agree on:

- the flat parameter space: parameters concatenated in the listed order (the trainer's fixed
  bucket order), each with its offset and element count;
- the optimizer: kind and param groups with their hyperparameters;
- the non-gradient buffers that travel in the control message.

What a valid spec is -- field types and ranges, the rules across fields, the optimizer's
defaults for a group field left out -- is the pydantic schema in checkmate.spec.schema.
It also converts between the flat per-slot arrays a shadow keeps and the ``state_dict``
formats of ``torch.nn.Module`` and ``torch.optim`` (state indexed by the parameter's position
in the concatenated ``param_groups[*]["params"]`` lists), so restore needs nothing else.
"""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from checkmate.errors import CheckmateError

_NP_BUFFER = {
    "float32": "<f4", "float64": "<f8", "float16": "<f2", "int64": "<i8", "int32": "<i4",
    "uint8": "u1", "bool": "?",
}


class SpecError(CheckmateError, ValueError):
    """A model spec that cannot be used; the message names the offending field."""


@dataclass(frozen=True)
class ParamSpec:
    name: str
    shape: tuple[int, ...]
    offset: int
    numel: int
    #: a shard of a larger tensor (a tensor-parallel rank's DTensor part): the whole
    #: tensor's shape and the shard's offsets in it; None for a whole tensor
    global_shape: tuple[int, ...] | None = None
    global_offset: tuple[int, ...] | None = None

    @property
    def whole(self) -> tuple[int, ...]:
        """The shape of the tensor this parameter is (a part of)."""
        return self.global_shape if self.global_shape is not None else self.shape

    @property
    def origin(self) -> tuple[int, ...]:
        """Where this parameter's elements start in :attr:`whole`."""
        return self.global_offset if self.global_offset is not None else (0,) * len(self.shape)


@dataclass(frozen=True)
class GroupSpec:
    """One optimizer param group. Fields that do not apply to the kind keep their default."""

    params: tuple[str, ...]
    lr: float
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    amsgrad: bool = False
    momentum: float = 0.0
    dampening: float = 0.0
    nesterov: bool = False
    maximize: bool = False

    def hyper(self, kind: str) -> dict[str, Any]:
        """The hyperparameters torch.optim's param_groups carry for this kind."""
        common = {"lr": self.lr, "weight_decay": self.weight_decay, "maximize": self.maximize}
        if kind == "sgd":
            return {**common, "momentum": self.momentum, "dampening": self.dampening,
                    "nesterov": self.nesterov}
        return {**common, "betas": tuple(self.betas), "eps": self.eps, "amsgrad": self.amsgrad}


@dataclass(frozen=True)
class BufferSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class ModelSpec:
    job: int
    params: tuple[ParamSpec, ...]
    total: int
    partitions: int
    kind: str
    groups: tuple[GroupSpec, ...]
    buffers: tuple[BufferSpec, ...] = ()
    grad_dtype: str = "float32"
    #: (alias, parameter): further names of a parameter reachable under several (tied
    #: embeddings, shared blocks). One parameter to the flat space, the optimizer and the
    #: shadows; every name is restored (torch's state_dict lists each of them).
    aliases: tuple[tuple[str, str], ...] = ()
    #: "index": optimizer state under torch.optim's state_dict indices; "fqn": under the
    #: parameters' names, as torch.distributed.checkpoint.state_dict keys it (a mesh job,
    #: whose groups' checkpoints join into one)
    state_keys: str = "index"
    _index: dict[str, int] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        self._index.update({p.name: i for i, p in enumerate(self.params)})

    # ----- construction -------------------------------------------------------------------
    @classmethod
    def build(
        cls,
        job: int,
        named_shapes: Iterable[tuple[str, Sequence[int]]],
        kind: str,
        groups: Sequence[Mapping[str, Any]],
        partitions: int,
        buffers: Iterable[tuple[str, Sequence[int], str]] = (),
        grad_dtype: str = "float32",
        aliases: Iterable[tuple[str, str]] = (),
        shards: Mapping[str, tuple[Sequence[int], Sequence[int]]] | None = None,
        state_keys: str = "index",
    ) -> ModelSpec:
        """A spec from parameter names and shapes in flat order; offsets are computed here.
        ``aliases``: (further name, parameter name) of each tied parameter's other names;
        ``shards``: name -> (global shape, global offset) of each parameter that is a shard."""
        params, off = [], 0
        for name, shape in named_shapes:
            n = math.prod(shape)
            params.append({"name": name, "shape": list(shape), "offset": off, "numel": n})
            if shards and name in shards:
                params[-1]["global_shape"] = list(shards[name][0])
                params[-1]["global_offset"] = list(shards[name][1])
            off += n
        return cls.from_json({
            "job": job, "params": params, "total": off, "partitions": partitions,
            "optimizer": {"kind": kind, "groups": [dict(g) for g in groups]},
            "buffers": [{"name": n, "shape": list(s), "dtype": d} for n, s, d in buffers],
            "grad_dtype": grad_dtype,
            **({"aliases": dict(aliases)} if aliases else {}),
            **({"state_keys": state_keys} if state_keys != "index" else {}),
        })

    @classmethod
    def from_torch(
        cls,
        job: int,
        model: Any,
        optimizer: Any,
        partitions: int,
        kind: str | None = None,
        grad_dtype: str = "float32",
        order: Sequence[str] | None = None,
        local: bool = False,
        state_keys: str = "index",
        parts: Mapping[str, tuple[tuple[int, ...], Any]] | None = None,
    ) -> ModelSpec:
        """A spec for a torch module and its optimizer.

        ``order`` is the flat order (parameter names); by default the module's own order.
        ``kind`` defaults from the optimizer's class name (AdamW, Adam or SGD). ``local``:
        DTensor parameters count as their local tensor (a tensor-parallel rank's shard:
        checkmate.train.tensor_parallel), not as the global tensor, and the spec says where
        the shard lies in it. ``state_keys``: see :attr:`state_keys`. ``parts``: name ->
        (shape, (global shape, global offset) or None) of every parameter, where the session
        knows better than the tensor (FSDP2 + TP: the TP rank's part, not FSDP's rows).
        """
        named = dict(model.named_parameters())
        names = list(order) if order is not None else list(named)
        if sorted(names) != sorted(named):
            raise SpecError("order must list every parameter of the model exactly once")
        by_id = {id(p): n for n, p in named.items()}
        if kind is None:
            kind = type(optimizer).__name__.lower()
        groups = []
        for g in optimizer.param_groups:
            try:
                pnames = [by_id[id(p)] for p in g["params"]]
            except KeyError:
                raise SpecError("the optimizer holds a tensor that is not a model parameter")\
                    from None
            hyper = {k: g[k] for k in ("lr", "betas", "eps", "weight_decay", "amsgrad",
                                       "momentum", "dampening", "nesterov", "maximize")
                     if k in g}
            hyper["lr"] = float(hyper["lr"])
            if "betas" in hyper:
                hyper["betas"] = [float(b) for b in hyper["betas"]]
            groups.append({"params": pnames, **hyper})
        persistent = set(model.state_dict())  # non-persistent buffers are not restored
        buffers = [(n, tuple(b.shape), str(b.dtype).removeprefix("torch."))
                   for n, b in model.named_buffers() if n in persistent]
        def shape(t: Any) -> tuple[int, ...]:
            return tuple(t.to_local().shape if local and hasattr(t, "to_local") else t.shape)

        shards = {}
        if local:
            shards = {n: at for n in names if (at := shard_part(named[n])[1]) is not None}
        shapes = [shape(named[n]) for n in names]
        if parts is not None:
            shards = {n: parts[n][1] for n in names if parts[n][1] is not None}
            shapes = [tuple(parts[n][0]) for n in names]
        return cls.build(job, list(zip(names, shapes, strict=True)), kind, groups,
                         partitions, buffers, grad_dtype, tied_names(model), shards,
                         state_keys)

    @classmethod
    def from_json(cls, obj: Any) -> ModelSpec:
        """Parse and validate a decoded (or string) spec; SpecError names what is wrong."""
        if isinstance(obj, (str, bytes)):
            try:
                obj = json.loads(obj)
            except ValueError:
                raise SpecError("spec is not valid JSON") from None
        from pydantic import ValidationError

        from checkmate.schema import first_error
        from checkmate.spec.schema import SpecDoc

        if not isinstance(obj, dict):
            raise SpecError(f"spec must be an object, got {type(obj).__name__}")
        try:
            doc = SpecDoc.model_validate(obj)
        except ValidationError as e:
            msg = first_error(e)
            raise SpecError(f"spec.{msg}" if e.errors()[0]["loc"] else msg) from None
        params = tuple(ParamSpec(p.name, p.shape, p.offset, p.numel, p.global_shape,
                                 p.global_offset) for p in doc.params)
        groups = tuple(GroupSpec(
            params=tuple(g.params), lr=g.lr, betas=g.betas, eps=g.eps,
            weight_decay=g.weight_decay, amsgrad=g.amsgrad, momentum=g.momentum,
            dampening=g.dampening, nesterov=g.nesterov, maximize=g.maximize)
            for g in doc.optimizer.groups)
        buffers = tuple(BufferSpec(b.name, b.shape, b.dtype) for b in doc.buffers)
        return cls(doc.job, params, doc.total, doc.partitions, doc.optimizer.kind, groups,
                   buffers, doc.grad_dtype, tuple(sorted(doc.aliases.items())),
                   doc.state_keys)

    def to_json(self) -> dict[str, Any]:
        """The spec as the JSON object docs/protocol.md describes."""
        return {
            "job": self.job,
            "params": [{"name": p.name, "shape": list(p.shape), "offset": p.offset,
                        "numel": p.numel, **({} if p.global_shape is None else {
                            "global_shape": list(p.global_shape),
                            "global_offset": list(p.global_offset)})}
                       for p in self.params],
            "total": self.total,
            "partitions": self.partitions,
            "optimizer": {"kind": self.kind, "groups": [
                {"params": list(g.params), "lr": g.lr, "betas": list(g.betas), "eps": g.eps,
                 "weight_decay": g.weight_decay, "amsgrad": g.amsgrad, "momentum": g.momentum,
                 "dampening": g.dampening, "nesterov": g.nesterov, "maximize": g.maximize}
                for g in self.groups]},
            "buffers": [{"name": b.name, "shape": list(b.shape), "dtype": b.dtype}
                        for b in self.buffers],
            "grad_dtype": self.grad_dtype,
            # only when there are any: the spec of an untied model stays what it was
            **({"aliases": dict(self.aliases)} if self.aliases else {}),
            **({"state_keys": self.state_keys} if self.state_keys != "index" else {}),
        }

    def dumps(self) -> str:
        """Canonical JSON text: equal specs give equal strings (used to refuse a change)."""
        return json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))

    # ----- layout -------------------------------------------------------------------------
    def param(self, name: str) -> ParamSpec:
        try:
            return self.params[self._index[name]]
        except KeyError:
            raise SpecError(f"no parameter named {name!r} in the spec") from None

    @property
    def slots(self) -> tuple[str, ...]:
        """Flat state arrays a shadow keeps, ``param`` first (the fetch/seed slot names)."""
        if self.kind == "sgd":
            extra = ("momentum_buffer",) if any(g.momentum != 0 for g in self.groups) else ()
        else:
            extra = ("exp_avg", "exp_avg_sq")
            if any(g.amsgrad for g in self.groups):
                extra += ("max_exp_avg_sq",)
        return ("param", *extra)

    def group_slots(self, group: GroupSpec) -> tuple[str, ...]:
        """The optimizer-state slots torch keeps for the params of one group."""
        if self.kind == "sgd":
            return ("momentum_buffer",) if group.momentum != 0 else ()
        return ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group.amsgrad else ())

    def bounds(self, partition: int) -> tuple[int, int]:
        """Half-open flat range [start, end) that ``partition`` owns."""
        from checkmate.spec.partition import partition_bounds

        if not 0 <= partition < self.partitions:
            raise SpecError(f"partition {partition} is outside 0..{self.partitions - 1}")
        return partition_bounds(self.total, self.partitions)[partition]

    def state_order(self) -> list[str]:
        """Parameter names in torch.optim state_dict index order (groups concatenated)."""
        return [n for g in self.groups for n in g.params]

    def group_of(self) -> dict[str, int]:
        return {n: gi for gi, g in enumerate(self.groups) for n in g.params}

    def pieces(self, start: int, end: int) -> list[tuple[ParamSpec, int, int]]:
        """(param, lo, hi): the part [lo, hi) of each flattened param inside [start, end)."""
        out = []
        for p in self.params:
            lo, hi = max(start, p.offset), min(end, p.offset + p.numel)
            if lo < hi:
                out.append((p, lo - p.offset, hi - p.offset))
        return out

    def group_ranges(self, start: int, end: int) -> list[tuple[int, int, int]]:
        """(local_start, local_end, group index) runs covering [start, end), merged when
        neighbours share a group; local means relative to ``start``."""
        gof = self.group_of()
        runs: list[tuple[int, int, int]] = []
        for p, lo, hi in self.pieces(start, end):
            a, b, gi = p.offset + lo - start, p.offset + hi - start, gof[p.name]
            if runs and runs[-1][2] == gi and runs[-1][1] == a:
                runs[-1] = (runs[-1][0], b, gi)
            else:
                runs.append((a, b, gi))
        return runs

    # ----- buffers ------------------------------------------------------------------------
    def encode_buffers(self, tensors: Mapping[str, Any]) -> dict[str, str]:
        """Control-message ``buffers``: base64 of each buffer's little-endian bytes."""
        import torch

        out = {}
        for b in self.buffers:
            t = tensors[b.name].detach().to("cpu").contiguous()
            if b.dtype == "bfloat16":
                raw = t.view(torch.int16).numpy().astype("<i2").tobytes()
            else:
                raw = t.numpy().astype(_NP_BUFFER[b.dtype]).tobytes()
            out[b.name] = base64.b64encode(raw).decode()
        return out

    def decode_buffers(self, encoded: Mapping[str, str]) -> dict[str, Any]:
        """Tensors from control-message ``buffers``; SpecError for a wrong name or size."""
        import torch

        out = {}
        known = {b.name: b for b in self.buffers}
        for name, text in encoded.items():
            b = known.get(name)
            if b is None:
                raise SpecError(f"buffer {name!r} is not in the spec")
            try:
                raw = base64.b64decode(text, validate=True)
            except (ValueError, TypeError):
                raise SpecError(f"buffer {name!r} is not valid base64") from None
            if b.dtype == "bfloat16":
                arr = np.frombuffer(raw, "<i2") if len(raw) == 2 * b.numel else None
                t = None if arr is None else torch.from_numpy(arr.copy()).view(torch.bfloat16)
            else:
                dt = np.dtype(_NP_BUFFER[b.dtype])
                ok = len(raw) == dt.itemsize * b.numel
                t = torch.from_numpy(np.frombuffer(raw, dt).copy()) if ok else None
            if t is None:
                raise SpecError(f"buffer {name!r} has {len(raw)} bytes, expected "
                                f"{b.numel} x {b.dtype}")
            out[name] = t.reshape(b.shape)
        return out

    # ----- state_dict conversion ----------------------------------------------------------
    def state_dicts(
        self,
        flat: Mapping[str, np.ndarray],
        step: int,
        buffers: Mapping[str, Any] | None = None,
        lrs: Sequence[float] | None = None,
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """Full (model_sd, optim_sd) from flat slot arrays of length ``total``.

        The optimizer state_dict is torch.optim's: ``state[i]`` for the i-th parameter of the
        concatenated groups; empty before the first step (as torch has it). ``lrs`` (the last
        step's per-group rates) replace the spec's initial ``lr`` when given.
        """
        import torch

        for s in self.slots:
            if s not in flat or len(flat[s]) != self.total:
                raise SpecError(f"slot {s!r} missing or not of length {self.total}")
        model_sd: dict[str, Any] = {}
        for p in self.params:
            model_sd[p.name] = torch.from_numpy(
                np.array(flat["param"][p.offset:p.offset + p.numel], dtype=np.float32)
            ).reshape(p.shape)
        for alias, name in self.aliases:  # a tied parameter under each of its names
            model_sd[alias] = model_sd[name]
        for name, t in (buffers or {}).items():
            model_sd[name] = t
        state: dict[int, dict[str, Any]] = {}
        groups_out = []
        idx = 0
        for gi, g in enumerate(self.groups):
            ids = []
            for name in g.params:
                p = self.param(name)
                entry: dict[str, Any] = {}
                if step > 0:
                    if self.kind != "sgd":
                        entry["step"] = torch.tensor(float(step), dtype=torch.float32)
                    for s in self.group_slots(g):
                        entry[s] = torch.from_numpy(np.array(
                            flat[s][p.offset:p.offset + p.numel], dtype=np.float32
                        )).reshape(p.shape)
                if entry:
                    state[idx] = entry
                ids.append(idx)
                idx += 1
            hyper = g.hyper(self.kind)
            if lrs is not None:
                hyper["lr"] = float(lrs[gi])
            groups_out.append({**hyper, "params": ids})
        return model_sd, {"state": state, "param_groups": groups_out}

    def slot_pieces(self, model_sd: Mapping[str, Any], optim_sd: Mapping[str, Any] | None
                    ) -> dict[str, list[tuple[int, Any]]]:
        """Where each slot's elements are in torch state_dicts, without copying them: per
        slot, (flat offset, tensor) for every parameter that has the slot (a slot with no
        state yet, before the first step, has no piece: its elements are zeros)."""
        pieces: dict[str, list[tuple[int, Any]]] = {s: [] for s in self.slots}
        for p in self.params:
            pieces["param"].append((p.offset, model_sd[p.name]))
        state = (optim_sd or {}).get("state", {})
        for idx, name in enumerate(self.state_order()):
            p = self.param(name)
            for s, t in state.get(idx, {}).items():
                if s in pieces and s != "param":
                    pieces[s].append((p.offset, t))
        return pieces

    def flat_from_state_dicts(
        self, model_sd: Mapping[str, Any], optim_sd: Mapping[str, Any] | None
    ) -> dict[str, np.ndarray]:
        """Flat fp32 slot arrays (length ``total``) from torch state_dicts: the seed source.

        Slots without state (before the first step) are zeros.
        """
        flat = {s: np.zeros(self.total, dtype=np.float32) for s in self.slots}
        for s, pieces in self.slot_pieces(model_sd, optim_sd).items():
            for offset, t in pieces:
                a = _np(t).reshape(-1)
                flat[s][offset:offset + a.size] = a
        return flat


def difference(shadows: ModelSpec, mine: ModelSpec) -> str | None:
    """The first way ``mine`` (this trainer's model and optimizer) differs from the spec the
    shadows hold, in words; None when a resume may load the shadows' state.

    Why everything is compared: the shadows' flat arrays are cut by *their* spec, so a
    reordered, reshaped or added parameter would load scrambled weights, and a changed
    optimizer setting would silently continue a different run than the one resumed.
    """
    if shadows.job != mine.job:
        return f"job id: shadows {shadows.job}, this job {mine.job}"
    if shadows.partitions != mine.partitions:
        return f"partitions: shadows {shadows.partitions}, this job {mine.partitions}"
    if shadows.aliases != mine.aliases and _all_names(shadows) == _all_names(mine):
        # the same names, tied otherwise: say so, not "a parameter is missing"
        return f"tied parameters changed (name = parameter): shadows {_ties(shadows)}, " \
               f"this model {_ties(mine)}"
    have, want = [p.name for p in shadows.params], [p.name for p in mine.params]
    extra = [n for n in want if n not in set(have)]
    if extra:
        return f"this model has parameters the shadows do not: {', '.join(extra[:4])}"
    missing = [n for n in have if n not in set(want)]
    if missing:
        return f"the shadows have parameters this model lacks: {', '.join(missing[:4])}"
    for i, (a, b) in enumerate(zip(have, want, strict=True)):
        if a != b:
            return f"parameter order differs at index {i}: shadows have {a!r}, this model {b!r}"
    for a, b in zip(shadows.params, mine.params, strict=True):
        if a.shape != b.shape:
            return f"parameter {a.name!r} shape: shadows {list(a.shape)}, this model " \
                   f"{list(b.shape)}"
    if shadows.aliases != mine.aliases:
        return f"tied parameters changed (name = parameter): shadows {_ties(shadows)}, " \
               f"this model {_ties(mine)}"
    if shadows.grad_dtype != mine.grad_dtype:
        return f"gradient dtype: shadows {shadows.grad_dtype}, this job {mine.grad_dtype}"
    hb = {b.name: b for b in shadows.buffers}
    mb = {b.name: b for b in mine.buffers}
    if list(hb) != list(mb):
        return f"buffers: shadows {list(hb)[:4]}, this model {list(mb)[:4]}"
    for name, a in hb.items():
        b = mb[name]
        if (a.shape, a.dtype) != (b.shape, b.dtype):
            return f"buffer {name!r}: shadows {list(a.shape)} {a.dtype}, this model " \
                   f"{list(b.shape)} {b.dtype}"
    if shadows.kind != mine.kind:
        return f"optimizer: shadows {shadows.kind}, this optimizer {mine.kind}"
    if len(shadows.groups) != len(mine.groups):
        return f"param groups: shadows {len(shadows.groups)}, this optimizer " \
               f"{len(mine.groups)}"
    for gi, (a, b) in enumerate(zip(shadows.groups, mine.groups, strict=True)):
        if a.params != b.params:
            diff = sorted(set(a.params) ^ set(b.params)) or ["(their order)"]
            return f"param group {gi} parameters differ: {', '.join(diff[:4])}"
        ha, hm = a.hyper(shadows.kind), b.hyper(mine.kind)
        for k in ha:
            if ha[k] != hm[k]:
                return f"param group {gi} {k}: shadows {ha[k]}, this optimizer {hm[k]}"
    return None


def shard_part(p: Any, dims: Sequence[int] | None = None
               ) -> tuple[tuple[int, ...], tuple[tuple[int, ...], tuple[int, ...]] | None]:
    """(shape, place) of ``p``'s part over its mesh dimensions ``dims`` (default: all of
    them; a DTensor's local shard): the part's shape, and (global shape, offsets of the part
    in it), so that a checkpoint stores the part at its place in the whole tensor and plain
    DCP reshards it. Place None: ``p`` is whole there (a plain tensor, or Replicate on every
    one of ``dims``)."""
    placements = getattr(p, "placements", None)
    if placements is None:
        return tuple(p.shape), None
    mesh = p.device_mesh
    dims = list(range(mesh.ndim)) if dims is None else list(dims)
    chosen = [placements[i] for i in dims]
    if not chosen or all(pl.is_replicate() for pl in chosen):
        return tuple(p.shape), None
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    sub = mesh if len(dims) == mesh.ndim else mesh[tuple(mesh.mesh_dim_names[i] for i in dims)]
    shape, offset = compute_local_shape_and_global_offset(p.shape, sub, chosen)
    return tuple(shape), (tuple(p.shape), tuple(int(o) for o in offset))


def tied_names(model: Any) -> list[tuple[str, str]]:
    """(further name, parameter name) for every parameter the module reaches under more
    than one name; the parameter name is the first, the one ``named_parameters()`` keeps."""
    first: dict[int, str] = {}
    out = []
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            out.append((name, first[id(p)]))
        else:
            first[id(p)] = name
    return sorted(out)


def _all_names(spec: ModelSpec) -> set[str]:
    """Every name the model reaches a parameter under, tied or not."""
    return {p.name for p in spec.params} | {alias for alias, _ in spec.aliases}


def _ties(spec: ModelSpec) -> str:
    return ", ".join(f"{a} = {n}" for a, n in spec.aliases[:4]) or "none"


def _np(t: Any) -> np.ndarray:
    if hasattr(t, "detach"):
        return t.detach().to("cpu").float().numpy()
    return np.asarray(t, dtype=np.float32)
