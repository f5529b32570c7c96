"""Children that end with the testbed command that started them.

A testbed command (``run``, ``chaos``, ``bench ...``) starts controllers, shadows and
trainers in sessions of their own (so a signal to one process group never hits them all).
Were the command killed -- by a timeout, SIGKILL, a closed terminal -- they would run on:
a ``control serve`` of a killed ``bench training`` ran for 49 minutes. So:

- every child is started with the parent-death signal (``PR_SET_PDEATHSIG``, SIGKILL): the
  kernel kills it when its parent goes, whatever killed the parent;
- the kernel sends that signal when the *thread* that forked the child ends, not the
  process, so children are forked by one long-lived thread of this process (:func:`popen`),
  never by a short-lived action thread;
- SIGTERM and SIGHUP raise SystemExit in the main thread (:func:`exit_on_signals`), so the
  command's own cleanup (namespaces, BPF, recorded processes) runs before it exits.

A testbed that outlives its command on purpose (``testbed up``'s controller) does not use
this module. Linux only (prctl); elsewhere children are started as before.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

_PR_SET_PDEATHSIG = 1
_libc: Any = None


def _prctl() -> Any:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    return _libc.prctl


def _die_with(parent: int) -> Callable[[], None]:
    """The child's preexec: SIGKILL when the forking thread's process ends; and if the
    parent is already gone (it died between fork and here), end now."""
    prctl = _prctl() if sys.platform.startswith("linux") else None

    def preexec() -> None:
        if prctl is not None:
            prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:
            os._exit(1)

    return preexec


#: One worker thread that lives as long as the process (an idle executor thread waits for
#: work, it does not exit) and forks every child.
_forker: ThreadPoolExecutor | None = None
_forker_lock = threading.Lock()


def popen(argv: list[str], **kw: Any) -> subprocess.Popen:
    """subprocess.Popen whose child is SIGKILLed when this process ends (see module doc)."""
    global _forker
    with _forker_lock:
        if _forker is None:
            _forker = ThreadPoolExecutor(1, thread_name_prefix="testbed-forker")
    kw["preexec_fn"] = _die_with(os.getpid())
    return _forker.submit(subprocess.Popen, argv, **kw).result()


def exit_on_signals() -> None:
    """SIGTERM and SIGHUP end the command through SystemExit (cleanup runs); only from the
    main thread, where Python delivers signals, and only in this process: a forked copy
    that receives one exits at once."""
    if threading.current_thread() is not threading.main_thread():
        return

    owner = os.getpid()

    def handler(signum: int, _frame: Any) -> None:
        signal.signal(signum, signal.SIG_DFL)  # a second one ends it at once
        if os.getpid() != owner:
            # A child forked without exec (pyroute2's netns helpers) inherits this handler:
            # it must die as it would have, not unwind the command's stack and run its
            # cleanup (which would remove the live testbed's namespaces under it).
            os._exit(128 + signum)
        raise SystemExit(128 + signum)

    for s in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, handler)
