"""The shadows' persisted checkpoint loads with plain torch: a real training run (one trainer,
gloo, host replication) against two real ``shadow serve --dir`` processes, then a fresh
Python that cannot import checkmate ``dcp.load``s the joined checkpoint into a plain
``model.state_dict()``, a torch.optim.AdamW state_dict and a LambdaLR state_dict, and must
match the trainer bit for bit. The partition boundary cuts the 4-D conv weight off a row
boundary, so its two pieces are stored as several rectangular chunks."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from fakes import free_port

from checkmate.config import cluster as cfgmod
from checkmate.optim import AdamW
from checkmate.train import CheckmateSession, JobLayout, ShadowTarget

pytestmark = pytest.mark.slow

STEPS = 4
EVERY = 2

# The model and param groups, as plain torch; the parent executes the same text.
MODEL = textwrap.dedent("""
    import torch

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 8, 3, padding=1, bias=False)
            self.bn = torch.nn.BatchNorm2d(8)
            self.fc = torch.nn.Linear(8, 4)

        def forward(self, x):
            h = torch.relu(self.bn(self.conv(x)))
            return self.fc(h.mean((2, 3)))

    def groups(m):
        return [{"params": [m.conv.weight, m.fc.weight], "weight_decay": 0.05},
                {"params": [m.bn.weight, m.bn.bias, m.fc.bias], "weight_decay": 0.0,
                 "lr": 2e-3}]

    def warmup(step):
        return min(1.0, (step + 1) / 3)
""")
_ns: dict = {}
exec(MODEL, _ns)  # noqa: S102 - our own constant text, shared with the subprocess
Net, groups, warmup = _ns["Net"], _ns["groups"], _ns["warmup"]


@pytest.fixture
def persisting_shadows(tmp_path: Path, serve_shadows) -> Iterator[tuple[str, list[str], Path]]:
    """Two real shadows (0/2, 1/2) persisting every EVERY iterations into one shared dir."""
    net = f"127.82.{random.randrange(1, 255)}"
    ckpt = tmp_path / "ckpt"
    with serve_shadows([f"{net}.100", f"{net}.101"], "--dir", str(ckpt),
                       "--persist-every", str(EVERY)) as ips:
        yield net, ips, ckpt


def _train(net: str, ips: list[str]) -> tuple[torch.nn.Module, AdamW, object]:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = Net()
        opt = AdamW(groups(model), lr=1e-3)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup)
        layout = JobLayout(
            job_id=7, rank=0, world=1, trainers=[(f"{net}.10", cfgmod.TRAINER_PORT)],
            shadows=[ShadowTarget(p, ip, cfgmod.SHADOW_PORT) for p, ip in enumerate(ips)],
            shadow_tcp=[(ip, cfgmod.RESTORE_PORT) for ip in ips], mode="host", seed=3)
        sess = CheckmateSession(model, opt, sched, layout, max_grad_norm=1.0)
        assert sess.start() == 0
        g = torch.Generator().manual_seed(1)
        for it in range(1, STEPS + 1):
            sess.begin(it)
            x, y = torch.randn(6, 3, 6, 6, generator=g), torch.randint(0, 4, (6,), generator=g)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(sess.model(x), y).backward()
            sess.step(extra={"data_pos": it * 6})
        assert sess.finish(timeout=30)["newest_consistent"] == STEPS
        sess.close()
    finally:
        dist.destroy_process_group()
    return model, opt, sched


LOADER = textwrap.dedent("""
    import sys
    try:
        import checkmate  # noqa: F401
        sys.exit("checkmate is importable here")
    except ModuleNotFoundError:
        pass
    sys.path.append(TORCH_SITE)
    import torch
    import torch.distributed.checkpoint as dcp
    exec(MODEL)
    torch.manual_seed(123)  # not the trainer's initial weights
    model = Net()
    opt = torch.optim.AdamW(groups(model), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup)
    params = [p for g in opt.param_groups for p in g["params"]]
    osd = opt.state_dict()  # torch keeps no state before a step: give it the slots to fill
    osd["state"] = {i: {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                        "exp_avg_sq": torch.zeros_like(p)} for i, p in enumerate(params)}
    sd = {"model": model.state_dict(), "optim": osd, "scheduler": sched.state_dict(),
          "extra": {"data_pos": 0}}
    root = CKPT
    dcp.load(sd, checkpoint_id=f"{root}/{open(root + '/latest').read().strip()}")
    model.load_state_dict(sd["model"])
    opt.load_state_dict(sd["optim"])
    sched.load_state_dict(sd["scheduler"])
    torch.save({"model": model.state_dict(), "optim": opt.state_dict(),
                "scheduler": sched.state_dict(), "extra": sd["extra"]}, OUT)
    model.train()
    model(torch.randn(2, 3, 6, 6)).sum().backward()
    opt.step()  # the loaded optimizer trains on
    sched.step()
    print("LOADED", "checkmate" in sys.modules)
""")


def test_plain_torch_dcp_load_of_the_shadow_checkpoint_matches_the_trainer(
        persisting_shadows, tmp_path):
    net, ips, ckpt = persisting_shadows
    model, opt, sched = _train(net, ips)
    name = f"iter-{STEPS:012d}"
    deadline = time.monotonic() + 60
    while not (ckpt / "latest").is_file() or (ckpt / "latest").read_text().strip() != name:
        assert time.monotonic() < deadline, sorted(os.listdir(ckpt)) if ckpt.exists() else []
        time.sleep(0.1)
    ref = {"model": model.state_dict(), "optim": opt.state_dict(),
           "scheduler": sched.state_dict()}
    torch.save(ref, tmp_path / "expected.pt")

    # the boundary lies inside the conv weight, off a row: partial rows are own chunks
    md = dcp.FileSystemReader(ckpt / name).read_metadata()
    conv = md.state_dict_metadata["model.conv.weight"]
    assert tuple(conv.size) == (8, 3, 3, 3) and len(conv.chunks) >= 3, conv.chunks
    assert {p.name for p in (ckpt / name).iterdir() if p.suffix == ".distcp"} == {
        "part0-__0_0.distcp", "part1-__0_0.distcp"}

    work = tmp_path / "plain"  # the subprocess's cwd and sys.path[0]: no checkmate there
    work.mkdir()
    script = (f"TORCH_SITE = {str(Path(torch.__file__).parents[1])!r}\n"
              f"MODEL = {MODEL!r}\nCKPT = {str(ckpt)!r}\n"
              f"OUT = {str(tmp_path / 'loaded.pt')!r}\n" + LOADER)
    # -S: no site-packages, so neither the editable install of checkmate nor its .pth hook
    r = subprocess.run([sys.executable, "-S", "-c", script], cwd=work, capture_output=True,
                       text=True, timeout=120, env={"PATH": os.environ.get("PATH", "")})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "LOADED False" in r.stdout, r.stdout + r.stderr

    got = torch.load(tmp_path / "loaded.pt")
    exp = torch.load(tmp_path / "expected.pt")
    assert got["model"].keys() == exp["model"].keys()
    for k, v in exp["model"].items():
        assert v.dtype == got["model"][k].dtype and torch.equal(v, got["model"][k]), k
    assert got["optim"]["state"].keys() == exp["optim"]["state"].keys() == set(range(5))
    for i, st in exp["optim"]["state"].items():
        assert st.keys() == got["optim"]["state"][i].keys(), i
        for slot, t in st.items():
            assert torch.equal(t, got["optim"]["state"][i][slot]), (i, slot)
    for ge, gg in zip(exp["optim"]["param_groups"], got["optim"]["param_groups"], strict=True):
        for k in ("lr", "initial_lr", "weight_decay", "eps", "amsgrad", "params"):
            assert ge[k] == gg[k], k
        assert tuple(ge["betas"]) == tuple(gg["betas"])
    assert got["scheduler"] == exp["scheduler"]
    assert got["extra"] == {"data_pos": STEPS * 6}
    # a fresh model really changed: the loaded weights are not its own initial ones
    torch.manual_seed(123)
    assert not torch.equal(Net().conv.weight, got["model"]["conv.weight"])
