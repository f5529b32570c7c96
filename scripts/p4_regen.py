"""After a change to p4/ (`make p4-fixtures`): compile both programs, copy the compiler's
P4Info into tests/fixtures/p4c/ unchanged and write the TNA program's stage usage into
docs/architecture.md between its markers. tests/test_p4_compile.py fails when either is
out of date with what the compiler makes of the sources.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from checkmate.control import p4build, pipeline
from checkmate.errors import CheckmateError

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "p4c"
DOC = ROOT / "docs" / "architecture.md"
STAGES = re.compile(r"(<!-- p4-tna-stages -->).*?(<!-- /p4-tna-stages -->)", re.S)


def fixture(arch: str) -> Path:
    return FIXTURES / f"{pipeline.PROGRAMS[arch]}.p4info.txtpb"


def stages_line(usage: dict[str, int]) -> str:
    """The doc's sentence for ``usage`` (p4build.stage_usage)."""
    return (f"TNA stage usage (Tofino 1, 12 match-action stages per gress; written by "
            f"`make p4-fixtures`): ingress {usage['ingress']} of 12, egress "
            f"{usage['egress']} of 12.")


def doc_stages(text: str) -> str:
    """The sentence between the doc's stage markers."""
    m = STAGES.search(text)
    if m is None:
        raise CheckmateError(f"{DOC} lacks the <!-- p4-tna-stages --> markers")
    return text[m.end(1):m.start(2)]


def main() -> int:
    try:
        results = {arch: p4build.compile_program(arch) for arch in pipeline.PROGRAMS}
        for arch, r in results.items():
            fixture(arch).write_text((r.out / "p4info.txtpb").read_text())
            print(f"wrote {fixture(arch).relative_to(ROOT)}")
        line = stages_line(p4build.stage_usage(results["tna"].out))
        text = DOC.read_text()
        doc_stages(text)
        DOC.write_text(STAGES.sub(lambda m: m.group(1) + line + m.group(2), text))
        print(f"wrote {DOC.relative_to(ROOT)}: {line}")
    except CheckmateError as e:
        print(f"p4_regen: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
