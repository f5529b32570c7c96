#!/usr/bin/env bash
# Does Checkmate install into a training environment with a given torch, and work there?
# (docs/usage.md, "Supported versions", records the results.)
#
#   scripts/check-install.sh TORCH_VERSION          e.g. 2.11.0
#   PYTHON=python3.12 scripts/check-install.sh 2.11.0
#
# In a scratch virtualenv of $PYTHON (default python3): installs torch==TORCH_VERSION from the
# package index first, as a team's environment already has it, then the wheel and sdist
# built from this checkout (`python -m build`) with pip's ordinary resolution, and checks
# that torch was left as it was. Then, with the console script of the installed wheel and
# outside the checkout: `checkmate launch` of examples/train.py, 2 ranks and 2 local shadows,
# once without a failure and once with one rank SIGKILLed at a random iteration
# (CHECKMATE_KILL_AT, as tests/test_launch.py does); the group restarts, resumes from the
# shadows, and its final model, optimizer and scheduler state must equal the failure-free
# run's bit for bit (the first launch compiles the shadows' Numba kernels from an empty
# cache, as a user's first run does). Last, tests/test_optim_rule.py against the installed package.
# Exit 0 when all passed; the scratch folder is removed unless KEEP=1. VENV=DIR reuses the
# virtualenv of an earlier KEEP=1 run (its torch must be TORCH_VERSION): no second download.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
torch_version=${1:?usage: scripts/check-install.sh TORCH_VERSION (e.g. 2.11.0)}
python=${PYTHON:-python3}
steps=${STEPS:-12}
work=$(mktemp -d "${TMPDIR:-/tmp}/ckm-check-install-XXXXXX")
cleanup() { if [[ "${KEEP:-0}" == 1 ]]; then echo "kept $work"; else rm -rf "$work"; fi; }
trap cleanup EXIT
say() { echo "check-install: $*"; }
fail() { echo "check-install: FAIL: $*" >&2; exit 1; }

venv=${VENV:-$work/venv}
py=$venv/bin/python
pip() { "$py" -m pip --disable-pip-version-check -q "$@"; }
probe='import importlib.metadata as md, torch; print(md.version("torch"), torch.__file__)'
if [[ -n "${VENV:-}" ]]; then
  say "reusing $venv ($("$py" --version 2>&1))"
  pip uninstall -y checkmate-ckpt >/dev/null 2>&1 || true
else
  say "scratch venv in $work with $($python --version 2>&1), torch==$torch_version"
  "$python" -m venv "$venv"
  pip install --upgrade pip >/dev/null
  pip install "torch==$torch_version" || fail "pip cannot install torch==$torch_version here"
fi
before=$("$py" -c "$probe" 2>/dev/null)
[[ "${before%%[ +]*}" == "$torch_version" ]] ||
  fail "the venv's torch is ${before%% *}, not $torch_version"

# the wheel and the sdist of this checkout, built from a copy (build/ may be shared)
mkdir -p "$work/src" "$work/dist"
git ls-files -co --exclude-standard | while read -r f; do [[ -f "$f" ]] && echo "$f"; done |
  tar -cf - -T - | tar -xf - -C "$work/src"
pip install build >/dev/null
"$py" -m build -q --outdir "$work/dist" "$work/src" >"$work/build.log" 2>&1 ||
  { tail -20 "$work/build.log"; fail "python -m build failed"; }
whl=$(ls "$work"/dist/checkmate_ckpt-*.whl)
say "built $(cd "$work/dist" && ls | tr '\n' ' ')"
pip install "$whl" pytest || fail "pip install of the wheel failed"
after=$("$py" -c "$probe" 2>/dev/null)
[[ "$before" == "$after" ]] || fail "installing the wheel changed torch: $before -> $after"
say "torch untouched: ${before%% *}; installed: $("$py" -m pip list --format=freeze 2>/dev/null |
  grep -iE '^(checkmate-ckpt|numpy|numba|pydantic|crc32c|pyyaml)==' | tr '\n' ' ')"

run=$work/run
mkdir -p "$run"
cd "$run"  # outside the checkout: only the installed package can be imported
"$py" -c 'import checkmate, sys; sys.exit(not checkmate.__file__.startswith(sys.argv[1]))' "$venv" ||
  fail "checkmate is not imported from the scratch venv"
# No kernel step: the first launch compiles the shadows' Numba kernels from an empty cache,
# as a user's first run after `pip install` does (the launcher waits for them).
launch() {  # NAME [ENV...]: a 2-rank launch with 2 local shadows, final state in NAME.pt
  local name=$1; shift
  env NUMBA_NUM_THREADS=1 "$@" "$venv/bin/checkmate" launch --nproc-per-node 2 \
    --shadows 2 --max-restarts 1 --progress-every 4 --dir "$run/$name" \
    "$root/examples/train.py" --steps "$steps" --out "$run/$name.pt" >"$run/$name.log" 2>&1 ||
    { tail -30 "$run/$name.log"; fail "the $name launch exited non-zero ($run/$name.log)"; }
}
rank=$((RANDOM % 2)); at=$((3 + RANDOM % (steps - 4)))
say "launch without a failure"
launch clean
grep -q "restarting the worker group" clean.log && fail "the clean run restarted"
say "launch with rank $rank SIGKILLed at iteration $at"
launch killed CHECKMATE_KILL_AT="$rank:$at"
grep -q "restarting the worker group" killed.log || fail "the killed run did not restart"
resumed=$(grep -oE "resumed from the shadows at iteration [0-9]+" killed.log | head -1) ||
  fail "the killed run did not resume from the shadows"
say "$resumed"
"$py" - "$run/clean.pt" "$run/killed.pt" <<'PY' || fail "the resumed run differs"
import sys
import torch

def same(a, b, where):
    if torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for k in a:
            same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{where}/{i}")
    else:
        assert a == b, where

ref, got = (torch.load(p, weights_only=False) for p in sys.argv[1:])
for part in ("model", "optimizer", "scheduler"):
    same(ref[part], got[part], part)
print("check-install: the killed and resumed run equals the clean run bit for bit "
      "(model, optimizer, scheduler)")
PY
say "tests/test_optim_rule.py"
"$venv/bin/pytest" -q -p no:cacheprovider "$root/tests/test_optim_rule.py" \
  >"$work/optim_rule.log" 2>&1 || { tail -30 "$work/optim_rule.log"; fail "tests/test_optim_rule.py"; }
tail -1 "$work/optim_rule.log"
say "PASS: torch ${before%% *} on $("$py" --version 2>&1)"
