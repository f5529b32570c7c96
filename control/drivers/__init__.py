"""Per-target drivers that apply a deploy plan: kernel (BPF maps), bmv2 and Tofino
(P4Runtime, or bmv2 Thrift for simple_switch; Tofino ports through bfrt)."""

from __future__ import annotations

from checkmate.config.cluster import ClusterConfig
from checkmate.control.drivers.base import ApplyResult, Driver
from checkmate.errors import CheckmateError

__all__ = ["ApplyResult", "Driver", "for_switch"]


def for_switch(cfg: ClusterConfig, name: str | None = None) -> Driver:
    """The driver of the config's switch; ``name`` must be that switch's name."""
    if name is not None and name != cfg.switch.name:
        raise CheckmateError(f"unknown switch {name!r} (the config has {cfg.switch.name!r})")
    target = cfg.switch.target
    if target == "kernel":
        from checkmate.control.drivers.kernel import KernelDriver

        return KernelDriver(cfg)
    if target == "bmv2" and cfg.switch.runtime == "thrift":
        from checkmate.control.drivers.bmv2_thrift import Bmv2ThriftDriver

        return Bmv2ThriftDriver(cfg)
    if target == "bmv2":
        from checkmate.control.drivers.p4runtime import P4RuntimeDriver

        return P4RuntimeDriver(cfg, "v1model")
    if target == "tofino":
        from checkmate.control.drivers.tofino import TofinoDriver

        return TofinoDriver(cfg)
    raise CheckmateError(f"no driver for target {target!r}")
