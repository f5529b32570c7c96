#!/usr/bin/env bash
# The test command (README.md, .ci/run): lint, then the whole suite. Needs `make setup` first.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check .
# The P4 compilers (tests/test_p4_compile.py), from ../shared/p4-toolchain when not on PATH.
p4bin=$(bash scripts/p4-toolchain.sh)
if [ -n "$p4bin" ]; then export PATH="$p4bin:$PATH"; fi
exec .venv/bin/python -m pytest -q --durations=30 "$@"
