#!/usr/bin/env bash
# Print the folder to put before PATH for the P4 compilers (make p4, scripts/test.sh), or
# nothing when they are already on PATH or no toolchain is at hand (then the P4 compile
# tests skip and say why). The toolchain archive is looked for in $P4_TOOLCHAIN, by default
# ../shared/p4-toolchain beside the clone (where CI keeps it); its install.sh installs the
# runtime libraries and unpacks it into build/p4-toolchain. Run from the repository root.
set -uo pipefail
if command -v p4c-bm2-ss >/dev/null && { command -v bf-p4c || command -v p4c-barefoot; } >/dev/null; then
  exit 0
fi
dir=${P4_TOOLCHAIN:-../shared/p4-toolchain}
if [ ! -x "$dir/install.sh" ]; then
  echo "p4-toolchain: no compilers on PATH and no $dir/install.sh: P4 compile tests skip" >&2
  exit 0
fi
if ! bin=$("$dir/install.sh" "$PWD/build/p4-toolchain" | tail -n 1); then
  echo "p4-toolchain: $dir/install.sh failed: P4 compile tests skip" >&2
  exit 0
fi
echo "$bin"
