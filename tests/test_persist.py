"""Durable DCP checkpoints of shadow partitions: atomicity, verification, error paths, and
loading all partitions into a real torch model and torch.optim.AdamW in a fresh process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from fakes import TinyNet, tiny_net_groups
from shadow_cluster import JOB, Cluster, make_spec

from checkmate.shadow import checkpoint_load, disk, persist
from checkmate.shadow.feed import control_body, control_datagrams, grad_datagrams


def _slots(spec, p, seed):
    a, b = spec.bounds(p)
    rng = np.random.default_rng(seed)
    return {s: rng.standard_normal(b - a).astype(np.float32) for s in spec.slots}


def test_round_trip_and_manifest_check(tmp_path):
    spec = make_spec()
    sl = _slots(spec, 1, 0)
    d = persist.save(tmp_path, spec, 1, 8, 7, sl, {"bn.mean": "AAAAAAAAAAAAAAAA"}, {"k": 1},
                     [0.1, 0.2])
    assert (tmp_path / "part1" / "latest").read_text().strip() == d.name
    ck = checkpoint_load.load_partition(d)
    assert ck.meta["iteration"] == 8 and ck.meta["step"] == 7 and ck.meta["extra"] == {"k": 1}
    for s in spec.slots:
        assert np.array_equal(ck.slots[s], sl[s])
    assert {".metadata", "ckm.json", "manifest.json"} <= set(os.listdir(d))
    # flip one byte of the DCP data: verification fails and the older checkpoint is used
    older = persist.save(tmp_path, spec, 1, 6, 5, _slots(spec, 1, 1))
    newest = persist.save(tmp_path, spec, 1, 9, 8, _slots(spec, 1, 2))
    data = next(f for f in newest.iterdir() if f.suffix == ".distcp")
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 1
    data.write_bytes(raw)
    with pytest.raises(disk.PersistError, match="sha256"):
        checkpoint_load.verify(newest)
    got = checkpoint_load.latest_valid(tmp_path / "part1")
    assert got.meta["iteration"] == 8
    assert older.exists()  # keep=3: 6, 8, 9 all kept


def test_keep_prunes_old_checkpoints(tmp_path):
    spec = make_spec()
    for it in range(1, 6):
        persist.save(tmp_path, spec, 0, it, it, _slots(spec, 0, it), keep=2)
    assert disk.list_iterations(tmp_path / "part0") == [4, 5]


def test_prune_keeps_newest_iteration_every_partition_holds(tmp_path):
    spec = make_spec()  # two partitions
    saved = {p: {} for p in (0, 1)}
    for it in range(1, 6):
        for p in (0, 1):
            saved[p][it] = _slots(spec, p, 100 * p + it)
            persist.save(tmp_path, spec, p, it, it, saved[p][it], keep=3)
    # partition 1 stalls at 5; partition 0 goes on to 20 with keep=3: it keeps the newest
    # 3, the common 5 and the 3 that partition 1 writes next (6, 7, 8)
    for it in range(6, 21):
        saved[0][it] = _slots(spec, 0, it)
        persist.save(tmp_path, spec, 0, it, it, saved[0][it], keep=3)
    assert disk.list_iterations(tmp_path / "part0") == [5, 6, 7, 8, 18, 19, 20]
    assert disk.list_iterations(tmp_path / "part1") == [3, 4, 5]
    assert checkpoint_load.newest_common(tmp_path, 2) == 5
    # three steps: partition 0's newest differs from its iteration 5; load; equal to it
    assert not np.array_equal(saved[0][20]["param"], saved[0][5]["param"])
    full = checkpoint_load.load_full_state(tmp_path)
    assert full.iteration == 5 and full.step == 5
    for p in (0, 1):
        a, b = spec.bounds(p)
        for s in spec.slots:
            assert np.array_equal(full.slots[s][a:b], saved[p][5][s]), (p, s)
    _m, _o, it = checkpoint_load.load_full(tmp_path)
    assert it == 5
    # partition 1 catches up at 20: 20 becomes the shared point and 5 may go
    persist.save(tmp_path, spec, 1, 20, 20, _slots(spec, 1, 120), keep=3)
    assert disk.list_iterations(tmp_path / "part1") == [4, 5, 20]
    persist.save(tmp_path, spec, 0, 21, 21, _slots(spec, 0, 21), keep=3)
    assert disk.list_iterations(tmp_path / "part0") == [19, 20, 21]
    assert checkpoint_load.load_full(tmp_path)[2] == 20


def test_prune_without_all_sibling_dirs_applies_keep_only(tmp_path):
    spec = make_spec(partitions=3)
    for it in range(1, 6):
        for p in (0, 1):  # part2 does not exist yet: nothing is held by all
            persist.save(tmp_path, spec, p, it, it, _slots(spec, p, it), keep=2)
    assert checkpoint_load.newest_common(tmp_path, 3) is None
    assert disk.list_iterations(tmp_path / "part0") == [4, 5]
    assert persist.prune(tmp_path / "part0", 1, 3) == [4]
    assert disk.list_iterations(tmp_path / "part0") == [5]


def test_crash_mid_write_keeps_previous_checkpoint(tmp_path, monkeypatch):
    import torch.distributed.checkpoint as dcp

    spec = make_spec()
    first = _slots(spec, 0, 0)
    persist.save(tmp_path, spec, 0, 4, 4, first)
    real_save = dcp.save

    def dying_save(sd, storage_writer, **kw):  # writes part of the files, then "dies"
        real_save(sd, storage_writer=storage_writer, **kw)
        (Path(storage_writer.path) / ".metadata").write_bytes(b"torn")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(dcp, "save", dying_save)
    with pytest.raises(disk.PersistError, match="No space left on device"):
        persist.save(tmp_path, spec, 0, 6, 6, _slots(spec, 0, 1))
    pdir = tmp_path / "part0"
    assert [e.name for e in pdir.iterdir() if e.name.startswith(".tmp")] == []
    ck = checkpoint_load.latest_valid(pdir)
    assert ck.meta["iteration"] == 4 and np.array_equal(ck.slots["param"], first["param"])

    # a process killed mid-write leaves a temp dir behind: ignored, then cleaned at start
    junk = pdir / ".tmp-iter-000000000006-1-1"
    junk.mkdir()
    (junk / "__0_0.distcp").write_bytes(b"partial")
    assert checkpoint_load.latest_valid(pdir).meta["iteration"] == 4
    assert persist.clean_temp(pdir) == [junk.name] and not junk.exists()


def test_unwritable_directory_is_reported_and_receive_goes_on(tmp_path):
    blocker = tmp_path / "afile"
    blocker.write_text("not a directory")
    c = Cluster(make_spec(partitions=1), dir=str(blocker / "ckpt"), persist_every=1)
    try:
        c.seed(1)
        for it in (1, 2, 3):
            g = c.rng.standard_normal(c.spec.total).astype(np.float32)
            c.send(it, g)
        sts = c.wait(lambda sts: sts[0]["latest"] == 3 and sts[0]["persist"]["errors"] >= 2)
        p = sts[0]["persist"]
        assert "cannot create checkpoint directory" in p["error"]
        assert "Not a directory" in p["error"] and p["written"] == 0
        assert p["last_iteration"] is None
    finally:
        c.close()


def test_two_partitions_load_into_torch_model_and_adamw_in_fresh_process(tmp_path):
    torch.manual_seed(0)
    net = TinyNet()
    opt = torch.optim.AdamW(tiny_net_groups(net), lr=1e-3)
    from checkmate.spec.model import ModelSpec

    # flat order differs from module order on purpose (the trainer's bucket order)
    order = ["out.weight", "out.bias", "bn.weight", "bn.bias", "fc.weight", "fc.bias",
             "emb.weight"]
    spec = ModelSpec.from_torch(JOB, net, opt, 2, order=order)
    c = Cluster(spec, dir=str(tmp_path), persist_every=2)
    try:
        c.flat = spec.flat_from_state_dicts(net.state_dict(), None)
        c.ref.load(c.flat, 0)
        c.seed(2)
        lrs = [1e-3, 2e-3]
        for it in range(1, 6):
            g = c.rng.standard_normal(spec.total).astype(np.float32)
            with torch.no_grad():
                net.bn.running_mean.add_(0.5)
                net.bn.num_batches_tracked.add_(1)
            bufs = spec.encode_buffers(dict(net.named_buffers()))
            body = control_body(it, lrs, 0.8, False, bufs, {"data_pos": it * 32})
            for p, n in enumerate(c.nodes):
                a, b = spec.bounds(p)
                for d in [*grad_datagrams(JOB, it, p, a, g[a:b], chunk=64),
                          *control_datagrams(JOB, it, body, frag=100, partition=p)]:
                    c.tx.sendto(d, ("127.0.0.1", n.udp_port))
            c.ref.step(g, lrs, 0.8)
            if it == 4:
                ref4 = c.ref.snapshot()
                bufs4 = spec.decode_buffers(bufs)
        c.wait(lambda sts: all(s["latest"] == 5 and s["persist"]["last_iteration"] == 4
                               for s in sts))
    finally:
        c.close()
    ref_m, ref_o = spec.state_dicts(ref4, 4, bufs4, lrs)
    torch.save({"model": ref_m, "optim": ref_o}, tmp_path / "ref.pt")
    script = textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from fakes import TinyNet, tiny_net_groups
        from checkmate.shadow.checkpoint_load import load_full
        model_sd, optim_sd, it = load_full({str(tmp_path)!r})
        net = TinyNet()
        opt = torch.optim.AdamW(tiny_net_groups(net), lr=1e-3)
        net.load_state_dict(model_sd, strict=True)
        opt.load_state_dict(optim_sd)
        ref = torch.load({str(tmp_path / 'ref.pt')!r})
        ok = all(torch.equal(v, ref["model"][k]) for k, v in net.state_dict().items())
        osd = opt.state_dict()
        ok &= osd["state"].keys() == ref["optim"]["state"].keys() and len(osd["state"]) == 7
        for i, st in osd["state"].items():
            ok &= st.keys() == ref["optim"]["state"][i].keys()
            ok &= all(torch.equal(st[k], ref["optim"]["state"][i][k]) for k in st)
        ok &= [g["lr"] for g in osd["param_groups"]] == [1e-3, 2e-3]
        net.train()
        x = torch.randint(0, 13, (4,))
        net.out(net.bn(net.fc(net.emb(x)))).sum().backward()
        opt.step()  # the restored optimizer keeps training
        print("RESULT", it, bool(ok), int(net.bn.num_batches_tracked))
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert "RESULT 4 True 5" in r.stdout, r.stdout + r.stderr
    meta = json.loads((tmp_path / "part1" / "iter-000000000004" / "ckm.json").read_text())
    assert meta["extra"] == {"data_pos": 128} and meta["step"] == 4


def test_time_based_persistence(tmp_path):
    c = Cluster(make_spec(partitions=1), dir=str(tmp_path), persist_seconds=0.5)
    try:
        c.seed(1)
        c.wait(lambda sts: sts[0]["seeded"])
        t0 = time.monotonic()
        for it in (1, 2, 3, 4):
            c.send(it, c.rng.standard_normal(c.spec.total).astype(np.float32))
        c.wait(lambda sts: sts[0]["latest"] == 4)
        fast = time.monotonic() - t0 < 0.5  # all four within one period (usual case)
        time.sleep(0.6)
        c.send(5, c.rng.standard_normal(c.spec.total).astype(np.float32))
        sts = c.wait(lambda sts: sts[0]["persist"]["last_iteration"] == 5)
        its = disk.list_iterations(tmp_path / "part0")
        assert its[-1] == 5
        if fast:  # at most one of iterations 0..4 was due, then 5 after the pause
            assert sts[0]["persist"]["written"] <= 2 and len(its) <= 2
    finally:
        c.close()


def test_a_partition_ahead_never_deletes_what_a_lagging_one_writes_next(tmp_path):
    """Issue 35 item 5: partition 0 runs ahead (5..25, keep 3) while partition 1 holds 0 and
    5. Before, partition 0 kept only [0, 15, 20, 25] besides the common 0/5, so when
    partition 1 wrote 10 no iteration but the seed's was common. Now every write of the
    lagging partition becomes the newest common one."""
    spec = make_spec()  # two partitions
    for it in (0, 5):
        for p in (0, 1):
            persist.save(tmp_path, spec, p, it, it + 1, _slots(spec, p, it), keep=3)
    for it in (10, 15, 20, 25):
        persist.save(tmp_path, spec, 0, it, it + 1, _slots(spec, 0, it), keep=3)
    assert disk.list_iterations(tmp_path / "part0") == [5, 10, 15, 20, 25]
    for it in (10, 15, 20, 25):
        persist.save(tmp_path, spec, 1, it, it + 1, _slots(spec, 1, it), keep=3)
        assert checkpoint_load.newest_common(tmp_path, 2) == it
    assert checkpoint_load.load_full_state(tmp_path).iteration == 25
    # caught up: the keep rule alone applies again
    persist.save(tmp_path, spec, 0, 30, 30, _slots(spec, 0, 30), keep=3)
    assert disk.list_iterations(tmp_path / "part0") == [20, 25, 30]


def test_an_empty_sibling_dir_holds_the_oldest_it_will_write(tmp_path):
    spec = make_spec()
    (tmp_path / "part1").mkdir()  # partition 1 started, has written nothing yet
    for it in range(1, 8):
        persist.save(tmp_path, spec, 0, it, it, _slots(spec, 0, it), keep=2)
    assert disk.list_iterations(tmp_path / "part0") == [1, 2, 6, 7]
    persist.save(tmp_path, spec, 1, 1, 1, _slots(spec, 1, 1), keep=2)
    assert checkpoint_load.newest_common(tmp_path, 2) == 1


class _Partition:
    """A real ShadowState stepping a real AdamW partition, its Persister wired as
    ShadowNode wires it (every commit goes to ``Persister.on_commit``)."""

    def __init__(self, root: Path, spec, p: int, every: int, keep: int) -> None:
        from checkmate.shadow.state import ShadowState
        self.spec, self.p = spec, p
        self.a, self.b = spec.bounds(p)
        self.state = ShadowState(p, spec.partitions, JOB, retain=16)
        self.state.set_spec(spec)
        self.per = persist.Persister(root, p, self.state, every=every, keep=keep)
        self.state.on_commit = self.per.on_commit
        self.state.after_commit = self.per.wait_room
        arrays = {s: np.zeros(self.b - self.a, np.float32) for s in spec.slots}
        self.state.install(0, 0, arrays)

    def step(self, it: int) -> None:
        from checkmate.shadow.control_message import Control
        g = np.random.default_rng(1000 * self.p + it).standard_normal(self.b - self.a)
        lrs = [0.01] * len(self.spec.groups)
        self.state.apply(it, g.astype(np.float32), Control(it, lrs, None, False, {}, {}))

    def close(self) -> None:
        self.per.stop()
        self.state.stop()


def test_a_slow_writer_skips_no_due_iteration_and_a_common_one_stays_recent(
        tmp_path, monkeypatch):
    """Real partitions, real DCP writes, the real schedule; partition 1's disk is slow (a
    write takes 3 commits' time and more). Every due iteration is written by both (the
    slow one's step waits instead of skipping), and after every commit -- any moment a
    correlated failure could strike -- the newest iteration both hold on disk is at most
    (backlog + 1) * every iterations old (docs/reliability.md)."""
    every, keep, backlog, last = 2, 2, 2, 24
    real_save = persist.save

    def slow_save(root, spec, partition, *a, **kw):
        if partition == 1:
            time.sleep(0.15)
        return real_save(root, spec, partition, *a, **kw)

    monkeypatch.setattr(persist, "save", slow_save)
    spec = make_spec()
    parts = [_Partition(tmp_path, spec, p, every, keep) for p in (0, 1)]
    try:
        assert parts[0].per.backlog == backlog
        ages = []
        for it in range(1, last + 1):
            time.sleep(0.01)  # the trainers' pace: partition 0's disk keeps up
            for part in parts:
                part.step(it)
            if it < (backlog + 1) * every:
                continue  # the seed's write (iteration 0) may still be under way
            common = checkpoint_load.newest_common(tmp_path, 2)
            assert common is not None, it
            ages.append(it - common)
            assert it - common <= (backlog + 1) * every, (it, common, [
                disk.list_iterations(tmp_path / f"part{p}") for p in (0, 1)])
        st = [part.per.status() for part in parts]
        assert st[1]["waits"] > 0 and st[1]["waited_seconds"] > 0  # the slow one waited
        assert max(ages) > every  # and its disk did lag
    finally:
        for part in parts:
            part.close()
    due = last // every + 1  # 0 (the seed), 2, 4, ..., last
    for part in parts:
        s = part.per.status()
        assert s["written"] == due and s["errors"] == 0, s
    assert checkpoint_load.newest_common(tmp_path, 2) == last
    assert disk.list_iterations(tmp_path / "part1")[-keep:] == [last - every, last]
