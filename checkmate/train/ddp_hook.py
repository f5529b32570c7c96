"""Checkmate for an unmodified ``torch.nn.parallel.DistributedDataParallel``.

``DDPSession`` is a ``CheckmateSession`` whose gradient path is the user's own DDP (any
backend: gloo on CPUs, NCCL on GPUs) instead of our ring. ``start()`` registers a DDP
communication hook that

1. multiplies the bucket by 1/world and allreduces it (sum) with the backend, exactly as
   DDP's built-in reduction does (not torch's ``allreduce_hook``, which divides: another
   last bit at 3 ranks), so the trainer's gradient is stock DDP's at every world size; after
   a restart, in the buckets of the run it resumes (checkmate.train.ddp_buckets);
2. when the allreduce completes, takes this rank's share of the reduced bucket (read in
   place on the CPU; on a GPU copied to pinned host memory asynchronously, on a side stream,
   and sent by a thread of its own once the copy completed: checkmate.train.share_copy over
   checkmate.train.copyengine) and sends it
   to the owning shadows (host replication and the replica log go
   through the session's ``_on_reduced``, as the ring's pieces do).

Shares are fixed by the model spec, not by DDP's buckets (which DDP rebuilds after
iteration 1 in autograd's ready order): a flat element belongs to the rank that
``ring.replica_owners`` names for the session's spec buckets, so each element is sent by one
rank once per iteration (about 1/world of the gradient per rank), and a shadow's repair
requests go to the trainer that holds the range. Every datagram carries the flat offset
from the spec and the iteration of ``begin()``.

``step()`` first checks that every parameter was reduced exactly once in this iteration and
that no later backward pass (inside ``ddp.no_sync()``) added to a reduced gradient (two
reducing passes, an accumulation after the reduction, or a step without backward would make
the shadows differ from the trainers) and raises a CheckmateError on every rank otherwise;
a post-accumulate-grad hook per parameter counts the backward passes for that. Gradient
accumulation with ``ddp.no_sync()`` works as in stock DDP: only the last backward reduces,
and that sum is what trainers and shadows apply. A parameter DDP left without a gradient
(``find_unused_parameters=True`` and unused on every rank) was reduced as zeros; its
``grad`` is set to zeros, as the shadows apply them.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from checkmate.errors import CheckmateError
from checkmate.train.layout import JobLayout
from checkmate.train.ring import MAX_CHUNK, replica_owners
from checkmate.train.segments import Segment, cut_segments, send_runs
from checkmate.train.session import CheckmateSession
from checkmate.train.share_copy import ShareSender


def owned_segments(spec: Any, buckets: list[tuple[int, int]], world: int, rank: int
                   ) -> dict[str, list[Segment]]:
    """Per parameter name, the segments ``rank`` sends: its share of the flat space (see
    ``ring.replica_owners``) cut at parameter and partition boundaries."""
    return cut_segments(spec, [(lo, hi) for lo, hi, r in
                               replica_owners(buckets, world, 0, spec.total) if r == rank])


class DDPSession(ShareSender, CheckmateSession):
    """A CheckmateSession over the user's own ``DistributedDataParallel`` model.

    Args:
        ddp: the user's DDP, already constructed (its process group does the allreduce);
            it must have no communication hook yet and float32 parameters that all require
            gradients.
        optimizer, scheduler, layout, max_grad_norm, group: as for CheckmateSession; the
            layout's mode must be ``host`` (trainers send the copies; there is no ckm ring
            for a switch to copy) or ``off`` (no hook, no shadows: the baseline).
        scaler: the job's torch.amp.GradScaler for fp16 (see CheckmateSession.step).
        copy_engine: the copy engine for the share's device-to-host copies
            (checkmate.train.copyengine); None picks it by the parameters' device (CUDA:
            asynchronous copies; CPU: read in place).

    ``sess.model`` is ``ddp``; the loop is the same as with CheckmateSession.
    """

    #: No ring: shares are ``owned_segments``', the same on any node layout.
    ring_nodes = False

    def __init__(self, ddp: DistributedDataParallel, optimizer: torch.optim.Optimizer,
                 scheduler: Any, layout: JobLayout, max_grad_norm: float | None = None,
                 group: Any = None, *, scaler: Any = None, copy_engine: Any = None) -> None:
        if not isinstance(ddp, DistributedDataParallel):
            raise CheckmateError(f"DDPSession needs a torch DistributedDataParallel model, "
                                 f"got {type(ddp).__name__}")
        if layout.mode not in ("host", "off"):
            raise CheckmateError(f"a stock DDP job feeds the shadows in host mode only "
                                 f"(or runs without them: off), got mode {layout.mode!r}")
        module = ddp.module
        for name, p in module.named_parameters():
            if p.dtype != torch.float32:
                raise CheckmateError(f"parameter {name} is {p.dtype}: the shadows keep "
                                     "float32 parameters")
            if not p.requires_grad:
                raise CheckmateError(f"parameter {name} is frozen (requires_grad=False): "
                                     "DDP does not reduce it, so the shadows would step it "
                                     "on no gradient; leave it out of the optimizer and "
                                     "the module, or unfreeze it")
        pg = ddp.process_group
        if pg is not None and dist.get_world_size(pg) != layout.world:
            raise CheckmateError(f"the DDP process group has {dist.get_world_size(pg)} "
                                 f"ranks, the layout says world {layout.world}")
        super().__init__(module, optimizer, scheduler, layout, max_grad_norm, group,
                         scaler=scaler)
        self.ddp = ddp
        self._pg = pg
        self._names = {id(p): n for n, p in module.named_parameters()}
        named = dict(module.named_parameters())
        #: id(parameter) -> spec index; the bucket layout the next iteration reduces in
        #: (sent with each control message) and, after a restore, the resumed run's layout
        #: the hook reduces in until DDP's own buckets are it (checkmate.train.ddp_buckets).
        self._index_of = {id(named[p.name]): i for i, p in enumerate(self.spec.params)}
        self._layout_next: list[list[int]] | None = None
        self._plan: Any = None
        self._segments: dict[str, list[Segment]] = {}
        self._piece = 0
        self._lock = threading.Lock()
        # Per iteration: parameter name -> the backward pass that reduced it; names reduced
        # more than once; names whose gradient grew in a later pass (no_sync after reducing).
        self._reduced: dict[int, dict[str, int]] = defaultdict(dict)
        self._twice: dict[int, list[str]] = defaultdict(list)
        self._late: dict[int, list[str]] = defaultdict(list)
        self._pass = 0  # backward passes seen (our post-accumulate hooks count them)
        self._in_pass = False
        #: Replicated buckets, pieces, bytes, and seconds spent copying and sending them.
        self.hook_stats: dict[str, float] = {"buckets": 0, "pieces": 0, "bytes": 0,
                                             "seconds": 0.0}
        #: Asynchronous device-to-host copies of the share (checkmate.train.share_copy): a
        #: CudaCopyEngine for CUDA parameters (None, the default, picks by device), a
        #: ThreadCopyEngine to run that path on the CPU; CPU parameters without one are
        #: read in place by the hook.
        self.copy_engine = copy_engine
        self.copier = None

    # ------------------------------------------------------------------ setup
    def _start_comm(self, nonce: int) -> None:
        lay = self.layout
        self.model = self.ddp
        if lay.mode == "off":  # the no-checkpoint baseline: stock DDP as it is
            return
        self._piece = MAX_CHUNK
        self._segments = owned_segments(self.spec, self.buckets, lay.world, lay.rank)
        self._start_copier(next(self.module.parameters()), self._send_share)
        for name, p in self.module.named_parameters():
            p.register_post_accumulate_grad_hook(self._accumulate_hook(name))
        try:
            self.ddp.register_comm_hook(self, _hook)
        except (RuntimeError, ValueError) as e:
            raise CheckmateError(f"cannot register Checkmate's DDP comm hook: "
                                 f"{str(e).splitlines()[0]}") from None
        self._start_buckets()

    def _start_buckets(self) -> None:
        """The layout to reduce in: DDP's own, or after a restore the resumed run's."""
        from checkmate.train import ddp_buckets as B

        now = B.current_layout(self.ddp, self._index_of)
        control = getattr(self, "restored_control", None) or {}
        recorded = B.parse_layout(control.get("ddp_buckets"), len(self.spec.params))
        self._layout_next = recorded or now
        why = None
        cap, was = int(getattr(self.ddp, "bucket_bytes_cap", 0)), control.get("ddp_bucket_bytes")
        if recorded is None and self.iteration > 0:
            why = "the checkpoint holds no DDP bucket layout (written by an older Checkmate)"
        elif isinstance(was, int) and was != cap:
            why = (f"this DDP's buckets hold {cap} bytes, the resumed run's {was} (build the "
                   "DDP with the bucket_cap_mb of the run it resumes)")
        elif recorded is not None and recorded != now:
            why = B.fits(now, recorded)
            if why is None:
                self._plan = B.BucketPlan(recorded)
        if why is not None and self.layout.rank == 0:
            print(f"checkmate: warning: this restart is consistent but not bit-identical to a "
                  f"run without it: {why}", flush=True)

    # ------------------------------------------------------------------ the hook
    def _bucket(self, bucket: dist.GradBucket) -> torch.futures.Future:
        """The comm hook body (see the module docstring)."""
        it = self.iteration
        params = bucket.parameters()
        names = [self._names[id(p)] for p in params]
        with self._lock:
            seen = self._reduced[it]
            self._twice[it].extend(n for n in names if n in seen)
            seen.update(dict.fromkeys(names, self._pass))
        buf = bucket.buffer()
        pg = self._pg
        # DDP's own reduction (no hook) multiplies by 1/world as it copies a gradient into
        # the bucket; torch's allreduce_hook divides, which differs in the last bit unless
        # the world size is a power of two. Multiplying keeps a hooked DDP stock DDP's.
        buf.mul_(1.0 / dist.get_world_size(pg))
        fut = self._allreduce(buf, params)
        grads = bucket.gradients()
        index = bucket.index()

        def replicate(f: torch.futures.Future) -> torch.Tensor:
            out = f.value()
            out = out if torch.is_tensor(out) else out[0]
            self._replicate(it, index, names, grads)
            return out

        return fut.then(replicate)

    def _allreduce(self, buf: torch.Tensor, params: list[torch.Tensor]
                   ) -> torch.futures.Future:
        """The backend's allreduce of one bucket; after a restore, as the resumed run's
        buckets while DDP's own differ (checkmate.train.ddp_buckets)."""
        from checkmate.train.ddp_buckets import reduce_as

        if self._plan is not None:
            idx = [self._index_of[id(p)] for p in params]
            pieces = self._plan.pieces(idx)
            if pieces is not None:
                return reduce_as(buf, idx, [p.numel() for p in params], pieces, self._pg)
        return dist.all_reduce(buf, group=self._pg, async_op=True).get_future()

    def _rebuilt_buckets(self) -> None:
        """Let DDP rebuild its buckets now, at the end of the step, rather than in the next
        forward (every rank calls it here: the rebuild broadcasts rank 0's layout), so this
        step's control message carries the layout the next iteration reduces in."""
        from checkmate.train.ddp_buckets import current_layout

        if not self.ddp.reducer._rebuild_buckets():
            return
        now = current_layout(self.ddp, self._index_of)
        if self._plan is not None and now != self._plan.recorded and self.layout.rank == 0:
            print("checkmate: warning: DDP rebuilt its buckets unlike the run this job resumed "
                  "(another autograd order): from here on it is consistent but not "
                  "bit-identical to that run", flush=True)
        self._plan = None  # DDP's own buckets are the recorded ones (or the new truth)
        self._layout_next = now

    def _control_body(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """CheckmateSession's control message, with the bucket layout the next iteration
        reduces in (and DDP's bucket size), for a restore (checkmate.train.ddp_buckets)."""
        body = super()._control_body(*args, **kwargs)
        if self._layout_next is not None:
            body["extra"]["ddp_buckets"] = self._layout_next
            body["extra"]["ddp_bucket_bytes"] = int(getattr(self.ddp, "bucket_bytes_cap", 0))
        return body

    def _replicate(self, it: int, index: int, names: list[str],
                   grads: list[torch.Tensor]) -> None:
        """Send this rank's segments of one reduced bucket, merged where they touch: read
        in place on the CPU, or queued for an asynchronous copy to the host (and sent by the
        copier's thread once it completed) for device memory."""
        parts = [(name, g.detach().reshape(-1), self._segments[name])
                 for name, g in zip(names, grads, strict=True) if self._segments.get(name)]
        t0 = time.perf_counter()
        self._send_share_parts(it, index, parts, self._send_share)
        if self.copier is not None:
            self.hook_stats["submit_seconds"] = (self.hook_stats.get("submit_seconds", 0.0)
                                                 + time.perf_counter() - t0)

    def _send_share(self, it: int, index: int, runs: list[tuple[int, int, np.ndarray]]
                    ) -> None:
        """Send one bucket's share (host arrays) through ``_on_reduced``."""
        if not runs:
            return
        t0 = time.perf_counter()
        with self._lock:
            if self._twice.get(it):
                return  # step() raises; sending a second gradient would only mislead
            pieces, nbytes = send_runs(
                runs, self._piece,
                lambda off, part, payload: self._on_reduced(it, index, off, part, payload))
            self.hook_stats["pieces"] += pieces
            self.hook_stats["bytes"] += nbytes
            self.hook_stats["buckets"] += 1
            self.hook_stats["seconds"] += time.perf_counter() - t0

    def _accumulate_hook(self, name: str):  # noqa: ANN202
        def hook(_p: torch.Tensor) -> None:
            self._accumulated(name)
        return hook

    def _accumulated(self, name: str) -> None:
        """A backward pass added to ``name``'s gradient: flag it if an earlier pass of this
        iteration already reduced it (what the shadows got would not be what steps)."""
        if not self._in_pass:
            self._in_pass = True
            self._pass += 1
            torch.autograd.Variable._execution_engine.queue_callback(self._end_pass)
        it = self.iteration
        with self._lock:
            at = self._reduced.get(it, {}).get(name)
            if at is not None and at != self._pass:
                self._late[it].append(name)

    def _end_pass(self) -> None:
        self._in_pass = False

    # ------------------------------------------------------------------ per iteration
    def step(self, extra: dict[str, Any] | None = None) -> float | None:
        """Check that this iteration's gradient reached the shadows once, then step as
        CheckmateSession does (clip, optimizer, scheduler, control message)."""
        it = self.iteration
        if self.layout.mode == "off":
            return super().step(extra)
        self._check_new_step()
        with self._lock:
            reduced = self._reduced.pop(it, {})
            twice = self._twice.pop(it, [])
            late = self._late.pop(it, [])
            for old in [i for i in self._reduced if i < it]:
                del self._reduced[old]
                self._twice.pop(old, None)
                self._late.pop(old, None)
        if twice:
            raise CheckmateError(
                f"iteration {it}: DDP reduced {twice[0]} twice (a second backward outside "
                f"ddp.no_sync() before the step, or no begin() between iterations); the "
                f"shadows hold the first gradient only -- accumulate with ddp.no_sync()")
        if late:
            raise CheckmateError(
                f"iteration {it}: a backward after DDP reduced {late[0]} (inside "
                f"ddp.no_sync()) added to its gradient; the shadows hold the reduced gradient "
                f"only -- run the no_sync() passes first and the reducing one last")
        missing = [p.name for p in self.spec.params if p.name not in reduced]
        if missing:
            raise CheckmateError(
                f"iteration {it}: DDP reduced no gradient for {len(missing)} of "
                f"{len(self.spec.params)} parameters (first {missing[0]}): call backward() "
                f"on the DDP model's output between begin() and step()")
        for p in self.module.parameters():
            if p.grad is None:  # unused on every rank: reduced (and replicated) as zeros
                p.grad = torch.zeros_like(p)
        self._rebuilt_buckets()
        return super().step(extra)


def _hook(state, bucket):  # noqa: ANN001, ANN202 -- DDP rejects string annotations here
    """The registered comm hook (DDP checks its annotations, and this module's are strings
    under ``from __future__ import annotations``, so it has none)."""
    return state._bucket(bucket)
