"""The torch layout of the shadows' checkpoints, without processes: rectangular chunks of a
flat range, the per-iteration join under a shared dir (published once every partition has
written, ``latest`` never moving back), ``export`` of partition dirs from separate disks,
the refusals (gaps, mixed iterations, a corrupt copy, optimizer state at step 0), and a
re-seed purging the lineage it replaces so that no join mixes two runs."""

from __future__ import annotations

import json
import math
import os
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    TensorProperties,
    TensorStorageMetadata,
)

from checkmate.shadow import checkpoint_load, disk, export, merge, persist, torch_layout
from checkmate.shadow.cli import main as shadow_main
from checkmate.shadow.control_message import Control
from checkmate.shadow.state import ShadowState
from checkmate.spec.model import ModelSpec

LRS = [0.01, 0.002]
EXTRA = {"scheduler": {"base_lrs": [0.02, 0.004], "last_epoch": 6,
                       "_last_lr": [0.011, 0.0021]},
         "hyper": [{"weight_decay": 0.2, "betas": [0.8, 0.9]}, {"eps": 1e-6}],
         "user": {"data_pos": 42}}


def _spec(partitions: int = 3) -> ModelSpec:
    """Boundaries of 3 partitions fall inside the 2-D and the 4-D tensor, off their rows."""
    return ModelSpec.build(
        5, [("emb", (10, 6)), ("conv", (4, 3, 2, 2)), ("empty", (0, 3)), ("b", (5,)),
            ("scale", ())], "adamw",
        [{"params": ["emb", "conv", "empty"], "lr": 0.02, "weight_decay": 0.1},
         {"params": ["b", "scale"], "lr": 0.004, "weight_decay": 0.0}],
        partitions, buffers=[("bn.mean", (3,), "float32"), ("bn.n", (), "int64")])


def _full(spec: ModelSpec, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {s: rng.standard_normal(spec.total).astype(np.float32) for s in spec.slots}


def _buffers(spec: ModelSpec) -> dict[str, str]:
    return spec.encode_buffers({"bn.mean": torch.tensor([0.5, -1.0, 2.0]),
                                "bn.n": torch.tensor(7)})


def _save_all(root: Path | list[Path], spec: ModelSpec, it: int, full: dict, keep: int = 3
              ) -> None:
    for p in range(spec.partitions):
        a, b = spec.bounds(p)
        r = root[p] if isinstance(root, list) else root
        persist.save(r, spec, p, it, it - 1, {s: v[a:b] for s, v in full.items()},
                     _buffers(spec), EXTRA, LRS, keep)


def _expected(spec: ModelSpec, full: dict, step: int) -> tuple[dict, dict]:
    return spec.state_dicts(full, step, spec.decode_buffers(_buffers(spec)), LRS)


def _load(ckpt: Path, spec: ModelSpec) -> dict:
    """dcp.load into zero-filled destinations shaped like a fresh model and optimizer."""
    m, o = _expected(spec, _full(spec, 0), 1)
    sd = {"model": {k: torch.zeros_like(v) for k, v in m.items()},
          "optim": {"state": {i: {k: torch.zeros_like(v) for k, v in st.items()}
                              for i, st in o["state"].items()},
                    "param_groups": [{**g, "initial_lr": 0.0} for g in o["param_groups"]]},
          "scheduler": {"base_lrs": [0.0, 0.0], "last_epoch": 0, "_last_lr": [0.0, 0.0]},
          "extra": {"data_pos": 0}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(sd, checkpoint_id=ckpt, no_dist=True)
    return sd


def test_boxes_tile_every_flat_range_with_contiguous_blocks():
    for shape in [(), (7,), (3, 4), (2, 3, 4), (3, 1, 5, 2), (1, 1, 3)]:
        n = math.prod(shape)
        ref = np.arange(n).reshape(shape)
        for lo in range(n):
            for hi in range(lo + 1, n + 1):
                bs = torch_layout.boxes(shape, lo, hi)
                assert 1 <= len(bs) <= max(1, 2 * len(shape) - 1), (shape, lo, hi)
                pos = lo
                for off, size, s, e in bs:
                    assert s == pos and e > s
                    block = ref[tuple(slice(o, o + z) for o, z in zip(off, size, strict=True))]
                    assert np.array_equal(block.reshape(-1), np.arange(s, e)), (shape, lo, hi)
                    pos = e
                assert pos == hi
    assert torch_layout.boxes((4, 5), 3, 3) == []


def test_joined_checkpoint_loads_with_dcp_and_equals_the_state_dicts(tmp_path):
    spec = _spec()
    full = _full(spec, 1)
    _save_all(tmp_path, spec, 6, full)
    name = "iter-000000000006"
    assert (tmp_path / "latest").read_text().strip() == name
    md = dcp.FileSystemReader(tmp_path / name).read_metadata()
    assert len(md.state_dict_metadata["model.conv"].chunks) >= 3  # cut off its rows
    # the partition dirs are untouched by the join: each still restores on its own
    assert checkpoint_load.load_full(tmp_path)[2] == 6

    sd = _load(tmp_path / name, spec)
    m, o = _expected(spec, full, 5)
    for k, v in m.items():
        assert v.dtype == sd["model"][k].dtype and torch.equal(v, sd["model"][k]), k
    assert sd["optim"]["state"].keys() == o["state"].keys()
    for i, st in o["state"].items():
        for k, v in st.items():
            assert torch.equal(v, sd["optim"]["state"][i][k]), (i, k)
    g0, g1 = sd["optim"]["param_groups"]
    # the scheduler's next rate (as torch's groups hold it after sched.step()), its
    # initial_lr, and the hyperparameters of the last step
    assert (g0["lr"], g0["initial_lr"], g0["weight_decay"], tuple(g0["betas"])) == (
        0.011, 0.02, 0.2, (0.8, 0.9))
    assert (g1["lr"], g1["eps"], g0["params"], g1["params"]) == (0.0021, 1e-6, [0, 1, 2],
                                                                 [3, 4])
    assert sd["scheduler"]["last_epoch"] == 6 and sd["extra"] == {"data_pos": 42}

    # DCP's own converter reads it whole, with nothing to provide
    dcp_to_torch_save(tmp_path / name, tmp_path / "whole.pt")
    whole = torch.load(tmp_path / "whole.pt")
    assert whole["checkmate"] == {"iteration": 6, "step": 5, "lrs": LRS, "partitions": 3}
    assert torch.equal(whole["model"]["conv"], m["conv"])
    assert whole["model"]["empty"].shape == (0, 3)


def test_publish_waits_for_every_partition_and_latest_never_moves_back(tmp_path):
    spec = _spec(partitions=2)
    a, b = spec.bounds(0)
    full2, full4 = _full(spec, 2), _full(spec, 4)
    persist.save(tmp_path, spec, 0, 2, 1, {s: v[a:b] for s, v in full2.items()})
    assert merge.list_merged(tmp_path) == [] and not (tmp_path / "latest").exists()
    persist.save(tmp_path, spec, 1, 2, 1, {s: v[b:] for s, v in full2.items()})
    assert merge.list_merged(tmp_path) == [2]
    _save_all(tmp_path, spec, 4, full4, keep=1)
    assert merge.list_merged(tmp_path) == [4]  # keep=1 pruned the join of 2 as well
    # a late publish of an older iteration (a slow shadow) does not move latest back
    _save_all(tmp_path, spec, 3, _full(spec, 3), keep=2)
    assert merge.list_merged(tmp_path) == [3, 4]
    assert (tmp_path / "latest").read_text().strip() == "iter-000000000004"
    # the joined files are links to the partitions' files, not copies
    data = [f for f in (tmp_path / "iter-000000000004").iterdir() if f.suffix == ".distcp"]
    assert len(data) == 2 and all(os.stat(f).st_nlink == 2 for f in data)
    sd = _load(tmp_path / "iter-000000000004", spec)
    assert torch.equal(sd["model"]["emb"], _expected(spec, full4, 3)[0]["emb"])
    assert not [e for e in tmp_path.iterdir() if e.name.startswith(".tmp")]


def test_merge_refuses_mixed_iterations_missing_partitions_and_gaps(tmp_path):
    spec = _spec(partitions=2)
    _save_all(tmp_path, spec, 2, _full(spec, 2))
    _save_all(tmp_path, spec, 4, _full(spec, 4))
    p0, p1 = tmp_path / "part0", tmp_path / "part1"
    with pytest.raises(merge.MergeError, match="disagree on iteration"):
        merge.merge([p0 / "iter-000000000002", p1 / "iter-000000000004"], tmp_path / "x")
    with pytest.raises(merge.MergeError, match=r"need partitions 0..1 once each, got \[0\]"):
        merge.merge([p0 / "iter-000000000002"], tmp_path / "x")
    assert not (tmp_path / "x").exists()
    props = TensorProperties.create_from_tensor(torch.zeros(1))
    gap = TensorStorageMetadata(props, torch.Size([4, 3]), [
        ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([2, 3])),
        ChunkStorageMetadata(torch.Size([2, 1]), torch.Size([2, 2]))])
    with pytest.raises(merge.MergeError, match="2 of 12 elements are in no partition"):
        merge.check_coverage("model.w", gap)
    gap.chunks.append(ChunkStorageMetadata(torch.Size([1, 0]), torch.Size([3, 1])))
    with pytest.raises(merge.MergeError, match="1 in more than one"):
        merge.check_coverage("model.w", gap)


def test_export_joins_separate_disks_and_skips_a_corrupt_iteration(tmp_path, capsys):
    spec = _spec(partitions=2)
    roots = [tmp_path / "hostA", tmp_path / "hostB"]  # each shadow's own disk
    full2, full4 = _full(spec, 2), _full(spec, 4)
    _save_all(roots, spec, 2, full2)
    _save_all(roots, spec, 4, full4)
    assert merge.list_merged(roots[0]) == [] == merge.list_merged(roots[1])
    bad = next((roots[1] / "part1" / "iter-000000000004").glob("*.distcp"))
    raw = bytearray(bad.read_bytes())
    raw[len(raw) // 2] ^= 1
    bad.write_bytes(raw)

    out = tmp_path / "exported"
    assert shadow_main(["export", "--out", str(out), str(roots[0]), str(roots[1])]) == 0
    cap = capsys.readouterr()
    assert "exported iteration 2 of 2 partitions" in cap.out
    assert "iteration 4 not exported" in cap.err and "sha256" in cap.err
    info = json.loads((out / "checkmate.json").read_text())
    assert info["iteration"] == 2 and info["partitions"] == 2
    assert all(os.stat(f).st_nlink == 1 for f in out.iterdir())  # copies, not links
    sd = _load(out, spec)
    m, _o = _expected(spec, full2, 1)
    assert all(torch.equal(v, sd["model"][k]) for k, v in m.items())

    with pytest.raises(merge.MergeError, match="not an empty directory"):
        export.export(roots, out)
    assert shadow_main(["export", "--out", str(tmp_path / "e2"), "--iteration", "4",
                        str(roots[0]), str(roots[1])]) == 2
    err = capsys.readouterr().err.strip()
    assert "no common iteration verifies" in err and "sha256" in err and "\n" not in err


def test_optimizer_state_at_step_zero_is_refused_not_dropped(tmp_path):
    spec = _spec(partitions=1)
    full = _full(spec, 5)
    with pytest.raises(disk.PersistError, match="not zero at step 0"):
        persist.save(tmp_path, spec, 0, 0, 0, full)
    zero = {s: (v if s == "param" else np.zeros_like(v)) for s, v in full.items()}
    d = persist.save(tmp_path, spec, 0, 0, 0, zero)
    ck = checkpoint_load.load_partition(d)
    assert all(np.array_equal(ck.slots[s], zero[s]) for s in spec.slots)
    md = dcp.FileSystemReader(tmp_path / "iter-000000000000").read_metadata()
    assert not [k for k in md.state_dict_metadata if k.startswith("optim.state")]


class _Shadow:
    """A real ShadowState stepping a real optimizer, its Persister wired as ShadowNode does
    (every commit goes to ``Persister.on_commit``)."""

    def __init__(self, root: Path, spec: ModelSpec, partition: int) -> None:
        self.spec, self.partition = spec, partition
        self.state = ShadowState(partition, spec.partitions, spec.job, retain=8)
        self.state.set_spec(spec)
        self.per = persist.Persister(root, partition, self.state, every=2, keep=5)
        self.state.on_commit = self.per.on_commit
        self.a, self.b = spec.bounds(partition)

    def _settle(self, fn, writes: int = 1) -> None:
        before = self.per.written + self.per.errors
        fn()
        end = time.monotonic() + 30
        while self.per.written + self.per.errors < before + writes:
            assert time.monotonic() < end, "the write did not finish"
            time.sleep(0.01)

    def seed(self, seed: int) -> None:
        arrays = {s: np.zeros(self.b - self.a, np.float32) for s in self.spec.slots}
        arrays["param"][:] = _full(self.spec, seed)["param"][self.a:self.b]
        self._settle(lambda: self.state.install(0, 0, arrays))

    def step(self, it: int, seed: int) -> None:
        g = np.random.default_rng(seed * 100 + it).standard_normal(self.b - self.a)
        ctl = Control(it, LRS, None, False, {}, {})
        self._settle(lambda: self.state.apply(it, g.astype(np.float32), ctl),
                     writes=int(it % 2 == 0))

    def slots(self, it: int) -> dict[str, np.ndarray]:
        with self.state.pinned(it) as v:
            return {s: a.copy() for s, a in v.slots.items()}

    def close(self) -> None:
        self.per.stop()
        self.state.stop()


def test_a_new_run_purges_the_old_lineage_before_it_can_be_joined(tmp_path):
    spec = _spec(partitions=2)
    old = [_Shadow(tmp_path, spec, p) for p in (0, 1)]
    try:
        for sh in old:
            sh.seed(1)
        for it in range(1, 5):
            for sh in old:
                sh.step(it, 1)
    finally:
        for sh in old:
            sh.close()
    # the seed iteration 0 is written but never joined; 2 and 4 are
    assert disk.list_iterations(tmp_path / "part1") == [0, 2, 4]
    assert merge.list_merged(tmp_path) == [2, 4]

    new = [_Shadow(tmp_path, spec, p) for p in (0, 1)]  # a new run in the same dir
    try:
        new[0].seed(2)
        # partition 0's old iterations and every join holding them are gone; iteration 0
        # is in both dirs (new and old run) but a seed point is never joined
        assert disk.list_iterations(tmp_path / "part0") == [0]
        assert disk.list_iterations(tmp_path / "part1") == [0, 2, 4]
        assert merge.list_merged(tmp_path) == [] and not (tmp_path / "latest").exists()
        assert new[0].per.purged == [0, 2, 4]
        with pytest.raises(disk.PersistError, match="iteration 0 is where partition"):
            checkpoint_load.load_full_state(tmp_path)  # nor does a restore from disk mix them
        new[1].seed(2)
        assert disk.list_iterations(tmp_path / "part1") == [0]
        for it in (1, 2):
            for sh in new:
                sh.step(it, 2)
        assert merge.list_merged(tmp_path) == [2]
        full = {s: np.concatenate([sh.slots(2)[s] for sh in new]) for s in spec.slots}
        m, o = spec.state_dicts(full, 2, None, LRS)
        sd = {"model": {k: torch.zeros_like(v) for k, v in m.items()},
              "optim": {"state": {i: {k: torch.zeros_like(v) for k, v in st.items()}
                                  for i, st in o["state"].items()}}}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(sd, checkpoint_id=tmp_path / "iter-000000000002", no_dist=True)
        assert all(torch.equal(v, sd["model"][k]) for k, v in m.items())
        assert all(torch.equal(v, sd["optim"]["state"][i][k])
                   for i, st in o["state"].items() for k, v in st.items())
    finally:
        for sh in new:
            sh.close()


def test_a_write_in_flight_when_the_shadow_is_reseeded_is_discarded(tmp_path, monkeypatch):
    spec = _spec(partitions=1)
    sh = _Shadow(tmp_path, spec, 0)
    real_save, gate, entered = torch_layout.save, threading.Event(), threading.Event()

    def slow_save(sd, path, threads=1):  # iteration 4's files wait for the gate
        if "iter-000000000004" in str(path):
            entered.set()
            assert gate.wait(30)
        real_save(sd, path, threads)

    monkeypatch.setattr(torch_layout, "save", slow_save)
    try:
        sh.seed(1)
        for it in (1, 2, 3):
            sh.step(it, 1)
        sh.state.apply(4, np.ones(spec.total, np.float32), Control(4, LRS, None, False, {}, {}))
        assert entered.wait(30)  # the writer is inside iteration 4's save
        arrays = {s: np.zeros(spec.total, np.float32) for s in spec.slots}
        sh.state.install(0, 0, arrays)  # re-seeded meanwhile: a new lineage from 0
        assert disk.list_iterations(tmp_path / "part0") == []  # 0 and 2 purged
        gate.set()
        end = time.monotonic() + 30
        while disk.list_iterations(tmp_path / "part0") != [0]:  # the new seed version
            assert time.monotonic() < end
            time.sleep(0.01)
        time.sleep(0.2)
        assert disk.list_iterations(tmp_path / "part0") == [0]  # iteration 4 discarded
        meta = json.loads((tmp_path / "part0" / "iter-000000000000" / "ckm.json").read_text())
        assert meta["seeded"] is True and sh.per.status()["errors"] == 0
        ck = checkpoint_load.latest_valid(tmp_path / "part0")
        assert not np.any(ck.slots["param"])  # the new lineage's state, not the old one's
    finally:
        gate.set()
        sh.close()


def _dcp_group(d: Path, tensors: dict[str, torch.Tensor]) -> merge.Joined:
    """A group's files as merge_groups sees them: real DCP files written by ``dcp.save``."""
    from torch.distributed.checkpoint.storage import WriteResult

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(tensors, storage_writer=dcp.FileSystemWriter(d), no_dist=True)
    md = dcp.FileSystemReader(d).read_metadata()
    results = [WriteResult(index=idx, size_in_bytes=info.length, storage_data=info)
               for idx, info in md.storage_data.items()]
    files = {info.relative_path: (d / info.relative_path, "") for info in
             md.storage_data.values()}
    return merge.Joined({}, dict(md.state_dict_metadata), {}, results, files)


def test_groups_that_store_one_name_in_place_must_hold_equal_values(tmp_path):
    """A copy every mesh group stores alike (a TP-replicated norm) is kept once when joined;
    two groups holding different values under one name (a parameter tied across two stages
    whose copies drifted) are refused in one line instead of keeping one silently."""
    w = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    g0 = _dcp_group(tmp_path / "g0", {"emb.weight": w, "other": torch.ones(2)})
    g1 = _dcp_group(tmp_path / "g1", {"emb.weight": w.clone()})
    export._same_copy("emb.weight", g0, 0, g1, 1)  # equal: nothing said
    drift = w.clone()
    drift[2, 3] = torch.nextafter(drift[2, 3], torch.tensor(100.0))  # one ulp
    g2 = _dcp_group(tmp_path / "g2", {"emb.weight": drift})
    with pytest.raises(merge.MergeError, match=r"^emb.weight: mesh groups 0 and 2 hold "
                       r"different values of it \(a parameter tied across two stages"):
        export._same_copy("emb.weight", g0, 0, g2, 2)
