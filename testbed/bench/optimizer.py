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

Every round runs one step of each variant twice: right after a torch op on the same
gradient (the norm ``clip_grad_norm_`` computes: the trainer's case, where torch's OpenMP
workers are still spinning when the step starts) and after a 10 ms idle gap (every variant
from the same quiet start). Load from other processes (this machine is shared) hits all
variants alike; a figure is the median over rounds, and the headline pairs the steps of each
round -- median over rounds of (fastest torch variant's time) / (our time) in the
trainer's case, at the size where it is lowest. The idle-gap ratio is printed beside it.

    testbed bench optimizer [--sizes 10M,100M] [--rounds N] [--seconds S]

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
from numba import njit

from checkmate.errors import CheckmateError, cli_guard
from checkmate.optim import AdamW, pool
from checkmate.optim.kernels import grab_size
from checkmate.optim.pool import fetch_add

BYTES_PER_PARAM = 28  # 4 reads + 3 writes of float32
BYTES_PER_ADD = 12  # c = a + b


STREAM = "bandwidth bound (stream, 28 B/param)"
ADD = "torch.add (12 B/element)"
OURS = "ours (checkmate.optim.AdamW)"
FUSED = "torch AdamW fused=True"
#: idle time before each timed step. After a torch op, torch's OpenMP workers spin for a
#: few ms; a step that follows at once shares the cores with them (ours measured +3-4 ms
#: at 10M on 2 cores, torch's own next op does not suffer: it runs on those threads).
#: The gap gives every variant the same start.
IDLE_GAP = 0.01
AFTER_OP = "right after a torch op (the trainer's case)"
GAP = "after a 10 ms idle gap"
FOREACH = "torch AdamW foreach=True"
LOOP = "torch AdamW foreach=False"


@njit(cache=True, nogil=True, error_model="numpy")
def _stream_chunk(p: np.ndarray, g: np.ndarray, m: np.ndarray, v: np.ndarray, lo: int,
                  hi: int) -> None:
    """AdamW's memory traffic without its arithmetic: 4 float32 reads, 3 writes."""
    p, g, m, v = p[lo:hi], g[lo:hi], m[lo:hi], v[lo:hi]
    for i in range(p.shape[0]):
        a = m[i] + g[i]
        b = v[i] + g[i]
        m[i] = a
        v[i] = b
        p[i] = p[i] + a


@njit(cache=True, nogil=True, error_model="numpy")
def _stream_worker(p: np.ndarray, g: np.ndarray, m: np.ndarray, v: np.ndarray, grab: int,
                   ctl: np.ndarray) -> None:
    """One thread's share, taken piece by piece exactly like our optimizer kernels'."""
    n = p.shape[0]
    fetch_add(ctl, 1, 1)
    while True:
        lo = fetch_add(ctl, 0, grab)
        if lo >= n:
            break
        _stream_chunk(p, g, m, v, lo, min(lo + grab, n))
    fetch_add(ctl, 1, -1)


def _stream(p: np.ndarray, g: np.ndarray, m: np.ndarray, v: np.ndarray) -> None:
    """Same threads, pieces and launch as our optimizer kernels (checkmate.optim.pool)."""
    threads = numba.get_num_threads()
    pool.run(_stream_worker, (p, g, m, v, grab_size(p.shape[0], threads)), threads)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise CheckmateError(message)


def _size(s: str) -> int:
    mult = {"K": 10**3, "M": 10**6, "G": 10**9}
    t = s.strip().upper()
    try:
        n = int(float(t[:-1]) * mult[t[-1]]) if t and t[-1] in mult else int(t)
    except ValueError:
        raise CheckmateError(f"bad size {s!r} (use e.g. 10M, 250K or 1000000)") from None
    if n < 1:
        raise CheckmateError(f"size must be >= 1, got {s!r}")
    return n


def _bench_size(n: int, rounds: int, seconds: float,
                with_loop: bool) -> dict[str, list[float]]:
    """Seconds per step of every variant at ``n`` parameters, one step each per round;
    stops early (after at least 5 rounds) once ``seconds`` have passed."""
    gen = torch.Generator().manual_seed(0)
    grad = torch.randn(n, generator=gen) * 1e-2
    a = torch.randn(n, generator=gen)
    out = torch.empty(n)
    steps: dict[str, Callable[[], object]] = {}
    makers: dict[str, Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]] = {
        OURS: lambda p: AdamW(p, lr=1e-3),
        FUSED: lambda p: torch.optim.AdamW(p, lr=1e-3, fused=True),
        FOREACH: lambda p: torch.optim.AdamW(p, lr=1e-3, foreach=True),
    }
    if with_loop:
        makers[LOOP] = lambda p: torch.optim.AdamW(p, lr=1e-3, foreach=False)
    for name, make in makers.items():
        p = torch.nn.Parameter(a.clone())
        p.grad = grad
        steps[name] = make([p]).step
    slots = [torch.zeros(n).numpy() for _ in range(3)]  # torch's allocator, like the others
    gnp = grad.numpy()
    steps[STREAM] = lambda: _stream(slots[0], gnp, slots[1], slots[2])
    steps[ADD] = lambda: torch.add(a, grad, out=out)
    for step in steps.values():
        step()  # allocate optimizer state, compile or load kernels, touch the pages
    times: dict[str, dict[str, list[float]]] = {m: {name: [] for name in steps}
                                                 for m in (AFTER_OP, GAP)}
    start = time.perf_counter()
    for r in range(rounds):
        if r >= 5 and time.perf_counter() - start > seconds:
            break
        for name, step in steps.items():
            for mode in ((AFTER_OP, GAP) if r % 2 == 0 else (GAP, AFTER_OP)):
                if mode == GAP:
                    time.sleep(IDLE_GAP)
                else:
                    torch.linalg.vector_norm(grad)  # what clip_grad_norm_ does first
                t = time.perf_counter()
                step()
                times[mode][name].append(time.perf_counter() - t)
    del steps
    gc.collect()
    return times


def _report(n: int, times: dict[str, list[float]], mode: str) -> float:
    """Print the table for one size; return the median paired ratio ours / fastest torch."""
    med = {name: statistics.median(ts) for name, ts in times.items()}
    bound = n / med[STREAM]
    print(f"\n{n / 1e6:g}M fp32 parameters, {mode}, {len(times[OURS])} rounds "
          f"(bandwidth: stream "
          f"{bound * BYTES_PER_PARAM / 1e9:.1f} GB/s, torch.add "
          f"{BYTES_PER_ADD * n / med[ADD] / 1e9:.1f} GB/s)")
    print(f"  {'variant':<38} {'ms/step':>9} {'M params/s':>11} {'GB/s':>7} {'of bound':>9}")
    for name, sec in med.items():
        if name != ADD:
            rate = n / sec
            print(f"  {name:<38} {sec * 1e3:9.2f} {rate / 1e6:11.0f} "
                  f"{rate * BYTES_PER_PARAM / 1e9:7.1f} {rate / bound:9.2f}")
    torch_names = [k for k in times if k not in (OURS, STREAM, ADD)]
    # Paired per round: the steps of one round ran back to back under the same load.
    paired = [min(times[k][r] for k in torch_names) / times[OURS][r]
              for r in range(len(times[OURS]))]
    ratio = statistics.median(paired)
    fastest = min(torch_names, key=med.__getitem__)
    print(f"  ours / fastest torch: {ratio:.2f} (median over rounds; by medians vs {fastest}: "
          f"{med[fastest] / med[OURS]:.2f}); ours / bandwidth bound: "
          f"{n / med[OURS] / bound:.2f}")
    return ratio


def main(argv: list[str] | None = None) -> int:
    ap = _Parser(prog="testbed bench optimizer", description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="10M,100M",
                    help="comma-separated parameter counts (K/M suffixes), default 10M,100M")
    ap.add_argument("--rounds", type=int, default=0,
                    help="rounds of one step per variant (default: 30 up to 20M, else 8)")
    ap.add_argument("--seconds", type=float, default=15.0,
                    help="stop a size's rounds after this long, once 5 are done (default 15)")
    args = ap.parse_args(argv)
    sizes = [_size(s) for s in args.sizes.split(",") if s.strip()]
    if not sizes:
        raise CheckmateError("--sizes needs at least one size")
    if args.rounds < 0:
        raise CheckmateError("--rounds must be >= 0 (0: the default per size)")
    threads = os.cpu_count() or 1
    torch.set_num_threads(threads)
    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    print(f"AdamW step, {threads} threads (torch {torch.__version__}, numba "
          f"{numba.__version__}, {numba.get_num_threads()} numba threads); "
          "rounds of one step per variant")
    ratios: dict[str, list[float]] = {AFTER_OP: [], GAP: []}
    for i, n in enumerate(sizes):
        rounds = args.rounds or (30 if n <= 20_000_000 else 8)
        times = _bench_size(n, rounds, args.seconds, with_loop=i == 0)
        for mode in (AFTER_OP, GAP):
            ratios[mode].append(_report(n, times[mode], mode))
    print(f"\nload average after the run: {os.getloadavg()[0]:.1f} on {threads} cores "
          "(other processes make every figure noisier; a ratio is the worst size's)")
    print(f"after a 10 ms idle gap, ours vs fastest torch: {min(ratios[GAP]):.2f}")
    print(f"ours vs fastest torch AdamW params/s ratio: {min(ratios[AFTER_OP]):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(cli_guard("testbed bench optimizer")(main)())
