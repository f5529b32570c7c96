"""The resume point: memory first, then disk, across partitions.

The choice alone on holdings, then real shadow nodes on loopback (real UDP/TCP, real DCP
checkpoints): one shadow restarts from disk while the other runs on, so no iteration is in
every shadow's memory; the resume point comes from one partition's disk and the other's
memory, and equals the reference state bit for bit.
"""

from __future__ import annotations

import socket
import time

import numpy as np
import pytest
from shadow_cluster import Cluster, assert_state, make_spec, run_iterations

from checkmate.errors import CheckmateError
from checkmate.shadow.node import NodeOptions, ShadowNode
from checkmate.train import resume_point
from checkmate.train.resume_point import Holding, choose, spans
from checkmate.train.shadow_client import ShadowClient, restore_point


def _h(p, memory=(), disk=(), error=""):
    return Holding(p, ("10.0.0.1", 47001 + p), list(memory), list(disk), error)


def test_an_iteration_reloaded_from_disk_is_not_called_kept_in_memory():
    both = [Holding(0, ("10.0.0.1", 47001), [9], [8, 9], reloaded=9),
            Holding(1, ("10.0.0.1", 47002), [9, 10], [8])]
    pt = choose(both)
    assert pt.line == ("checkmate: resuming at iteration 9: every shadow holds it in memory "
                       "(partition(s) 0 reloaded it from disk at start)")
    both[0].reloaded = 7  # reloaded an older one, and has received 9 since
    assert choose(both).line.endswith("every shadow holds it in memory")


def test_choose_prefers_the_newest_common_iteration_memory_first():
    pt = choose([_h(0, [7, 8, 9]), _h(1, [8, 9, 10])])
    assert (pt.iteration, pt.sources) == (9, ["memory", "memory"])
    assert pt.line == "checkmate: resuming at iteration 9: every shadow holds it in memory"
    # Memory shares nothing: the newest iteration on both disks (or one memory, one disk).
    pt = choose([_h(0, [120, 121, 122, 123], [20, 25, 120]), _h(1, [25], [20, 25])])
    assert (pt.iteration, pt.sources) == (25, ["disk", "memory"])
    pt = choose([_h(0, [120, 121], [100, 110, 120]), _h(1, [25], [10, 20, 25, 110])])
    assert (pt.iteration, pt.sources) == (110, ["disk", "disk"])
    assert "partition 0 from disk (memory holds 120-121)" in pt.line
    assert "partition 1 from disk (memory holds 25)" in pt.line
    # An iteration in memory is read from memory even when the disk holds it too.
    pt = choose([_h(0, [20, 21], [20]), _h(1, [30], [10, 20])])
    assert (pt.iteration, pt.sources) == (20, ["memory", "disk"])


def test_choose_fails_only_when_there_is_nothing_and_says_what_is_missing():
    with pytest.raises(CheckmateError) as e:
        choose([_h(0, [5]), _h(1)])
    assert "partition 1 (10.0.0.1:47002) holds no state to restore" in str(e.value)
    assert "resume=False" in str(e.value)
    with pytest.raises(CheckmateError) as e:
        choose([_h(0, [5, 6], [4]), _h(1, [9], [8])])
    assert str(e.value) == (
        "resume: no iteration is held by every partition, in memory or on disk: "
        "partition 0 (10.0.0.1:47001) memory 5-6, disk 4; "
        "partition 1 (10.0.0.1:47002) memory 9, disk 8")
    with pytest.raises(CheckmateError) as e:
        choose([_h(0, [5]), _h(1, error="connection refused")])
    assert str(e.value) == ("resume: nothing to resume from: partition 1 (10.0.0.1:47002) "
                            "cannot be reached: connection refused")
    assert spans([9, 3, 4, 5, 11, 12]) == "3-5,9,11-12" and spans([]) == ""


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_restart_from_disk_while_the_other_runs_on_resumes_from_disk(tmp_path):
    spec = make_spec()
    c = Cluster(spec, dir=str(tmp_path), persist_every=2, keep=3, retain=2)
    fresh = None
    try:
        c.seed()
        # Each due iteration is written before the next is sent, so the disk holds each
        # one when the next step runs (a burst would only make the step wait for room
        # behind the writes, shadow/persist.py).
        grads: dict = {}
        for its in ((1, 2), (3, 4), (5, 6), (7,)):
            run_iterations(c, its, grads)
            c.wait(lambda sts, n=its[-1]: all(
                s["latest"] == n and s["persist"]["last_iteration"] == n - n % 2
                for s in sts))
        # Partition 1's shadow dies; partition 0's runs on to 11 (trainers kept training).
        c.nodes[1].stop()
        with ShadowClient(c.addrs[0]) as cl:
            for it in range(8, 12):
                grads[it] = c.rng.standard_normal(spec.total).astype(np.float32)
                c.send(it, grads[it], parts=[0], clip=0.5)
                c.step_ref(it, grads[it], 0.5)
                end = time.monotonic() + 15
                while cl.status()["persist"]["last_iteration"] != it - it % 2:
                    assert time.monotonic() < end, cl.status()
                    time.sleep(0.02)
        # ... and partition 1's comes back from its disk, at iteration 6.
        fresh = ShadowNode(NodeOptions(1, 2, spec.job, bind="127.0.0.1", port=0,
                                       restore_bind="127.0.0.1", restore_port=0,
                                       dir=str(tmp_path), persist_every=2, keep=3,
                                       retain=2)).start()
        addrs = [c.addrs[0], ("127.0.0.1", fresh.tcp_port)]
        hs = resume_point.ask(addrs)
        # (keep=3: partition 0 holds 6, 8, 10 -- 6 also as the newest iteration both hold.)
        assert [h.memory for h in hs] == [[10, 11], [6]], hs
        assert [h.reloaded for h in hs] == [None, 6], hs  # what it holds came from disk
        assert {6, 10} <= set(hs[0].disk) and max(hs[1].disk) == 6, hs
        pt = choose(hs)
        assert (pt.iteration, pt.sources) == (6, ["disk", "memory"]), pt
        assert pt.line == ("checkmate: resuming at iteration 6: partition 0 from disk "
                           "(memory holds 10-11), partition 1 from memory (reloaded from "
                           "disk at start); no newer iteration is held by every partition")
        r = restore_point(addrs, spec, pt.iteration, sources=pt.sources)
        assert r.iteration == 6 and r.extra == {"it": 6} and r.step == 6
        assert_state(spec, r.model_sd, r.optim_sd, c.refs[6], 6)
        # Memory alone has no common iteration: the old way fails here.
        with pytest.raises(CheckmateError, match="no iteration is retained by every"):
            restore_point(addrs, spec)
        # A disk fetch of an iteration the disk does not hold is one refusal line.
        with ShadowClient(addrs[0]) as cl, pytest.raises(CheckmateError) as e:
            cl.fetch(7, "disk")
        assert "\n" not in str(e.value) and "iter-000000000007" in str(e.value)
        # A partition nobody serves is named; an empty one too.
        with pytest.raises(CheckmateError, match="partition 1 .* cannot be reached"):
            choose(resume_point.ask([addrs[0], ("127.0.0.1", _closed_port())]))
        said: list[str] = []
        hs = resume_point.survey([addrs[0], ("127.0.0.1", _closed_port())], wait=0.6,
                                 say=said.append)
        assert hs[1].error and len(said) == 1 and "resume waits up to 1s" in said[0]
    finally:
        c.close()
        if fresh is not None:
            fresh.stop()


def test_restart_from_disk_far_behind_asks_for_a_reseed_at_once(tmp_path):
    """A shadow back from its disk whose trainers report progress more than its window
    ahead asks for the re-seed on that report (the restart starts it), not after a repair
    round answered "gone"."""
    spec = make_spec()
    c = Cluster(spec, dir=str(tmp_path), persist_every=2, window=4)
    fresh = None
    try:
        c.seed()
        run_iterations(c, range(1, 5))
        c.wait(lambda sts: all(s["persist"]["last_iteration"] == 4 for s in sts))
        c.nodes[1].stop()
        fresh = ShadowNode(NodeOptions(1, 2, spec.job, bind="127.0.0.1", port=0,
                                       restore_bind="127.0.0.1", restore_port=0,
                                       dir=str(tmp_path), persist_every=2,
                                       window=4)).start()
        assert fresh.warm_seconds is None  # kernels compiled while installing from disk
        with ShadowClient(("127.0.0.1", fresh.tcp_port)) as cl:
            st = cl.request({"op": "status", "progress": 8})[0]  # within the window
            assert st["latest"] == 4 and st["reseed"]["wanted"] == "", st
            t0 = time.monotonic()
            st = cl.request({"op": "status", "progress": 9})[0]  # beyond it
            assert time.monotonic() - t0 < 1.0
            assert st["reseed"]["wanted"] == ("restarted from disk at iteration 4, the "
                                              "trainers are at 9"), st
    finally:
        c.close()
        if fresh is not None:
            fresh.stop()


def test_an_empty_shadow_compiles_its_kernels_at_start():
    spec = make_spec()
    n = ShadowNode(NodeOptions(0, 2, spec.job, bind="127.0.0.1", port=0,
                               restore_bind="127.0.0.1", restore_port=0)).start()
    try:
        end = time.monotonic() + 120
        while n.warm_seconds is None:
            assert time.monotonic() < end
            time.sleep(0.05)
        assert n.status()["warm_seconds"] == n.warm_seconds >= 0
    finally:
        n.stop()


def test_disk_fetch_refusals_are_one_line():
    spec = make_spec()
    c = Cluster(spec)  # no --dir
    try:
        c.seed()
        with ShadowClient(c.addrs[0]) as cl:
            h = cl.holdings()
            assert (h["memory"], h["disk"], h["dir"]) == ([0], [], None)
            for source, msg in (("disk", "persists nothing (no --dir)"),
                                ("tape", "fetch 'source' must be memory or disk")):
                with pytest.raises(CheckmateError) as e:
                    cl.fetch(0, source)
                assert msg in str(e.value) and "\n" not in str(e.value)
            assert cl.fetch(0).iteration == 0  # the connection stays usable
    finally:
        c.close()


def test_a_restart_resumes_only_from_a_trained_iteration_else_seeds_anew(monkeypatch,
                                                                          capsys):
    from checkmate.train import session_resume

    def holdings(*hs):
        monkeypatch.setattr(resume_point, "survey", lambda addrs: list(hs))

    holdings(_h(0, memory=[0]), _h(1))  # died while seeding: partition 1 never seeded
    assert session_resume._any_seeded([[]]) is False
    assert "hold no trained iteration" in capsys.readouterr().out
    holdings(_h(0), _h(1))
    assert session_resume._any_seeded([[]]) is False
    assert "no shadow was seeded" in capsys.readouterr().out
    holdings(_h(0, memory=[0, 1]), _h(1, disk=[0]))  # a trained iteration: resume (and a
    assert session_resume._any_seeded([[]]) is True    # resume that cannot is one line)
    holdings(_h(0, error="refused"), _h(1, error="refused"))
    with pytest.raises(CheckmateError, match="cannot ask the shadows whether to resume"):
        session_resume._any_seeded([[]])


def test_replicas_of_a_partition_serve_what_any_of_them_holds():
    """Two replicas per partition: a partition whose first replica is gone, or lags, is
    served by its sibling; a partition none of whose replicas answers is an error naming
    each."""
    a, b = ("10.0.0.1", 1), ("10.0.0.2", 1)
    set0 = [Holding(0, a, error="refused"), Holding(1, a, memory=[5, 6, 7])]
    set1 = [Holding(0, b, memory=[6, 7, 8], disk=[4]), Holding(1, b, memory=[5, 6])]
    merged = resume_point.merge_replicas([set0, set1])
    assert [h.error for h in merged] == ["", ""]
    assert merged[0].memory == [6, 7, 8] and merged[0].disk == [4] and merged[0].addr == b
    assert merged[1].memory == [5, 6, 7] and merged[1].addr == a
    point = choose(merged)
    assert point.iteration == 7 and point.sources == ["memory", "memory"]
    assert resume_point.replica_for([set0, set1], 0, 7) == (b, "memory")
    assert resume_point.replica_for([set0, set1], 1, 7) == (a, "memory")
    assert resume_point.replica_for([set0, set1], 0, 4) == (b, "disk")
    with pytest.raises(CheckmateError, match="no replica of partition 1 holds iteration 9"):
        resume_point.replica_for([set0, set1], 1, 9)
    gone = resume_point.merge_replicas([[Holding(0, a, error="refused")],
                                        [Holding(0, b, error="timed out")]])
    assert gone[0].error == "replica 0 (10.0.0.1:1): refused; replica 1 (10.0.0.2:1): " \
                            "timed out"
