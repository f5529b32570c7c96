"""`testbed bench fec`: erasure-code throughput for the replica stream, pyeclib vs zfec.

The shape checkmate.protocol.fec codes: groups of ``k`` pieces of ``--piece`` bytes (default 8916,
2229 float32) plus ``m`` parity blocks, one thread. Per library and (k, m):

- encode: k pieces (separate ``bytes``, as a trainer holds them) -> m parity blocks;
- decode: the first m data pieces lost -> the m missing pieces, from k-m data + m parity;
- the same two with 4-byte pieces: what one group costs whatever its size (call overhead,
  the decode matrix), since groups are small.

Each library is driven the way checkmate.protocol.fec would have to: pyeclib (liberasurecode
``isa_l_rs_cauchy``) joins the pieces into one buffer and decodes only fragments with its
header, so the decode puts cached headers back on the blocks; zfec takes the pieces as they
are. A third row runs checkmate.protocol.fec itself (GroupEncoder / GroupDecoder: piece table,
validation, bookkeeping). Libraries alternate in every round (order reversed every other
round) and a figure is the median over rounds: the machine is shared and noisy.

    testbed bench fec [--ks 8,16,32] [--ms 1,2,4] [--piece 8916] [--rounds 7] [--json OUT]

Headline ``fec ratio: <x>``: checkmate.protocol.fec's library (pyeclib) encode MB/s divided by the
other library's (zfec), geometric mean over the (k, m) pairs. Above 1 the chosen library
encodes faster; below 1 the other one does on this machine (the choice should then be
measured again), and ``nan`` when one of them is not installed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from checkmate.errors import CheckmateError, cli_guard
from checkmate.protocol import fec

CHOSEN, OTHER, OURS = "pyeclib", "zfec", "checkmate.protocol.fec"
TINY = 4  # bytes per piece for the per-group cost
SAMPLE_S = 0.01  # one timed sample: this long, however many calls that takes

Ops = tuple[Callable[[], object], Callable[[], object]]  # (encode, decode)


def _zfec(k: int, m: int, pieces: list[bytes]) -> Ops | None:
    try:
        import zfec
    except ImportError:
        return None
    enc, dec = zfec.Encoder(k, k + m), zfec.Decoder(k, k + m)
    nums = tuple(range(k, k + m))
    parity = enc.encode(pieces, nums)
    # zfec reorders its input list in place unless every data block sits at its own index:
    # put the parity blocks where the lost ones were, and build a fresh list per call.
    have_nums = nums + tuple(range(m, k))

    def decode() -> list[bytes]:
        return dec.decode([*parity, *pieces[m:]], have_nums)[:m]

    assert decode() == pieces[:m]
    return (lambda: enc.encode(pieces, nums)), decode


def _pyeclib(k: int, m: int, pieces: list[bytes]) -> Ops | None:
    try:
        from pyeclib.ec_iface import ECDriver, ECDriverError
    except ImportError:
        return None
    try:
        drv = ECDriver(k=k, m=m, ec_type=fec.EC_TYPE)
    except ECDriverError:
        return None
    size = len(pieces[0])
    zero = drv.encode(bytes(k * size))  # no checksum: headers do not depend on the data
    head = len(zero[0]) - size
    headers = [f[:head] for f in zero]

    def encode() -> list[memoryview]:
        return [memoryview(f)[head:] for f in drv.encode(b"".join(pieces))[k:]]

    parity = [bytes(b) for b in encode()]

    def decode() -> list[bytes]:
        frags = [headers[k + j] + parity[j] for j in range(m)]
        frags += [headers[i] + pieces[i] for i in range(m, k)]
        out = drv.decode(frags)
        return [out[i * size:(i + 1) * size] for i in range(m)]

    assert decode() == pieces[:m]
    return encode, decode


def _ours(k: int, m: int, pieces: list[bytes]) -> Ops | None:
    try:
        fec.GroupEncoder(k, m)
    except fec.FecError:
        return None
    size = len(pieces[0]) // 4
    offsets = [i * size for i in range(k)]

    def encode() -> list[tuple[int, bytes]]:
        enc = fec.GroupEncoder(k, m)
        for off, p in zip(offsets, pieces, strict=True):
            out = enc.add(off, p)
        assert out is not None
        return out

    parity = encode()
    dec = fec.GroupDecoder(max_groups=4)
    key = [0]

    def decode() -> list[tuple[int, bytes]]:
        key[0] += 1
        for i in range(m, k):
            dec.data(key[0], i, offsets[i], pieces[i], k=k)
        for j, body in parity:
            dec.parity(key[0], j, body)
        return dec.recover(key[0])

    assert decode() == list(zip(offsets[:m], pieces[:m], strict=True))
    return encode, decode


LIBS: dict[str, Callable[[int, int, list[bytes]], Ops | None]] = {
    CHOSEN: _pyeclib, OTHER: _zfec, OURS: _ours}


def _per_call(fn: Callable[[], object], calls: int) -> float:
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t) / calls


def _calls(fn: Callable[[], object]) -> int:
    """Calls that make one sample of about SAMPLE_S seconds."""
    return max(1, int(SAMPLE_S / max(_per_call(fn, 3), 1e-7)))


def _parse_list(s: str, what: str) -> list[int]:
    try:
        out = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise CheckmateError(f"--{what}: comma-separated integers, got {s!r}") from None
    if not out or min(out) < 1:
        raise CheckmateError(f"--{what} needs integers >= 1, got {s!r}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="testbed bench fec", description=__doc__.split("\n\n")[0])
    ap.add_argument("--ks", default="8,16,32", help="data pieces per group (default 8,16,32)")
    ap.add_argument("--ms", default="1,2,4", help="parity blocks per group (default 1,2,4)")
    ap.add_argument("--piece", type=int, default=8916, help="bytes per piece (default 8916)")
    ap.add_argument("--rounds", type=int, default=7, help="alternated rounds (medians)")
    ap.add_argument("--json", metavar="OUT", help="write every figure as JSON to OUT")
    args = ap.parse_args(argv)
    ks, ms = _parse_list(args.ks, "ks"), _parse_list(args.ms, "ms")
    if args.rounds < 1 or args.piece < TINY or args.piece % 4 or args.piece > fec.MAX_BLOCK:
        raise CheckmateError(f"need --rounds >= 1 and --piece a multiple of 4 in {TINY} .. "
                             f"{fec.MAX_BLOCK}")
    pairs = [(k, m) for k in ks for m in ms if k + m <= fec.MAX_BLOCKS]
    if not pairs:
        raise CheckmateError(f"no (k, m) with k + m <= {fec.MAX_BLOCKS}")
    rng = np.random.default_rng(0)
    # (lib, k, m, piece bytes) -> (encode, decode, calls per sample of each)
    ops: dict[tuple[str, int, int, int], tuple[Ops, int, int]] = {}
    missing: set[str] = set()
    for k, m in pairs:
        for size in (args.piece, TINY):
            pieces = [rng.bytes(size) for _ in range(k)]
            for lib, make in LIBS.items():
                got = make(k, m, pieces)
                if got is None:
                    missing.add(lib)
                    continue
                ops[lib, k, m, size] = got, _calls(got[0]), _calls(got[1])
    libs = [lib for lib in LIBS if lib not in missing]
    print(f"fec bench: pieces of {args.piece} bytes, one thread, {args.rounds} rounds, "
          f"libraries {', '.join(libs)}" + (f" (not installed: {', '.join(sorted(missing))})"
                                            if missing else ""), flush=True)
    times: dict[tuple[str, int, int, int], tuple[list[float], list[float]]] = {
        key: ([], []) for key in ops}
    for r in range(args.rounds):
        for k, m in pairs:
            for size in (args.piece, TINY):
                for lib in (libs if r % 2 == 0 else libs[::-1]):
                    (encode, decode), n_enc, n_dec = ops[lib, k, m, size]
                    times[lib, k, m, size][0].append(_per_call(encode, n_enc))
                    times[lib, k, m, size][1].append(_per_call(decode, n_dec))
    rows = []
    for k, m in pairs:
        for lib in libs:
            enc_s, dec_s = (statistics.median(t) for t in times[lib, k, m, args.piece])
            tiny_enc, tiny_dec = (statistics.median(t) for t in times[lib, k, m, TINY])
            data = k * args.piece / 1e6
            rows.append({"k": k, "m": m, "library": lib, "encode_mbs": data / enc_s,
                         "decode_mbs": data / dec_s, "encode_us": enc_s * 1e6,
                         "decode_us": dec_s * 1e6, "tiny_encode_us": tiny_enc * 1e6,
                         "tiny_decode_us": tiny_dec * 1e6})
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"FEC per group, {args.piece}-byte pieces (and {TINY}-byte ones), decode "
                    f"with m pieces lost; MB/s of data, one thread, median of {args.rounds} "
                    "rounds")
    for col in ("k", "m", "library", "enc MB/s", "dec MB/s", "enc µs", "dec µs",
                f"{TINY} B: enc µs", f"{TINY} B: dec µs"):
        t.add_column(col, justify="left" if col == "library" else "right", no_wrap=True)
    for row in rows:
        t.add_row(str(row["k"]), str(row["m"]), row["library"], f"{row['encode_mbs']:.0f}",
                  f"{row['decode_mbs']:.0f}", f"{row['encode_us']:.1f}",
                  f"{row['decode_us']:.1f}", f"{row['tiny_encode_us']:.1f}",
                  f"{row['tiny_decode_us']:.1f}")
    Console(width=max(Console().width, 100)).print(t)
    by = {(r["library"], r["k"], r["m"]): r for r in rows}
    if CHOSEN in libs and OTHER in libs:
        ratio = math.exp(statistics.fmean(
            math.log(by[CHOSEN, k, m]["encode_mbs"] / by[OTHER, k, m]["encode_mbs"])
            for k, m in pairs))
        dec_ratio = math.exp(statistics.fmean(
            math.log(by[CHOSEN, k, m]["decode_mbs"] / by[OTHER, k, m]["decode_mbs"])
            for k, m in pairs))
        print(f"{CHOSEN} / {OTHER} decode MB/s, geometric mean over (k, m): {dec_ratio:.2f}")
    else:
        ratio = math.nan
    print(f"load average after the run: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "piece": args.piece, "rounds": args.rounds, "tiny": TINY, "rows": rows,
            "times_s": {"/".join(map(str, key)): val for key, val in times.items()},
            "ratio": ratio}, indent=1))
    # The one headline line (bench convention): chosen library's encode MB/s over the
    # other's, geometric mean over (k, m); < 1 would mean the other library is faster.
    print(f"fec ratio: {ratio:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(cli_guard("testbed bench fec")(main)())
