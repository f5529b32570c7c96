"""Building the BPF object: compiled by clang, a no-op when current, verifier-clean."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from checkmate.dataplane import build

needs_clang = pytest.mark.skipif(shutil.which("clang") is None, reason="clang not installed")


@needs_clang
def test_build_is_a_noop_when_up_to_date():
    obj = build.ensure_built()
    assert obj.exists() and obj.stat().st_size > 0
    mtime = obj.stat().st_mtime_ns
    assert build.ensure_built() == obj
    assert obj.stat().st_mtime_ns == mtime  # not rebuilt


@needs_clang
def test_object_has_both_programs_and_all_maps():
    from checkmate.dataplane.maps import MAP_LAYOUT

    obj = build.ensure_built()
    syms = subprocess.run(["llvm-objdump", "-t", str(obj)], capture_output=True, text=True)
    if syms.returncode != 0:
        pytest.skip("llvm-objdump not available")
    for name in ["ckm_ingress", "ckm_egress", *MAP_LAYOUT]:
        assert name in syms.stdout, name


@pytest.mark.netns
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("bpftool") is None,
                    reason="needs root and bpftool")
def test_programs_pass_the_verifier(tmp_path):
    from checkmate.dataplane.switch import ensure_bpffs

    ensure_bpffs()
    pin = f"/sys/fs/bpf/ta-verify-{os.getpid()}"
    try:
        res = subprocess.run(["bpftool", "prog", "loadall", str(build.ensure_built()), pin,
                              "type", "classifier"], capture_output=True, text=True)
        assert res.returncode == 0, res.stderr[-2000:]
        assert sorted(os.listdir(pin)) == ["ckm_egress", "ckm_ingress"]
    finally:
        shutil.rmtree(pin, ignore_errors=True)


def test_bpf_syscall_number_is_per_machine_and_an_unknown_one_is_one_error(monkeypatch):
    from checkmate.dataplane import bpfsys
    from checkmate.errors import CheckmateError

    real = os.uname()

    def machine(name):
        return os.uname_result((real.sysname, real.nodename, real.release, real.version, name))

    monkeypatch.setattr(bpfsys.os, "uname", lambda: machine("x86_64"))
    assert bpfsys._sys_bpf() == 321
    monkeypatch.setattr(bpfsys.os, "uname", lambda: machine("aarch64"))
    assert bpfsys._sys_bpf() == 280
    monkeypatch.setattr(bpfsys.os, "uname", lambda: machine("vax"))
    with pytest.raises(CheckmateError, match="no syscall number known for machine 'vax'"):
        bpfsys._bpf(1, bpfsys._attr())
