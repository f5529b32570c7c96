"""``checkmate doctor``: is this node ready for a Checkmate job? One line per check.

    checkmate doctor [--device auto|cuda|cpu] [--shadow ADDR ... | --controller ADDR]
                     [--job-id J] [--rdzv-endpoint HOST[:PORT] --nnodes N ...]

Run it on a node before a job, with the flags the job's ``checkmate launch`` will get. Each
check prints ``PASS``, ``WARN`` or ``FAIL``, what it saw and what to do; the exit status is
0 only when nothing failed. The checks live in checkmate.launch.doctor_node (this machine's
software) and checkmate.launch.doctor_net (the network); docs/usage.md, "checkmate doctor".
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from checkmate.errors import CheckmateError, cli_guard

PROG = "checkmate doctor"
PASS, WARN, FAIL = "PASS", "WARN", "FAIL"


@dataclass(frozen=True)
class Check:
    """One line of the report: its verdict, what was checked, what was seen and what to do."""

    status: str
    name: str
    detail: str

    def line(self) -> str:
        return f"{self.status} {self.name}: {self.detail}"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise CheckmateError(message)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description="Check this node for a Checkmate job: versions, the "
                "optimizer against the shadows' kernels, the job secret, the shadows or the "
                "controller, the NCCL plugin, socket buffers, MTU, the rendezvous host.")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                   help="where the optimizer check runs (auto: cuda when visible)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--shadow", action="append", default=[], metavar="HOST[:PORT]",
                   help="a shadow of the job, once per partition, in order")
    g.add_argument("--controller", default=None, metavar="HOST[:PORT]",
                   help="the controller the job finds its shadows through")
    p.add_argument("--job-id", type=int, default=1, help="ckm job id (with --controller)")
    p.add_argument("--rdzv-endpoint", "--rdzv_endpoint", default="", metavar="HOST[:PORT]",
                   help="the job's rendezvous endpoint: check torch will find this node")
    p.add_argument("--nnodes", default="2", metavar="MIN[:MAX]",
                   help="the job's nodes (default 2: a job of several nodes)")
    p.add_argument("--rdzv-backend", "--rdzv_backend", choices=("c10d", "static"),
                   default="c10d")
    p.add_argument("--rdzv-conf", "--rdzv_conf", default="", metavar="K=V,...")
    p.add_argument("--local-addr", "--local_addr", default=None, metavar="ADDR")
    p.add_argument("--worker-ip", default=None, metavar="IP")
    return p


def _checks(args: argparse.Namespace) -> Iterator[Callable[[], Check | list[Check]]]:
    """The checks in the order they run: cheap ones first; the kernel cache before the
    optimizer check (which would fill it)."""
    from checkmate.launch import doctor_net as net
    from checkmate.launch import doctor_node as node
    from checkmate.train.shadow_client import parse_addr

    device = args.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    yield node.check_versions
    yield node.check_secret
    yield node.check_kernels
    yield lambda: node.check_optimizer(device)
    yield node.check_nccl_plugin
    shadows = [parse_addr(a) for a in args.shadow]
    groups = [1]  # the controller's config says how many data-parallel groups
    if args.controller:
        controller = parse_addr(args.controller, _controller_port())

        def controller_check() -> list[Check]:
            c, found, groups[0] = net.check_controller(controller, args.job_id)
            shadows.extend(found)
            return [c]

        yield controller_check
    yield lambda: net.check_shadows(shadows, groups=groups[0]) if shadows else Check(
        WARN, "shadows", "none given: pass the job's --shadow ADDR ... or --controller ADDR "
        "to check them")
    yield net.check_buffers
    if shadows or args.controller:
        yield lambda: net.check_mtu([h for h, _ in shadows] or [controller[0]])
    yield lambda: net.check_hostname(args.rdzv_endpoint or None, _max_nodes(args.nnodes),
                                     args.rdzv_backend, args.local_addr, args.rdzv_conf,
                                     args.worker_ip)


def _max_nodes(nnodes: str) -> int:
    """--nnodes N or MIN:MAX as torchrun reads it: the largest number of nodes."""
    lo, sep, hi = nnodes.partition(":")
    top = hi if sep else lo
    if not (lo.isdigit() and top.isdigit() and 0 < int(lo) <= int(top)):
        raise CheckmateError(f"--nnodes must be N or MIN:MAX with 0 < MIN <= MAX, got "
                             f"{nnodes!r}")
    return int(top)


def _controller_port() -> int:
    from checkmate.config.cluster import CONTROLLER_PORT

    return CONTROLLER_PORT


def run(args: argparse.Namespace, print_line: Callable[[str], None] = print) -> list[Check]:
    """Every check, each line printed as it comes; the checks."""
    done: list[Check] = []
    for check in _checks(args):
        got = check()
        for c in got if isinstance(got, list) else [got]:
            print_line(c.line())
            done.append(c)
    return done


@cli_guard(PROG)
def main(argv: list[str] | None = None) -> int:
    """Exit 0 when no check failed, 1 when one did (2: a bad command line)."""
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    _max_nodes(args.nnodes)  # a bad command line before any check runs
    done = run(args, lambda s: print(s, flush=True))
    count = {s: sum(c.status == s for c in done) for s in (PASS, WARN, FAIL)}
    print(f"{PROG}: {count[PASS]} passed, {count[WARN]} warning(s), {count[FAIL]} failed",
          flush=True)
    return 1 if count[FAIL] else 0


if __name__ == "__main__":
    sys.exit(main())
