"""Resuming a session: whether this attempt resumes, and the restore from GoCkpt.

The decision is the same on every rank: rank 0 asks the shadows whether any holds state
(restarting ones are waited for), looks for a GoCkpt checkpoint, or (several nodes) reads
the job's rendezvous store, and broadcasts the answer. The restore from the shadows is
checkmate.train.restore.restore_session; a GoCkpt job restores from its directory here.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from checkmate.errors import CheckmateError
from checkmate.spec.model import ModelSpec


class _Resume:
    """Part of :class:`CheckmateSession` (session.py): whether and from where to resume."""

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
                                         *self._job_place(),
                                         lambda: agreement.marked(store, "seeded")))
        if not job.restart_count:
            return False
        if self.mesh is not None and gk is None:
            from checkmate.train import agreement

            # Every group decides alike: rank 0 of the job asks every group's shadows.
            per = len(job.shadow_tcp) // self.mesh.count
            sets = [job.shadow_tcp[g * per:(g + 1) * per] for g in range(self.mesh.count)]
            return bool(agreement.decide(agreement.attempt_store(), "resume",
                                         *self._job_place(),
                                         lambda: any(_any_seeded([a]) for a in sets)))
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
            try:
                answer[0] = _any_seeded(self.layout.tcp_sets)
            except CheckmateError as e:
                answer[0] = str(e)
        dist.broadcast_object_list(answer, group=self.group, group_src=0)
        if isinstance(answer[0], str):
            raise CheckmateError(answer[0])
        return bool(answer[0])

    def control_place(self) -> Any:
        """How the controller knows this session's shadows
        (checkmate.train.attempt.ControlPlace): a mesh job's group by the job's own id and
        the config's partition numbers, every group's shadows beside it."""
        from checkmate.protocol.wire import GROUP_SHIFT
        from checkmate.train.attempt import ControlPlace

        lay = self.layout
        if self.mesh is None or self.mesh.count == 1:
            return ControlPlace.of_layout(lay)
        return ControlPlace(lay.job_id & ((1 << GROUP_SHIFT) - 1), self.mesh.index,
                            self.mesh.count, len(lay.shadow_tcp),
                            tuple(getattr(self, "job_shadow_tcp", lay.shadow_tcp)))

    def _job_place(self) -> tuple[int, int]:
        """(rank, world) of this trainer in the whole job: a mesh job's decisions are the
        job's, not one group's."""
        if self.mesh is not None:
            return dist.get_rank(), dist.get_world_size()
        return self.layout.rank, self.layout.world

    def _job_store(self, job: Any) -> Any:
        """A client of the job's rendezvous store (multi-node launches), made once."""
        import os

        from checkmate.train import agreement

        if getattr(self, "_jstore", None) is None:
            self._jstore = agreement.job_store(job.rdzv_store,
                                               os.environ.get("TORCHELASTIC_RUN_ID", "none"))
        return self._jstore

    def local_state_dicts(self, model_sd: dict[str, Any], optim_sd: dict[str, Any]
                          ) -> tuple[dict[str, Any], dict[str, Any]]:
        """Whole-model state dicts (a restore) in the form this rank's module and optimizer
        load: each parameter's tensor and optimizer state placed by ``_place_like``
        (unchanged for whole parameters)."""
        if not self.places_state:
            return model_sd, optim_sd
        params = dict(self.module.named_parameters(remove_duplicate=False))  # tied: each name
        msd = {k: self._place_like(v, params[k]) if k in params else v
               for k, v in model_sd.items()}
        order = self.spec.state_order()
        state = {i: {k: self._place_like(v, params[order[i]])
                     if torch.is_tensor(v) and v.dim() else v for k, v in st.items()}
                 for i, st in optim_sd["state"].items()}
        return msd, {**optim_sd, "state": state}

    @property
    def places_state(self) -> bool:
        """Whether restored tensors need placing (tensor-parallel DTensors; FSDPSession's
        shards): whole parameters load as they are."""
        return self.tensor_parallel

    def _place_like(self, t: torch.Tensor, p: torch.Tensor) -> Any:
        """A restored tensor of parameter ``p``, as ``p`` holds it: a tensor-parallel rank's
        local tensor wrapped as its DTensor (checkmate.train.tensor_parallel.like)."""
        from checkmate.train.tensor_parallel import like

        return like(p, t)

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
        dist.broadcast_object_list(got, group=self.group, group_src=0)
        if got[1] is not None:
            raise CheckmateError(got[1])
        it, step, model_sd, optim_sd, extra = restore(lay.gockpt[0], spec, got[0])
        load_trainer_state(self.module, self.optimizer, self.scheduler, model_sd, optim_sd,
                           extra, self.scaler)
        self.restored_extra = extra.get("user", {})
        self.opt_step = step
        return it


def _any_seeded(sets: list[list[tuple[str, int]]]) -> bool:
    """Whether any shadow (of any replica set in ``sets``) holds a trained iteration
    (memory or disk) to resume from; restarting shadows are waited for (with several
    replicas only when none answers). CheckmateError when none can be asked.

    Shadows that hold the initial state at most (iteration 0: the previous attempt died
    while seeding, perhaps with some partitions seeded and others not) are seeded anew:
    a fresh start builds that same initial state, and a resume could fail on the
    partitions that were never seeded."""
    from checkmate.train import resume_point

    hs = [h for addrs in sets[1:] for h in resume_point.ask(addrs)]
    if not hs or all(h.error for h in hs):  # no replica answers: wait for the first set
        hs = resume_point.survey(sets[0]) + hs
    else:
        hs = resume_point.ask(sets[0]) + hs
    if all(h.error for h in hs):
        raise CheckmateError("cannot ask the shadows whether to resume: "
                             + "; ".join(h.describe() for h in hs))
    if any(i > 0 for h in hs for i in h.memory + h.disk):
        return True
    seeded = any(h.memory or h.disk for h in hs)
    print("checkmate: " + ("the shadows hold no trained iteration (the last attempt ended "
                           "before its first step): seeding them anew" if seeded else
                           "no shadow was seeded before the restart: starting fresh"),
          flush=True)
    return False
