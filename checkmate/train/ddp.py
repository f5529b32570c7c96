"""Data-parallel wrapper whose gradient buckets are allreduced over the ckm ring.

Why not torch's DistributedDataParallel with a comm hook: DDP rebuilds its buckets after the
first iteration in autograd's ready order, so the flat layout the shadows were seeded with
would change under them. Here the layout is fixed before iteration 1 and identical on every
rank and at the shadows:

- the flat gradient space is the parameters in ``order`` (the model spec's order), one
  contiguous fp32 buffer; each ``param.grad`` becomes a view into it;
- buckets are contiguous ranges of that buffer cut at parameter boundaries, numbered from
  the end of the model (its gradients are ready first), at least ``bucket_elems`` each.

A post-accumulate-grad hook counts each bucket's parameters; when the last one is ready the
bucket is divided by the world size and handed to the ring's communication thread, which
returns a ``torch.futures.Future``. Backward is never blocked per bucket: one callback queued
on the autograd engine waits for all futures when backward ends, as DDP's reducer does.

Gradient accumulation: backward passes inside ``with model.no_sync():`` only accumulate into
the local gradient (no allreduce, nothing replicated); the next backward outside it reduces
the sum, so each iteration is reduced exactly once and the shadows see exactly the gradient
the optimizer uses. Reducing a second time in one iteration (another backward outside
``no_sync`` before the next ``iteration``) would send the shadows two different gradients
for one step: it is a CheckmateError, raised as that backward begins.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from checkmate.errors import CheckmateError
from checkmate.train.ring import RingAllreduce
from checkmate.train.tensor_parallel import like, local

#: Default bucket size in elements (4 MiB of fp32).
BUCKET_ELEMS = 1 << 20


def bucket_ranges(sizes: list[int], bucket_elems: int) -> list[tuple[int, int, list[int]]]:
    """Buckets over parameters of ``sizes`` (flat order): ``(start, end, param indices)``.

    Filled from the last parameter backwards, so bucket 0 holds the end of the model.
    """
    offsets = [0]
    for n in sizes:
        offsets.append(offsets[-1] + n)
    buckets: list[tuple[int, int, list[int]]] = []
    cur: list[int] = []
    count = 0
    for i in reversed(range(len(sizes))):
        cur.append(i)
        count += sizes[i]
        if count >= bucket_elems:
            buckets.append((offsets[min(cur)], offsets[max(cur) + 1], sorted(cur)))
            cur, count = [], 0
    if cur:
        buckets.append((offsets[min(cur)], offsets[max(cur) + 1], sorted(cur)))
    return buckets


class CheckmateDDP(nn.Module):
    """Wrap ``module`` for data-parallel training over a ``RingAllreduce``.

    Args:
        module: the model; every rank must build it identically.
        ring: this rank's ring.
        order: parameter names in flat order (default: ``module.named_parameters()`` order).
        bucket_elems: minimum bucket size in elements.

    Set ``iteration`` before each backward (``CheckmateSession.begin`` does); datagrams of
    the step carry it so the shadows know which step a gradient belongs to. Each iteration
    is reduced once; accumulate over several backward passes with :meth:`no_sync`.
    """

    def __init__(self, module: nn.Module, ring: RingAllreduce, order: list[str] | None = None,
                 bucket_elems: int = BUCKET_ELEMS) -> None:
        super().__init__()
        self.module = module
        self.ring = ring
        self.world = ring.world
        named = dict(module.named_parameters())
        self.order = list(order) if order is not None else list(named)
        if sorted(self.order) != sorted(named):
            raise CheckmateError("order must name every parameter of the module once")
        params = [named[n] for n in self.order]
        if any(p.dtype != torch.float32 for p in params):
            raise CheckmateError("CheckmateDDP needs float32 parameters")
        # A tensor-parallel parameter (DTensor) is reduced as its local shard: the view is
        # the shard's, and its gradient a DTensor over that view, placed as the parameter.
        shards = [local(p) for p in params]
        sizes = [t.numel() for t in shards]
        self.total = sum(sizes)
        self.flat_grad = torch.zeros(self.total, dtype=torch.float32)
        self._views: list[torch.Tensor] = []
        #: What each parameter's ``grad`` is set to: its view, or a DTensor over the view.
        self._grads: list[torch.Tensor] = []
        off = 0
        for p, t, n in zip(params, shards, sizes, strict=True):
            view = self.flat_grad[off:off + n].view(t.shape)
            self._views.append(view)
            self._grads.append(like(p, view))
            off += n
        self._params = params
        self.buckets = bucket_ranges(sizes, bucket_elems)
        self._bucket_of = {}
        for b, (_, _, idx) in enumerate(self.buckets):
            for i in idx:
                self._bucket_of[i] = b
        self._pending = [0] * len(self.buckets)
        self._futures: list[torch.futures.Future | None] = [None] * len(self.buckets)
        self._callback_queued = False
        self.iteration = 0
        #: The iteration whose gradient was last reduced (None: none yet).
        self.reduced_iteration: int | None = None
        self._sync = True
        self._in_backward_sync = True
        #: Parameters whose gradient backward passes inside no_sync() accumulated.
        self._accumulated: set[int] = set()
        for i, p in enumerate(params):
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._make_hook(i))

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes run inside accumulate locally, with no allreduce and nothing
        sent to the shadows; the first backward after it reduces the accumulated sum."""
        old, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = old

    # ------------------------------------------------------------------ hooks
    def _make_hook(self, i: int):
        def hook(p: torch.Tensor) -> None:
            self._on_grad(i, p)
        return hook

    def _on_grad(self, i: int, p: torch.Tensor) -> None:
        if not self._callback_queued:
            self._start_backward()
        view, mine = self._views[i], self._grads[i]
        if p.grad is not mine:
            g = local(p.grad)
            if g is None or g.data_ptr() != view.data_ptr():
                view.copy_(g)
            p.grad = mine
        if not self._in_backward_sync:
            self._accumulated.add(i)
            return
        self._fired.add(i)
        b = self._bucket_of[i]
        self._pending[b] -= 1
        if self._pending[b] == 0:
            self._launch(b)

    def _start_backward(self) -> None:
        if not self._sync:
            if self.reduced_iteration == self.iteration:
                raise CheckmateError(
                    f"iteration {self.iteration}: backward() inside no_sync() after this "
                    "iteration's gradient was reduced would change it behind the shadows' "
                    "back; accumulate before the one backward outside no_sync()")
            self._in_backward_sync = False
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
            return
        if self.reduced_iteration == self.iteration:
            raise CheckmateError(
                f"iteration {self.iteration}: a second backward() outside no_sync() would "
                "reduce this iteration's gradient twice and the shadows would drift; run the "
                "accumulation passes inside `with model.no_sync():` (the last one outside)")
        self.reduced_iteration = self.iteration
        self._in_backward_sync = True
        self._callback_queued = True
        self._fired: set[int] = set()
        for b, (_, _, idx) in enumerate(self.buckets):
            self._pending[b] = sum(1 for i in idx if self._params[i].requires_grad)
            self._futures[b] = None
        torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)

    def _launch(self, b: int) -> None:
        start, end, _ = self.buckets[b]
        t = self.flat_grad[start:end]
        t.div_(self.world)
        self._futures[b] = self.ring.submit(t, start, self.iteration, b)

    def _finish_backward(self) -> None:
        if not self._in_backward_sync:
            self._callback_queued = False
            return
        # Parameters that got no gradient in this iteration count as zero, on every rank;
        # a gradient that only no_sync() passes accumulated is kept.
        for b, (_, _, idx) in enumerate(self.buckets):
            if self._futures[b] is None:
                for i in idx:
                    kept = i in self._accumulated and self._params[i].grad is self._grads[i]
                    if i not in self._fired and not kept:
                        self._views[i].zero_()
                        self._params[i].grad = self._grads[i]
                self._launch(b)
        self._accumulated.clear()
        try:
            torch.futures.wait_all([f for f in self._futures if f is not None])
        finally:
            self._callback_queued = False

    def reduce(self) -> None:
        """Reduce now what backward passes inside ``no_sync()`` accumulated, as the next
        backward outside it would: for schedules that run the backward passes themselves
        (torch.distributed.pipelining: ``with model.no_sync(): schedule.step(...)``, then
        ``model.reduce()``). Once per iteration, like a reducing backward."""
        if self._callback_queued:
            raise CheckmateError("reduce() during a backward pass: call it after the "
                                 "schedule's step, outside no_sync()")
        if self.reduced_iteration == self.iteration:
            raise CheckmateError(
                f"iteration {self.iteration}: reduce() after this iteration's gradient was "
                "reduced would reduce it twice and the shadows would drift")
        self.reduced_iteration = self.iteration
        self._in_backward_sync = True
        self._fired = set()
        self._futures = [None] * len(self.buckets)
        self._callback_queued = True
        self._finish_backward()

    def flat_gradient(self) -> torch.Tensor:
        """The reduced gradient of the last backward in flat order (a view, do not modify)."""
        return self.flat_grad
