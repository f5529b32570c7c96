"""Placing co-located shadows at each rendezvous round (checkmate.launch.colocation, issue
38): three launchers' rounds over a real torch store, each starting real ``shadow serve``
processes on loopback. A node lost and another in its place: the survivors' shadows keep
running (same processes, same ports), the lost node's are placed on the newcomer, and the
list the workers read is the new one; a round that cannot hold the replicas keeps the
placement and says so; the handler torch's agent gets is torch's own c10d underneath."""

from __future__ import annotations

import io
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch.distributed as dist

from checkmate.errors import CheckmateError
from checkmate.launch.colocation import BACKEND, Colocation, use
from checkmate.launch.local_shadows import LocalShadows
from checkmate.train import env as envmod
from checkmate.train.shadow_client import ShadowClient


def _colocation(tmp: Path, node: str, ips: dict[str, str]) -> Colocation:
    def make(addrs: list, mine: list[int]) -> LocalShadows:
        return LocalShadows("", 4, tmp / node, replicas=2, addrs=addrs, mine=mine)

    return Colocation(node, ips, None, 2, 2, make, tmp / node / "shadows.json")


def _round(store: dist.Store, number: int, members: list[Colocation]) -> list[str]:
    """One rendezvous round of ``members`` (their ranks in this order), each on its node's
    own thread as each launcher is its own process (a launcher's shadows die with the
    thread that started them: PR_SET_PDEATHSIG); what each printed."""
    prefixed = dist.PrefixStore(f"round{number}", store)
    outs = [io.StringIO() for _ in members]
    runs = [_THREADS.setdefault(m.node, ThreadPoolExecutor(1)).submit(
        m.on_round, prefixed, rank, len(members), outs[rank])
        for rank, m in enumerate(members)]
    for r in runs:
        r.result(180)
    return [o.getvalue() for o in outs]


_THREADS: dict[str, ThreadPoolExecutor] = {}


def _answers(addr: tuple[str, int]) -> dict:
    with ShadowClient(addr, 10.0) as c:
        return c.status()


@pytest.mark.slow
def test_a_lost_nodes_shadows_are_placed_on_its_replacement_and_the_rest_keep_running(
        tmp_path, monkeypatch):
    monkeypatch.setenv(envmod.SHADOWS, "")  # the rounds write the launcher's environment
    monkeypatch.setenv(envmod.SHADOWS_UDP, "")
    monkeypatch.setenv(envmod.SHADOWS_FILE, "")
    net = f"127.86.{os.getpid() % 250 + 1}"
    ips = {"a": f"{net}.10", "b": f"{net}.11", "c": f"{net}.12"}
    store = dist.HashStore()
    a, b, c = (_colocation(tmp_path, n, ips) for n in "abc")
    try:
        said = _round(store, 1, [a, b])
        assert "partition 0: a, b\npartition 1: a, b" in said[0], said
        assert a.slots == b.slots and {s[0] for s in a.slots} == {"a", "b"}
        first = {i: p.pid for i, p in a.local.procs.items()}
        assert sorted(first) == [0, 1]
        for _n, ip, _u, tcp in a.slots:
            assert _answers((ip, tcp))["partition"] in (0, 1)
        b.stop()  # node b is lost with its shadows; c comes in
        said = _round(store, 2, [a, c])
        moved = ("the job's nodes are now a, c: placed 2 shadow(s) anew (partition 0 "
                 "replica 1: b -> c; partition 1 replica 1: b -> c)")
        assert moved in said[0] and moved in said[1], said
        assert a.slots == c.slots and a.gen == c.gen == 2
        assert {i: p.pid for i, p in a.local.procs.items()} == first  # kept running
        assert [s[0] for s in a.slots] == ["a", "a", "c", "c"]
        for i, (_n, ip, _u, tcp) in enumerate(a.slots):
            st = _answers((ip, tcp))
            assert (st["partition"], st["partitions"]) == (i % 2, 2)
        lists = json.loads((tmp_path / "a" / "shadows.json").read_text())
        job = envmod.read({**_worker_env(), envmod.SHADOWS_FILE: str(tmp_path / "a"
                                                                     / "shadows.json")})
        assert lists[envmod.SHADOWS] == envmod.format_addrs(a.tcp)
        assert job.shadow_tcp + [t for ts in job.replica_tcp for t in ts] == a.tcp  # read
        said = _round(store, 3, [a])  # c lost too: one node cannot hold two replicas
        assert "cannot place the replicas of c anew (2 replicas per partition need 2 " \
               "nodes, the job has 1 (a))" in said[0], said
        assert [s[0] for s in a.slots] == ["a", "a", "c", "c"] and a.gen == 2
    finally:
        for x in (a, b, c):
            x.stop()
        for pool in _THREADS.values():
            pool.shutdown()


def _worker_env() -> dict[str, str]:
    return {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", envmod.MODE: "host",
            envmod.REPLICAS: "2", envmod.TRAINERS: "127.0.0.1:47000",
            envmod.SHADOWS: "127.0.0.9:1,127.0.0.9:2,127.0.0.9:3,127.0.0.9:4"}


def test_a_bad_shadows_file_is_one_line(tmp_path):
    bad = tmp_path / "shadows.json"
    bad.write_text("{not json")
    with pytest.raises(CheckmateError, match=r"^CHECKMATE_SHADOWS_FILE .*: cannot read this "
                       r"round's shadows"):
        envmod.read({**_worker_env(), envmod.SHADOWS_FILE: str(bad)})
    with pytest.raises(CheckmateError, match="cannot read this round's shadows"):
        envmod.read({**_worker_env(), envmod.SHADOWS_FILE: str(tmp_path / "none")})


def test_two_nodes_of_one_name_are_refused_in_one_line(tmp_path):
    ips = {"a": "127.0.0.1"}
    store = dist.PrefixStore("r", dist.HashStore())
    store.set("checkmate/colocate/member/1", json.dumps(
        {"node": "a", "gen": 0, "slots": [], "placement": None}))
    with pytest.raises(CheckmateError, match=r"^two nodes of the job call themselves a "):
        _colocation(tmp_path, "a", ips).on_round(store, 0, 2, io.StringIO())


def test_the_handler_is_torchs_c10d_underneath():
    """What the agent gets answers as torch's c10d handler does (the run id, the nodes
    waiting) and names its own backend, as torch's registry requires."""
    from torch.distributed.elastic.rendezvous import (
        RendezvousParameters,
        rendezvous_handler_registry,
    )

    colo = Colocation("a", {"a": "127.0.0.1"}, None, 1, 1, None, Path("unused"))
    backend = use(colo, "c10d")
    assert backend == BACKEND
    handler = rendezvous_handler_registry.create_handler(RendezvousParameters(
        backend, "localhost:0", "ckm-test-run", 1, 1, "127.0.0.1", is_host="1"))
    try:
        assert handler.get_backend() == BACKEND
        assert handler.get_run_id() == "ckm-test-run"
        assert handler.num_nodes_waiting() == 0 and not handler.is_closed()
    finally:
        handler.shutdown()
