"""Optimizer kinds, their state slots and hyperparameter defaults (torch 2.13's)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from checkmate.errors import CheckmateError

KINDS = ("adam", "adamw", "sgd")

#: torch's constructor defaults per kind (lr included: a group may omit it).
DEFAULTS: dict[str, dict[str, Any]] = {
    "adam": {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0,
             "amsgrad": False, "maximize": False},
    "adamw": {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2,
              "amsgrad": False, "maximize": False},
    "sgd": {"lr": 1e-3, "momentum": 0.0, "dampening": 0.0, "weight_decay": 0.0,
            "nesterov": False, "maximize": False},
}


def check_kind(kind: str) -> str:
    if kind not in KINDS:
        raise CheckmateError(f"unknown optimizer kind {kind!r} (use one of {', '.join(KINDS)})")
    return kind


def resolve(kind: str, hyper: Mapping[str, Any]) -> dict[str, Any]:
    """``hyper`` over the kind's defaults, validated like torch does. Unknown keys (e.g. a
    spec group's ``params``) are ignored; None values mean "default"."""
    check_kind(kind)
    out = dict(DEFAULTS[kind])
    for k in out:
        if hyper.get(k) is not None:
            out[k] = hyper[k]
    try:
        out["lr"] = float(out["lr"])
        out["weight_decay"] = float(out["weight_decay"])
        out["maximize"] = bool(out["maximize"])
        if kind == "sgd":
            out["momentum"] = float(out["momentum"])
            out["dampening"] = float(out["dampening"])
            out["nesterov"] = bool(out["nesterov"])
        else:
            b1, b2 = (float(b) for b in out["betas"])
            out["betas"] = (b1, b2)
            out["eps"] = float(out["eps"])
            out["amsgrad"] = bool(out["amsgrad"])
    except (TypeError, ValueError) as e:
        raise CheckmateError(f"bad {kind} hyperparameters {dict(hyper)!r}: {e}") from None
    if out["lr"] < 0 or out["weight_decay"] < 0:
        # a group a torch scheduler drives keeps its base lr as initial_lr: the lr refused
        # is then the scheduler's for this step, not the one the optimizer was built with
        base = hyper.get("initial_lr")
        by = (f" (lr {out['lr']} is the scheduler's for this step, from initial_lr {base})"
              if base is not None and base != out["lr"] else "")
        raise CheckmateError(f"{kind}: lr and weight_decay must be >= 0, got {out}{by}")
    if kind == "sgd":
        if out["momentum"] < 0:
            raise CheckmateError(f"sgd: momentum must be >= 0, got {out['momentum']}")
        if out["nesterov"] and (out["momentum"] <= 0 or out["dampening"] != 0):
            raise CheckmateError("sgd: Nesterov momentum requires a momentum and zero dampening")
    else:
        b1, b2 = out["betas"]
        if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0) or out["eps"] < 0:
            raise CheckmateError(f"{kind}: need 0 <= betas < 1 and eps >= 0, got {out}")
    return out


def slots(kind: str, groups: list[Mapping[str, Any]]) -> tuple[str, ...]:
    """State slots a partition holds, in the order used on the wire (seed/fetch)."""
    check_kind(kind)
    if kind == "sgd":
        has_buf = any(float(g.get("momentum") or 0.0) != 0 for g in groups)
        return ("param", "momentum_buffer") if has_buf else ("param",)
    ams = any(bool(g.get("amsgrad")) for g in groups)
    return ("param", "exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if ams else ())


def control_hyper(kind: str, group: Mapping[str, Any]) -> dict[str, Any]:
    """A param group's hyperparameters other than ``lr`` (which travels in ``lrs``), resolved
    as the optimizer steps with them: the control message's ``hyper`` entry of the group."""
    out = {k: v for k, v in resolve(kind, group).items() if k != "lr"}
    if "betas" in out:
        out["betas"] = list(out["betas"])
    return out


def check_change(kind: str, old: Mapping[str, Any], new: Mapping[str, Any], where: str) -> None:
    """Refuse a mid-run change the flat state cannot follow: ``amsgrad`` (adds or drops the
    max_exp_avg_sq slot) and SGD momentum between zero and non-zero (the momentum buffer
    exists from the start or never). Every other setting may change at any step."""
    if kind != "sgd" and bool(old["amsgrad"]) != bool(new["amsgrad"]):
        raise CheckmateError(f"{where} amsgrad changed from {old['amsgrad']} to "
                             f"{new['amsgrad']} mid-run; Checkmate's shadows keep the slots "
                             "fixed at the start (restart the job with resume=False)")
    if kind == "sgd" and (float(old["momentum"]) == 0) != (float(new["momentum"]) == 0):
        raise CheckmateError(f"{where} momentum changed from {old['momentum']} to "
                             f"{new['momentum']} mid-run; between zero and non-zero it adds or "
                             "drops the momentum buffer, which Checkmate's shadows keep fixed "
                             "(restart the job with resume=False)")
