"""The model spec's JSON schema (pydantic): what a shadow and a restore accept as a spec.

Types and ranges per field, and the rules across fields: parameters contiguous in listed
order with unique names, ``total`` their sum, every parameter in exactly one optimizer group,
buffer names new. A group field left out takes torch's default for the optimizer kind
(checkmate.optim.hyper.DEFAULTS, the one table of defaults). Errors follow the key path
(``spec.params[1].offset must be 6 ...``); checkmate.spec.model turns the first into a SpecError.
Unknown fields are ignored, so an older reader takes a newer spec's known part.
"""

from __future__ import annotations

import math
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from checkmate.schema import int_in as _int_in
from checkmate.schema import one_of as _one_of

KINDS = ("adamw", "adam", "sgd")
GRAD_DTYPES = ("float32", "bfloat16", "float16")
STATE_KEYS = ("index", "fqn")
BUFFER_DTYPES = ("float32", "float64", "float16", "bfloat16", "int64", "int32", "uint8",
                 "bool")


def _name(v: Any) -> str:
    if not isinstance(v, str) or not v:
        raise ValueError("must be a non-empty string")
    return v


def _shape(v: Any) -> tuple[int, ...]:
    if not isinstance(v, list) or not all(
            isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v):
        raise ValueError(f"must be a list of non-negative integers, got {v!r}")
    return tuple(v)


def _finite(v: Any) -> float | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise ValueError(f"must be a finite number, got {v!r}")
    return float(v)


def _flag(v: Any) -> bool | None:
    if v is not None and not isinstance(v, bool):
        raise ValueError(f"must be true or false, got {v!r}")
    return v


def _betas(v: Any) -> tuple[float, float] | None:
    if v is None:
        return None
    if (not isinstance(v, list | tuple) or len(v) != 2 or not all(
            isinstance(b, int | float) and not isinstance(b, bool) and 0 <= b < 1 for b in v)):
        raise ValueError(f"must be two numbers in [0, 1), got {v!r}")
    return float(v[0]), float(v[1])


def _names(v: Any) -> list[str]:
    if not isinstance(v, list) or not all(isinstance(n, str) for n in v):
        raise ValueError("must be a list of parameter names")
    return v


Name = Annotated[str, BeforeValidator(_name)]
Shape = Annotated[tuple[int, ...], BeforeValidator(_shape)]
I63 = Annotated[int, _int_in(0, 2**63 - 1)]
Num = Annotated[float | None, BeforeValidator(_finite)]
Flag = Annotated[bool | None, BeforeValidator(_flag)]


class _Obj(BaseModel):
    model_config = ConfigDict(extra="ignore")


def _opt_shape(v: Any) -> tuple[int, ...] | None:
    return None if v is None else _shape(v)


OptShape = Annotated[tuple[int, ...] | None, BeforeValidator(_opt_shape)]


class ParamDoc(_Obj):
    name: Name = Field(None, validate_default=True)
    shape: Shape = Field(None, validate_default=True)
    offset: I63 = Field(None, validate_default=True)
    numel: I63 = Field(None, validate_default=True)
    #: a shard of a larger tensor (a DTensor's local part): the whole tensor's shape, and
    #: where the shard starts in it; both or neither
    global_shape: OptShape = None
    global_offset: OptShape = None

    @model_validator(mode="after")
    def _numel(self) -> ParamDoc:
        n = math.prod(self.shape)
        if self.numel != n:
            raise ValueError(f".numel is {self.numel} but shape {list(self.shape)} has {n} "
                             "elements")
        g, o = self.global_shape, self.global_offset
        if (g is None) != (o is None):
            raise ValueError(".global_shape and .global_offset come together")
        if g is not None and (len(g) != len(self.shape) or len(o) != len(self.shape) or any(
                a + z > w for a, z, w in zip(o, self.shape, g, strict=True))):
            raise ValueError(f": a shard of shape {list(self.shape)} at {list(o)} does not "
                             f"fit in the global shape {list(g)}")
        return self


class GroupDoc(_Obj):
    """None: not given (the kind's default is filled in by SpecDoc)."""

    params: Annotated[list[str], BeforeValidator(_names)] = Field(None, validate_default=True)
    lr: Num = None
    betas: Annotated[tuple[float, float] | None, BeforeValidator(_betas)] = None
    eps: Num = None
    weight_decay: Num = None
    amsgrad: Flag = None
    momentum: Num = None
    dampening: Num = None
    nesterov: Flag = None
    maximize: Flag = None

    @model_validator(mode="after")
    def _lr(self) -> GroupDoc:
        if self.lr is None or self.lr < 0:
            raise ValueError(".lr must be a non-negative number")
        return self


class BufferDoc(_Obj):
    name: Name = Field(None, validate_default=True)
    shape: Shape = Field(None, validate_default=True)
    dtype: Annotated[str, _one_of(BUFFER_DTYPES)] = Field(None, validate_default=True)


def _nonempty_list(v: Any) -> Any:
    if not isinstance(v, list) or not v:
        raise ValueError("must be a non-empty list")
    return v


NonEmpty = BeforeValidator(_nonempty_list)


def _object(v: Any) -> Any:
    if not isinstance(v, dict):
        raise ValueError(f"must be an object, got {type(v).__name__}")
    return v


Obj = BeforeValidator(_object)


def _list(v: Any) -> Any:
    if not isinstance(v, list):
        raise ValueError("must be a list")
    return v


class OptimizerDoc(_Obj):
    kind: Annotated[str, _one_of(KINDS)] = Field(None, validate_default=True)
    groups: Annotated[list[Annotated[GroupDoc, Obj]], NonEmpty] = Field(
        None, validate_default=True)


class SpecDoc(_Obj):
    job: Annotated[int, _int_in(0, 2**32 - 1)] = Field(None, validate_default=True)
    params: Annotated[list[Annotated[ParamDoc, Obj]], NonEmpty] = Field(
        None, validate_default=True)
    total: I63 = Field(None, validate_default=True)
    partitions: Annotated[int, _int_in(1, 65535)] = Field(None, validate_default=True)
    optimizer: Annotated[OptimizerDoc, Obj] = Field(None, validate_default=True)
    buffers: Annotated[list[Annotated[BufferDoc, Obj]], BeforeValidator(_list)] = Field(
        default_factory=list)
    grad_dtype: Annotated[str, _one_of(GRAD_DTYPES)] = "float32"
    #: further name -> parameter name, for a parameter reachable under several names (tied)
    aliases: dict[Annotated[str, BeforeValidator(_name)], Annotated[str, BeforeValidator(
        _name)]] = Field(default_factory=dict)
    #: how the checkpoint keys optimizer state: "index" (torch.optim's state_dict) or "fqn"
    #: (torch.distributed.checkpoint.state_dict's, a mesh job: its groups' files join)
    state_keys: Annotated[str, _one_of(STATE_KEYS)] = "index"

    @model_validator(mode="after")
    def _across_fields(self) -> SpecDoc:
        from checkmate.optim.hyper import DEFAULTS

        names: set[str] = set()
        off = 0
        for i, p in enumerate(self.params):
            where = f"spec.params[{i}]"
            if p.name in names:
                raise ValueError(f"{where}.name {p.name!r} is listed twice")
            if p.offset != off:
                raise ValueError(f"{where}.offset must be {off} (parameters are contiguous in "
                                 f"listed order), got {p.offset}")
            names.add(p.name)
            off += p.numel
        if self.total != off:
            raise ValueError(f"spec.total is {self.total} but the parameters hold {off} "
                             "elements")
        if self.partitions > max(self.total, 1):
            raise ValueError(f"spec.partitions ({self.partitions}) exceeds spec.total "
                             f"({self.total})")
        grouped: set[str] = set()
        dflt = DEFAULTS[self.optimizer.kind]
        for i, g in enumerate(self.optimizer.groups):
            where = f"spec.optimizer.groups[{i}]"
            for n in g.params:
                if n not in names:
                    raise ValueError(f"{where}.params names unknown parameter {n!r}")
                if n in grouped:
                    raise ValueError(f"{where}.params: {n!r} is already in another group")
                grouped.add(n)
            for key, value in (("betas", tuple(dflt.get("betas", (0.9, 0.999)))),
                               ("eps", dflt.get("eps", 1e-8)),
                               ("weight_decay", dflt["weight_decay"]),
                               ("momentum", dflt.get("momentum", 0.0)),
                               ("dampening", dflt.get("dampening", 0.0)),
                               ("amsgrad", False), ("nesterov", False), ("maximize", False)):
                if getattr(g, key) is None:
                    setattr(g, key, value)
        if grouped != names:
            missing = sorted(names - grouped)
            raise ValueError(f"parameters in no optimizer group: {', '.join(missing[:5])}")
        bnames: set[str] = set()
        for i, b in enumerate(self.buffers):
            if b.name in bnames or b.name in names:
                raise ValueError(f"spec.buffers[{i}].name must be a new non-empty string, "
                                 f"got {b.name!r}")
            bnames.add(b.name)
        for alias, target in self.aliases.items():
            if alias in names or alias in bnames:
                raise ValueError(f"spec.aliases: {alias!r} is already a parameter or buffer")
            if target not in names:
                raise ValueError(f"spec.aliases[{alias!r}] names unknown parameter {target!r}")
        return self
