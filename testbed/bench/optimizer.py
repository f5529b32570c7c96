"""`testbed bench optimizer`: AdamW parameters/s, ours vs torch's CPU AdamW.

One run, same machine, same threads (all cores for every variant), one fp32 parameter
tensor per size:

- ours: ``checkmate.optim.AdamW`` (Numba kernel, the arithmetic trainer and shadow share);
- torch.optim.AdamW with ``foreach=True`` and with ``fused=True``; ``foreach=False`` (the
  arithmetic we follow) for reference at the smallest size;
- the memory-bandwidth bound, measured in the same run: a streaming kernel with AdamW's
  exact traffic and almost no arithmetic (reads param, grad, exp_avg, exp_avg_sq, writes
  param, exp_avg, exp_avg_sq: 28 bytes/parameter, all threads); a streaming
  ``torch.add`` (12 bytes/element) is shown beside it as a second bandwidth figure.

Variants alternate over ``--rounds`` rounds so load from other processes spreads over
all of them; each variant's figure is its best round's median step time (sizes above
20M take half the steps per round to keep the default run near a minute).

    testbed bench optimizer [--sizes 10M,100M] [--steps 5] [--rounds 3]

Headline: ours / the fastest torch variant.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from collections.abc import Callable

import numba
import numpy as np
import torch
from numba import njit, prange

from checkmate.errors import CheckmateError, cli_guard
from checkmate.optim import AdamW

BYTES_PER_PARAM = 28  # 4 reads + 3 writes of float32
BYTES_PER_ADD = 12  # c = a + b


STREAM = "bandwidth bound (stream, 28 B/param)"
ADD = "torch.add (12 B/element)"
OURS = "ours (checkmate.optim.AdamW)"


@njit(cache=True, parallel=True, error_model="numpy")
def _stream(p: np.ndarray, g: np.ndarray, m: np.ndarray, v: np.ndarray) -> None:
    """AdamW's memory traffic without its arithmetic: 4 float32 reads, 3 writes."""
    for i in prange(p.shape[0]):
        a = m[i] + g[i]
        b = v[i] + g[i]
        m[i] = a
        v[i] = b
        p[i] = p[i] + a


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise CheckmateError(message)


def _size(s: str) -> int:
    mult = {"K": 10**3, "M": 10**6, "G": 10**9}
    s = s.strip().upper()
    try:
        n = int(float(s[:-1]) * mult[s[-1]]) if s and s[-1] in mult else int(s)
    except ValueError:
        raise CheckmateError(f"bad size {s!r} (use e.g. 10M, 250K or 1000000)") from None
    if n < 1:
        raise CheckmateError(f"size must be >= 1, got {s!r}")
    return n


def _median_step(step: Callable[[], object], steps: int) -> float:
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _bench_size(n: int, steps: int, rounds: int, with_loop: bool) -> dict[str, float]:
    """Best-of-rounds median seconds per step for every variant at ``n`` parameters."""
    gen = torch.Generator().manual_seed(0)
    grad = torch.randn(n, generator=gen) * 1e-2
    a = torch.randn(n, generator=gen)
    out = torch.empty(n)
    params: dict[str, torch.nn.Parameter] = {}
    opts: dict[str, Callable[[], object]] = {}
    makers: dict[str, Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]] = {
        OURS: lambda p: AdamW(p, lr=1e-3),
        "torch AdamW foreach=True": lambda p: torch.optim.AdamW(p, lr=1e-3, foreach=True),
        "torch AdamW fused=True": lambda p: torch.optim.AdamW(p, lr=1e-3, fused=True),
    }
    if with_loop:
        makers["torch AdamW foreach=False"] = lambda p: torch.optim.AdamW(
            p, lr=1e-3, foreach=False)
    for name, make in makers.items():
        p = torch.nn.Parameter(a.clone())
        p.grad = grad
        opt = make([p])
        opt.step()  # allocates state; compiles or loads our kernel
        params[name], opts[name] = p, opt.step
    slots = [np.zeros(n, np.float32) for _ in range(3)]
    gnp = grad.numpy()
    opts[STREAM] = lambda: _stream(slots[0], gnp, slots[1], slots[2])
    opts[ADD] = lambda: torch.add(a, grad, out=out)
    for step in opts.values():
        step()  # the new ones: compile, touch the pages
    best = {name: float("inf") for name in opts}
    for _ in range(rounds):
        for name, step in opts.items():
            best[name] = min(best[name], _median_step(step, steps))
    del params, opts
    gc.collect()
    return best


def _report(n: int, best: dict[str, float]) -> float:
    bound = n / best[STREAM]
    add_bw = BYTES_PER_ADD * n / best[ADD]
    print(f"\n{n / 1e6:g}M fp32 parameters (bandwidth: stream {bound * BYTES_PER_PARAM / 1e9:.1f}"
          f" GB/s, torch.add {add_bw / 1e9:.1f} GB/s)")
    print(f"  {'variant':<38} {'ms/step':>9} {'M params/s':>11} {'GB/s':>7} {'of bound':>9}")
    rates = {}
    for name, sec in best.items():
        if name == ADD:
            continue
        rate = n / sec
        if name != STREAM:
            rates[name] = rate
        print(f"  {name:<38} {sec * 1e3:9.2f} {rate / 1e6:11.0f} "
              f"{rate * BYTES_PER_PARAM / 1e9:7.1f} {rate / bound:9.2f}")
    ours = rates.pop(OURS)
    fastest_name = max(rates, key=rates.__getitem__)
    ratio = ours / rates[fastest_name]
    print(f"  ours / fastest torch ({fastest_name}): {ratio:.2f}; ours / bandwidth bound: "
          f"{ours / bound:.2f}")
    return ratio


def main(argv: list[str] | None = None) -> int:
    ap = _Parser(prog="testbed bench optimizer", description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="10M,100M",
                    help="comma-separated parameter counts (K/M suffixes), default 10M,100M")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per round (default 5)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds (default 3)")
    args = ap.parse_args(argv)
    sizes = [_size(s) for s in args.sizes.split(",") if s.strip()]
    if not sizes:
        raise CheckmateError("--sizes needs at least one size")
    if args.steps < 1 or args.rounds < 1:
        raise CheckmateError("--steps and --rounds must be >= 1")
    threads = os.cpu_count() or 1
    torch.set_num_threads(threads)
    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    print(f"AdamW step, {threads} threads (torch {torch.__version__}, numba "
          f"{numba.__version__}, {numba.get_num_threads()} numba threads); best of "
          f"{args.rounds} rounds x median of {args.steps} steps")
    ratios = []
    for i, n in enumerate(sizes):
        steps = args.steps if n <= 20_000_000 else max(1, args.steps // 2)
        best = _bench_size(n, steps, args.rounds, with_loop=i == 0)
        ratios.append(_report(n, best))
    print(f"\nload average after the run: {os.getloadavg()[0]:.1f} on {threads} cores "
          "(other processes make every figure noisier; the ratio is the worst size's)")
    print(f"ours vs fastest torch AdamW params/s ratio: {min(ratios):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(cli_guard("testbed bench optimizer")(main)())
