"""docs/architecture.md's layout table matches the tree, and no import crosses it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BASE = ("errors", "extras", "fastexit", "metrics", "metrics_port", "ratelog", "schema")
TOPS = ("dataplane", "control", "shadow", "testbed", "p4")


def _table() -> dict[str, set[str]]:
    """folder key -> the groups it may import, from the doc's table."""
    text = (ROOT / "docs/architecture.md").read_text()
    section = text.split("## Where the code lives", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, set[str]] = {}
    for line in section.splitlines():
        m = re.match(r"\| `([a-z0-9_/]+)/`[^|]*\|[^|]*\| (.*) \|$", line)
        if not m:
            continue
        folder, allowed = m.group(1), m.group(2)
        key = "base" if folder == "checkmate" else folder.removeprefix("checkmate/")
        groups = {g.split(" (")[0].strip() for g in allowed.split(",")}
        rows[key] = groups
    return rows


def _group_of_module(mod: str) -> str | None:
    parts = mod.split(".")
    if parts[0] != "checkmate" or len(parts) == 1:
        return None
    return "base" if parts[1] in BASE else parts[1]


def _group_of_file(path: Path) -> str:
    rel = path.relative_to(ROOT).parts
    if rel[0] == "checkmate":
        return "base" if len(rel) == 2 else rel[1]
    return rel[0]


def _python_files() -> list[Path]:
    files = list((ROOT / "checkmate").rglob("*.py"))
    for top in TOPS:
        files += (ROOT / top).rglob("*.py")
    return [f for f in files if "__pycache__" not in f.parts]


def test_the_table_names_every_package_folder_and_no_other():
    rows = _table()
    tree = {d.name for d in (ROOT / "checkmate").iterdir()
            if d.is_dir() and (d / "__init__.py").exists()}
    tree |= {"base"} | {t for t in TOPS if (ROOT / t).is_dir()}
    assert set(rows) == tree, f"table {sorted(rows)} vs tree {sorted(tree)}"


def test_no_module_imports_a_folder_its_row_does_not_allow():
    rows = _table()
    everything = set(rows) - {"testbed"}
    bad = []
    for f in _python_files():
        group = _group_of_file(f)
        allowed = rows[group]
        if "everything above" in allowed:
            allowed = everything
        for node in ast.walk(ast.parse(f.read_text())):
            mods: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                mods = [node.module]
                if node.module == "checkmate":
                    mods = [f"checkmate.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            for m in mods:
                target = _group_of_module(m)
                if target and target != group and target not in allowed:
                    bad.append(f"{f.relative_to(ROOT)}:{node.lineno} imports {m} ({target})")
    assert not bad, "imports the table does not allow:\n" + "\n".join(bad)
