"""Persistence under faults: a real full disk (a small tmpfs) and DCP's CheckpointException
must not end the writer thread, must leave no temp dir, and must not stop later writes."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from shadow_cluster import JOB, make_spec

from checkmate.shadow import checkpoint_load, disk, persist
from checkmate.shadow.control_message import Control
from checkmate.shadow.state import ShadowState
from checkmate.spec.model import ModelSpec

LR = 0.01


@pytest.fixture
def small_disk() -> Iterator[Path]:
    """A 2 MiB tmpfs at /tmp/ckm-persist-XXXX, unmounted and removed even if the test fails."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    d = Path(tempfile.mkdtemp(prefix="ckm-persist-", dir="/tmp"))
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "ckm-persist", str(d)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        d.rmdir()
        pytest.skip(f"cannot mount a tmpfs: {(r.stderr or r.stdout).strip()}")
    try:
        yield d
    finally:
        if subprocess.run(["umount", str(d)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(d)], capture_output=True)
        d.rmdir()


def _big_spec() -> ModelSpec:
    """One partition of 65536 fp32 x 3 AdamW slots: 768 KiB per checkpoint."""
    return ModelSpec.build(JOB, [("w", (256, 256))], "adamw",
                           [{"params": ["w"], "lr": LR, "weight_decay": 0.0,
                             "amsgrad": False}], 1)


def _hidden(root: Path) -> list[str]:
    """Leftover hidden temp entries (``.tmp-iter-...`` dirs, ``.tmp-latest-...`` files)."""
    return [str(p) for p in root.rglob(".tmp*")]


def _wait(cond, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


class Shadow:
    """A real ShadowState stepping a real optimizer, wired to a Persister like ShadowNode."""

    def __init__(self, root: Path, spec: ModelSpec, keep: int) -> None:
        self.spec = spec
        self.state = ShadowState(0, 1, JOB, retain=8)
        self.state.set_spec(spec)
        self.per = persist.Persister(root, 0, self.state, every=1, keep=keep)
        self.state.on_commit = self._on_commit
        self.rng = np.random.default_rng(3)
        arrays = {s: np.zeros(spec.total, np.float32) for s in spec.slots}
        arrays["param"][:] = self.rng.standard_normal(spec.total).astype(np.float32)
        self._settle(lambda: self.state.install(0, 0, arrays))

    def _on_commit(self, v) -> None:
        p = self.per
        if p.last_iteration is None or v.iteration > p.last_iteration:
            p.offer(v)

    def _settle(self, fn) -> None:
        """Run ``fn`` (one commit) and wait until its write succeeded or failed."""
        before = self.per.written + self.per.errors
        fn()
        _wait(lambda: self.per.written + self.per.errors == before + 1)

    def step(self, it: int) -> None:
        g = self.rng.standard_normal(self.spec.total).astype(np.float32)
        lrs = [LR] * len(self.spec.groups)
        self._settle(lambda: self.state.apply(it, g, Control(it, lrs, None, False, {}, {})))

    def version(self, it: int) -> dict[str, np.ndarray]:
        with self.state.pinned(it) as v:
            return {s: a.copy() for s, a in v.slots.items()}

    def close(self) -> None:
        self.per.stop()
        self.state.stop()


def test_full_disk_keeps_writer_alive_and_resumes_when_space_returns(small_disk, caplog):
    caplog.set_level(logging.WARNING, logger="checkmate.shadow")
    root = small_disk / "ckpt"
    pdir = disk.part_dir(root, 0)
    sh = Shadow(root, _big_spec(), keep=1)
    try:
        assert sh.per.written == 1 and disk.list_iterations(pdir) == [0]
        # take all but ~300 KiB: the next checkpoints (768 KiB each) cannot fit
        filler = small_disk / "filler"
        with open(filler, "wb") as f:
            f.write(b"\0" * (shutil.disk_usage(small_disk).free - (300 << 10)))
        sh.step(1)
        sh.step(2)
        time.sleep(0.3)  # a failed version is not retried in a loop
        st = sh.per.status()
        assert st["alive"] and sh.per._thread.is_alive()
        assert st["errors"] == 2 and st["written"] == 1 and st["last_iteration"] == 0
        assert st["last_error"] and "\n" not in st["last_error"]
        assert "iter-000000000002" in st["last_error"] and st["error"] == st["last_error"]
        assert "disk full" in st["last_error"] or "No space left" in st["last_error"]
        assert st["last_failed_iteration"] == 2
        assert _hidden(root) == []  # no temp dir, no temp latest
        logged = [r for r in caplog.records
                  if r.levelno >= logging.ERROR and "persist:" in r.getMessage()]
        assert len(logged) == 1, [r.getMessage() for r in logged]  # one per distinct error
        # three steps: on disk is still iteration 0, which differs from iteration 3
        sh.step(3)  # still full: fails too
        v3 = sh.version(3)
        old = checkpoint_load.latest_valid(pdir)
        assert old.meta["iteration"] == 0
        assert not np.array_equal(old.slots["param"], v3["param"])
        # space returns: the next due version is written, by itself
        filler.unlink()
        sh.step(4)
        v4 = sh.version(4)
        st = sh.per.status()
        assert st["written"] == 2 and st["last_iteration"] == 4 and st["errors"] == 3
        assert st["error"] == "" and st["last_error"] and st["alive"]
        ck = checkpoint_load.latest_valid(pdir)
        assert ck.meta["iteration"] == 4 and ck.meta["step"] == 4
        for s in sh.spec.slots:
            assert np.array_equal(ck.slots[s], v4[s]), s
        assert disk.list_iterations(pdir) == [4] and _hidden(root) == []
        assert any("writing again" in r.getMessage() for r in caplog.records)
    finally:
        sh.close()


def test_checkpoint_exception_is_counted_and_leaves_no_temp(tmp_path, monkeypatch, caplog):
    """Runs without root: DCP raising its CheckpointException (a BaseException) mid-write."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

    caplog.set_level(logging.ERROR, logger="checkmate.shadow")
    spec = make_spec(partitions=1)
    real_save = dcp.save
    broken = {"on": True}

    def failing_save(sd, storage_writer, **kw):  # files half written, then the DCP error
        if not broken["on"]:
            return real_save(sd, storage_writer=storage_writer, **kw)
        real_save(sd, storage_writer=storage_writer, **kw)
        try:
            raise RuntimeError("[enforce fail at inline_container.cc:672] unexpected pos 7")
        except RuntimeError as e:
            raise CheckpointException("write", {0: _wrap_exception(e)}) from None

    monkeypatch.setattr(dcp, "save", failing_save)
    assert not issubclass(CheckpointException, Exception)
    with pytest.raises(disk.PersistError, match="RuntimeError: .*unexpected pos 7"):
        persist.save(tmp_path, spec, 0, 2, 2, {s: np.ones(spec.total, np.float32)
                                                for s in spec.slots})
    assert _hidden(tmp_path) == [] and disk.list_iterations(tmp_path / "part0") == []

    sh = Shadow(tmp_path, spec, keep=3)  # iteration 0 fails too
    try:
        sh.step(1)
        st = sh.per.status()
        assert st["alive"] and st["errors"] == 2 and st["written"] == 0
        assert "unexpected pos" in st["last_error"] and "\n" not in st["last_error"]
        assert _hidden(tmp_path) == []
        assert len([r for r in caplog.records if "persist:" in r.getMessage()]) == 1
        broken["on"] = False
        sh.step(2)
        v2 = sh.version(2)
        ck = checkpoint_load.latest_valid(tmp_path / "part0")
        assert sh.per.status()["last_iteration"] == 2 and ck.meta["iteration"] == 2
        for s in spec.slots:
            assert np.array_equal(ck.slots[s], v2[s]), s
    finally:
        sh.close()
