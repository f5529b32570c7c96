"""The training-side entry point: one ``CheckmateSession`` per trainer process.

A user's loop reads::

    sess = CheckmateSession(model, optimizer, scheduler, layout, max_grad_norm=1.0)
    start = sess.start(resume=False)       # seed the shadows, or restore from them
    for it in range(start + 1, steps + 1):
        sess.begin(it)                     # iteration number, per-iteration RNG seed
        loss = loss_fn(sess.model(x), y)   # sess.model wraps model (CheckmateDDP)
        loss.backward()                    # buckets allreduce over ckm while backward runs
        sess.step(extra={"data": ...})     # clip, optimizer + scheduler step, control msg
    sess.close()

Rendezvous, barriers and the run nonce go through torch.distributed (gloo); the gradient
allreduce itself goes over the ckm ring only.

Randomness: ``begin`` reseeds torch's RNG from (seed, rank, iteration), so after a restore
every rank draws exactly what it would have drawn; the control message therefore needs no
RNG state, only the scheduler state and the user's ``extra`` (e.g. data position).

This module builds a session (by hand, or ``from_env`` under ``checkmate launch``) and
closes it; the session's other parts live beside it, one concept each:
checkmate.train.session_group (which data-parallel group this trainer is in, and where its
ranks are), session_start (``start``: run nonce, seeding, the ring), session_resume
(whether to resume; GoCkpt's restore), session_step (``begin``, ``step``, the control
message) and session_reliability (repair, re-seed, ``protection``, ``report``, ``finish``).
"""

from __future__ import annotations

import atexit
import threading
import weakref
from typing import Any

import torch
import torch.distributed as dist

from checkmate.errors import CheckmateError
from checkmate.spec.model import ModelSpec
from checkmate.train import failures
from checkmate.train.ddp import CheckmateDDP, bucket_ranges
from checkmate.train.layout import JobLayout
from checkmate.train.protection import ProtectionMonitor
from checkmate.train.repair import RepairServer
from checkmate.train.replica_log import ReplicaLog
from checkmate.train.replicate import ShadowSender
from checkmate.train.ring import RingAllreduce
from checkmate.train.session_reliability import _Reliability
from checkmate.train.session_resume import _Resume
from checkmate.train.session_start import RUN_ENV, _Start, draw_run
from checkmate.train.session_step import _Step, rng_seed

# Importable from here as before their modules existed (tests, scripts replaying the RNG).
__all__ = ["RUN_ENV", "CheckmateSession", "draw_run", "rng_seed"]


def flip_hook(iteration: int, module: torch.nn.Module) -> Any:
    """Test-only silent data corruption (CHECKMATE_FLIP_AT): after ``iteration``'s optimizer
    step, flip a bit of this rank's first parameter element (its local tensor): mantissa bit
    20, an eighth of the element's value, so that it reaches every rank's state through the
    gradients (the lowest bit can round away in them, and the corruption stay on one rank)."""
    def hook(phase: str, it: int) -> None:
        if phase == "before-control" and it == iteration:
            p = next(module.parameters())
            local = p.to_local() if hasattr(p, "to_local") else p
            with torch.no_grad():
                local.view(-1)[:1].view(torch.int32).bitwise_xor_(1 << 20)
    return hook


def _hooks(*hooks: Any) -> Any:
    """One injector calling each of ``hooks`` that is set (None when none is)."""
    live = [h for h in hooks if h is not None]
    if not live:
        return None

    def hook(phase: str, it: int) -> None:
        for h in live:
            h(phase, it)
    return hook


def _kill_hook(iteration: int) -> Any:
    """Test-only failure (CHECKMATE_KILL_AT): SIGKILL this process after ``iteration``'s
    optimizer step, before its control message."""
    def hook(phase: str, it: int) -> None:
        if phase == "before-control" and it == iteration:
            import os
            import signal

            os.kill(os.getpid(), signal.SIGKILL)
    return hook


class CheckmateSession(_Start, _Resume, _Step, _Reliability):
    """Checkmate on one trainer: ring, wrapper, bootstrap, control messages, restore (its
    parts: the mixins of session_start, session_resume, session_step, session_reliability).

    ``scaler``: the job's ``torch.amp.GradScaler`` for fp16 loss scaling; ``step`` then does
    unscale, skip and update (checkmate.train.amp), and a restore resumes its state.
    """

    #: A mesh job's data-parallel group (checkmate.train.session_group.MeshGroup): set by
    #: from_env(mesh=...); None: the job is this one data-parallel group.
    mesh: Any = None
    #: ``start(resume=True)`` resumes at this iteration, not the newest, and rewinds the
    #: shadows to it (checkmate.train.restore.rewind_shadows); None: the newest.
    resume_at: int | None = None
    #: The model holds tensor-parallel DTensors: the session replicates their local shards.
    tensor_parallel = False
    #: Every ``verify_every`` iterations (and at ``finish()``) the data-parallel ranks
    #: compare their state (checkmate.train.replica_check) and the shadows check theirs
    #: (checkmate.train.shadow_check); 0: never, check_schedule.AUTO: K by measurement
    #: (from_env's default, unless CHECKMATE_VERIFY_EVERY says otherwise).
    #: ``verified_iteration``: the newest they
    #: agreed on, or the iteration they started from (None: no check).
    verify_every = 0
    verified_iteration: int | None = None
    #: A divergence of the copies: "stop" ends the job; "restore" leaves the iteration the
    #: launcher's next attempt resumes at (checkmate.train.replica_check).
    on_divergence = "stop"
    #: Every data-parallel rank holds the whole (group's) state, so the ranks' copies can
    #: be compared; FSDP2's ranks hold different shards (FSDPSession says False).
    replicates_state = True
    #: The gradient path is our ring, whose copies follow the ring schedule's nodes
    #: (checkmate.train.ring_schedule); a session over another path says False.
    ring_nodes = True

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 scheduler: Any, layout: JobLayout, max_grad_norm: float | None = None,
                 group: Any = None, *, scaler: Any = None) -> None:
        from checkmate.optim import SGD, Adam
        from checkmate.train.amp import check_scaler

        if layout.mode != "off" and not isinstance(optimizer, (SGD, Adam)):
            # torch.optim's own arithmetic differs from the shadows' in the last bits: the
            # shadows would drift from the trainers silently.
            raise CheckmateError(
                f"the optimizer is {type(optimizer).__module__}.{type(optimizer).__name__}; "
                "Checkmate needs checkmate.optim.SGD, Adam or AdamW (drop-ins for torch.optim's) "
                "so that the shadows repeat its steps bit for bit")
        self.layout = layout
        self.module = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.max_grad_norm = max_grad_norm
        self.group = group
        #: fp16 loss scaling (torch.amp.GradScaler): step() unscales, skips and updates it,
        #: and the control message tells the shadows (checkmate.train.amp).
        self.scaler = check_scaler(scaler)
        self._check_model(model)
        self.spec = ModelSpec.from_torch(layout.job_id, model, optimizer,
                                         max(1, len(layout.shadows)),
                                         local=self.tensor_parallel,
                                         state_keys="index" if self.mesh is None else "fqn",
                                         parts=self._spec_parts(model))
        self.iteration = 0
        self.last_clip: float | None = None
        self.control_bytes = 0
        self.model: CheckmateDDP | None = None
        self.ring: RingAllreduce | None = None
        #: Each rank's node (start(): the layout's, or torch elastic's GROUP_RANK gathered
        #: from every rank); None: every rank its own node.
        self.node_of: list[int] | None = None
        # The job secret tags every datagram a shadow takes (checkmate.protocol.datamac) and opens
        # every shadow connection (checkmate.protocol.auth); a job without shadows needs none.
        self.secret: bytes | None = None
        self.data_key: tuple[int, int] | None = None
        if layout.mode != "off":
            from checkmate.protocol import auth, datamac

            self.secret = auth.load_secret()
            self.data_key = datamac.data_key(self.secret)
        self.sender = ShadowSender(layout.job_id, layout.shadows, self.secret,
                                   mirrors=layout.replica_shadows)
        from checkmate.shadow.control_message import control_limit

        self.sender.control_limit = control_limit(self.spec)
        #: This start's run nonce (checkmate.protocol.datamac.run_secret): every key that
        #: tags a datagram for the shadows derives from it; drawn by rank 0 in ``start``.
        self.run = ""
        #: Failure-injection hook ``(phase, iteration)`` for tests and scenarios.
        self.injector: Any = None
        self._refresh_stop = threading.Event()
        self._refresher: threading.Thread | None = None
        #: Last iteration whose step (and control message) is done; optimizer steps taken.
        self.done_iteration = 0
        self.opt_step = 0
        self.replica_log: ReplicaLog | None = None
        self.repair: RepairServer | None = None
        self.monitor: ProtectionMonitor | None = None
        self.metrics: Any = None  # Prometheus exporter (CHECKMATE_METRICS_PORT)
        self.gockpt: Any = None  # checkmate.gockpt.trainer.GoCkpt with layout.gockpt
        self.buckets = [(a, b) for a, b, _ in bucket_ranges(
            [p.numel for p in self.spec.params], layout.bucket_elems)]
        # A script that ends on an exception without close() would leave the session's
        # threads inside socket and torch calls while the interpreter tears down (native
        # code then aborts the process instead of exiting with the script's status).
        self._closed = False
        self._at_exit = _closer(weakref.ref(self))
        atexit.register(self._at_exit)

    def _spec_parts(self, model: torch.nn.Module) -> dict[str, Any] | None:
        """Per parameter, the shape this session replicates and its place in the whole
        tensor, where the tensors do not say it themselves (ModelSpec.from_torch's
        ``parts``); None: they do."""
        return None

    def _check_model(self, model: torch.nn.Module) -> None:
        """Refuse what this session's gradient path cannot replicate (FSDP2's DTensors here:
        ``checkmate.train.fsdp.FSDPSession`` takes those); a mesh session takes the
        DTensors of tensor parallel (their local shards: checkmate.train.tensor_parallel)."""
        if self.mesh is not None:
            from checkmate.train.tensor_parallel import uses_tensor_parallel

            self.tensor_parallel = uses_tensor_parallel(model, self.mesh.place)
            return
        from checkmate.train.sharded import refuse_sharded

        refuse_sharded(model)  # one line, not a crash or a drift mid-run

    @classmethod
    def from_env(cls, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 scheduler: Any = None, max_grad_norm: float | None = None,
                 resume: bool | None = None, *, scaler: Any = None, mesh: Any = None,
                 **layout: Any) -> CheckmateSession:
        """A started session for a script run by ``checkmate launch`` (or by hand with the
        variables of checkmate.train.env): the job's addresses come from the environment,
        the gloo process group is initialized if the script has not done it (a script on
        another backend, e.g. NCCL, gets a gloo group beside it for Checkmate's own
        messages), and the session is started, fresh or restored.

        ``resume`` None decides by itself: a worker group restarted by the launcher
        (TORCHELASTIC_RESTART_COUNT > 0) resumes from the shadows, unless no shadow was
        ever seeded (the previous attempt died before training began); ``checkmate launch
        --resume`` resumes in the first attempt too. Training continues at
        ``sess.done_iteration + 1``; ``sess.restored_extra`` is the user ``extra`` of the
        restored iteration ({} on a fresh start). ``scaler``: the job's
        ``torch.amp.GradScaler`` for fp16 (see ``step``); its state is restored too.
        ``mesh``: the job's torch ``DeviceMesh`` when it is not purely data parallel
        (pipeline or tensor parallel beside it): this session then protects this rank's
        data-parallel group only (checkmate.train.session_group.mesh_group), with that
        group's share of the launcher's shadows, and every group resumes at one iteration.
        ``layout`` overrides JobLayout fields.
        """
        from checkmate.train import env as envmod
        from checkmate.train import session_group
        from checkmate.train import world as worldmod

        job = envmod.read()
        layout.setdefault("fixed_world", worldmod.fixed_from_env())
        if job.stall_timeout is not None:
            layout.setdefault("stall_timeout", job.stall_timeout)
        mg = None
        if mesh is None:
            group = session_group.join_group(job)
            where = {"job_id": job.job_id, "rank": job.rank, "world": job.world,
                     "trainers": session_group.ring_addrs(job, group),
                     "shadows": job.shadows, "shadow_tcp": job.shadow_tcp,
                     "replica_shadows": job.replica_shadows, "replica_tcp": job.replica_tcp,
                     "placed": job.placed}
        else:
            mg = session_group.mesh_group(mesh, job.rank)
            group = mg.dp
            where = session_group.group_layout(job, mg)
        lay = JobLayout(mode="off" if job.mode == "gockpt" else job.mode, seed=job.seed,
                        gockpt=job.gockpt, controller=job.controller, **where, **layout)
        # The mesh is known before __init__ runs (which checks the model against it), for
        # every subclass alike, without a parameter in each one's signature.
        sess = cls.__new__(cls)
        sess.mesh = mg
        sess.__init__(model, optimizer, scheduler, lay, max_grad_norm, group, scaler=scaler)
        # switch mode under the launcher: each attempt has the controller program its ring
        # (a mesh job's rank 0: every group's, whose shadows are all in the job's list)
        sess.announce_attempt = lay.mode == "switch"
        sess.job_shadow_tcp = tuple(job.shadow_tcp)
        sess.progress_every = job.progress_every
        first = not job.restart_count  # test faults: the first attempt only
        sess.injector = _hooks(
            flip_hook(job.flip_at[1], model) if first and job.flip_at is not None
            and job.flip_at[0] == job.rank else None,
            _kill_hook(job.kill_at[1]) if first and job.kill_at is not None
            and job.kill_at[0] == job.rank else None)
        sess.verify_every = job.verify_every
        sess.on_divergence = job.on_divergence
        # --resume-at: the first attempt only (later ones go on); a later attempt goes back
        # to where the last one's replicas were last verified, when they diverged after it
        at = (job.resume_at if not job.restart_count
              else failures.rewind_for(job.restart_count))
        if at == 0:  # the start: seed the shadows anew, and they drop what they held
            resume = False
        elif at is not None:
            sess.resume_at = at
            resume = True
        if resume is None:
            resume = sess._resume_wanted(job)
        done = sess.start(resume=resume)
        if sess.verify_every:
            sess.verified_iteration = done  # every rank began from the same state
        if not hasattr(sess, "restored_extra"):
            sess.restored_extra = {}
        if mg is not None:
            dist.barrier(group=mg.world)  # every group seeded or restored: then "seeded"
        if job.rdzv_store is not None and not resume and job.rank == 0 and lay.mode != "off":
            from checkmate.train import agreement

            agreement.mark(sess._job_store(job), "seeded")  # later attempts resume
        if job.rank == 0:
            how = (f"resumed from the shadows at iteration {done}" if resume and not lay.gockpt
                   else f"resumed from GoCkpt checkpoint {done}" if resume
                   else f"seeded {len(lay.shadows)} shadow(s)" if lay.mode != "off"
                   else "GoCkpt checkpoints every {} iterations over {} steps".format(
                       *lay.gockpt[1:]) if lay.gockpt else "no shadows (mode off)")
            groups = ("" if mg is None else
                      f" (one data-parallel group: {' x '.join(mg.place.dp_dims)})"
                      if not mg.place.other_dims else
                      f" ({mg.count} data-parallel groups of {lay.world}: "
                      f"{' x '.join(mg.place.other_dims)} x {' x '.join(mg.place.dp_dims)})")
            print(f"checkmate: rank 0 of {job.world}{groups}, attempt {job.restart_count}: "
                  f"{how}", flush=True)
        return sess

    def __enter__(self) -> CheckmateSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the session's threads and sockets; safe to call again (and called at
        interpreter exit if the script did not)."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self._at_exit)
        self._refresh_stop.set()
        if self.monitor is not None:
            self.monitor.close()
        if self.ring is not None:
            self.ring.close()
        if self.repair is not None:
            self.repair.close()
        if self.metrics is not None:
            self.metrics.close()
        if self.gockpt is not None:
            self.gockpt.close()
        self.sender.close()


def _closer(ref: weakref.ref) -> Any:
    """An exit hook that closes the session if it is still alive (a weak reference: the
    hook must not keep a dropped session's buffers alive)."""
    def close() -> None:
        sess = ref()
        if sess is not None:
            sess.close()
    return close
