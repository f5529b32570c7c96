"""``checkmate plan``: checkpoint intervals by the Young/Daly model, and shadow sizing.

The model (GoCkpt, section 3; Young/Daly): a job of steps of ``T_step`` seconds saves a
checkpoint every N steps at ``T_ckpt`` seconds of stall each, fails at rate p = 1/MTBF and
then loads one in ``T_load`` seconds and repeats, on average, half an interval. The wasted
fraction of training time is

    P(N) = T_ckpt / (N T_step) + p N T_step / 2 + p T_load,

smallest at N* = sqrt(2 T_ckpt / (p T_step^2)). The planner evaluates P at the whole
numbers around N* (at least 1: nothing checkpoints more often than every step) and reports,
per scheme, the interval, the expected time lost per failure (N T_step / 2 + T_load) and
the effective throughput 1 / (1 + P). Checkmate's "checkpoint" is every step at the cost
the trainers pay per step, so its N is 1 by construction.

Sizing answers how many shadows a model needs from the rates measured on this project's
machine (docs/benchmarks.md): a shadow must take in its partition's gradient (ingest) and
step its optimizer within one training step, and hold its state, staging window and
retained versions in memory; it says which of these binds and where the sizing runs out.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from dataclasses import dataclass

from checkmate.errors import CheckmateError

#: Measured here (docs/benchmarks.md): one shadow receive thread places ~2.0 GB/s of
#: gradient; the AdamW step runs at ~2300 M params/s on 2 vCPUs (memory-bound, 28 B/param).
INGEST_BYTES_PER_S = 2.0e9
OPTIMIZER_PARAMS_PER_S = 2.3e9
#: Measured end to end (docs/benchmarks.md, "shadow capacity", 2026-11-26): a whole shadow
#: node receiving, checking and placing the gradient, stepping AdamW and keeping a retained
#: version, 68-128 M params/s per core of its threads' CPU over that day's runs (medians of
#: 5 rounds; with the step writing the version itself 79-127); its receive path is one thread,
#: so this is what one shadow process (one partition) takes. Printed beside the sizing, and
#: the sizing's bound with ``--shadow-capacity`` (not by default: the switch figures count a
#: port per shadow, and processes that share a host's port are not modelled yet).
CAPACITY_PARAMS_PER_S = 1.0e8
#: float32 slots a shadow keeps per optimizer kind (param + optimizer state).
SLOTS = {"sgd": 1, "sgd-momentum": 2, "adam": 3, "adamw": 3, "adamw-amsgrad": 4}
_UNITS = {"": 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "m": 60.0, "min": 60.0, "h": 3600.0,
          "d": 86400.0}
_SIZE = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "b": 1e9, "t": 1e12}


@dataclass(frozen=True)
class Scheme:
    name: str
    ckpt_s: float  # stall per checkpoint
    load_s: float  # time to load one after a failure
    every_step: bool = False  # Checkmate: a checkpoint exists after every step


@dataclass(frozen=True)
class Plan:
    scheme: Scheme
    interval: int  # steps between checkpoints
    n_star: float  # the unrounded optimum
    waste: float  # P at ``interval``
    lost_per_failure_s: float

    @property
    def throughput(self) -> float:
        """Useful fraction of wall time, 1 / (1 + P)."""
        return 1.0 / (1.0 + self.waste)


def waste(n: float, step_s: float, ckpt_s: float, load_s: float, mtbf_s: float) -> float:
    """P(N): wasted time per unit of useful training time."""
    p = 1.0 / mtbf_s
    return ckpt_s / (n * step_s) + p * n * step_s / 2 + p * load_s


def plan(s: Scheme, step_s: float, mtbf_s: float) -> Plan:
    """The best whole-number interval for ``s`` (see the module docstring)."""
    if min(step_s, mtbf_s) <= 0 or min(s.ckpt_s, s.load_s) < 0:
        raise CheckmateError("step time and MTBF must be > 0, costs >= 0")
    p = 1.0 / mtbf_s
    n_star = 1.0 if s.every_step else math.sqrt(2 * s.ckpt_s / (p * step_s ** 2))
    if s.every_step:
        best = 1
    else:
        cands = {max(1, math.floor(n_star)), max(1, math.ceil(n_star))}
        best = min(cands, key=lambda n: waste(n, step_s, s.ckpt_s, s.load_s, mtbf_s))
    return Plan(s, best, n_star, waste(best, step_s, s.ckpt_s, s.load_s, mtbf_s),
                best * step_s / 2 + s.load_s)


@dataclass(frozen=True)
class Sizing:
    shadows: int
    bound: str  # which requirement set the count
    partition_params: int
    memory_bytes: float  # per shadow
    nic_bytes_per_s: float  # gradient into each shadow
    ingest_util: float  # of one receive thread, per shadow
    optimizer_util: float  # of the measured step rate, per shadow
    capacity_util: float  # of the end-to-end capacity (given, else measured), per shadow


def size(params: int, step_s: float, grad_bytes: int = 4, optimizer: str = "adamw",
         retain: int = 4, window: int = 8, shadow_memory: float | None = None,
         ingest: float = INGEST_BYTES_PER_S, opt_rate: float = OPTIMIZER_PARAMS_PER_S,
         capacity: float | None = None) -> Sizing:
    """Fewest shadows so each one ingests and steps its partition within a step, by the
    component rates and by the end-to-end ``capacity`` (params/s a shadow takes in and
    steps), and fits ``shadow_memory`` bytes when given."""
    if optimizer not in SLOTS:
        raise CheckmateError(f"optimizer must be one of {', '.join(SLOTS)}, got {optimizer!r}")
    if params < 1 or step_s <= 0 or grad_bytes not in (2, 4):
        raise CheckmateError("need params >= 1, step time > 0, gradient of 2 or 4 bytes")
    slots = SLOTS[optimizer]
    per_param_mem = 4 * slots * (1 + retain) + 4 * window  # state + retained + staging
    need = {
        "ingest": params * grad_bytes / (ingest * step_s),
        "optimizer step": params / (opt_rate * step_s),
        "capacity": params / (capacity * step_s) if capacity else 0.0,
        "memory": params * per_param_mem / shadow_memory if shadow_memory else 0.0,
    }
    bound = max(need, key=need.get)
    n = max(1, math.ceil(need[bound]))
    part = math.ceil(params / n)
    return Sizing(n, bound, part, part * per_param_mem, part * grad_bytes / step_s,
                  part * grad_bytes / (ingest * step_s), part / (opt_rate * step_s),
                  part / ((capacity or CAPACITY_PARAMS_PER_S) * step_s))


# ----- CLI ---------------------------------------------------------------------------------
def _seconds(text: str) -> float:
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e-?[0-9]+)?)\s*([a-z]*)\s*", text.lower())
    if not m or m.group(2) not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (e.g. 0.5, 250ms, 45m, 3h)")
    return float(m.group(1)) * _UNITS[m.group(2)]


def _count(text: str) -> int:
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-z]?)\s*", text.lower())
    if not m or m.group(2) not in _SIZE:
        raise argparse.ArgumentTypeError(f"not a count: {text!r} (e.g. 7B, 350M, 256G)")
    return int(float(m.group(1)) * _SIZE[m.group(2)])


def _scheme(text: str) -> Scheme:
    """NAME=CKPT[,LOAD] e.g. torch.save=12s,30s"""
    name, sep, rest = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=CKPT_COST[,LOAD_TIME], got {text!r}")
    costs = rest.split(",")
    if len(costs) > 2:
        raise argparse.ArgumentTypeError(f"expected NAME=CKPT_COST[,LOAD_TIME], got {text!r}")
    ckpt = _seconds(costs[0])
    load = _seconds(costs[1]) if len(costs) == 2 else 0.0
    return Scheme(name, ckpt, load)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="checkmate plan",
        description="Checkpoint interval per scheme (Young/Daly) and shadow sizing.")
    ap.add_argument("--mtbf", type=_seconds, required=True,
                    help="mean time between failures of the job (e.g. 3h, 45m)")
    ap.add_argument("--step-time", type=_seconds, required=True, help="seconds per step")
    ap.add_argument("--ckpt-cost", type=_scheme, action="append", default=[],
                    metavar="NAME=COST[,LOAD]",
                    help="a periodic scheme's stall per checkpoint and load time (repeat)")
    ap.add_argument("--checkmate-cost", type=_seconds, default=None, metavar="COST",
                    help="what Checkmate costs the trainers per step (a checkpoint exists "
                         "after every step)")
    ap.add_argument("--checkmate-load", type=_seconds, default=0.0,
                    help="time to restore from the shadows")
    ap.add_argument("--params", type=_count, default=None,
                    help="model parameters, for shadow sizing (e.g. 7B, 350M)")
    ap.add_argument("--grad-dtype", choices=("float32", "bfloat16", "float16"),
                    default="float32")
    ap.add_argument("--optimizer", choices=tuple(SLOTS), default="adamw")
    ap.add_argument("--shadow-memory", type=_count, default=None,
                    help="bytes of memory a shadow may use (e.g. 256G)")
    ap.add_argument("--shadow-ingest", type=_count, default=INGEST_BYTES_PER_S,
                    help="gradient bytes/s one shadow takes in (default: the measured "
                         f"{INGEST_BYTES_PER_S / 1e9:g}G, docs/benchmarks.md)")
    ap.add_argument("--shadow-step-rate", type=_count, default=OPTIMIZER_PARAMS_PER_S,
                    help="params/s one shadow steps (default: the measured "
                         f"{OPTIMIZER_PARAMS_PER_S / 1e9:g}G)")
    ap.add_argument("--shadow-capacity", type=_count, default=None,
                    help="params/s one shadow takes in and steps, end to end: size by it "
                         f"too (measured here: {CAPACITY_PARAMS_PER_S / 1e6:g}M per process)")
    ap.add_argument("--gpus", type=_count, default=None,
                    help="ranks of the job, for switch state and controller work (needs "
                         "--params; docs/scale.md)")
    ap.add_argument("--gpus-per-node", type=_count, default=8,
                    help="ranks per node (default 8)")
    ap.add_argument("--tp", type=_count, default=1,
                    help="tensor-parallel degree: shadows are sized per data-parallel group "
                         "(TP x PP groups, each 1/(TP x PP) of the model; docs/scale.md)")
    ap.add_argument("--pp", type=_count, default=1, help="pipeline-parallel degree")
    ap.add_argument("--replicas", type=_count, default=1,
                    help="shadows per partition (issue 38): switch state, ports and copies "
                         "count every replica (default 1)")
    ap.add_argument("--colocated", action="store_true",
                    help="the shadows run on the job's own nodes (checkmate launch "
                         "--colocate): they take no switch port of their own")
    return ap


def main(argv: list[str]) -> int:
    a = _parser().parse_args(argv)
    schemes = list(a.ckpt_cost)
    if a.checkmate_cost is not None:
        schemes.append(Scheme("checkmate", a.checkmate_cost, a.checkmate_load, every_step=True))
    if not schemes and a.params is None:
        raise CheckmateError("give at least one --ckpt-cost NAME=COST, --checkmate-cost or "
                             "--params")
    print(f"step {a.step_time:g} s, MTBF {a.mtbf:g} s (p = {1 / a.mtbf:.3g}/s)")
    if schemes:
        print(f"{'scheme':<16}{'N*':>10}{'interval':>10}{'waste P':>10}"
              f"{'lost/failure s':>16}{'throughput':>12}")
        for s in schemes:
            pl = plan(s, a.step_time, a.mtbf)
            print(f"{s.name:<16}{pl.n_star:>10.1f}{pl.interval:>10d}{pl.waste:>10.4f}"
                  f"{pl.lost_per_failure_s:>16.2f}{pl.throughput:>12.4f}")
    if min(a.tp, a.pp) < 1:
        raise CheckmateError("--tp and --pp must be at least 1")
    groups = a.tp * a.pp
    if a.colocated and groups > 1:
        raise CheckmateError("--colocated plans a data-parallel job (`checkmate launch "
                             "--colocate` is not for --pp/--tp)")
    if a.params is not None and groups > 1:
        print(f"mesh: TP {a.tp} x PP {a.pp}: {groups} data-parallel groups, each protecting "
              f"1/{groups} of the model ({math.ceil(a.params / groups):.3g} params) with "
              "shadows of its own; the sizing below is per group")
        a.params = math.ceil(a.params / groups)
    if a.params is not None:
        gb = 2 if a.grad_dtype != "float32" else 4
        sz = size(a.params, a.step_time, gb, a.optimizer, shadow_memory=a.shadow_memory,
                  ingest=a.shadow_ingest, opt_rate=a.shadow_step_rate,
                  capacity=a.shadow_capacity)
        print(f"shadows for {a.params:.3g} params ({a.optimizer}, {a.grad_dtype} gradient): "
              f"{sz.shadows}, set by {sz.bound}; each holds {sz.partition_params:.3g} params "
              f"in {sz.memory_bytes / 2**30:.1f} GiB and takes {sz.nic_bytes_per_s / 1e9:.2f} "
              f"GB/s of gradient ({sz.ingest_util:.0%} of one receive thread, "
              f"{sz.optimizer_util:.0%} of the measured step rate)")
        print("rates measured here (docs/benchmarks.md): ingest "
              f"{INGEST_BYTES_PER_S / 1e9:.1f} GB/s per receive thread, AdamW "
              f"{OPTIMIZER_PARAMS_PER_S / 1e9:.1f} G params/s on 2 vCPUs; the sizing runs out "
              "where one shadow's NIC cannot carry its share or the switch cannot copy at "
              "line rate (one copy of each byte: the gradient's size per step in total)")
        if a.shadow_capacity is None:
            e2e = size(a.params, a.step_time, gb, a.optimizer,
                       shadow_memory=a.shadow_memory, ingest=a.shadow_ingest,
                       opt_rate=a.shadow_step_rate, capacity=CAPACITY_PARAMS_PER_S)
            print(f"end to end (receive, check, place, AdamW) one shadow process measured "
                  f"{CAPACITY_PARAMS_PER_S / 1e6:.0f} M params/s here (docs/benchmarks.md, "
                  f"\"shadow capacity\"): {e2e.shadows} processes for this model and step, "
                  "a core each; --shadow-capacity sizes by it")
        if (a.shadow_ingest, a.shadow_step_rate) != (INGEST_BYTES_PER_S,
                                                     OPTIMIZER_PARAMS_PER_S) \
                or a.shadow_capacity is not None:
            print(f"sized with ingest {a.shadow_ingest / 1e9:g} GB/s and step rate "
                  f"{a.shadow_step_rate / 1e9:g} G params/s per shadow"
                  + (f", capacity {a.shadow_capacity / 1e6:g} M params/s"
                     if a.shadow_capacity is not None else "") + " (given)")
        if a.replicas > 1:
            print(f"replicas: {a.replicas} shadows per partition, {sz.shadows * a.replicas} "
                  f"shadow processes ({sz.memory_bytes * a.replicas / 2**30:.1f} GiB per "
                  "partition in all); host mode: the trainers send each copy "
                  f"{a.replicas} times; switch mode: one more multicast member per replica")
    if a.gpus is not None:
        if a.params is None:
            raise CheckmateError("--gpus needs --params (the shadows set the partitions)")
        from checkmate.launch import scale

        if groups > 1:
            nodes = scale.group_nodes(a.gpus, a.gpus_per_node, a.tp, a.pp)
            one = scale.scale(len(nodes), a.gpus_per_node, sz, a.step_time, gb, a.params,
                              node_of=nodes, replicas=a.replicas, colocated=a.colocated)
            lines = scale.describe_mesh(one, a.gpus, a.gpus_per_node, a.tp, a.pp)
        else:
            lines = scale.describe(scale.scale(a.gpus, a.gpus_per_node, sz, a.step_time, gb,
                                               a.params, replicas=a.replicas,
                                               colocated=a.colocated))
        for line in lines:
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
