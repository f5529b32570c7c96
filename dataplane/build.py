"""Compile the tc-eBPF switch into build/bpf/ (`python -m checkmate.dataplane.build`).

A no-op when the object is newer than its sources; the loader calls :func:`ensure_built`
so a missing object is built on demand.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from checkmate.errors import CheckmateError

SRC_DIR = Path(__file__).resolve().parent / "bpf"
SOURCES = (SRC_DIR / "ckm_switch.c", SRC_DIR / "ckm_wire.h")


def _repo_root() -> Path:
    here = Path(__file__).resolve().parent
    if (here.parent / "pyproject.toml").exists():
        return here.parent
    return Path.cwd()


def object_path() -> Path:
    return _repo_root() / "build" / "bpf" / "ckm_switch.o"


def _up_to_date(obj: Path) -> bool:
    if not obj.exists():
        return False
    mtime = obj.stat().st_mtime
    return all(s.stat().st_mtime <= mtime for s in SOURCES)


def ensure_built(force: bool = False) -> Path:
    """Path of a current object file, compiling it first when needed."""
    obj = object_path()
    if not force and _up_to_date(obj):
        return obj
    clang = shutil.which("clang")
    if clang is None:
        raise CheckmateError("clang not found; install clang, llvm and libbpf-dev (make setup)")
    obj.parent.mkdir(parents=True, exist_ok=True)
    tmp = obj.with_suffix(".o.tmp")
    cmd = [clang, "-O2", "-g", "-Wall", "-target", "bpf", "-I/usr/include/x86_64-linux-gnu",
           f"-I{SRC_DIR}", "-c", str(SOURCES[0]), "-o", str(tmp)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        first = (res.stderr.strip().splitlines() or ["no output"])[0]
        raise CheckmateError(f"compiling {SOURCES[0].name} failed: {first}")
    tmp.replace(obj)
    return obj


def main(argv: list[str] | None = None) -> int:
    from checkmate.errors import cli_guard

    @cli_guard("dataplane.build")
    def run(args: list[str]) -> int:
        before = object_path().exists() and _up_to_date(object_path())
        obj = ensure_built(force="--force" in args)
        print(f"{obj} {'up to date' if before and '--force' not in args else 'built'}")
        return 0

    return run(list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
