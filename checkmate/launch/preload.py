"""What the fork server that starts ``checkmate launch``'s workers imports before it forks.

Every worker, and every worker of a restarted group, is forked from one server (torch's
elastic agent with ``start_method="forkserver"``) that has torch loaded, with the
torch._dynamo that every torch optimizer imports on its first call: seconds of CPU a worker
otherwise spends importing before it can train or resume (measured in docs/benchmarks.md,
"restart"). Only third-party modules: Checkmate's read the worker's environment when
imported, which the server does not have. The heap is frozen after the imports, so the
workers' collections do not walk those objects; the server itself, once the launcher is
gone, leaves without the interpreter's teardown (seconds with torch loaded, and triton's
bindings would report every frozen object as a leak: checkmate.fastexit).
"""

import atexit
import gc
import os

import numpy  # noqa: F401
import torch  # noqa: F401
import torch._dynamo  # noqa: F401
import torch.distributed  # noqa: F401

_SERVER = os.getpid()


def _leave() -> None:
    """Registered last, so run first: the server ends here; a forked worker (which runs
    its atexit handlers itself, checkmate.train.run_script) goes on to the others."""
    if os.getpid() == _SERVER:
        os._exit(0)


atexit.register(_leave)
gc.freeze()
