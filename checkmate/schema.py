"""Building blocks shared by the document schemas (config, scenario, model spec).

Validators that raise a ValueError worded to follow the key path, and the one format every
schema's first error takes: ``hosts[1].ip is used twice`` -- one line, key first.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BeforeValidator


def int_in(lo: int, hi: int) -> BeforeValidator:
    def check(v: Any) -> int:
        if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
            raise ValueError(f"must be an integer in {lo}..{hi}, got {v!r}")
        return v
    return BeforeValidator(check)


def matching(rx: re.Pattern) -> BeforeValidator:
    def check(v: Any) -> str:
        if not isinstance(v, str) or not rx.match(v):
            raise ValueError(f"must match {rx.pattern}, got {v!r}")
        return v
    return BeforeValidator(check)


def one_of(choices: tuple[str, ...]) -> BeforeValidator:
    def check(v: Any) -> str:
        if v not in choices:
            raise ValueError(f"must be one of {', '.join(choices)}, got {v!r}")
        return v
    return BeforeValidator(check)


def _path(loc: tuple) -> str:
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path


def first_error(e: Any, unknown_top: str = "unknown top-level key(s)") -> str:
    """One line for the first problem of a pydantic ValidationError, led by its key path
    (``hosts[1].ip``): the one error format of every document schema here."""
    errs = e.errors(include_url=False)
    extra = [x["loc"] for x in errs if x["type"] == "extra_forbidden"]
    if extra:
        parent = extra[0][:-1]
        keys = sorted(str(loc[-1]) for loc in extra if loc[:-1] == parent)
        where = f"{_path(parent)}: " if parent else ""
        what = unknown_top if not parent else "unknown key(s)"
        return f"{where}{what}: {', '.join(keys)}" if not parent else \
            f"{where}{what} {', '.join(keys)}"
    x = errs[0]
    path = _path(x["loc"])
    msg = str(x["msg"]).removeprefix("Value error, ")
    if x["type"] == "missing":
        msg = "is required"
    if not path:
        return msg
    return path + ("" if msg.startswith((".", "[", ":")) else " ") + msg
