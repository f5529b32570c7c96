"""FSDP2 (``fully_shard``) on CPU with gloo, as torch 2.13 runs it: what Checkmate would build on.

Two real processes on loopback. The test shows the facts the FSDP2 design in
docs/architecture.md relies on -- FSDP2 trains here; every parameter and gradient is a
DTensor sharded on dim 0; each rank's gradient shard is one contiguous range of the
parameter's flat (row-major) layout, the ranks' ranges are disjoint and cover it, and the
shards are the reduced (mean) gradient -- and that a Checkmate session over an FSDP2 model is
refused with one CheckmateError line (not supported yet) instead of crashing or drifting.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.slow


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 5))  # 5 rows: 3 + 2


def _worker() -> int:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Shard

    from checkmate.errors import CheckmateError
    from checkmate.optim import AdamW
    from checkmate.train import CheckmateSession, DDPSession, JobLayout, ShadowTarget

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    out: dict = {"rank": rank, "params": {}}
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    # the reduced gradient an unsharded data-parallel job would use: mean over ranks
    ref = _model()
    ref(x).square().sum().backward()
    for p in ref.parameters():
        dist.all_reduce(p.grad)
        p.grad.div_(world)
    m = _model()
    fully_shard(m)
    m(x).square().sum().backward()
    for (name, p), q in zip(m.named_parameters(), ref.parameters(), strict=True):
        g = p.grad
        local = g.to_local()
        rows = -(-p.shape[0] // world)  # torch.chunk: ceil-sized shards, the last smaller
        row = q[0].numel() if q.dim() > 1 else 1
        lo = min(rank * rows, p.shape[0]) * row
        want = q.grad.reshape(-1)[lo:lo + local.numel()]
        out["params"][name] = {
            "dtensor": isinstance(p, DTensor) and isinstance(g, DTensor),
            "shard0": tuple(g.placements) == (Shard(0),),
            "contiguous": local.is_contiguous(),
            "range": [lo, lo + local.numel()], "numel": q.numel(),
            "close_to_mean": bool(torch.allclose(local.reshape(-1), want, rtol=1e-5,
                                                 atol=1e-6)),
            "equal_to_mean": bool(torch.equal(local.reshape(-1), want)),
        }
    layout = JobLayout(job_id=7, rank=rank, world=world, trainers=[("127.0.0.1", 1)] * world,
                       shadows=[ShadowTarget(0, "127.0.0.1", 9)],
                       shadow_tcp=[("127.0.0.1", 9)], mode="host")
    opt = AdamW(m.parameters(), lr=1e-2)
    for cls in (CheckmateSession, DDPSession):
        try:
            cls(m, opt, None, layout)
            out[cls.__name__] = "accepted"
        except CheckmateError as e:
            out[cls.__name__] = str(e)
    print(json.dumps(out), flush=True)
    dist.destroy_process_group()
    return 0


def test_fsdp2_runs_on_cpu_gloo_and_a_checkmate_session_refuses_it_in_one_line():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, __file__], env={**env, "RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    res = []
    for p in procs:
        try:
            o, e = p.communicate(timeout=240)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
        assert p.returncode == 0, e[-2000:]
        res.append(json.loads(o.strip().splitlines()[-1]))
    names = list(res[0]["params"])
    assert names == ["0.weight", "0.bias", "2.weight", "2.bias"]
    for name in names:
        per = [r["params"][name] for r in res]
        assert all(v["dtensor"] and v["shard0"] and v["contiguous"] for v in per), name
        # rank 0 holds the front of the flat parameter, rank 1 the rest: disjoint, covering
        assert per[0]["range"][0] == 0 and per[0]["range"][1] == per[1]["range"][0]
        assert per[1]["range"][1] == per[0]["numel"], name
        assert all(v["close_to_mean"] for v in per), name
    assert res[0]["params"]["2.weight"]["range"] == [0, 48]  # 5 rows of 16: 3 on rank 0
    for r in res:
        for cls in ("CheckmateSession", "DDPSession"):
            msg = r[cls]
            assert "\n" not in msg
        assert "is a DTensor sharded" in r["CheckmateSession"]
        assert "FSDP2" in r["CheckmateSession"]
        assert "needs a torch DistributedDataParallel" in r["DDPSession"]


if __name__ == "__main__":
    sys.exit(_worker())
