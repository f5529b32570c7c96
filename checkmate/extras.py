"""Which pip extra brings an optional package: one line instead of a ModuleNotFoundError.

A trainer installs only the core (``pip install checkmate-ckpt``); the controller, shadows'
metrics, testbed and benches need packages of their own (pyproject.toml,
``[project.optional-dependencies]``). Each module that imports such a package does it inside
``with needs("switch"):``, so importing it without that extra fails with one line that names
the extra to install, never a traceback into a trainer that did not ask for it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from checkmate.errors import CheckmateError

#: The distribution name under which pip knows this project.
DIST = "checkmate-ckpt"


class MissingExtra(CheckmateError, ImportError):
    """An optional package is not installed; the message names the extra that brings it."""


@contextmanager
def needs(extra: str) -> Iterator[None]:
    """Turn a missing import inside the block into :class:`MissingExtra` naming ``extra``."""
    try:
        yield
    except ModuleNotFoundError as e:
        missing = e.name or str(e)
        raise MissingExtra(f"python package {missing} is not installed; it comes with the "
                           f"[{extra}] extra: pip install '{DIST}[{extra}]' (from a "
                           f"checkout: pip install '.[{extra}]')", name=e.name) from None
