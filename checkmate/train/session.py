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
"""

from __future__ import annotations

import atexit
import secrets
import threading
import weakref
from typing import Any

import torch
import torch.distributed as dist

from checkmate.errors import CheckmateError
from checkmate.spec.model import ModelSpec
from checkmate.train.control_message import _ControlMessage
from checkmate.train.ddp import CheckmateDDP, bucket_ranges
from checkmate.train.layout import JobLayout
from checkmate.train.protection import ProtectionMonitor
from checkmate.train.repair import RepairServer
from checkmate.train.replica_log import ReplicaLog
from checkmate.train.replicate import ShadowSender
from checkmate.train.ring import MAX_CHUNK, RingAllreduce
from checkmate.train.session_reliability import _Reliability
from checkmate.train.transport import open_socket


def _kill_hook(iteration: int) -> Any:
    """Test-only failure (CHECKMATE_KILL_AT): SIGKILL this process after ``iteration``'s
    optimizer step, before its control message."""
    def hook(phase: str, it: int) -> None:
        if phase == "before-control" and it == iteration:
            import os
            import signal

            os.kill(os.getpid(), signal.SIGKILL)
    return hook


#: A run nonce given from outside (32 lowercase hex digits) instead of drawn: for a launcher
#: that also hands the run's secret to a component deriving its keys from a secret file
#: (the NCCL plugin, docs/nccl_plugin.md). It must change with every attempt.
RUN_ENV = "CHECKMATE_RUN"


def draw_run() -> str:
    """Rank 0's run nonce (checkmate.protocol.datamac.run_secret): $CHECKMATE_RUN if set, else
    16 random bytes. With the NCCL plugin tagging the replicas (CKM_NCCL_BUCKETS) and no
    $CHECKMATE_RUN, the empty run: the plugin's tags are the job secret's own, and shadows
    keyed to any other run would drop every replica; one warning line says the run is not
    bound (docs/security.md, "Not yet protected")."""
    import os

    from checkmate.protocol import datamac

    given = os.environ.get(RUN_ENV, "")
    if given:
        if not datamac.valid_run(given):
            raise CheckmateError(f"{RUN_ENV} must be 32 lowercase hex digits")
        return given
    if os.environ.get("CKM_NCCL_BUCKETS"):
        print(f"checkmate: warning: the NCCL plugin tags the replicas with the job secret's "
              f"own keys ({RUN_ENV} not set): datagrams of this run are not bound to it "
              "(docs/security.md)", flush=True)
        return ""
    return secrets.token_hex(16)


def rng_seed(seed: int, rank: int, iteration: int) -> int:
    """The torch seed of (rank, iteration): a fixed function, so restores redraw the same."""
    return (seed * 1_000_003 + rank * 7_919 + iteration * 104_729) % (2**63 - 1)


class CheckmateSession(_Reliability, _ControlMessage):
    """Checkmate on one trainer: ring, wrapper, bootstrap, control messages, restore.

    ``scaler``: the job's ``torch.amp.GradScaler`` for fp16 loss scaling; ``step`` then does
    unscale, skip and update (checkmate.train.amp), and a restore resumes its state.
    """

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
                                         max(1, len(layout.shadows)))
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
        self.sender = ShadowSender(layout.job_id, layout.shadows, self.secret)
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

    def _check_model(self, model: torch.nn.Module) -> None:
        """Refuse what this session's gradient path cannot replicate (FSDP2's DTensors here:
        ``checkmate.train.fsdp.FSDPSession`` takes those)."""
        from checkmate.train.sharded import refuse_sharded

        refuse_sharded(model)  # one line, not a crash or a drift mid-run

    # ------------------------------------------------------------------ launcher
    @classmethod
    def from_env(cls, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 scheduler: Any = None, max_grad_norm: float | None = None,
                 resume: bool | None = None, *, scaler: Any = None,
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
        ``layout`` overrides JobLayout fields.
        """
        from checkmate.train import env as envmod
        from checkmate.train import world as worldmod

        job = envmod.read()
        layout.setdefault("fixed_world", worldmod.fixed_from_env())
        group = None
        if not dist.is_initialized():
            # On GPUs (checkmate launch binds each worker to its GPU) the job's collectives
            # run on NCCL: CUDA tensors on NCCL, CPU ones on gloo, in the group the script
            # sees; Checkmate's own messages still get a gloo group of their own (below).
            dist.init_process_group(envmod.backend_for(job.device), rank=job.rank,
                                    world_size=job.world)
        if dist.get_backend() != "gloo":
            group = dist.new_group(backend="gloo")
        trainers = job.trainers or _exchange_addrs(job.local_trainer, job.world, group)
        if job.stall_timeout is not None:
            layout.setdefault("stall_timeout", job.stall_timeout)
        lay = JobLayout(job_id=job.job_id, rank=job.rank, world=job.world,
                        trainers=trainers, shadows=job.shadows, shadow_tcp=job.shadow_tcp,
                        mode="off" if job.mode == "gockpt" else job.mode, seed=job.seed,
                        gockpt=job.gockpt, controller=job.controller, **layout)
        sess = cls(model, optimizer, scheduler, lay, max_grad_norm, group, scaler=scaler)
        # switch mode under the launcher: each attempt has the controller program its ring
        sess.announce_attempt = lay.mode == "switch"
        sess.progress_every = job.progress_every
        if job.kill_at is not None and job.kill_at[0] == job.rank and not job.restart_count:
            sess.injector = _kill_hook(job.kill_at[1])
        if resume is None:
            resume = sess._resume_wanted(job)
        done = sess.start(resume=resume)
        if job.rdzv_store is not None and not resume and job.rank == 0 and lay.mode != "off":
            from checkmate.train import agreement

            agreement.mark(sess._job_store(job), "seeded")  # later attempts resume
        if not hasattr(sess, "restored_extra"):
            sess.restored_extra = {}
        if job.rank == 0:
            how = (f"resumed from the shadows at iteration {done}" if resume and not lay.gockpt
                   else f"resumed from GoCkpt checkpoint {done}" if resume
                   else f"seeded {len(lay.shadows)} shadow(s)" if lay.mode != "off"
                   else "GoCkpt checkpoints every {} iterations over {} steps".format(
                       *lay.gockpt[1:]) if lay.gockpt else "no shadows (mode off)")
            print(f"checkmate: rank 0 of {job.world}, attempt {job.restart_count}: {how}",
                  flush=True)
        return sess

    def _resume_wanted(self, job: Any) -> bool:
        """The same resume decision on every rank (rank 0 asks the shadows, or looks for
        a GoCkpt checkpoint; see from_env)."""
        gk = self.layout.gockpt
        if self.layout.mode == "off" and gk is None:
            return False
        if job.resume:
            return True
        if job.rdzv_store is not None and gk is None:
            # Several nodes: an agent's restart count says nothing about the job (a spare
            # that replaced a lost node counts none, a node joining restarts the group
            # without counting): the job's rendezvous store says whether it was seeded.
            from checkmate.train import agreement

            store = self._job_store(job)
            return bool(agreement.decide(agreement.attempt_store(), "resume",
                                         self.layout.rank,
                                         lambda: agreement.marked(store, "seeded")))
        if not job.restart_count:
            return False
        answer: list[Any] = [True]
        if self.layout.rank == 0 and gk is not None:
            from checkmate.gockpt.trainer import wait_idle
            from checkmate.shadow import checkpoint_load

            wait_idle(gk[0], self.layout.world)  # the killed attempt's writes finish first
            answer[0] = checkpoint_load.newest_common(gk[0], self.layout.world) is not None
            if answer[0] is False:
                print("checkmate: no GoCkpt checkpoint was written before the restart: "
                      "starting fresh", flush=True)
        elif self.layout.rank == 0:
            from checkmate.train import resume_point

            # Restarting shadows are waited for; state in memory or on disk counts.
            hs = resume_point.survey(self.layout.shadow_tcp)
            if all(h.error for h in hs):
                answer[0] = ("cannot ask the shadows whether to resume: "
                             + "; ".join(h.describe() for h in hs))
            else:
                answer[0] = any(h.memory or h.disk for h in hs)
            if answer[0] is False:
                print("checkmate: no shadow was seeded before the restart: starting fresh",
                      flush=True)
        dist.broadcast_object_list(answer, src=0, group=self.group)
        if isinstance(answer[0], str):
            raise CheckmateError(answer[0])
        return bool(answer[0])

    def _job_store(self, job: Any) -> Any:
        """A client of the job's rendezvous store (multi-node launches), made once."""
        import os

        from checkmate.train import agreement

        if getattr(self, "_jstore", None) is None:
            self._jstore = agreement.job_store(job.rdzv_store,
                                               os.environ.get("TORCHELASTIC_RUN_ID", "none"))
        return self._jstore

    def report(self, loss: float | torch.Tensor | None = None) -> None:
        """Progress for the console: on rank 0, every ``progress_every`` iterations
        (CHECKMATE_PROGRESS_EVERY; ``checkmate launch --progress-every``), one line with the
        iteration, ``loss`` and the protection state. Call it after ``step``."""
        every = getattr(self, "progress_every", 0)
        it = self.done_iteration
        if self.layout.rank != 0 or not every or it % every:
            return
        text = f"checkmate: iteration {it}"
        if loss is not None:
            text += f" loss {float(loss.detach() if torch.is_tensor(loss) else loss):.4f}"
        if self.layout.mode == "off":
            text += " | not protected (mode off)"
        else:
            # Asked now on connections of its own (the monitor thread owns its clients).
            from checkmate.train.shadow_client import ShadowClient

            latest: list[int | None] = []
            for a in self.layout.shadow_tcp:
                try:
                    with ShadowClient(a, 2.0) as c:
                        latest.append(c.status().get("latest"))
                except (CheckmateError, OSError):
                    latest.append(None)
            held = min(latest) if None not in latest else None
            lags = " ".join("?" if x is None else str(it - x) for x in latest)
            text += f" | shadows hold iteration {held} (lag per shadow: {lags})"
        print(text, flush=True)

    # ------------------------------------------------------------------ setup
    def start(self, resume: bool = False, seed_timeout: float = 60.0) -> int:
        """Seed the shadows (fresh job) or restore from them; returns the last done iteration.

        Every rank must call it. Training may start only after it returns: the shadows of
        every partition then hold the initial (or restored) state.
        """
        lay = self.layout
        # The ring's incarnation nonce, and the run nonce the shadows' keys derive from: a
        # datagram of an earlier run or attempt verifies in no later one.
        nonce: list[Any] = [0, "", None]
        if lay.rank == 0:
            try:
                nonce = [secrets.randbits(32), draw_run(), None]
            except CheckmateError as e:
                nonce[2] = str(e)
        dist.broadcast_object_list(nonce, src=0, group=self.group)
        if nonce[2] is not None:
            raise CheckmateError(nonce[2])  # the same line on every rank
        self._set_run(nonce[1])
        self.node_of = self._gather_nodes()
        if lay.mode == "switch" and getattr(self, "announce_attempt", False):
            from checkmate.train.attempt import announce
            from checkmate.train.ring_schedule import RingSchedule

            # the switch copies this attempt's ring hops, under a new epoch (iteration 0 waits)
            announce(lay, RingSchedule.build(lay.world, self.node_of).order)
        if lay.mode == "switch" and lay.controller is not None:
            self._refresh_sessions()
            self._refresher = threading.Thread(target=self._refresh_loop, daemon=True,
                                               name="ckm-sessions")
            self._refresher.start()
        if lay.mode == "off":
            if resume and lay.gockpt is None:
                raise CheckmateError("nothing to resume from without shadows (mode off)")
            self.iteration = self._gockpt_restore() if resume else 0
            if lay.gockpt is not None:  # after the restore: its process starts from there
                from checkmate.gockpt.trainer import GoCkpt

                root, every, steps = lay.gockpt
                self.gockpt = GoCkpt(self.module, self.optimizer, root, every, steps,
                                     lay.rank, lay.world, lay.job_id)
        elif resume:
            from checkmate.train.restore import restore_session

            self.iteration = restore_session(self)
        else:
            from checkmate.train.shadow_client import seed_share, wait_seeded

            flat = self._seed_flat()
            seed_share(lay.shadow_tcp, self.spec, flat, lay.rank, lay.world)
            wait_seeded(lay.shadow_tcp, timeout=seed_timeout)
            self.iteration = 0
        self.done_iteration = self.iteration
        if lay.verbs_device:
            self._use_verbs()
        if lay.mode != "off":
            self._start_reliability()
        dist.barrier(group=self.group)
        self._start_comm(nonce[0])
        # Every ring socket must be bound before anyone sends.
        dist.barrier(group=self.group)
        return self.iteration

    def _gather_nodes(self) -> list[int] | None:
        """Every rank's node, the same on every rank: the layout's ``node_of``, else what
        each rank reads from torch elastic's environment (GROUP_RANK), gathered. In switch
        mode, ranks that share an address must share a node (ring_schedule.check_hosts)."""
        import os

        from checkmate.train import ring_schedule

        lay = self.layout
        if not self.ring_nodes:
            return None
        nodes = lay.node_of
        if nodes is None:
            keys: list[Any] = [None] * lay.world
            dist.all_gather_object(keys, ring_schedule.node_from_env(os.environ),
                                   group=self.group)
            nodes = ring_schedule.node_of_from_keys(keys)
        if lay.mode == "switch":
            ring_schedule.check_hosts(ring_schedule.RingSchedule.build(lay.world, nodes),
                                      [ip for ip, _ in lay.trainers])
        return nodes

    def _set_run(self, run: str) -> None:
        """Derive every datagram key from run ``run`` (the shadows learn it with ``peers``)."""
        self.run = run
        self.sender.set_run(run)
        if self.secret is not None:
            from checkmate.protocol import datamac

            self.data_key = datamac.data_key(datamac.run_secret(self.secret, run))

    def _use_verbs(self) -> None:
        """Host mode over RDMA: a UD sender per shadow, to the queue pair it publishes."""
        from checkmate.shadow.verbs import QPAddress, VerbsSender
        from checkmate.train.shadow_client import ShadowClient

        for p, a in enumerate(self.layout.shadow_tcp):
            with ShadowClient(a) as c:
                qp = c.status().get("verbs")
            if not qp:
                raise CheckmateError(f"shadow {p} at {a[0]}:{a[1]} does not receive over "
                                     "verbs (start it with --transport verbs --device DEV)")
            self.sender.use_verbs(p, VerbsSender(self.layout.verbs_device, QPAddress(
                qp["gid"], int(qp["qpn"]), int(qp["qkey"]))))

    def _seed_flat(self) -> dict[str, Any]:
        """Every slot of the whole model as flat arrays: what this rank seeds a share of."""
        return self.spec.flat_from_state_dicts(self.module.state_dict(),
                                               self.optimizer.state_dict())

    def local_state_dicts(self, model_sd: dict[str, Any], optim_sd: dict[str, Any]
                          ) -> tuple[dict[str, Any], dict[str, Any]]:
        """Whole-model state dicts (a restore) in the form this rank's module and optimizer
        load: unchanged here; FSDPSession keeps its rank's shards."""
        return model_sd, optim_sd

    def _gockpt_restore(self) -> int:
        """Every rank loads the iteration rank 0 found newest in the GoCkpt directory."""
        from checkmate.gockpt.trainer import restore
        from checkmate.train.restore import load_trainer_state

        lay = self.layout
        spec = ModelSpec.from_torch(lay.job_id, self.module, self.optimizer, lay.world)
        got: list[Any] = [None, None]
        if lay.rank == 0:
            try:
                got[0] = restore(lay.gockpt[0], spec)[0]
            except CheckmateError as e:
                got[1] = str(e)
        dist.broadcast_object_list(got, src=0, group=self.group)
        if got[1] is not None:
            raise CheckmateError(got[1])
        it, step, model_sd, optim_sd, extra = restore(lay.gockpt[0], spec, got[0])
        load_trainer_state(self.module, self.optimizer, self.scheduler, model_sd, optim_sd,
                           extra, self.scaler)
        self.restored_extra = extra.get("user", {})
        self.opt_step = step
        return it

    def _start_comm(self, nonce: int) -> None:
        """The gradient path: our ring and CheckmateDDP (checkmate.train.ddp_hook replaces
        it with a comm hook on the user's own DistributedDataParallel)."""
        lay = self.layout
        dev = next((p.device for p in self.module.parameters() if p.device.type != "cpu"),
                   None)
        if dev is not None:
            raise CheckmateError(f"the model is on {dev}: Checkmate's own ring allreduces "
                                 "CPU tensors; a GPU model takes DDPSession over torch's "
                                 "DistributedDataParallel (NCCL) or FSDPSession over FSDP2")
        ip, port = lay.trainers[lay.rank]
        sock = open_socket(ip, port)
        on_reduced = self._on_reduced if lay.mode != "off" else None
        from checkmate.train.ring_schedule import RingSchedule

        sched = RingSchedule.build(lay.world, self.node_of)
        self.ring = RingAllreduce(
            lay.rank, lay.world, sock, lay.trainers[sched.right(lay.rank)],
            lay.trainers[sched.left(lay.rank)], lay.job_id, nonce, self.spec.total,
            self.spec.partitions, chunk=lay.chunk, on_reduced=on_reduced, link=lay.link,
            tag=lay.mode != "off", piece=MAX_CHUNK, mac_key=self.data_key,
            node_of=self.node_of, stall_timeout=lay.stall_timeout)
        order = [p.name for p in self.spec.params]
        self.model = CheckmateDDP(self.module, self.ring, order, lay.bucket_elems)


    # ------------------------------------------------------------------ per iteration
    def begin(self, iteration: int) -> None:
        """Start ``iteration`` (1-based): tag datagrams with it and reseed the RNG."""
        if self.model is None:
            raise CheckmateError("call start() first")
        self.iteration = iteration
        if isinstance(self.model, CheckmateDDP):  # a user's own DDP reads sess.iteration
            self.model.iteration = iteration
        torch.manual_seed(rng_seed(self.layout.seed, self.layout.rank, iteration))

    def step(self, extra: dict[str, Any] | None = None) -> float | None:
        """Clip, step the optimizer and scheduler, and (rank 0) send the control message.

        With a ``scaler`` (fp16 loss scaling; the loop calls ``scaler.scale(loss).backward()``
        and nothing else of the scaler): unscale the gradients, agree on every rank whether
        one is inf/nan, and then either clip and step, or skip the step as GradScaler does
        (no optimizer step, no scheduler step, no step counted); ``scaler.update()`` either
        way. The shadows got the scaled gradient: the control message carries the float32
        ``inv_scale`` they multiply it by and the ``skip``.

        Returns the clip coefficient applied (None without clipping or on a skipped step).
        """
        from checkmate.train import amp

        hyper = self._step_hyper()  # before anything changes: a refused step leaves no trace
        self._before_grads_change()
        inv_scale, skip = (amp.unscale(self.scaler, self.optimizer, self.layout.world,
                                       self.group) if self.scaler is not None else (None, False))
        if self.gockpt is not None:
            self.gockpt.before_clip(self.iteration)
        coef = self._clip() if self.max_grad_norm is not None and not skip else None
        lrs = [float(g["lr"]) for g in self.optimizer.param_groups]
        if self.scaler is not None:
            self.scaler.step(self.optimizer)  # skips by itself: the agreed found_inf
            self.scaler.update()
        else:
            self.optimizer.step()
        if self.scheduler is not None and not skip:
            self.scheduler.step()
        self._sync_buffers()
        self.last_clip = coef
        if self.injector is not None:
            self.injector("before-control", self.iteration)
        steps = self.opt_step + (0 if skip else 1)
        if self.gockpt is not None:
            self.gockpt.after_step(self.iteration, steps,
                                   self._control_body(lrs, coef, hyper, extra, None, skip))
        if self.layout.rank == 0 and self.layout.mode != "off":
            data = self.sender.control(self.iteration, self._control_body(
                lrs, coef, hyper, extra, inv_scale, skip))
            self.control_bytes = len(data)
            if self.replica_log is not None:
                self.replica_log.add_control(self.iteration, data)
        self.opt_step = steps
        self.done_iteration = self.iteration
        if self.monitor is not None:
            self.monitor.capture(self.iteration, self.opt_step)
        return coef

    def _before_grads_change(self) -> None:
        """Called by ``step`` before anything writes the gradients (unscale, clip): a
        gradient path that still reads them (an asynchronous device-to-host copy) orders
        itself before. Nothing to do for the ring, whose pieces are sent by then."""

    def _check_new_step(self) -> None:
        """A session over a user's own gradient path sees no backward of its own: one
        step per begin() is all it can check here."""
        it = self.iteration
        if it <= self.done_iteration:
            raise CheckmateError(f"step() again for iteration {it}: call begin(iteration) "
                                 "before each iteration's forward and backward")


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


def _exchange_addrs(mine: tuple[str, int] | None, world: int, group: Any
                    ) -> list[tuple[str, int]]:
    """Every rank's ring address in rank order, from each rank's own (multi-node launches:
    the rendezvous assigns the ranks, so the workers tell each other where they are)."""
    if mine is None:
        raise CheckmateError("no ring address for this worker: the launcher sets "
                             "CHECKMATE_TRAINERS or CHECKMATE_LOCAL_TRAINERS")
    out: list[Any] = [None] * world
    dist.all_gather_object(out, [mine[0], mine[1]], group=group)
    addrs = [(str(a[0]), int(a[1])) for a in out]
    if len(set(addrs)) != world:
        dup = sorted({a for a in addrs if addrs.count(a) > 1})
        raise CheckmateError(f"two ranks of the job share the ring address {dup[0][0]}:"
                             f"{dup[0][1]}: give each node its own --worker-ip")
    return addrs


def _closer(ref: weakref.ref) -> Any:
    """An exit hook that closes the session if it is still alive (a weak reference: the
    hook must not keep a dropped session's buffers alive)."""
    def close() -> None:
        sess = ref()
        if sess is not None:
            sess.close()
    return close
