"""checkmate.train.session_group: which group a session is in and where its ranks are, on a
real two-process gloo group over loopback."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch.multiprocessing as mp

from checkmate.errors import CheckmateError
from checkmate.train.session_group import exchange_addrs

BASE_PORT = 29_100  # ring ports only named, never bound


def _rank(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from checkmate.train.layout import JobLayout
    from checkmate.train.replicate import ShadowTarget
    from checkmate.train.session_group import (
        exchange_addrs,
        gather_nodes,
        join_group,
        ring_addrs,
    )

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.pop("LOCAL_RANK", None)
    os.environ.pop("RANK", None)
    os.environ["GROUP_RANK"] = str(rank)  # two nodes of one rank each
    job = SimpleNamespace(device="cpu", rank=rank, world=2, trainers=None,
                          local_trainer=("127.0.0.1", BASE_PORT + rank))
    got: dict = {}
    group = join_group(job)
    got["initialized"] = dist.is_initialized()
    got["backend"] = dist.get_backend()
    got["group_is_default"] = group is None
    got["addrs"] = ring_addrs(job, group)
    # the launcher's own list is taken as it is: nothing is exchanged
    given = [("10.0.0.1", 1), ("10.0.0.2", 2)]
    got["given"] = ring_addrs(SimpleNamespace(**{**vars(job), "trainers": given}), group)
    try:
        exchange_addrs(("127.0.0.1", BASE_PORT), 2, group)  # both ranks claim one address
        got["dup"] = None
    except CheckmateError as e:
        got["dup"] = str(e)
    lay = JobLayout(job_id=1, rank=rank, world=2, trainers=got["addrs"], shadows=[],
                    shadow_tcp=[], mode="off")
    got["nodes"] = gather_nodes(lay, group)
    lay.node_of = [5, 5]
    got["nodes_from_layout"] = gather_nodes(lay, group)
    # switch mode: two nodes behind one address would tag hops the switch never sees
    switch = JobLayout(job_id=1, rank=rank, world=2, trainers=got["addrs"],
                       shadows=[ShadowTarget(0, "127.0.0.1", 1)],
                       shadow_tcp=[("127.0.0.1", 2)], mode="switch")
    try:
        gather_nodes(switch, group)
        got["switch"] = None
    except CheckmateError as e:
        got["switch"] = str(e)
    switch.node_of = [3, 3]  # one node: allowed
    got["switch_one_node"] = gather_nodes(switch, group)
    # every rank must be given the same shadows (each node's launcher computes its own list)
    from checkmate.train.session_group import check_same_shadows

    check_same_shadows(switch, group)  # the same on both: nothing to say
    other = JobLayout(job_id=1, rank=rank, world=2, trainers=got["addrs"],
                      shadows=[ShadowTarget(0, "127.0.0.1", 1)],
                      shadow_tcp=[("127.0.0.1", 2 + rank)], mode="host")
    try:
        check_same_shadows(other, group)
        got["shadows_differ"] = None
    except CheckmateError as e:
        got["shadows_differ"] = str(e)
    del os.environ["GROUP_RANK"]
    lay.node_of = None
    got["nodes_unknown"] = gather_nodes(lay, group)
    dist.destroy_process_group()
    Path(out, f"rank{rank}.json").write_text(json.dumps(got))


@pytest.mark.slow
def test_two_ranks_join_one_gloo_group_and_agree_on_addresses_and_nodes(tmp_path):
    from fakes import free_port

    mp.spawn(_rank, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for g in got:
        assert g["initialized"] and g["backend"] == "gloo" and g["group_is_default"]
        assert g["addrs"] == [["127.0.0.1", BASE_PORT], ["127.0.0.1", BASE_PORT + 1]]
        assert g["given"] == [["10.0.0.1", 1], ["10.0.0.2", 2]]
        assert g["dup"] == (f"two ranks of the job share the ring address 127.0.0.1:"
                            f"{BASE_PORT}: give each node its own --worker-ip")
        assert g["nodes"] == [0, 1]
        assert g["nodes_from_layout"] == [5, 5]
        assert g["switch"] is not None and g["switch"].startswith(
            "ranks 0 and 1 share the address 127.0.0.1 but are on nodes 0 and 1:")
        assert g["switch_one_node"] == [3, 3]
        assert g["nodes_unknown"] is None
        assert g["shadows_differ"] == (
            "rank 1 was given other shadows than rank 0 (replica 0 of partition 0: "
            "127.0.0.1:2 on rank 0, 127.0.0.1:3 on rank 1): start every node's launcher "
            "with the same --shadow, --colocate and --domain")


def test_a_worker_without_a_ring_address_is_one_line():
    with pytest.raises(CheckmateError, match="^no ring address for this worker: the launcher "
                       "sets CHECKMATE_TRAINERS or CHECKMATE_LOCAL_TRAINERS$"):
        exchange_addrs(None, 2, None)
