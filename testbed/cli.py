"""`testbed`: build, inspect and tear down the namespace testbed; run scenarios and benches.

Each subcommand lives in its own module and exposes ``main(argv) -> int``; this file only
dispatches, so the modules stay independent.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys

from checkmate.errors import cli_guard

#: subcommand -> (module, one-line help)
COMMANDS = {
    "up": ("checkmate.testbed.commands", "build the topology from a config"),
    "down": ("checkmate.testbed.commands", "remove everything `up` created"),
    "status": ("checkmate.testbed.commands", "print the inventory (--json)"),
    "exec": ("checkmate.testbed.commands", "run a command in a host's namespace"),
    "demo": ("checkmate.testbed.demo", "send replicated and plain ckm traffic, print counters"),
    "run": ("checkmate.testbed.run", "run a training scenario (failure-free, kill-restore)"),
    "chaos": ("checkmate.testbed.chaos", "the reliability suite: every fault case, bit-exact"),
    "bench": ("checkmate.testbed.bench", "run a benchmark: testbed bench NAME"),
    "device-check": ("checkmate.testbed.device_check",
                     "Checkmate on one GPU: optimizers, DDP/FSDP2 kill+restore, schemes"),
}


def _benches() -> list[str]:
    import checkmate.testbed.bench as pkg

    return sorted(m.name for m in pkgutil.iter_modules(pkg.__path__) if not m.name.startswith("_"))


def _usage() -> str:
    lines = ["usage: testbed COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<12} {help_}" for name, (_, help_) in COMMANDS.items()]
    return "\n".join(lines)


@cli_guard("testbed")
def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd not in COMMANDS:
        print(f"testbed: error: unknown command {cmd!r} (try: {', '.join(COMMANDS)})",
              file=sys.stderr)
        return 2
    if cmd == "bench":
        names = _benches()
        if not rest or rest[0] not in names:
            got = repr(rest[0]) if rest else "none"
            print(f"testbed: error: bench needs one of {', '.join(names)}; got {got}",
                  file=sys.stderr)
            return 2
        from checkmate.testbed import lifeline

        lifeline.exit_on_signals()  # SIGTERM/SIGHUP: clean up, then exit
        mod = importlib.import_module(f"checkmate.testbed.bench.{rest[0]}")
        return mod.main(rest[1:])
    if cmd in ("run", "chaos", "demo"):
        from checkmate.testbed import lifeline

        lifeline.exit_on_signals()  # SIGTERM/SIGHUP: clean up, then exit
    mod = importlib.import_module(COMMANDS[cmd][0])
    if mod.__name__ == "checkmate.testbed.commands":
        return mod.main([cmd, *rest])
    return mod.main(rest)


if __name__ == "__main__":
    from checkmate import fastexit

    fastexit.install()
    sys.exit(main())
