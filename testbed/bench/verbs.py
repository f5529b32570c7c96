"""`testbed bench verbs`: the shadow's receive thread, UDP vs verbs (UD on rxe0), inside
the soft-RoCE guest (checkmate.testbed.guest).

Both shadows of checkmate.testbed.verbs_checks take the same datagrams; each round times
one variant's receive thread (its own CPU seconds, from /proc) over the same number of
iterations, the order alternating per round; the headline is the ratio of the medians of
CPU per datagram, UDP / verbs (above 1: verbs costs less). The guest runs under QEMU's TCG
emulation, so the figures compare the two paths with each other only; they say nothing
about either path's speed on real hardware (rxe's own work, in the guest kernel, is not
counted in the receive thread either).
"""

from __future__ import annotations

import argparse
import json
import sys

from checkmate.errors import CheckmateError


def main(argv: list[str] | None = None) -> int:
    from checkmate.testbed import guest

    ap = argparse.ArgumentParser(prog="testbed bench verbs")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--iterations", type=int, default=6, help="iterations per round")
    args = ap.parse_args(argv)
    if args.rounds < 2 or args.iterations < 1:
        print("testbed bench verbs: error: need --rounds >= 2 and --iterations >= 1",
              file=sys.stderr)
        return 2
    try:
        rc, out, share = guest.run(
            ".venv/bin/python -m checkmate.testbed.verbs_checks bench $CKM_SHARE/bench.json",
            timeout=1800, env={"CKM_VERBS_ROUNDS": str(args.rounds),
                               "CKM_VERBS_ITERATIONS": str(args.iterations)})
    except CheckmateError as e:
        print(f"testbed bench verbs: error: {e}", file=sys.stderr)
        return 2
    if rc != 0:
        print(out[-3000:], file=sys.stderr)
        print(f"testbed bench verbs: error: the guest's bench exited {rc}", file=sys.stderr)
        return 1
    r = json.loads((share / "bench.json").read_text())
    print("receive-thread CPU per datagram (us), TCG guest, per round:")
    for name in ("udp", "verbs"):
        runs = " ".join(f"{x:.1f}" for x in r["cpu_us_per_datagram"][name])
        print(f"  {name:5s} {runs}  median {r['median'][name]:.1f}")
    print(f"verbs ratio: {r['ratio']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
