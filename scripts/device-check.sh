#!/usr/bin/env bash
# The device check on a machine with one GPU (docs/gpu.md): `testbed device-check`, with the
# project importable and its small dependencies present even on a bare Python.
#
#   scripts/device-check.sh [device-check options]   run it (default budget 450 s)
#   scripts/device-check.sh --fetch-wheels           where a network exists: download the
#                                                    Python 3.12 wheels of crc32c and pydantic
#                                                    into build/device-wheels, to carry along
#
# Python: $PYTHON if set, else the first of .venv/bin/python and python3 whose torch sees
# CUDA (a GPU machine's own Python with its CUDA torch), else the .venv. Without an installed project, a folder of
# links (build/device-py) mirrors pyproject.toml's package mapping. Missing crc32c/pydantic
# (the launcher, shadows and sessions import them) are installed from build/device-wheels
# into build/device-deps; without them the launcher checks fail with one line each.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
wheels=build/device-wheels
deps=(crc32c pydantic)

if [[ "${1:-}" == "--fetch-wheels" ]]; then
  py=${PYTHON:-python3}
  [[ -x .venv/bin/python ]] && py=${PYTHON:-.venv/bin/python}
  mkdir -p "$wheels"
  "$py" -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux_2_28_x86_64 -d "$wheels" "${deps[@]}"
  echo "device-check: wheels for Python 3.12 in $wheels:"; ls "$wheels"
  exit 0
fi

cuda_torch() { "$1" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' \
  2>/dev/null; }
py=${PYTHON:-}
if [[ -z "$py" ]]; then
  for cand in .venv/bin/python python3; do  # the first whose torch sees CUDA
    if command -v "$cand" >/dev/null && cuda_torch "$cand"; then py=$cand; break; fi
  done
fi
if [[ -z "$py" ]]; then  # no CUDA anywhere: the CUDA checks skip, the rest runs
  if [[ -x .venv/bin/python ]]; then py=.venv/bin/python; else py=python3; fi
fi

if ! "$py" -c 'import checkmate.testbed.device_check' 2>/dev/null; then
  rm -rf build/device-py
  mkdir -p build/device-py/checkmate
  for f in checkmate/*; do ln -s "$root/$f" build/device-py/checkmate/; done
  for d in dataplane control shadow testbed p4; do
    ln -s "$root/$d" "build/device-py/checkmate/$d"
  done
  export PYTHONPATH="$root/build/device-py${PYTHONPATH:+:$PYTHONPATH}"
fi

missing=$("$py" -c 'import importlib.util as u, sys
print(" ".join(m for m in sys.argv[1:] if u.find_spec(m) is None))' "${deps[@]}")
if [[ -n "$missing" ]]; then
  if compgen -G "$wheels/*.whl" >/dev/null; then
    # pip where there is one; else the wheels are unpacked (they are zip files)
    "$py" -m pip install -q --no-index --find-links "$wheels" --target build/device-deps \
      --upgrade $missing 2>/dev/null || "$py" -c 'import glob, zipfile
for w in glob.glob("build/device-wheels/*.whl"):
    zipfile.ZipFile(w).extractall("build/device-deps")'
    export PYTHONPATH="$root/build/device-deps${PYTHONPATH:+:$PYTHONPATH}"
  else
    echo "device-check: $missing not installed and no wheels in $wheels" \
         "(run scripts/device-check.sh --fetch-wheels where a network exists)"
  fi
fi

exec "$py" -m checkmate.testbed.cli device-check "$@"
