"""`testbed device-check`: Checkmate on one GPU, in one command with a global time budget.

Run by a person with one GPU after ``make setup`` (or ``scripts/device-check.sh``, which
installs the project's wheel and the core dependencies it lacks into that machine's
Python). Prints one line per check -- ``PASS``, ``FAIL`` or ``SKIP`` with the reason -- and
a summary line; with CUDA it writes the figures into docs/gpu.md (``--doc``). Checks
(docs/gpu.md):

  optim[CASE]     each checkmate optimizer and option, 10M+ parameters, 50 steps: the CUDA
                  result vs the shadows' CPU Numba kernel (FlatOptimizer) fed the same
                  gradients, learning rates and clip factors, bit for bit
                  (checkmate.optim.device_check: its CASES, check_case)
  optim-speed     checkmate AdamW on CUDA vs torch's fused CUDA AdamW, 100M parameters
                  (checkmate.optim.device_check.bench_adamw)
  ddp             2-rank DDP on NCCL on the one GPU (a NCCL_HOSTID per rank), 2 shadows,
                  under `checkmate launch`; a worker SIGKILLed at a random iteration and
                  restarted; final state bit-identical to a failure-free run
  fsdp            the same with FSDP2
  schemes         none, torch.save, DCP async (stager, pinned memory), CheckFreq, GoCkpt,
                  Checkmate (DDP hook, host mode) on >= 1 GB of model + optimizer state
  nccl-plugin     NCCL's own allreduce through torch.distributed with the ckm NCCL plugin
                  (NCCL_NET_PLUGIN, 2 ranks on one GPU, distinct NCCL_HOSTID, tagging on):
                  exact results, every reduced element tagged once, the 2 shadows' shares
                  equal to the trainers'; records the NCCL release (root: a tap on lo)

Without CUDA every CUDA part is a SKIP line that names it; ``--cpu-smoke`` runs the
optimizer harness on CPU tensors at a small size (the exact torch path against the shadow
kernel: the harness itself, not the device).
A check that does not fit the remaining budget is skipped and says so. Exit status: 0
when nothing failed, 1 otherwise; bad arguments are one line and 2.

The workers (``--worker ddp|fsdp|bench``) are this file run by `checkmate launch`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from checkmate.testbed.device_common import (
    DOC,
    PROJECT_DEPS,
    Budget,
    Result,
    _missing,
    environment,
)
from checkmate.testbed.device_nccl import nccl_plugin_check
from checkmate.testbed.device_nccl import worker as _worker_nccl
from checkmate.testbed.device_runs import (
    _probe,
    kill_restore,
    optim_case,
    optim_speed,
    placement,
    probe_backend,
    schemes_check,
)
from checkmate.testbed.device_workers import _worker_bench, _worker_ddp_fsdp

BEGIN, END = "<!-- device-check results: begin -->", "<!-- device-check results: end -->"


def _doc_table(results: list[Result], env: dict[str, str], seconds: float) -> str:
    head = (f"Run {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} on **{env['card']}**: "
            f"torch {env['torch']}, CUDA {env['cuda']}, NCCL {env['nccl']}, numba "
            f"{env['numba']}, triton {env['triton']}, Python {env['python']}; "
            f"{seconds:.0f} s in all.\n\n")
    rows = ["| check | result | figures |", "|---|---|---|"]
    for r in results:
        figs = json.dumps(r.figures, sort_keys=True) if r.figures else ""
        rows.append(f"| {r.name} | {r.status} | {r.reason.replace('|', '/')}"
                    f"{' `' + figs + '`' if figs else ''} |")
    return head + "\n".join(rows) + "\n"


def write_doc(path: Path, results: list[Result], env: dict[str, str], seconds: float) -> None:
    text = path.read_text() if path.exists() else f"# GPU results\n\n{BEGIN}\n{END}\n"
    if BEGIN not in text or END not in text:
        raise ValueError(f"{path} lacks the markers {BEGIN} / {END}")
    a, b = text.index(BEGIN) + len(BEGIN), text.index(END)
    path.write_text(text[:a] + "\n" + _doc_table(results, env, seconds) + text[b:])


def run_checks(args: argparse.Namespace, emit: Callable[[Result], None]) -> list[Result]:
    budget = Budget(args.budget)
    results: list[Result] = []

    def add(r: Result) -> None:
        results.append(r)
        emit(r)

    def guarded(name: str, fn: Callable[[], Any]) -> None:
        try:
            got = fn()
        except Exception as e:  # noqa: BLE001 - every failure is one FAIL line
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            add(Result(name, "FAIL", f"{type(e).__name__}: {msg}"))
            return
        for r in got if isinstance(got, list) else [got]:
            add(r)

    # the launcher's decision (checkmate.launch.placement), for the 2-rank jobs
    cuda = placement(args.cpu_smoke).device == "cuda"
    only = set(args.only.split(",")) if args.only else None

    def wanted(name: str) -> bool:
        return only is None or name in only

    no_cuda = "--cpu-smoke given" if args.cpu_smoke else "no CUDA device"
    # (a) optimizers: every case of checkmate.optim.device_check
    if wanted("optim"):
        from checkmate.optim.device_check import CASE_NAMES

        if not cuda:
            for name in CASE_NAMES:
                if not budget.fits(5):
                    add(Result(f"optim-cpu[{name}]", "SKIP", "does not fit the time budget"))
                    continue
                guarded(f"optim-cpu[{name}]",
                        lambda n=name: optim_case(n, "cpu", args.cpu_n, args.cpu_steps))
        for name in CASE_NAMES:
            if not cuda:
                add(Result(f"optim[{name}]", "SKIP", f"CUDA vs shadow kernel: {no_cuda}"))
            elif not budget.fits(15):
                add(Result(f"optim[{name}]", "SKIP", f"does not fit the time budget "
                           f"({budget.left():.0f} s left)"))
            else:
                guarded(f"optim[{name}]",
                        lambda n=name: optim_case(n, "cuda", args.params, args.steps))
    if wanted("optim-speed"):
        if not cuda:
            add(Result("optim-speed", "SKIP", f"checkmate vs fused CUDA AdamW: {no_cuda}"))
        elif not budget.fits(20):
            add(Result("optim-speed", "SKIP", "does not fit the time budget"))
        else:
            guarded("optim-speed", lambda: optim_speed(args.speed_params))
    # (e) the NCCL plugin under real NCCL (run before the launcher checks: it needs no
    # launcher, only CUDA, gcc and the wire format's dependencies)
    if wanted("nccl-plugin"):
        if not cuda:
            add(Result("nccl-plugin", "SKIP", "NCCL's own allreduce through the ckm plugin, "
                       f"2 ranks on one GPU: {no_cuda}"))
        elif _missing(("crc32c",)):
            add(Result("nccl-plugin", "FAIL", "needs crc32c (the wire format's CRC); "
                       "scripts/device-check.sh installs it from build/device-wheels"))
        else:
            guarded("nccl-plugin", lambda: nccl_plugin_check(budget))
    # (b)-(d) need the launcher, shadows and sessions: the project's own dependencies
    later = [c for c in ("ddp", "fsdp", "schemes") if wanted(c)]
    if not later:
        return results
    if args.cpu_launch:  # the launcher parts on CPU tensors with gloo: logic, not device
        if _missing(PROJECT_DEPS):
            for c in later:
                add(Result(f"{c}-cpu", "FAIL", f"needs {', '.join(_missing(PROJECT_DEPS))}"))
            return results
        for c in ("ddp", "fsdp"):
            if c in later:
                guarded(f"{c}-cpu", lambda c=c: kill_restore(c, "gloo", budget, args.job_steps,
                                                             "cpu"))
        if "schemes" in later:
            guarded("schemes-cpu", lambda: schemes_check("gloo", budget, args.bench_width,
                                                         args.bench_layers, args.rounds, "cpu"))
    if not cuda:
        what = {"ddp": "2-rank DDP on NCCL on one GPU, SIGKILL + restart, bit-identical",
                "fsdp": "2-rank FSDP2 on one GPU, SIGKILL + restart, bit-identical",
                "schemes": "checkpoint schemes on the GPU with >= 1 GB of state"}
        for c in later:
            add(Result(c, "SKIP", f"{what[c]}: {no_cuda}"))
        return results
    missing = _missing(PROJECT_DEPS)
    if missing:
        for c in later:
            add(Result(c, "FAIL", f"needs {', '.join(missing)} (the launcher, shadows and "
                       "sessions import them); scripts/device-check.sh installs them from "
                       "build/device-wheels"))
        return results
    backend, how = (None, "")
    if budget.fits(30):
        try:
            backend, how = probe_backend(budget)
        except Exception as e:  # noqa: BLE001
            how = f"probe failed: {e}"
    else:
        how = "no time left in the budget to probe"
    note = " (NCCL refused: the checks below run on gloo)" if backend == "gloo" else ""
    add(Result("backend", "FAIL" if backend is None else "PASS", how + note,
               {"backend": backend}))
    if backend is None:
        for c in later:
            add(Result(c, "FAIL", "no backend runs 2 ranks on this GPU (see backend)"))
        return results
    for c in ("ddp", "fsdp"):
        if c not in later:
            continue
        if c == "fsdp" and backend != "nccl":
            add(Result(c, "SKIP", "FSDP2 needs NCCL's reduce-scatter on CUDA; gloo ran"))
        elif not budget.fits(90):
            add(Result(c, "SKIP", f"does not fit the time budget ({budget.left():.0f} s "
                       "left, about 90 s needed)"))
        else:
            guarded(c, lambda c=c: kill_restore(c, backend, budget, args.job_steps))
    if "schemes" in later:
        guarded("schemes", lambda: schemes_check(backend, budget, args.bench_width,
                                                 args.bench_layers, args.rounds))
    return results


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"] and len(argv) > 1:
        kind = argv[1]
        if kind in ("ddp", "fsdp"):
            return _worker_ddp_fsdp(kind, argv[2:])
        if kind == "bench":
            return _worker_bench(argv[2:])
        if kind == "nccl-plugin":
            return _worker_nccl(argv[2:])
    if argv[:1] == ["--probe"] and len(argv) > 1:
        return _probe(argv[1])
    return _main(argv)


def _positive(kind: type) -> Callable[[str], Any]:
    def conv(s: str) -> Any:
        try:
            v = kind(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {s!r}") from None
        if v <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {s}")
        return v
    return conv


def _main(argv: list[str]) -> int:
    from checkmate.errors import cli_guard

    @cli_guard("testbed device-check")
    def run() -> int:
        ap = argparse.ArgumentParser(prog="testbed device-check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
        ap.add_argument("--budget", type=_positive(float), default=450.0, metavar="SECONDS",
                        help="global time budget; what does not fit is skipped (default 450)")
        ap.add_argument("--cpu-smoke", action="store_true",
                        help="run the optimizer harness on CPU tensors at a small size and "
                        "skip every CUDA part")
        ap.add_argument("--cpu-launch", action="store_true",
                        help="also run the launcher checks (ddp, fsdp, schemes) on CPU tensors "
                        "with gloo at the sizes given: their logic, not the device")
        ap.add_argument("--only", help="comma-separated subset: optim, optim-speed, ddp, "
                        "fsdp, schemes, nccl-plugin")
        ap.add_argument("--params", type=_positive(int), default=10_500_000,
                        help="elements per optimizer case on CUDA (10M+)")
        ap.add_argument("--steps", type=_positive(int), default=50)
        ap.add_argument("--cpu-n", type=_positive(int), default=20_011)
        ap.add_argument("--cpu-steps", type=_positive(int), default=5)
        ap.add_argument("--speed-params", type=_positive(int), default=100_000_000)
        ap.add_argument("--job-steps", type=_positive(int), default=24)
        ap.add_argument("--bench-width", type=_positive(int), default=4096)
        ap.add_argument("--bench-layers", type=_positive(int), default=6)
        ap.add_argument("--rounds", type=_positive(int), default=5)
        ap.add_argument("--doc", type=Path, default=None,
                        help=f"write the results table here (default with CUDA: {DOC})")
        ap.add_argument("--no-doc", action="store_true", help="write no results table")
        args = ap.parse_args(argv)
        known = {"optim", "optim-speed", "ddp", "fsdp", "schemes", "nccl-plugin"}
        if args.only and not set(args.only.split(",")) <= known:
            from checkmate.errors import CheckmateError

            raise CheckmateError(f"--only takes {', '.join(sorted(known))}; got {args.only}")
        t0 = time.monotonic()
        env = environment()
        print("device-check: " + ", ".join(f"{k} {v}" for k, v in env.items()), flush=True)
        results = run_checks(args, lambda r: print(r.line(), flush=True))
        secs = time.monotonic() - t0
        counts = {s: sum(1 for r in results if r.status == s) for s in ("PASS", "FAIL", "SKIP")}
        cuda = placement(args.cpu_smoke).device == "cuda"
        doc = args.doc if args.doc is not None else (DOC if cuda else None)
        if doc is not None and not args.no_doc:
            write_doc(doc, results, env, secs)
        print(f"device-check summary: {counts['PASS']} passed, {counts['FAIL']} failed, "
              f"{counts['SKIP']} skipped in {secs:.0f} s on {env['card']}"
              + (f"; figures written to {doc}" if doc is not None and not args.no_doc
                 else ""), flush=True)
        return 1 if counts["FAIL"] else 0

    return run()


if __name__ == "__main__":
    sys.exit(main())
