"""JSON with bounds: the one parser for JSON that arrives from the network.

``json.loads`` recurses once per nesting level: a 2 KB document of ``[[[[...`` raises
RecursionError (not ValueError), which killed the thread that parsed it. ``loads`` here
refuses, with a ``JsonBoundError`` (a ValueError) and before parsing, a document longer than
``max_bytes`` or nested deeper than ``max_depth`` (counted over brackets outside strings, in
one compiled-regex pass), so no input can get to the recursion limit; a caller that treats
ValueError as "bad input" is then safe. Used by the shadow's control messages; callers of
any other JSON input (service frames, handshakes) can use it the same way.
"""

from __future__ import annotations

import json
import re
from typing import Any

#: Deepest nesting a control or service message needs (a spec is 4 levels, a control
#: message's scheduler state a few more).
MAX_DEPTH = 32
#: Brackets, and strings (skipped whole, escapes included) so that brackets inside them
#: do not count.
_TOKENS = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]')


class JsonBoundError(ValueError):
    """JSON refused: too long, too deep or not JSON; the message says which."""


def depth(data: bytes) -> int:
    """Deepest bracket nesting of ``data`` (strings skipped); an unbalanced document gives
    whatever depth it reached (json.loads refuses it afterwards)."""
    d = deepest = 0
    for m in _TOKENS.finditer(data):
        c = m.group()
        if c in (b"[", b"{"):
            d += 1
            if d > deepest:
                deepest = d
        elif c in (b"]", b"}"):
            d -= 1
    return deepest


def loads(data: bytes | bytearray | memoryview, max_bytes: int,
          max_depth: int = MAX_DEPTH) -> Any:
    """``json.loads(data)`` within the bounds; JsonBoundError otherwise."""
    raw = bytes(data)
    if len(raw) > max_bytes:
        raise JsonBoundError(f"JSON of {len(raw)} bytes exceeds the {max_bytes} byte limit")
    if raw.count(b"[") + raw.count(b"{") > max_depth:
        d = depth(raw)  # only documents with enough brackets pay for the scan
        if d > max_depth:
            raise JsonBoundError(f"JSON nested {d} levels deep (at most {max_depth})")
    try:
        return json.loads(raw)
    except RecursionError:  # not reachable within MAX_DEPTH; kept as a last line
        raise JsonBoundError("JSON nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise JsonBoundError(f"not JSON: {e}") from None
