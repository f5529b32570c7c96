"""The ckm header: codec behaviour, and the generated C/P4 views staying in step."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from checkmate.protocol import wire, wire_gen

REPO = Path(__file__).resolve().parent.parent


def test_roundtrip_and_crc() -> None:
    payload = bytes(range(40))
    h = wire.Header(flags=wire.Flags.REPLICATE | wire.Flags.LAST, job_id=7, epoch=3, token=99,
                    iteration=2**40 + 5, offset=123456789012, count=10, seq=17, bucket=4,
                    partition=1, dtype=wire.DType.FLOAT32)
    buf = wire.encode(h, payload)
    assert len(buf) == wire.HEADER_LEN + 40
    got, body = wire.decode(buf)
    assert bytes(body) == payload
    assert got.with_(crc32c=0) == h
    assert got.crc32c == wire.crc(payload) != 0


@given(st.binary(min_size=1, max_size=200), st.integers(0, 2**32 - 1))
def test_any_payload_roundtrips(payload: bytes, seq: int) -> None:
    h = wire.Header(seq=seq, dtype=wire.DType.BYTES, count=len(payload))
    got, body = wire.decode(wire.encode(h, payload))
    assert bytes(body) == payload and got.seq == seq


def test_corruption_is_detected() -> None:
    buf = bytearray(wire.encode(wire.Header(dtype=wire.DType.BYTES, count=8), b"abcdefgh"))
    buf[-1] ^= 0x40
    with pytest.raises(wire.WireError, match="CRC32C"):
        wire.decode(bytes(buf))


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda b: b[:10], "shorter"),
        (lambda b: b"\x00\x00" + b[2:], "magic"),
        (lambda b: b[:2] + b"\x09" + b[3:], "version"),
        (lambda b: b[:44] + b"\x77" + b[45:], "dtype"),
        (lambda b: b + b"x", "payload is"),
    ],
)
def test_malformed_headers_raise(mutate, message: str) -> None:
    good = wire.encode(wire.Header(dtype=wire.DType.BYTES, count=4), b"wxyz")
    with pytest.raises(wire.WireError, match=message):
        wire.decode(mutate(good))


def test_count_must_match_payload() -> None:
    with pytest.raises(wire.WireError, match="needs 8"):
        wire.encode(wire.Header(dtype=wire.DType.FLOAT32, count=2), b"abc")


@pytest.mark.parametrize("rel", sorted(wire_gen.VIEWS))
def test_checked_in_views_match_generator(rel: str) -> None:
    assert (REPO / rel).read_text() == wire_gen.VIEWS[rel](), (
        f"{rel} drifted from checkmate/protocol/wire.py; run python -m checkmate.protocol.wire_gen"
    )


@pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc is not installed")
def test_c_compiler_lays_out_the_struct_like_python(tmp_path: Path) -> None:
    prog = ['#include <stdio.h>', '#include <stddef.h>', '#include "ckm_wire.h"',
            "int main(void) {"]
    prog += [f'printf("{f.name} %zu %zu\\n", offsetof(struct ckm_hdr, {f.name}), '
             f"sizeof(((struct ckm_hdr *)0)->{f.name}));" for f in wire.FIELDS]
    prog += ['printf("total %zu 0\\n", sizeof(struct ckm_hdr));', "return 0; }"]
    src = tmp_path / "layout.c"
    src.write_text("\n".join(prog))
    exe = tmp_path / "layout"
    subprocess.run(["gcc", f"-I{REPO / 'nccl_plugin'}", str(src), "-o", str(exe)], check=True)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.split()
    got = {out[i]: (int(out[i + 1]), int(out[i + 2])) for i in range(0, len(out), 3)}
    assert got.pop("total") == (wire.HEADER_LEN, 0)
    assert got == {f.name: (f.offset, f.size) for f in wire.FIELDS}


@pytest.mark.skipif(shutil.which("clang") is None, reason="clang is not installed")
def test_bpf_view_compiles_for_the_bpf_target(tmp_path: Path) -> None:
    src = tmp_path / "x.c"
    src.write_text('#include "ckm_wire.h"\nint size(void) { return sizeof(struct ckm_hdr); }\n')
    subprocess.run(
        ["clang", "-O2", "-target", "bpf", "-I/usr/include/x86_64-linux-gnu",
         f"-I{REPO / 'dataplane' / 'bpf'}", "-c", str(src), "-o", str(tmp_path / "x.o")],
        check=True,
    )


def test_p4_view_declares_every_field_with_its_width() -> None:
    text = (REPO / "p4" / "include" / "ckm_headers.p4").read_text()
    for f in wire.FIELDS:
        assert f"bit<{f.size * 8}> {f.name};" in text
