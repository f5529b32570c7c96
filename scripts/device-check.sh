#!/usr/bin/env bash
# The device check on a machine with one GPU (docs/gpu.md): this project's wheel installed
# into that machine's own Python (its CUDA torch untouched), then `testbed device-check`.
#
#   scripts/device-check.sh --fetch-wheels   where a network exists: this checkout's wheel and
#                                            the Python 3.12 wheels of the core dependencies
#                                            a GPU machine lacks (crc32c, pydantic and its
#                                            own) into build/device-wheels, to carry along
#   scripts/device-check.sh [options]        install them and run the check (default budget
#                                            450 s; the options are device-check's)
#
# Python: $PYTHON if set, else the first of .venv/bin/python and python3 whose torch sees
# CUDA, else .venv/bin/python or python3 (then the CUDA checks skip and say so).
# Install, offline: `pip install --no-deps` of build/device-wheels/checkmate_ckpt-*.whl (built
# here from the checkout when absent), and of the core dependencies that Python lacks, from
# the same folder. A Python marked externally managed (PEP 668) gets a virtualenv with its
# system site-packages instead (build/device-venv), so its torch is still the one used; a
# Python without pip gets the wheels unpacked into build/device-site on its PYTHONPATH.
# $DEVICE_WHEELS moves the wheel folder (tests/test_packaging.py uses it).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
wheels=${DEVICE_WHEELS:-$root/build/device-wheels}
here=$(dirname "$wheels")  # build/: device-venv and device-site go beside the wheels
# the core dependencies (pyproject.toml) a GPU machine may lack; torch, numpy and numba it has
deps=(crc32c pydantic yaml)
declare -A dist=([crc32c]=crc32c [pydantic]=pydantic [yaml]=pyyaml)

build_wheel() {  # this checkout's wheel into $wheels, built from a copy (build/ may be shared)
  local py=$1 src
  src=$(mktemp -d /tmp/ckm-device-src-XXXXXX)
  git ls-files -co --exclude-standard | while read -r f; do [[ -f "$f" ]] && echo "$f"; done |
    tar -cf - -T - | tar -xf - -C "$src"
  rm -f "$wheels"/checkmate_ckpt-*.whl
  "$py" -m pip wheel -q --no-deps --no-build-isolation -w "$wheels" "$src" ||
    { rm -rf "$src"; echo "device-check: building the project's wheel failed" >&2; exit 1; }
  rm -rf "$src"
}

if [[ "${1:-}" == "--fetch-wheels" ]]; then
  py=${PYTHON:-python3}
  [[ -x .venv/bin/python ]] && py=${PYTHON:-.venv/bin/python}
  mkdir -p "$wheels"
  "$py" -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux_2_28_x86_64 -d "$wheels" crc32c pydantic pyyaml
  build_wheel "$py"
  echo "device-check: wheels in $wheels:"; ls "$wheels"
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
py=$(command -v "$py")

# A development environment (make setup's editable install) already imports this checkout.
dev=0
"$py" -c 'import os, sys, checkmate.testbed.device_check as d
sys.exit(0 if os.path.realpath(d.__file__).startswith(os.path.realpath(sys.argv[1]) + "/")
         else 1)' "$root" 2>/dev/null && dev=1

mkdir -p "$wheels"
if (( ! dev )) && ! compgen -G "$wheels/checkmate_ckpt-*.whl" >/dev/null; then
  "$py" -c 'import setuptools, wheel' 2>/dev/null && "$py" -m pip --version >/dev/null 2>&1 &&
    build_wheel "$py"
fi
whl=$(ls "$wheels"/checkmate_ckpt-*.whl 2>/dev/null | head -1) || true
(( dev )) || [[ -n "$whl" ]] || { echo "device-check: no project wheel in $wheels and none can be built" \
  "here (run scripts/device-check.sh --fetch-wheels where a network exists)" >&2; exit 1; }

# PEP 668: an externally managed Python gets a virtualenv layered over its site-packages
if "$py" -c 'import sys, sysconfig, os
sys.exit(0 if os.path.exists(os.path.join(sysconfig.get_path("stdlib"),
                                          "EXTERNALLY-MANAGED")) else 1)' 2>/dev/null; then
  [[ -x "$here/device-venv/bin/python" ]] ||
    "$py" -m venv --system-site-packages "$here/device-venv"
  py=$here/device-venv/bin/python
fi
missing=()
for m in "${deps[@]}"; do
  "$py" -c "import importlib.util as u, sys; sys.exit(u.find_spec('$m') is None)" ||
    missing+=("${dist[$m]}")
done
offline=(--no-index --find-links "$wheels" --disable-pip-version-check -q)
if (( dev )); then
  echo "device-check: $py imports this checkout (a development install): no wheel installed"
  if (( ${#missing[@]} )); then
    "$py" -m pip install "${offline[@]}" "${missing[@]}" || echo "device-check:" \
      "${missing[*]} not installed from $wheels; the launcher checks will say what is missing"
  fi
elif "$py" -m pip --version >/dev/null 2>&1; then
  "$py" -m pip install "${offline[@]}" --no-deps --force-reinstall "$whl"
  if (( ${#missing[@]} )); then  # their own dependencies too, from the folder only
    "$py" -m pip install "${offline[@]}" "${missing[@]}" || echo "device-check:" \
      "${missing[*]} not installed from $wheels (run scripts/device-check.sh --fetch-wheels" \
      "where a network exists); the launcher checks will say what is missing"
  fi
else  # no pip: a wheel is a zip file, unpacked where that Python looks
  rm -rf "$here/device-site" && mkdir -p "$here/device-site"
  "$py" -c 'import sys, zipfile
for w in sys.argv[2:]:
    zipfile.ZipFile(w).extractall(sys.argv[1])' "$here/device-site" "$whl" \
    $( (( ${#missing[@]} )) && ls "$wheels"/*.whl | grep -v checkmate_ckpt- || true)
  export PYTHONPATH="$here/device-site${PYTHONPATH:+:$PYTHONPATH}"
fi

# Outside the checkout, so that its checkmate/ folder cannot shadow the installed package;
# the results table goes into this checkout's docs/gpu.md, the plugin into its build/nccl.
export CHECKMATE_CHECKOUT=$root
cd "$wheels"
"$py" -c 'import checkmate.testbed.device_check' ||
  { echo "device-check: the installed project cannot be imported by $py" >&2; exit 1; }
exec "$py" -m checkmate.testbed.cli device-check "$@"
