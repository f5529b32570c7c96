#!/usr/bin/env bash
# The test command (README.md, .ci/run): lint, then the whole suite. Needs `make setup` first.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check .
exec .venv/bin/python -m pytest -q --durations=30 "$@"
