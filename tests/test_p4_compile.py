"""Both P4 programs compile with the real compilers, with no error, and what they emit is
what the controller tests use.

v1model with p4c-bm2-ss; TNA with bf-p4c or p4c's Tofino driver down to pipe/tofino.bin
and pipe/context.json. Each compiles once per session into build/p4/ (control/p4build.py
skips the compile when the sources and command are unchanged). Without the compilers on
PATH (scripts/test.sh puts ../shared/p4-toolchain there) these tests skip and say why.
"""

from __future__ import annotations

import difflib
import json
import struct
import sys
from pathlib import Path

import pytest
from fakes import P4C_FIXTURES

from checkmate.control import p4build, pipeline
from checkmate.control import p4info as p4info_mod

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import p4_regen  # noqa: E402 - the script that writes what these tests compare

BUILD = ROOT / "build" / "p4"


@pytest.fixture(scope="session")
def compiled():
    """{arch: p4build.Result}, compiled (or found up to date) once per session."""
    cache: dict[str, p4build.Result] = {}

    def get(arch: str) -> p4build.Result:
        if arch not in cache:
            cc, why = p4build.compiler(arch)
            if cc is None:
                pytest.skip(f"no {arch} compiler: {why} (make p4 / scripts/p4-toolchain.sh)")
            cache[arch] = p4build.compile_program(arch, BUILD / pipeline.PROGRAMS[arch])
        return cache[arch]

    return get


@pytest.mark.parametrize("arch", pipeline.PROGRAMS)
def test_compiles_with_no_errors(compiled, arch):
    r = compiled(arch)
    how = "up to date" if r.cached else f"compiled in {r.seconds:.1f} s"
    print(f"{arch}: {how}, {len(r.warnings)} warning(s)")
    for w in r.warnings:
        print(f"  {w}")
    for name in p4build.OUTPUTS[arch]:
        assert (r.out / name).stat().st_size > 0, name
    assert "error:" not in r.log


def canonical(text: str, source: str):
    """The P4Info as the controller reads it (Tofino extern payloads dropped), with the
    lists p4c emits in no fixed order sorted: the TNA driver writes its two Snapshot
    extern instances in either order from one run to the next."""
    info = p4info_mod.parse_text(text, source).p4info
    for ext in info.externs:
        ext.instances.sort(key=lambda i: i.preamble.id)
    info.externs.sort(key=lambda e: e.extern_type_id)
    return info


@pytest.mark.parametrize("arch", pipeline.PROGRAMS)
def test_p4info_is_the_controller_tests_fixture(compiled, arch):
    """tests/fixtures/p4c holds the compiler's P4Info for the current sources (the same
    objects, ids and payload lines, in any order); a difference names the objects that
    differ and how to regenerate."""
    built = compiled(arch).out / "p4info.txtpb"
    fixture = p4_regen.fixture(arch)
    want, got = fixture.read_text(), built.read_text()
    info_f, info_b = canonical(want, str(fixture)), canonical(got, str(built))
    if info_f == info_b and sorted(want.splitlines()) == sorted(got.splitlines()):
        return
    names_f, names_b = p4info_mod.names(info_f), p4info_mod.names(info_b)
    diff = list(difflib.unified_diff(str(info_f).splitlines(), str(info_b).splitlines(),
                                     str(fixture), str(built), lineterm="", n=1))
    pytest.fail(f"{fixture.relative_to(ROOT)} differs from the compiler's P4Info: only in "
                f"the fixture {sorted(names_f - names_b)}, only in the build "
                f"{sorted(names_b - names_f)}; regenerate with `make p4-fixtures`\n"
                + "\n".join(diff[:60] or ["(only in the Tofino extern payloads)"]))


def test_the_fixtures_are_the_ones_the_controller_tests_read():
    from fakes import compiled_fixture

    for arch in pipeline.PROGRAMS:
        assert compiled_fixture(arch) == p4_regen.fixture(arch)
        assert compiled_fixture(arch).parent == P4C_FIXTURES


def test_tna_builds_a_tofino_binary_and_fits_its_stages(compiled):
    r = compiled("tna")
    ctx = json.loads((r.out / "pipe" / "context.json").read_text())
    assert ctx["tables"], "context.json has no tables"
    usage = p4build.stage_usage(r.out)
    assert 0 < usage["ingress"] <= 12 and 0 < usage["egress"] <= 12, usage
    print(f"tna stages: {usage}")
    doc = p4_regen.DOC.read_text()
    assert p4_regen.doc_stages(doc) == p4_regen.stages_line(usage), (
        "docs/architecture.md's TNA stage usage is not the compiler's: `make p4-fixtures`")


def test_tofino_pipeline_config_packs_the_real_build(compiled, monkeypatch):
    """Both packings the Tofino driver pushes, made from the compiler's own tofino.bin,
    context.json and bfrt.json, decode back to exactly those files."""
    r = compiled("tna")
    monkeypatch.setenv("CHECKMATE_P4_BUILD", str(BUILD))
    binary = (r.out / "pipe" / "tofino.bin").read_bytes()
    context = (r.out / "pipe" / "context.json").read_bytes()
    blob, parts = pipeline.device_config("tna", "sde"), []
    while blob:
        (n,) = struct.unpack("<i", blob[:4])
        parts.append(blob[4:4 + n])
        blob = blob[4 + n:]
    assert parts == [b"checkmate_tna", binary, context]
    packed = pipeline.device_config("tna", "stratum", [0, 1])
    assert binary in packed and context in packed
    assert (r.out / "bfrt.json").read_bytes() in packed
