# Two commands set up a fresh machine and do the work (README.md):
#   make run    the main job on the embedded default (namespace testbed, kernel switch)
#   make test   the test suite (namespace tests need root)
# Both need root: as root type them as they are, otherwise with sudo before them.
# Both install what they need and are safe to re-run.

VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.checkmate-installed
APT_PKGS := clang llvm libbpf-dev bpftool iproute2 ethtool gcc

.PHONY: setup run test lint bpf nccl guest kernels mininet clean p4 p4-fixtures

setup: $(STAMP) bpf nccl guest kernels mininet

# System packages (clang/libbpf for the BPF switch). Skipped when already present.
.apt-stamp:
	@if ! command -v clang >/dev/null || ! command -v bpftool >/dev/null || \
	    ! test -e /usr/include/bpf/bpf_helpers.h || ! command -v ethtool >/dev/null; then \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(APT_PKGS); \
	fi
	@touch $@

$(STAMP): pyproject.toml .apt-stamp
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	# torch first, pinned: the CPU build on this machine's disk; pyproject.toml's range
	# (torch>=2.11) keeps it, where resolving the range alone would pull a CUDA build.
	# Then the project with every role's extra (the tests import them all).
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,bench,testbed,switch,shadow,metrics]'
	@touch $@

bpf: $(STAMP)
	$(PY) -m checkmate.dataplane.build

# The shadow's compiled kernels (ingest checks, optimizer steps) into Numba's on-disk cache,
# so no shadow of the job or the tests waits for the compiler (10-30 s on a cold cache).
kernels: $(STAMP)
	$(PY) -c "from checkmate.shadow import ingest, kernels; ingest.warm(); kernels.warm_up_kernels()"

# The NCCL net plugin (build/nccl/libnccl-net-ckm.so; docs/nccl_plugin.md): gcc only.
nccl: .apt-stamp
	$(MAKE) -C nccl_plugin OUT=$(CURDIR)/build/nccl

# The soft-RoCE guest for the verbs receiver (docs/verbs.md): QEMU, busybox-static, the
# kernel package's modules (depmod) and Debian's pyverbs; the kernel is downloaded into
# build/guest. Without them the verbs guest tests skip and say what is missing.
GUEST_PKGS := qemu-system-x86 busybox-static kmod cpio file rdma-core ibverbs-providers \
              python3-pyverbs iproute2
guest: $(STAMP)
	@dpkg -s $(GUEST_PKGS) >/dev/null 2>&1 || { apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	  $(GUEST_PKGS) >/dev/null; } || echo "guest packages not installed: verbs guest tests skip"
	@$(PY) -m checkmate.testbed.guest build || echo "no soft-RoCE guest: verbs guest tests skip"

# Mininet's mnexec for the bmv2 testbed (testbed/mininet_bmv2.py): Debian's package; the
# Python package comes with the testbed extra. Without it the bmv2 testbed tests skip.
mininet:
	@command -v mnexec >/dev/null || { apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	  mininet >/dev/null; } || echo "mininet not installed: the bmv2 testbed tests skip"

# Both P4 programs into build/p4/ (docs/architecture.md, "P4 programs"): p4c-bm2-ss and
# bf-p4c or p4c's Tofino driver, from PATH or the toolchain in $$P4_TOOLCHAIN
# (default ../shared/p4-toolchain; scripts/p4-toolchain.sh). A no-op when up to date.
P4_PATH = p4bin=$$(bash scripts/p4-toolchain.sh); PATH="$${p4bin:+$$p4bin:}$$PATH"
p4: $(STAMP)
	@$(P4_PATH) $(PY) -m checkmate.control.p4build

# After a change to p4/: compile, then copy the compiler's P4Info into tests/fixtures/p4c
# and its TNA stage usage into docs/architecture.md (scripts/p4_regen.py).
p4-fixtures: $(STAMP)
	@$(P4_PATH) $(PY) scripts/p4_regen.py

run: setup
	$(VENV)/bin/testbed run --scenario kill-restore

test: setup
	bash scripts/test.sh

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	-$(VENV)/bin/testbed down
	rm -rf build .apt-stamp
