"""One error type for bad input, and the CLI guard that turns it into one line and exit 2."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable


class CheckmateError(Exception):
    """Bad input or an unreachable peer: shown to the user as one line, never a traceback."""


def _user_errors() -> tuple[type[BaseException], ...]:
    """CheckmateError and the config and wire errors -- the latter two only where their
    modules were imported (nothing else raises them), so that a CLI that never reads a
    config does not import what config and wire need (pydantic, crc32c: absent on a GPU
    machine's own Python, where the device check runs)."""
    out: list[type[BaseException]] = [CheckmateError]
    for mod, name in (("checkmate.config", "ConfigError"), ("checkmate.wire", "WireError")):
        m = sys.modules.get(mod)
        if m is not None:
            out.append(getattr(m, name))
    return tuple(out)


def cli_guard(prog: str) -> Callable[[Callable[..., int]], Callable[..., int]]:
    """Wrap a CLI main so user-facing errors print ``prog: error: ...`` and exit non-zero."""

    def wrap(main: Callable[..., int]) -> Callable[..., int]:
        @functools.wraps(main)
        def guarded(*args, **kwargs) -> int:
            try:
                return main(*args, **kwargs)
            except PermissionError as e:
                msg = f"permission denied ({e.strerror}); run as root"
                print(f"{prog}: error: {msg}", file=sys.stderr)
                return 2
            except KeyboardInterrupt:
                print(f"{prog}: interrupted", file=sys.stderr)
                return 130
            except Exception as e:
                if not isinstance(e, _user_errors()):
                    raise
                print(f"{prog}: error: {e}", file=sys.stderr)
                return 2

        return guarded

    return wrap
