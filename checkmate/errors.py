"""One error type for bad input, and the CLI guard that turns it into one line and exit 2."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable


class CheckmateError(Exception):
    """Bad input or an unreachable peer: shown to the user as one line, never a traceback."""


def cli_guard(prog: str) -> Callable[[Callable[..., int]], Callable[..., int]]:
    """Wrap a CLI main so user-facing errors print ``prog: error: ...`` and exit non-zero."""

    def wrap(main: Callable[..., int]) -> Callable[..., int]:
        @functools.wraps(main)
        def guarded(*args, **kwargs) -> int:
            try:
                return main(*args, **kwargs)
            except CheckmateError as e:  # ConfigError, WireError & co. are CheckmateErrors
                print(f"{prog}: error: {e}", file=sys.stderr)
                return 2
            except PermissionError as e:
                msg = f"permission denied ({e.strerror}); run as root"
                print(f"{prog}: error: {msg}", file=sys.stderr)
                return 2
            except KeyboardInterrupt:
                print(f"{prog}: interrupted", file=sys.stderr)
                return 130

        return guarded

    return wrap
