"""Compile both P4 programs with the compilers on PATH (`make p4`, `python -m
checkmate.control.p4build`).

The commands are the ones in docs/architecture.md ("P4 programs"): p4c-bm2-ss for v1model;
for TNA the SDE's ``bf-p4c`` when installed, else the open-source ``p4c --target tofino``
driver (which runs p4c-barefoot, bfas and p4c-gen-conf). No path outside the tree is named:
the compilers come from PATH (scripts/p4-toolchain.sh puts the project's toolchain there).

Each build folder (control/pipeline.py's layout) keeps the compiler's log and a stamp of
the sources' hash and the command: a rerun with the same sources and compiler is a no-op.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from checkmate.control import pipeline
from checkmate.errors import CheckmateError

STAMP = ".checkmate-p4build"
LOG = "compile.log"
#: What a successful compile leaves in the program's folder (besides the P4Info).
OUTPUTS = {"v1model": ("checkmate_v1model.json", "p4info.txtpb"),
           "tna": ("pipe/tofino.bin", "pipe/context.json", "bfrt.json", "p4info.txtpb",
                   "p4info.bin")}
#: A p4c diagnostic line: "file(line): [--Wwarn=x] warning: ..." or "error: ...".
_DIAG = re.compile(r"(?:^|\s)(error|warning):", re.M)


@dataclass
class Result:
    arch: str
    out: Path
    seconds: float
    cached: bool
    log: str

    @property
    def warnings(self) -> list[str]:
        return [ln for ln in self.log.splitlines() if _DIAG.search(ln)
                and _DIAG.search(ln).group(1) == "warning"]


def compiler(arch: str) -> tuple[str | None, str]:
    """(the compiler's path, or None, and why not) for ``arch``."""
    if arch == "v1model":
        path = shutil.which("p4c-bm2-ss")
        return path, "" if path else "p4c-bm2-ss is not on PATH"
    for name in ("bf-p4c", "p4c"):
        path = shutil.which(name)
        if path and (name == "bf-p4c" or shutil.which("p4c-barefoot")):
            return path, ""
    return None, "neither bf-p4c nor p4c with its Tofino backend (p4c-barefoot) is on PATH"


def command(arch: str, src: Path, out: Path) -> list[str]:
    """The compile command for ``arch``'s program ``src`` into build folder ``out``."""
    cc, why = compiler(arch)
    if cc is None:
        raise CheckmateError(f"cannot compile {src.name}: {why} (make p4, docs/architecture.md)")
    inc = ["-I", str(src.parent), "-I", str(src.parent / "include")]
    if arch == "v1model":
        std = Path(cc).resolve().parent.parent / "share" / "p4c" / "p4include"
        std_inc = ["-I", str(std)] if std.is_dir() else []
        return [cc, "--arch", "v1model", *std_inc, *inc,
                "-o", str(out / f"{pipeline.PROGRAMS[arch]}.json"),
                "--p4runtime-files", str(out / "p4info.txtpb"), str(src)]
    files = ",".join(str(out / f) for f in ("p4info.txtpb", "p4info.bin"))
    return [cc, "--target", "tofino", "--arch", "tna", *inc, "-o", str(out),
            "--p4runtime-files", files, str(src)]


def sources_hash(src: Path, cmd: list[str]) -> str:
    """Hash of the program, its includes and the command (the compiler's path included)."""
    h = hashlib.sha256(json.dumps(cmd).encode())
    for p in [src, *sorted((src.parent / "include").glob("*.p4"))]:
        h.update(p.name.encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


def compile_program(arch: str, out: Path | None = None, force: bool = False) -> Result:
    """Compile ``arch``'s program into ``out`` (default: the controller's build folder),
    unless the folder already holds this exact build. Raises CheckmateError naming the
    error count and the log on failure."""
    src = pipeline.p4_source(arch)
    out = (Path(out) if out is not None else pipeline.program_dir(arch)).resolve()
    out.mkdir(parents=True, exist_ok=True)
    # Two compiles into one folder (two `make p4`, two test workers) would write the same
    # files at once: the second waits for the first and then finds its build up to date.
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _compile_locked(arch, src, out, force)


def _compile_locked(arch: str, src: Path, out: Path, force: bool) -> Result:
    cmd = command(arch, src, out)
    key = sources_hash(src, cmd)
    stamp = out / STAMP
    done = all((out / f).is_file() for f in OUTPUTS[arch])
    if not force and done and stamp.is_file() and stamp.read_text() == key:
        return Result(arch, out, 0.0, True, (out / LOG).read_text())
    out.mkdir(parents=True, exist_ok=True)
    stamp.unlink(missing_ok=True)
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    seconds = time.monotonic() - t0
    log = proc.stdout + proc.stderr
    (out / LOG).write_text(log)
    errors = [ln for ln in log.splitlines() if _DIAG.search(ln)
              and _DIAG.search(ln).group(1) == "error"]
    missing = [f for f in OUTPUTS[arch] if not (out / f).is_file()]
    if proc.returncode != 0 or errors or missing:
        raise CheckmateError(
            f"{src.name} did not compile: exit {proc.returncode}, {len(errors)} error(s)"
            + (f", missing {', '.join(missing)}" if missing else "")
            + f"; log {out / LOG}" + ("\n" + "\n".join(errors) if errors else ""))
    stamp.write_text(key)
    return Result(arch, out, seconds, False, log)


def stage_usage(out: Path) -> dict[str, int]:
    """Match-action stages each gress uses, from the compiled TNA context.json (every
    table's stage numbers). Tofino 1 has 12 per gress."""
    ctx = json.loads((out / pipeline.TNA_PIPE / "context.json").read_text())
    stages: dict[str, set[int]] = {"ingress": set(), "egress": set()}

    def walk(node: object, gress: str | None) -> None:
        if isinstance(node, dict):
            gress = node.get("direction", node.get("gress", gress))
            if (gress in stages and isinstance(node.get("stage_number"), int)
                    and node["stage_number"] >= 0):  # -1: the parser's table
                stages[gress].add(node["stage_number"])
            for v in node.values():
                walk(v, gress)
        elif isinstance(node, list):
            for v in node:
                walk(v, gress)

    walk(ctx.get("tables", []), None)
    return {g: (max(s) + 1 if s else 0) for g, s in stages.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m checkmate.control.p4build",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("arch", nargs="*", help=f"{' or '.join(pipeline.PROGRAMS)} (default: both)")
    ap.add_argument("--force", action="store_true", help="compile even when up to date")
    args = ap.parse_args(argv)
    unknown = [a for a in args.arch if a not in pipeline.PROGRAMS]
    if unknown:
        ap.error(f"unknown program {', '.join(unknown)} (one of {', '.join(pipeline.PROGRAMS)})")
    try:
        for arch in args.arch or list(pipeline.PROGRAMS):
            r = compile_program(arch, force=args.force)
            for w in r.warnings:
                print(f"{arch}: {w}")
            how = "up to date" if r.cached else f"compiled in {r.seconds:.0f} s"
            extra = ""
            if arch == "tna":
                extra = ", stages " + ", ".join(f"{g} {n} of 12"
                                                for g, n in stage_usage(r.out).items())
            print(f"{arch}: {r.out} {how}, 0 errors, {len(r.warnings)} warning(s){extra}")
    except CheckmateError as e:
        print(f"p4build: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
