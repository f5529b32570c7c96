"""P4Info as compilers write it and switches report it, resolved by name.

Nothing here knows an id: p4c assigns hash-based ids, and a switch reports whatever its
compiler chose, so every table, action, match field, parameter and counter of the Checkmate
program is looked up by its fully qualified P4 name. Two spellings differ between the
compilers and are folded here: TNA names may carry the pipeline instance prefix ("pipe.";
p4c's Tofino backend puts it on tables and counters but not on actions), and TNA counters
come out as Tofino ``externs`` (types "Counter"/"DirectCounter") instead of
``counters``/``direct_counters`` unless bf-p4c ran with ``--p4runtime-force-std-externs``.

Text P4Info with Tofino externs holds ``google.protobuf.Any`` payloads of Barefoot's own
message types, which no public proto here describes; :func:`load` drops those payloads
(the controller needs only names and ids) and marks the result ``opaque``, and such a
P4Info is never pushed to a switch: pushing needs the compiler's binary P4Info, whose Any
payloads pass through untouched.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from checkmate.control import p4proto
from checkmate.errors import CheckmateError
from checkmate.extras import needs

with needs("switch"):
    from google.protobuf import text_format
    from google.protobuf.message import DecodeError

#: Pipeline instance prefix of TNA names (``Pipeline(...) pipe;`` in checkmate_tna.p4).
PIPE_PREFIX = "pipe."
#: Tofino extern types that stand for counters in a TNA P4Info.
EXTERN_COUNTER, EXTERN_DIRECT_COUNTER = "Counter", "DirectCounter"

_ANY = re.compile(r"\[type\.googleapis\.com/[\w.]+\]\s*{")


def canonical(name: str) -> str:
    """A P4 name without the TNA pipeline prefix: both compilers' spellings map to one."""
    return name[len(PIPE_PREFIX):] if name.startswith(PIPE_PREFIX) else name


@dataclass
class Loaded:
    """A parsed P4Info; ``opaque`` when Any payloads were dropped (never pushed then)."""

    p4info: object
    opaque: bool
    source: str


def _drop_any_payloads(text: str) -> tuple[str, bool]:
    """Remove every ``field { [type.googleapis.com/T] { ... } }`` block from text format."""
    dropped = False
    while (m := _ANY.search(text)) is not None:
        # The enclosing field: the last "name {" before the Any expansion.
        opener = text.rfind("{", 0, m.start())
        start = text.rfind("\n", 0, opener) + 1
        depth, end = 0, opener
        for end in range(opener, len(text)):
            depth += {"{": 1, "}": -1}.get(text[end], 0)
            if depth == 0:
                break
        text = text[:start] + text[end + 1:]
        dropped = True
    return text, dropped


def parse_text(text: str, source: str) -> Loaded:
    body, opaque = _drop_any_payloads(text)
    try:
        info = text_format.Parse(body, p4proto.p4info().P4Info())
    except text_format.ParseError as e:
        raise CheckmateError(f"{source} is not a P4Info text proto: {e}") from None
    return Loaded(info, opaque, source)


def load(path: Path) -> Loaded:
    """Read a compiler's P4Info: binary (``.binpb``/``.bin``/``.pb``) or text format."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise CheckmateError(f"cannot read P4Info {path}: {e.strerror}") from None
    if path.suffix in (".binpb", ".bin", ".pb"):
        info = p4proto.p4info().P4Info()
        try:
            info.ParseFromString(data)
        except DecodeError:
            raise CheckmateError(f"{path} is not a binary P4Info") from None
        return Loaded(info, False, str(path))
    try:
        text = data.decode()
    except UnicodeDecodeError:
        raise CheckmateError(f"{path} is not a P4Info text proto (not UTF-8)") from None
    return parse_text(text, str(path))


@dataclass(frozen=True)
class Counter:
    """A counter resolved by name: its id, and whether it is a Tofino extern instance."""

    name: str
    id: int
    direct: bool
    extern: bool


def counters(p4info) -> dict[str, Counter]:
    """Every counter and direct counter by canonical name, standard or Tofino extern."""
    out = {}
    for c in p4info.counters:
        out[canonical(c.preamble.name)] = Counter(c.preamble.name, c.preamble.id, False, False)
    for c in p4info.direct_counters:
        out[canonical(c.preamble.name)] = Counter(c.preamble.name, c.preamble.id, True, False)
    for ext in p4info.externs:
        if ext.extern_type_name not in (EXTERN_COUNTER, EXTERN_DIRECT_COUNTER):
            continue
        direct = ext.extern_type_name == EXTERN_DIRECT_COUNTER
        for inst in ext.instances:
            out[canonical(inst.preamble.name)] = Counter(inst.preamble.name, inst.preamble.id,
                                                         direct, True)
    return out


def names(p4info) -> set[str]:
    """Canonical names of tables, actions, parameters, match fields and counters, for
    comparing two P4Infos (a compiler's and a hand-written one) without their ids."""
    out = set()
    for t in p4info.tables:
        tn = canonical(t.preamble.name)
        out.add(f"table {tn}")
        out |= {f"key {tn}.{f.name}/{f.bitwidth}" for f in t.match_fields}
    for a in p4info.actions:
        an = canonical(a.preamble.name)
        out.add(f"action {an}")
        out |= {f"param {an}.{p.name}/{p.bitwidth}" for p in a.params}
    out |= {f"{'direct_counter' if c.direct else 'counter'} {n}"
            for n, c in counters(p4info).items()}
    return out
