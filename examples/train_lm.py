"""A small causal language model with tied input/output embeddings, on any gradient path:

    checkmate launch --nproc-per-node 3 --shadows 2 --max-restarts 1 examples/train_lm.py
    checkmate launch ... examples/train_lm.py --path ddp     # torch's DistributedDataParallel
    checkmate launch ... examples/train_lm.py --path fsdp    # FSDP2 (fully_shard)

``lm_head.weight`` is ``emb.weight`` (as GPT-2 ties them): one parameter under two names,
which Checkmate keeps as one parameter and restores under both. Each step accumulates two
micro-batches (the first inside ``no_sync()`` where the path has one), with SGD nesterov
and a StepLR schedule. The model class needs only torch (the checkmate imports are inside
``main``), so a plain-torch program can import it to ``dcp.load`` the shadows' checkpoint.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from typing import Any

import torch
from torch import nn

VOCAB, WIDTH, CONTEXT = 48, 32, 12


class Block(nn.Module):
    """Pre-norm causal self-attention and MLP."""

    def __init__(self, width: int, heads: int = 2) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, dropout=0.1, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(),
                                 nn.Linear(2 * width, width), nn.Dropout(0.1))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        t = h.shape[1]
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool), diagonal=1)
        x = self.ln1(h)
        h = h + self.attn(x, x, x, attn_mask=mask, need_weights=False)[0]
        return h + self.mlp(self.ln2(h))


class TiedLM(nn.Module):
    """Token and position embeddings, one block, and an output layer tied to the input."""

    def __init__(self, vocab: int = VOCAB, width: int = WIDTH, context: int = CONTEXT) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(context, width)
        self.block = Block(width)
        self.ln = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.lm_head.weight = self.emb.weight  # the tie
        nn.init.normal_(self.emb.weight, std=0.02)  # GPT-2's initialization
        nn.init.normal_(self.pos.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens) + self.pos(torch.arange(tokens.shape[1]))
        return self.lm_head(self.ln(self.block(h)))


def batch(size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences whose next token follows from the current one (drawn from torch's RNG,
    which ``sess.begin`` reseeds per rank and iteration)."""
    start = torch.randint(VOCAB, (size, 1))
    seq = (start + 5 * torch.arange(CONTEXT + 1)) % VOCAB
    return seq[:, :-1], seq[:, 1:]


def main() -> None:
    import torch.distributed as dist

    from checkmate.optim import SGD

    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--path", choices=("own", "ddp", "fsdp"), default="own",
                    help="own: CheckmateSession; ddp: DistributedDataParallel + DDPSession; "
                         "fsdp: fully_shard + FSDPSession")
    ap.add_argument("--out", help="rank 0 saves the final (whole) state here (torch.save)")
    ap.add_argument("--sleep", type=float, default=0.0,
                    help="seconds per iteration (a test's time to kill something mid-run)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)  # every rank builds the same initial model
    model = TiedLM()
    wrapped: Any = model
    if args.path != "own":
        dist.init_process_group("gloo")
    if args.path == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(model, bucket_cap_mb=0.01)
    elif args.path == "fsdp":
        from torch.distributed.fsdp import fully_shard

        fully_shard(model.block)
        fully_shard(model)  # emb, pos, ln and the tied lm_head: the root's parameters
    optimizer = SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.7)
    if args.path == "own":
        from checkmate.train import CheckmateSession as Session
    elif args.path == "ddp":
        from checkmate.train import DDPSession as Session
    else:
        from checkmate.train import FSDPSession as Session
    sess = Session.from_env(wrapped, optimizer, scheduler, max_grad_norm=1.0)
    loss_fn = nn.CrossEntropyLoss()
    for it in range(sess.done_iteration + 1, args.steps + 1):
        sess.begin(it)
        x, y = batch(args.batch)
        h = args.batch // 2
        optimizer.zero_grad()
        # accumulation: the first micro-batch adds to the gradient without a reduction
        quiet = sess.model.no_sync() if args.path != "fsdp" else contextlib.nullcontext()
        with quiet:
            loss_fn(sess.model(x[:h]).flatten(0, 1), y[:h].flatten()).backward()
        loss = loss_fn(sess.model(x[h:]).flatten(0, 1), y[h:].flatten())
        loss.backward()
        sess.step(extra={"data": it})
        sess.report(loss)
        time.sleep(args.sleep)
    sess.finish()
    if args.out:  # FSDP2: gathering whole tensors is a collective, every rank takes part
        def full(v: object) -> object:
            return v.full_tensor() if hasattr(v, "full_tensor") else v
        osd = optimizer.state_dict()
        state = {"model": {k: full(v) for k, v in model.state_dict().items()},
                 "optimizer": {"state": {i: {k: full(v) for k, v in st.items()}
                                         for i, st in sorted(osd["state"].items())},
                               "param_groups": osd["param_groups"]},
                 "scheduler": scheduler.state_dict()}
        if sess.layout.rank == 0:
            torch.save(state, args.out)
    sess.close()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
