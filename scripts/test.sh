#!/usr/bin/env bash
# The test command (README.md, .ci/run): lint, then the whole suite. Needs `make setup` first.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check .
# The P4 compilers (tests/test_p4_compile.py), from ../shared/p4-toolchain when not on PATH.
p4bin=$(bash scripts/p4-toolchain.sh)
if [ -n "$p4bin" ]; then export PATH="$p4bin:$PATH"; fi
# Two test files at a time (pytest-xdist, a file's tests on one worker: its module fixtures
# are made once; one at a time on a single core): most of the suite's time is processes
# that start, train a few iterations and wait, so two files overlap well on two cores.
# Then the end-to-end scenarios marked `serial` (tests/conftest.py), alone: their
# deadlines are a loaded machine's to miss. Status: the first failure's.
workers=$(( $(nproc) >= 2 ? 2 : 1 ))
status=0
.venv/bin/python -m pytest -q --durations=30 -n "$workers" --dist loadfile -m "not serial" "$@" \
    || status=$?
rc=0
.venv/bin/python -m pytest -q --durations=15 -m serial -p no:xdist "$@" || rc=$?
# 5: no test selected (arguments that name no file of that part); both 5: nothing ran
if [ "$status" -eq 5 ] && [ "$rc" -eq 5 ]; then exit 5; fi
if [ "$status" -eq 5 ]; then status=0; fi
if [ "$status" -eq 0 ] && [ "$rc" -ne 5 ]; then status=$rc; fi
exit "$status"
