"""How ``checkmate launch`` starts its workers: forked from a server that holds torch.

torch's elastic agent starts a function entrypoint (``checkmate.train.run_script.worker``)
with ``start_method="forkserver"``; the server imports checkmate.launch.preload once, so a
worker, and every worker of a restarted group, begins with torch and torch._dynamo loaded
instead of importing them (docs/benchmarks.md, "restart").

One difference from a started process is mended here. For a function entrypoint the agent
reports only the first worker its join noticed, where for a started one it reports every
worker that had failed when it looked; the launcher's last line names the worker whose
failure set the others off (checkmate.train.failures), which needs them all. So every
worker that had already ended with a failure when the agent looked is reported beside it,
with its exit code, as torch does for started workers.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import tempfile
from typing import Any

START_METHOD = "forkserver"
#: Longest folder the server's socket may be made in: a Unix socket's path is at most 107
#: bytes, and multiprocessing adds ``/pymp-XXXXXXXX/listener-XXXXXXXX`` (33) to it.
SOCKET_DIR_MAX = 70


def use_fork_server() -> None:
    """Call before the agent starts: the server imports the preload, and the agent reports
    every failed worker."""
    from checkmate.train import env as envmod

    os.environ[envmod.LAUNCHER_PID] = str(os.getpid())  # the workers watch it
    _short_socket_dir()
    multiprocessing.get_context(START_METHOD).set_forkserver_preload(
        ["checkmate.launch.preload"])
    from torch.distributed.elastic.multiprocessing import api

    poll = api.MultiprocessContext._poll
    if getattr(poll, "checkmate", False):
        return  # a second launch in this process (tests)

    @functools.wraps(poll)
    def poll_every_failure(self: Any) -> Any:
        ended = _failed_before(self)
        result = poll(self)
        if result is not None and result.failures:
            _add_failures(self, result.failures, ended)
        return result

    poll_every_failure.checkmate = True  # type: ignore[attr-defined]
    api.MultiprocessContext._poll = poll_every_failure


def _failed_before(ctx: Any) -> dict[int, tuple[int, int]]:
    """local rank -> (pid, exit code) of each worker that has ended with a failure."""
    procs = getattr(getattr(ctx, "_pc", None), "processes", None) or []
    ended = {}
    for rank, proc in enumerate(procs):
        code = proc.exitcode  # polls without waiting
        if code not in (None, 0):
            ended[rank] = (proc.pid, code)
    return ended


def _add_failures(ctx: Any, failures: dict[int, Any], ended: dict[int, tuple[int, int]]
                  ) -> None:
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    for rank, (pid, code) in ended.items():
        if rank not in failures:
            failures[rank] = ProcessFailure(local_rank=rank, pid=pid, exitcode=code,
                                            error_file=ctx.error_files[rank])


def _short_socket_dir() -> None:
    """Make multiprocessing's folder (the server's socket lives there) in /tmp when the
    temporary folder's path is too long for a socket (a deep TMPDIR); it is removed when the
    launcher exits, as it would be in TMPDIR."""
    from multiprocessing import util

    if len(tempfile.gettempdir()) <= SOCKET_DIR_MAX or not os.access("/tmp", os.W_OK):
        return
    before = tempfile.tempdir
    tempfile.tempdir = "/tmp"
    try:
        util.get_temp_dir()  # made now, under /tmp, and kept for the process
    finally:
        tempfile.tempdir = before
