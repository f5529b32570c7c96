"""Starting a session, on every rank: the run nonce, seeding or restoring the shadows, and
the gradient path (the ckm ring and CheckmateDDP).

After ``start`` returns the shadows of every partition hold the initial (or restored) state
and every ring socket is bound: training may begin. Each start draws a new ring nonce and
run nonce, so a datagram of an earlier run or attempt verifies in no later one.
"""

from __future__ import annotations

import os
import secrets
import sys
import threading
from typing import Any

import torch.distributed as dist

from checkmate.errors import CheckmateError
from checkmate.train.ddp import CheckmateDDP
from checkmate.train.ring import MAX_CHUNK, RingAllreduce
from checkmate.train.transport import open_socket

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


#: Seconds a trainer waits for a shadow that does not answer at all before it fails (one
#: that answers and compiles its kernels is waited for up to shadow_client.READY_TIMEOUT).
SILENT_SHADOW = 30.0


class _Start:
    """Part of :class:`CheckmateSession` (session.py): ``start`` and what it sets up."""

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
        dist.broadcast_object_list(nonce, group=self.group, group_src=0)
        if nonce[2] is not None:
            raise CheckmateError(nonce[2])  # the same line on every rank
        self._set_run(nonce[1])
        if lay.mode != "off":
            from checkmate.train.session_group import check_same_shadows

            check_same_shadows(lay, self.group)
        self.node_of = self._gather_nodes()
        if lay.mode == "switch" and getattr(self, "announce_attempt", False):
            from checkmate.train.attempt import announce
            from checkmate.train.ring_schedule import RingSchedule

            # the switch copies this attempt's ring hops, under a new epoch (iteration 0
            # waits); a mesh job's groups are programmed together, by the job's rank 0
            order = RingSchedule.build(lay.world, self.node_of).order
            announce(lay, self.control_place(), [lay.trainers[r][0] for r in order],
                     *self._job_place(), group=self.mesh.world if self.mesh else None)
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
            from checkmate.train.shadow_client import seed_share, wait_ready, wait_seeded

            # Shadows started beside a torchrun (not by `checkmate launch`, which waits for
            # them) may still compile their kernels: a seed sent now would time out.
            every = [a for addrs in lay.tcp_sets for a in addrs]  # each replica alike
            wait_ready(every, on_wait=self._say_compiling if lay.rank == 0 else None,
                       silent_timeout=SILENT_SHADOW)
            flat = self._seed_flat()
            for addrs in lay.tcp_sets:
                seed_share(addrs, self.spec, flat, lay.rank, lay.world)
            wait_seeded(every, timeout=seed_timeout)
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

    def _say_compiling(self, seconds: float) -> None:
        """Once, on rank 0: why training has not started yet."""
        if seconds >= 2.0 and not getattr(self, "_said_compiling", False):
            self._said_compiling = True
            print("checkmate: waiting for the shadows to compile their kernels once (a cold "
                  "Numba cache)", file=sys.stderr, flush=True)

    def _gather_nodes(self) -> list[int] | None:
        """Every rank's node (checkmate.train.session_group.gather_nodes); None for a
        gradient path that does not follow the ring schedule's nodes."""
        from checkmate.train.session_group import gather_nodes

        return gather_nodes(self.layout, self.group) if self.ring_nodes else None

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
        """Every slot of the whole model as flat arrays: what this rank seeds a share of
        (a tensor-parallel rank's: of its local shards)."""
        return self.spec.flat_from_state_dicts(*self._local_state_dicts())

    def _state_pieces(self) -> dict[str, list[tuple[int, Any]]]:
        """What ``_seed_flat`` holds, as (flat offset, tensor) pieces per slot, the tensors
        where they are (a GPU's stay on it): what the state check hashes."""
        return self.spec.slot_pieces(*self._local_state_dicts())

    def _local_state_dicts(self) -> tuple[dict[str, Any], dict[str, Any]]:
        msd, osd = self.module.state_dict(), self.optimizer.state_dict()
        if self.tensor_parallel:
            from checkmate.train.tensor_parallel import local_optim_state, local_state

            msd, osd = local_state(msd), local_optim_state(osd)
        return msd, osd

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
