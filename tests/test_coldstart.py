"""The first run after an install: the shadows' Numba cache is empty and they compile their
kernels for a minute or two. Nothing may time out meanwhile -- the launcher (and a trainer
started beside running shadows) waits until every shadow says its kernels are ready, and a
wait that runs out is one line saying the shadow is still compiling.

The fast tests hold a real shadow's warm-up (a real node, its real TCP service and status
reply) so "compiling" lasts as long as the test needs; the slow one runs a real 2-rank
``checkmate launch`` with NUMBA_CACHE_DIR pointing at an empty directory, then `checkmate
doctor`'s kernel check on that cache.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from checkmate.errors import CheckmateError
from checkmate.launch import doctor_node, local_shadows
from checkmate.launch.doctor import PASS, WARN
from checkmate.protocol.frames import ShadowError
from checkmate.shadow import node as nodemod
from checkmate.shadow.node import NodeOptions, ShadowNode
from checkmate.train.shadow_client import ShadowClient, kernels_state, wait_ready

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train.py"


def _held_node(monkeypatch: pytest.MonkeyPatch, release: threading.Event,
               fail: str = "") -> ShadowNode:
    """A real shadow whose optimizer-kernel warm-up waits for ``release`` (then raises
    ``fail`` when given): it answers status while it "compiles"."""

    def held() -> None:
        release.wait(30)
        if fail:
            raise RuntimeError(fail)

    monkeypatch.setattr(nodemod, "warm_up_kernels", held)
    return ShadowNode(NodeOptions(partition=0, partitions=1, job=1, bind="127.0.0.1", port=0,
                                  restore_bind="127.0.0.1", restore_port=0)).start()


def test_wait_for_a_compiling_shadow_fails_in_one_line_that_says_so(monkeypatch):
    release = threading.Event()
    node = _held_node(monkeypatch, release)
    addr = ("127.0.0.1", node.tcp_port)
    try:
        with ShadowClient(addr, 5.0) as c:
            assert kernels_state(c.status())[0] == "compiling"
        seen: list[float] = []
        with pytest.raises(ShadowError) as e:
            wait_ready([addr], timeout=0.6, on_wait=seen.append, poll=0.1)
        line = str(e.value)
        assert "\n" not in line
        assert f"shadow 127.0.0.1:{node.tcp_port} is still compiling its Numba kernels" in line
        assert "cold Numba cache" in line and "waited 1s" in line
        assert seen, "no progress was reported while it compiled"
        release.set()
        assert wait_ready([addr], timeout=10.0, poll=0.05) >= 0.0
        with ShadowClient(addr, 5.0) as c:
            assert kernels_state(c.status())[0] == "ready"
    finally:
        release.set()
        node.stop()


def test_a_shadow_whose_compile_fails_is_one_line_not_a_wait(monkeypatch):
    release = threading.Event()
    release.set()
    node = _held_node(monkeypatch, release, fail="no LLVM today")
    try:
        with pytest.raises(ShadowError, match=r"could not compile its kernels: "
                                              r"RuntimeError: no LLVM today"):
            wait_ready([("127.0.0.1", node.tcp_port)], timeout=10.0, poll=0.05)
    finally:
        node.stop()


def test_a_silent_address_is_named_in_the_line():
    with pytest.raises(ShadowError, match=r"shadow 127\.0\.0\.1:1 does not answer: .*waited"):
        wait_ready([("127.0.0.1", 1)], timeout=0.3, poll=0.1)
    # a wrong address fails after silent_timeout, not after the compile's long timeout
    t0 = time.monotonic()
    with pytest.raises(ShadowError, match=r"does not answer"):
        wait_ready([("127.0.0.1", 1)], timeout=60.0, poll=0.1, silent_timeout=0.3)
    assert time.monotonic() - t0 < 5


def test_check_shadows_waits_for_kernels_with_one_progress_line(monkeypatch, capsys):
    """``--shadow ADDR``: the launcher waits for a compiling shadow too, then says ready."""
    release = threading.Event()
    node = _held_node(monkeypatch, release)
    monkeypatch.setattr(local_shadows, "SAY_AFTER", 0.0)
    try:
        threading.Timer(1.0, release.set).start()
        assert local_shadows.check_shadows([("127.0.0.1", node.tcp_port)]) in (0, 1)
        out = capsys.readouterr().out.splitlines()
        assert out[0].startswith(local_shadows.PROG_LINE), out
        assert out[-1].startswith("checkmate launch: the shadow kernels are ready after"), out
        assert len(out) == 2, out
    finally:
        release.set()
        node.stop()


def test_check_shadows_timeout_is_one_checkmate_line(monkeypatch):
    release = threading.Event()
    node = _held_node(monkeypatch, release)
    monkeypatch.setattr(local_shadows, "START_TIMEOUT", 0.5)
    try:
        with pytest.raises(CheckmateError, match=r"^the shadows were not ready in 0s: shadow "
                                                 r".* is still compiling its Numba kernels"):
            local_shadows.check_shadows([("127.0.0.1", node.tcp_port)])
    finally:
        release.set()
        node.stop()


def test_progress_on_a_terminal_is_one_line_rewritten():
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    out = Tty()
    p = local_shadows.Progress(out)
    say = local_shadows.SAY_AFTER
    for s in (0.5, say + 0.5, say + 0.7, say + 1.6, say + 3.0):
        p(s)
    p.end(True, say + 3.2)
    text = out.getvalue()
    assert text.count("\n") == 1 and text.endswith(f"{say + 3.2:.0f} s: ready\n")
    assert text.count("\r") == 4  # 3 updates and the closing rewrite; 0.5 and +0.7 skipped


@pytest.mark.slow
def test_first_launch_with_an_empty_numba_cache_succeeds(tmp_path):
    """Slow: an empty NUMBA_CACHE_DIR makes every shadow compile its kernels from nothing
    (1-2 minutes on a loaded 2-core machine), which is the case being tested."""
    cache = tmp_path / "numba-cache"
    cache.mkdir()
    out = tmp_path / "final.pt"
    argv = [sys.executable, "-m", "checkmate.launch.cli", "launch", "--nproc-per-node", "2",
            "--shadows", "2", "--max-restarts", "0", "--dir", str(tmp_path / "job"),
            str(EXAMPLE), "--steps", "3", "--out", str(out)]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=900,
                       env={**os.environ, "NUMBA_CACHE_DIR": str(cache),
                            "NUMBA_NUM_THREADS": "1"})
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    assert local_shadows.PROG_LINE in p.stdout, p.stdout
    assert "the shadow kernels are ready after" in p.stdout, p.stdout
    assert "done; the shadows hold iteration 3" in p.stdout, p.stdout
    assert out.exists()
    # the shadows really compiled into (and only from) the empty cache
    compiled = sorted(f for f in cache.rglob("*") if f.suffix == ".nbc")
    assert compiled, "nothing was compiled"
    # `checkmate doctor` on the same cache (one run, not a second cold compile): every
    # kernel loads from it; with one module's kernels gone it compiles those, warns, and
    # the next look finds it kept
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache)}
    warm = doctor_node.check_kernels(env)
    assert warm.status == PASS and "loaded from Numba's cache" in warm.detail, warm
    (small,) = [d for d in cache.iterdir() if d.name.startswith("protocol_")]
    for f in small.iterdir():  # the datagram tag's kernels: a few seconds to compile again
        f.unlink()
    first = doctor_node.check_kernels(env)
    assert first.status == WARN and "were not in Numba's cache: compiled now" in \
        first.detail, first
    again = doctor_node.check_kernels(env)
    assert again.status == PASS and str(cache) in again.detail, again
