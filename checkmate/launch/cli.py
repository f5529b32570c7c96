"""``checkmate``: the console command (pyproject.toml [project.scripts]) and its
subcommands.

    checkmate launch [--nproc-per-node N] [--device auto|cuda|cpu]
                     [--shadows n | --shadow ADDR ...] [--mode host|off|gockpt]
                     [--gockpt EVERY,STEPS] [--max-restarts R]
                     [--dir DIR] [--persist-every K] [--resume] [--progress-every K]
                     [--seed S] [--job-id J] SCRIPT [ARGS ...]
    checkmate secret new FILE
    checkmate plan ...
    checkmate doctor [--shadow ADDR ... | --controller ADDR] ...

``launch`` (also what a first argument that is a flag means) is torchrun for a Checkmate
job: its flags are checkmate.launch.options, what it does with them
checkmate.launch.launcher, where its workers run checkmate.launch.placement. ``plan`` is
checkmate.launch.plan, ``doctor`` checkmate.launch.doctor. A subcommand is one entry of
COMMANDS: a function from the rest of the command line to an exit status, raising
CheckmateError for one line and exit 2.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

from checkmate.errors import CheckmateError, cli_guard
from checkmate.launch.options import PROG


def _launch(argv: list[str]) -> int:
    from checkmate.launch import launcher

    return launcher.launch(argv)


@cli_guard("checkmate secret")  # its errors name it, not launch
def _secret(argv: list[str]) -> int:
    """``checkmate secret new FILE``: a job secret for machines set up by hand."""
    from checkmate.protocol import auth

    if len(argv) != 2 or argv[0] != "new":
        raise CheckmateError("usage: checkmate secret new FILE")
    path = Path(argv[1])
    if path.exists():
        raise CheckmateError(f"{path} exists; a new secret goes to a new file")
    auth.create_secret(path)
    print(f"{PROG}: wrote a new job secret to {path} (mode 600); give every process of the "
          f"job {auth.SECRET_ENV}={path}")
    return 0


@cli_guard("checkmate plan")  # its errors name it, not launch
def _plan(argv: list[str]) -> int:
    from checkmate.launch import plan

    return plan.main(argv)


@cli_guard("checkmate checkpoints")  # its errors name it, not launch
def _checkpoints(argv: list[str]) -> int:
    from checkmate.launch import checkpoints

    return checkpoints.main(argv)


@cli_guard("checkmate doctor")  # its errors name it, not launch
def _doctor(argv: list[str]) -> int:
    from checkmate.launch import doctor

    return doctor.main(argv)


#: name -> (what runs it, its usage in the unknown-command line)
COMMANDS: dict[str, tuple[Callable[[list[str]], int], str]] = {
    "launch": (_launch, "checkmate launch ..."),
    "secret": (_secret, "checkmate secret new FILE"),
    "plan": (_plan, "checkmate plan ..."),
    "doctor": (_doctor, "checkmate doctor ..."),
    "checkpoints": (_checkpoints, "checkmate checkpoints --shadow HOST[:PORT] ..."),
}


@cli_guard(PROG)
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in COMMANDS:
        return COMMANDS[argv[0]][0](argv[1:])
    if argv and not argv[0].startswith("-"):
        raise CheckmateError(f"unknown command {argv[0]!r}; usage: "
                             + " | ".join(usage for _, usage in COMMANDS.values()))
    return _launch(argv)  # `checkmate --nproc-per-node ...`: launch, as before


if __name__ == "__main__":
    from checkmate import fastexit

    fastexit.install()
    sys.exit(main())
