"""Compile the tc-eBPF programs into build/bpf/ (`python -m checkmate.dataplane.build`).

Two objects: ``ckm_switch`` (the switch) and ``ckm_sink`` (the dataplane bench's stand-in
for a shadow on another machine). A no-op when an object is newer than its sources; the
loaders call :func:`ensure_built` so a missing object is built on demand.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from checkmate.errors import CheckmateError

SRC_DIR = Path(__file__).resolve().parent / "bpf"
HEADERS = (SRC_DIR / "ckm_wire.h",)
PROGRAMS = ("ckm_switch", "ckm_sink")
SOURCES = (SRC_DIR / "ckm_switch.c", *HEADERS)


def sources(name: str = "ckm_switch") -> tuple[Path, ...]:
    """The C file of program ``name`` first, then the headers it includes."""
    if name not in PROGRAMS:
        raise CheckmateError(f"unknown BPF program {name!r} (known: {', '.join(PROGRAMS)})")
    return (SRC_DIR / f"{name}.c", *HEADERS)


def _repo_root() -> Path:
    here = Path(__file__).resolve().parent
    if (here.parent / "pyproject.toml").exists():
        return here.parent
    return Path.cwd()


def object_path(name: str = "ckm_switch") -> Path:
    return _repo_root() / "build" / "bpf" / f"{name}.o"


def _up_to_date(obj: Path, srcs: tuple[Path, ...] = SOURCES) -> bool:
    if not obj.exists():
        return False
    mtime = obj.stat().st_mtime
    return all(s.stat().st_mtime <= mtime for s in srcs)


def ensure_built(force: bool = False, name: str = "ckm_switch") -> Path:
    """Path of a current object file of program ``name``, compiling it first when needed."""
    srcs = sources(name)
    obj = object_path(name)
    if not force and _up_to_date(obj, srcs):
        return obj
    clang = shutil.which("clang")
    if clang is None:
        raise CheckmateError("clang not found; install clang, llvm and libbpf-dev (make setup)")
    obj.parent.mkdir(parents=True, exist_ok=True)
    tmp = obj.with_suffix(".o.tmp")
    cmd = [clang, "-O2", "-g", "-Wall", "-target", "bpf", "-I/usr/include/x86_64-linux-gnu",
           f"-I{SRC_DIR}", "-c", str(srcs[0]), "-o", str(tmp)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        first = (res.stderr.strip().splitlines() or ["no output"])[0]
        raise CheckmateError(f"compiling {srcs[0].name} failed: {first}")
    tmp.replace(obj)
    return obj


def main(argv: list[str] | None = None) -> int:
    from checkmate.errors import cli_guard

    @cli_guard("dataplane.build")
    def run(args: list[str]) -> int:
        force = "--force" in args
        for name in PROGRAMS:
            before = _up_to_date(object_path(name), sources(name))
            obj = ensure_built(force=force, name=name)
            print(f"{obj} {'up to date' if before and not force else 'built'}")
        return 0

    return run(list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
