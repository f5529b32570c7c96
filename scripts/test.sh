#!/usr/bin/env bash
# The test command (README.md, .ci/run): lint, then the whole suite. Needs `make setup` first.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check .
# The P4 compilers (tests/test_p4_compile.py), from ../shared/p4-toolchain when not on PATH.
p4bin=$(bash scripts/p4-toolchain.sh)
if [ -n "$p4bin" ]; then export PATH="$p4bin:$PATH"; fi
# Two test files at a time (pytest-xdist, a file's tests on one worker: its module fixtures
# are made once), or one on a single core: most of the suite's time is processes that start,
# train a few iterations and wait, so two files overlap well on two cores.
workers=$(( $(nproc) >= 2 ? 2 : 1 ))
exec .venv/bin/python -m pytest -q --durations=30 -n "$workers" --dist loadfile "$@"
