"""One worker of ``checkmate launch``: ``worker(SCRIPT, *ARGS)``, forked from the launcher's
server (checkmate.launch.forked_workers), or ``python -m checkmate.train.run_script SCRIPT
ARGS`` (``--worker-start exec``).

Runs the user's script as ``python SCRIPT ARGS`` would (``__main__``, ``sys.argv``, the
script's folder first on ``sys.path``), so that a CheckmateError raised in it -- a bad
environment, shadows that cannot be restored from -- is one line on stderr with exit
status 2, never a traceback. When another rank dies, the survivors' next collective fails
in gloo ("Connection reset by peer"): that is one line too (exit 1), since the launcher is
already restarting the group. Any other exception -- the script's own, or one from a
library -- is one line too (its type, message and the script's line), with its traceback
in a file of the launcher's log directory that the line names (checkmate.train.failures);
so is an exception that ends one of the process's threads. Every failure line is also
recorded there, for the launcher's last line. On these paths the process ends at once
(``os._exit``): threads still blocked on a dead peer must not hold it. A script that
succeeds ends the same way once its objects are released, its non-daemon threads joined and
its atexit handlers run: the interpreter's own teardown can abort in gloo's C++ threads.

Ctrl-C (the agent forwards SIGINT) is one line and exit 130, at once: SIGINT is blocked in
every thread and taken by one that waits for it, so it is answered even while the main
thread sits in a gloo call (where a KeyboardInterrupt would wait until the call returns).
Processes the script starts inherit the blocked SIGINT; they end with their parent.

A worker also ends when its launcher is gone (SIGKILLed: no agent is left to stop it),
instead of training on alone.

With CHECKMATE_DEVICE=cuda (``checkmate launch`` on a machine with GPUs) the worker is bound
to GPU ``LOCAL_RANK mod devices`` (``torch.cuda.set_device``) before the script runs, so
``torch.cuda.current_device()``, NCCL and ``.cuda()`` all mean that GPU. More workers than
GPUs share them; NCCL refuses two ranks of one communicator on one GPU unless they look like
different hosts, so each sharing worker gets its own NCCL_HOSTID (unless one is set).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import io
import os
import runpy
import select
import signal
import sys
import threading
import time

from checkmate.errors import CheckmateError
from checkmate.train import agreement, failures


def _exit_now(code: int, line: str) -> None:
    failures.record(line, os.environ.get("RANK", "?"))
    sys.stdout.flush()
    sys.stderr.flush()
    os.write(2, f"{line}\n".encode())  # one write: lines of ranks failing together stay whole
    agreement.said()  # a refusal rank 0 waits to see read: read, and said (agreement)
    os._exit(code)


def _watch_parent(rank: str, launcher: int | None = None) -> None:
    """End this worker when the launcher is gone: its parent, or ``launcher`` (a worker
    forked from the launcher's server, which outlives the launcher as long as its workers
    live)."""
    parent = os.getppid()

    def gone() -> None:
        _exit_now(1, f"checkmate: rank {rank}: the launcher is gone; exiting")

    def watch_parent() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        gone()

    def watch_launcher(pid: int) -> None:
        try:
            fd = os.pidfd_open(pid)  # readable once the process has ended
        except ProcessLookupError:
            gone()
        except OSError:  # a kernel before 5.3: ask the process table every half second
            while True:
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    gone()
                except OSError:
                    pass  # there, but not ours to signal
                time.sleep(0.5)
        select.select([fd], [], [])
        gone()

    if launcher is None:
        threading.Thread(target=watch_parent, daemon=True, name="ckm-parent").start()
    else:
        threading.Thread(target=watch_launcher, args=(launcher,), daemon=True,
                         name="ckm-parent").start()


def _take_sigint(rank: str) -> None:
    """Answer SIGINT from a thread of its own (see the module docstring)."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})  # before any other thread

    def wait() -> None:
        signal.sigwait({signal.SIGINT})
        _exit_now(130, f"checkmate: rank {rank}: interrupted")

    threading.Thread(target=wait, daemon=True, name="ckm-sigint").start()


def bind_device(env: dict[str, str] | os._Environ, devices: int) -> int | None:
    """The GPU this worker is bound to under CHECKMATE_DEVICE=cuda with ``devices`` visible
    (None: cpu); sets NCCL_HOSTID in ``env`` when workers share a GPU. CheckmateError when
    no device is visible or LOCAL_RANK is missing."""
    from checkmate.train import env as envmod

    if (env.get(envmod.DEVICE) or "cpu") != "cuda":
        return None
    if devices < 1:
        raise CheckmateError(f"{envmod.DEVICE}=cuda but this worker sees no CUDA device")
    local = env.get("LOCAL_RANK", "")
    if not local.isdigit():
        raise CheckmateError(f"LOCAL_RANK must be set to bind the worker to a GPU, got "
                             f"{local!r}")
    shared = int(env.get("LOCAL_WORLD_SIZE", "1") or 1) > devices
    if shared and not env.get("NCCL_HOSTID"):
        env["NCCL_HOSTID"] = f"checkmate-{os.uname().nodename}-{local}"
    return int(local) % devices


def _bind(rank: str) -> None:
    """Bind this worker to its GPU (see the module docstring)."""
    from checkmate.train import env as envmod

    if (os.environ.get(envmod.DEVICE) or "cpu") != "cuda":
        return
    import torch

    dev = bind_device(os.environ, torch.cuda.device_count())
    if dev is not None:
        torch.cuda.set_device(dev)


def worker(script: str, *args: str) -> None:
    """A worker forked by ``checkmate launch``'s fork server (torch's elastic agent calls it
    with the script and its arguments). Ends as ``main`` does, except that a script that
    succeeds returns here instead of exiting: the agent collects its return before the
    process ends (still without the interpreter's teardown: the fork server's child leaves
    with ``os._exit``)."""
    from checkmate.train import env as envmod

    sys.stdout.reconfigure(line_buffering=True)  # as ``python -u`` prints: line by line
    sys.stderr.reconfigure(line_buffering=True)
    code = main([script, *args], exit_on_success=False,
                launcher=int(os.environ[envmod.LAUNCHER_PID]))
    if code:  # a failure main returns instead of ending the process (no such script)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def main(argv: list[str] | None = None, exit_on_success: bool = True,
         launcher: int | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print("usage: python -m checkmate.train.run_script SCRIPT [ARGS ...]", file=sys.stderr)
        return 2
    script = argv[0]
    rank = os.environ.get("RANK", "?")
    sys.argv = list(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    _take_sigint(rank)
    _watch_parent(rank, launcher)
    threading.excepthook = _thread_error(rank)
    agreement.say_first()
    if failures.stop_recorded():
        # an earlier attempt of this launch stopped on a divergence (--on-divergence stop):
        # the failure that ended it made torch's agent start this one, which ends at once
        # and cleanly, so no other follows and the launcher says why the job stopped
        _finish(0, exit_now=exit_on_success)
        return 0
    try:
        _bind(rank)
        runpy.run_path(script, run_name="__main__")
    except CheckmateError as e:
        line = f"checkmate: rank {rank}: error: {e}"
        if getattr(e, "stop", False):  # replica_check's divergence, --on-divergence stop
            failures.record_stop(line)
        _exit_now(2, line)
    except KeyboardInterrupt:
        _exit_now(130, f"checkmate: rank {rank}: interrupted")
    except FileNotFoundError as e:
        if e.filename == script:
            line = f"checkmate: rank {rank}: error: no such script {script}"
            failures.record(line, rank)
            print(line, file=sys.stderr)
            return 2
        _exit_now(1, f"checkmate: rank {rank}: error: {failures.describe(e, rank)}")
    except SystemExit as e:  # sys.exit() in the script: its status, as python SCRIPT gives
        if e.code not in (None, 0):  # the script said why itself: recorded, not repeated
            failures.record(f"checkmate: rank {rank}: the script exited with {e.code!r}",
                            rank)
        if e.code is not None and not isinstance(e.code, int):
            raise  # sys.exit("message"): Python prints it and exits 1
        code = e.code or 0
    except BaseException as e:  # noqa: BLE001 -- every other failure is one line too
        gloo = _gloo_cause(e)
        if gloo is not None:
            why = gloo.split("] ", 1)[-1].split(". ")[0]
            _exit_now(1, f"checkmate: rank {rank}: a peer of the process group is gone "
                      f"({why}); exiting for the launcher to restart the group")
        _exit_now(1, f"checkmate: rank {rank}: error: {failures.describe(e, rank)}")
    else:
        code = 0
    _finish(code, exit_now=exit_on_success or code != 0)
    return code


def _gloo_cause(e: BaseException) -> str | None:
    """The text of a gloo transport error that caused ``e`` (torch's pipelining stages
    re-raise it as their own RuntimeError ``from`` it), or None."""
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, RuntimeError) and "/gloo/" in str(cur):
            return str(cur)
        cur = cur.__cause__ or cur.__context__
    return None


def _finish(code: int, exit_now: bool = True) -> None:
    """End a worker whose script returned, without the interpreter's teardown.

    Left to finalization, gloo's C++ worker threads can outlive the interpreter and abort
    the process ("terminate called without an active exception", SIGABRT) after the script
    succeeded; pytorch/pytorch#190489 and the abandoned #179291 describe it. So what the
    teardown would do for the script is done here, in its order, while the interpreter is
    whole: non-daemon threads joined, atexit handlers run, files the script left open
    flushed (every live buffered file: one held in a reference cycle would lose its buffer
    even to gc); then the process ends at once.
    """
    main = threading.main_thread()
    for t in threading.enumerate():
        if t is not main and not t.daemon:
            t.join()
    atexit._run_exitfuncs()
    for obj in gc.get_objects():
        if _open(obj):
            with contextlib.suppress(Exception):
                obj.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    if exit_now:
        os._exit(code)


def _open(obj: object) -> bool:
    """Whether ``obj`` is a stream that is still open."""
    if not issubclass(type(obj), io.IOBase):  # type(), not isinstance: no __class__ lookup
        return False  # (torch.distributed.reduce_op warns when asked for its __class__)
    try:
        return not obj.closed
    except Exception:  # noqa: BLE001 -- a half-built or detached stream: nothing to flush
        return False


def _thread_error(rank: str):  # noqa: ANN202
    """threading.excepthook: a thread that ends on an exception is one line, not a
    traceback (the traceback goes to the log directory's file)."""
    def hook(args: threading.ExceptHookArgs) -> None:
        if args.exc_type is SystemExit or args.exc_value is None:
            return
        name = args.thread.name if args.thread is not None else "?"
        line = (f"checkmate: rank {rank}: error in thread {name}: "
                f"{failures.describe(args.exc_value, rank)}")
        print(line, file=sys.stderr, flush=True)
    return hook


if __name__ == "__main__":
    sys.exit(main())
