"""The metrics port setting, apart from the exporter so that reading it needs no prometheus.

A trainer or shadow asks for the port first and imports :mod:`checkmate.metrics` (and so
prometheus-client, the ``[metrics]`` extra) only when metrics are on.
"""

from __future__ import annotations

import os
from typing import Any, Final

from checkmate.errors import CheckmateError

#: Environment variable naming the metrics port. When set (non-empty) it wins over the
#: default passed by the constructor or CLI, so a deployment can move the port without
#: touching code; ``0`` asks for any free port.
METRICS_PORT_ENV: Final[str] = "CHECKMATE_METRICS_PORT"

_MAX_PORT: Final[int] = 65535


def check_port(port: Any, what: str) -> int:
    """``port`` when it is an integer port number, else one CheckmateError line."""
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= _MAX_PORT:
        raise CheckmateError(f"{what}: {port!r} is not a port (an integer 0..{_MAX_PORT})")
    return port


def port_from_env(default: int | None) -> int | None:
    """The metrics port: :data:`METRICS_PORT_ENV` when set and non-empty, else ``default``."""
    raw = os.environ.get(METRICS_PORT_ENV, "").strip()
    if not raw:
        return default
    try:
        port = int(raw, 10)
    except ValueError:
        raise CheckmateError(
            f"{METRICS_PORT_ENV}={raw!r} is not a port (an integer 0..{_MAX_PORT})"
        ) from None
    return check_port(port, METRICS_PORT_ENV)
