"""Compiled Checkmate programs -> the ForwardingPipelineConfig a switch accepts.

One build folder serves the tests, the testbed and the drivers: ``build/p4/`` under the
working directory, or ``$CHECKMATE_P4_BUILD``. Each program has its own folder, laid out as
its compiler writes it (commands in docs/architecture.md, "P4 programs"):

    build/p4/checkmate_v1model/   checkmate_v1model.json, p4info.bin / p4info.txtpb
    build/p4/checkmate_tna/       bf-p4c -o output: bfrt.json, pipe/tofino.bin,
                                  pipe/context.json, p4info.bin / p4info.txtpb

P4Info is read binary first: ``p4info.bin``, the binary suffix p4c writes (it knows .bin,
.txt, .json and .txtpb and refuses .binpb), or ``p4info.binpb`` from other toolchains;
then ``p4info.txtpb``.

bmv2's p4_device_config is the JSON itself. Tofino servers want bf-p4c's folder packed, and
the two that exist pack it differently (``switch.tofino.server``):

- ``stratum`` (stratum_bf / stratum_bfrt): a serialized ``stratum.hal.barefoot.
  BfPipelineConfig`` protobuf (stratum/hal/lib/barefoot/bf.proto): p4_name = 1 (string),
  bfruntime_info = 2 (bfrt.json), profiles = 3, each Profile holding profile_name = 1,
  context = 2 (context.json), binary = 3 (tofino.bin), pipe_scope = 4 (hardware pipes).
- ``sde`` (the P4Runtime server of the SDE's bf_switchd, built on PI): PI's Tofino packing,
  three length-prefixed blobs, each length a 32-bit little-endian integer: the program
  name, tofino.bin, context.json. stratum_bfrt does not accept this one.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

from checkmate.control import p4info as p4info_mod
from checkmate.errors import CheckmateError

PROGRAMS = {"v1model": "checkmate_v1model", "tna": "checkmate_tna"}
#: The pipeline's name in the TNA program (``Pipeline(...) pipe;``): bf-p4c's profile folder.
TNA_PIPE = "pipe"
SERVERS = ("stratum", "sde")


def p4_source(arch: str) -> Path:
    """The program's source, its includes in ``include/`` beside it. A wheel installs p4/
    as package data (checkmate/p4/, no __init__: a top-level ``p4`` package would shadow
    the p4runtime wheel's); an editable install or a clone keeps it at the repository's
    top, next to the checkmate package."""
    from importlib.resources import files

    name = f"{PROGRAMS[arch]}.p4"
    installed = Path(str(files("checkmate"))) / "p4" / name
    if installed.is_file():
        return installed
    clone = Path(str(files("checkmate"))).parent / "p4" / name
    if clone.is_file():
        return clone
    raise CheckmateError(f"P4 source {name} is not installed (looked in {installed.parent} "
                         f"and {clone.parent})")


def build_dir() -> Path:
    """Where compiled programs and generated switch scripts live."""
    return Path(os.environ.get("CHECKMATE_P4_BUILD", "build/p4"))


def program_dir(arch: str) -> Path:
    return build_dir() / PROGRAMS[arch]


#: The P4Info files a build folder may hold, in the order they are read (binary first).
P4INFO_FILES = ("p4info.bin", "p4info.binpb", "p4info.txtpb")


def compiled_p4info(arch: str) -> p4info_mod.Loaded:
    """The compiler's P4Info for ``arch``: binary preferred (it keeps Tofino extern
    payloads intact), text otherwise."""
    d = program_dir(arch)
    for name in P4INFO_FILES:
        if (d / name).is_file():
            return p4info_mod.load(d / name)
    raise CheckmateError(f"no compiled P4Info in {d} ({', '.join(P4INFO_FILES)}); compile "
                         f"p4/{PROGRAMS[arch]}.p4 first (docs/architecture.md, P4 programs)")


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise CheckmateError(f"{path} is missing: compile the P4 program into "
                             f"{path.parent} first") from None
    except OSError as e:
        raise CheckmateError(f"cannot read {path}: {e.strerror}") from None


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field (wire type 2)."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def stratum_config(name: str, bfrt: bytes, context: bytes, binary: bytes,
                   pipes: list[int]) -> bytes:
    """Serialized BfPipelineConfig with one profile (field numbers: module docstring)."""
    scope = b"".join(_varint(p) for p in pipes)
    profile = (_field(1, TNA_PIPE.encode()) + _field(2, context) + _field(3, binary)
               + (_field(4, scope) if pipes else b""))
    return _field(1, name.encode()) + _field(2, bfrt) + _field(3, profile)


def pi_tofino_config(name: str, binary: bytes, context: bytes) -> bytes:
    """PI's Tofino packing: (int32 LE length, bytes) for name, tofino.bin, context.json."""
    return b"".join(struct.pack("<i", len(b)) + b for b in (name.encode(), binary, context))


def device_config(arch: str, server: str = "stratum", pipes: list[int] | None = None) -> bytes:
    """The p4_device_config for the compiled ``arch`` program on ``server``."""
    d = program_dir(arch)
    if arch == "v1model":
        return _read(d / f"{PROGRAMS[arch]}.json")
    binary = _read(d / TNA_PIPE / "tofino.bin")
    context = _read(d / TNA_PIPE / "context.json")
    if server == "sde":
        return pi_tofino_config(PROGRAMS[arch], binary, context)
    if server == "stratum":
        return stratum_config(PROGRAMS[arch], _read(d / "bfrt.json"), context, binary,
                              pipes or [])
    raise CheckmateError(f"unknown Tofino P4Runtime server {server!r} (one of "
                         f"{', '.join(SERVERS)})")
