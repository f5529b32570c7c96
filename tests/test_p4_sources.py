"""The P4 sources agree with their P4Info, with the ckm wire format and with the controller,
and keep to the rules the compilers enforce.

tests/test_p4_compile.py compiles both programs with the real compilers when they are at
hand; these checks need none: the sources are parsed with a small reader good enough for
the subset they use (controls, tables, keys, actions, counters, header types, parser
states), so they also say what a rule means (the length check is evaluated against the
kernel switch's). Every table, key, action, parameter and
counter is checked by name against the hand-written P4Info and against what p4c emitted
(tests/fixtures/p4c/), bit widths resolved from the header definitions. Structural checks
stand for the Tofino compile errors met before (indexed and direct counters in one action;
two accesses to one indexed counter on a packet's path), and the shared parser is run on
real frames by a small interpreter of its states.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import pytest
from fakes import (
    LENGTH_RULE_CASES,
    compiled_fixture,
    compiled_p4info,
    fixture_p4info,
    unchecked_p4info,
)

from checkmate.config import cluster as config
from checkmate.control import p4info as p4info_mod
from checkmate.control import p4proto, pfc
from checkmate.control import plan as plan_mod
from checkmate.control.drivers import p4runtime as p4rt_driver
from checkmate.control.drivers import p4tables
from checkmate.protocol import wire, wire_gen

P4 = Path(__file__).resolve().parents[1] / "p4"
ARCHS = {"v1model": "", "tna": "pipe."}
#: Architecture types and intrinsic fields used as keys/params (v1model.p4, tna.p4).
TYPE_WIDTHS = {"PortId_t": 9, "MulticastGroupId_t": 16}
INTRINSIC_WIDTHS = {"std_md.egress_rid": 16, "eg_intr_md.egress_rid": 16,
                    "std_md.ingress_port": 9, "ig_intr_md.ingress_port": 9}


def strip_comments(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def block(text: str, start: int) -> str:
    """The text between the brace at/after ``start`` and its matching close."""
    i = text.index("{", start)
    depth = 0
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1:j]
    raise AssertionError("unbalanced braces")


def source(arch: str) -> str:
    return strip_comments((P4 / f"checkmate_{arch}.p4").read_text())


def include(name: str) -> str:
    return strip_comments((P4 / "include" / name).read_text())


def header_types() -> dict[str, dict[str, int]]:
    text = include("checkmate_common.p4") + include("ckm_headers.p4")
    out = {}
    for m in re.finditer(r"header\s+(\w+)\s*{", text):
        fields = re.findall(r"bit<(\d+)>\s+(\w+)\s*;", block(text, m.start()))
        out[m.group(1)] = {name: int(w) for w, name in fields}
    return out


def headers_struct() -> dict[str, str]:
    text = include("checkmate_common.p4")
    m = re.search(r"struct\s+headers_t\s*{", text)
    return {name: typ for typ, name in re.findall(r"(\w+)\s+(\w+)\s*;", block(text, m.start()))}


def width_of(expr: str) -> int:
    if expr in INTRINSIC_WIDTHS:
        return INTRINSIC_WIDTHS[expr]
    root, hdr, field = expr.split(".")
    assert root == "hdr", expr
    return header_types()[headers_struct()[hdr]][field]


def param_width(typ: str) -> int:
    m = re.fullmatch(r"bit<(\d+)>", typ)
    return int(m.group(1)) if m else TYPE_WIDTHS[typ]


def parse_program(arch: str) -> dict:
    """{"tables": {ctrl.table: {...}}, "actions": {ctrl.action: [(param, width)]},
    "direct": {ctrl.counter}, "counters": {ctrl.counter}}"""
    text = source(arch)
    prog: dict = {"tables": {}, "actions": {}, "direct": set(), "counters": set()}
    for cm in re.finditer(r"control\s+(\w+)\s*\(", text):
        ctrl = cm.group(1)
        body = block(text, cm.end())
        for am in re.finditer(r"action\s+(\w+)\s*\(([^)]*)\)", body):
            params = [p.split() for p in am.group(2).split(",") if p.strip()]
            prog["actions"][f"{ctrl}.{am.group(1)}"] = [(n, param_width(t)) for t, n in params]
        for dm in re.finditer(r"(?:direct_counter|DirectCounter<[^()]*>)\s*\([^)]*\)\s*(\w+)",
                              body):
            prog["direct"].add(f"{ctrl}.{dm.group(1)}")
        for c in re.finditer(r"(?:\bcounter|\bCounter<[^()]*>)\s*\([^)]*\)\s*(\w+)", body):
            prog["counters"].add(f"{ctrl}.{c.group(1)}")
        for tm in re.finditer(r"table\s+(\w+)\s*{", body):
            tb = block(body, tm.start())
            keys_text = block(tb, tb.index("key"))
            keys = [(name, width_of(expr)) for expr, name in
                    re.findall(r"([\w.]+)\s*:\s*exact\s+@name\(\"(\w+)\"\)", keys_text)]
            acts_text = block(tb, tb.index("actions"))
            acts = {}
            for a in [a.strip() for a in acts_text.split(";") if a.strip()]:
                default_only = a.startswith("@defaultonly")
                acts[a.split()[-1]] = default_only
            counter = re.search(r"counters\s*=\s*(\w+)", tb).group(1)
            size = int(re.search(r"size\s*=\s*(\d+)", tb).group(1))
            prog["tables"][f"{ctrl}.{tm.group(1)}"] = {
                "keys": keys, "actions": acts, "counter": f"{ctrl}.{counter}", "size": size}
    return prog


def p4info(arch: str):
    """The hand-written P4Info (a test fixture now: the controller reads the switch's)."""
    return fixture_p4info(f"handwritten_{arch}.p4info.txtpb")


@pytest.mark.parametrize("arch", ARCHS)
def test_tables_keys_actions_agree_with_p4info(arch):
    prefix = ARCHS[arch]
    prog = parse_program(arch)
    info = p4info(arch)
    actions_by_id = {a.preamble.id: a for a in info.actions}
    assert {t.preamble.name for t in info.tables} == {prefix + n for n in prog["tables"]}
    default_only = p4proto.p4info().ActionRef.DEFAULT_ONLY
    for t in info.tables:
        src = prog["tables"][t.preamble.name.removeprefix(prefix)]
        assert [(f.name, f.bitwidth) for f in t.match_fields] == src["keys"], t.preamble.name
        assert all(f.match_type == p4proto.p4info().MatchField.EXACT for f in t.match_fields)
        refs = {}
        for r in t.action_refs:
            name = actions_by_id[r.id].preamble.alias
            refs[name] = r.scope == default_only
        assert refs == src["actions"], t.preamble.name
        assert t.size == src["size"]
        (dc_id,) = t.direct_resource_ids
        dc = next(d for d in info.direct_counters if d.preamble.id == dc_id)
        assert dc.preamble.name == prefix + src["counter"] and dc.direct_table_id == t.preamble.id
    for a in info.actions:
        if a.preamble.name == "NoAction":
            continue
        src_params = prog["actions"][a.preamble.name.removeprefix(prefix)]
        assert [(p.name, p.bitwidth) for p in a.params] == src_params, a.preamble.name
    declared = {n for n in prog["actions"]}
    used = {f"{t.split('.')[0]}.{a}" for t, d in prog["tables"].items() for a in d["actions"]
            if a != "NoAction"}
    assert used <= declared
    assert {prefix + n for n in used} == {a.preamble.name for a in info.actions} - {"NoAction"}
    assert {d.preamble.name for d in info.direct_counters} == {prefix + n for n in prog["direct"]}
    assert {c.preamble.name for c in info.counters} == {prefix + n for n in prog["counters"]}
    stat_size = int(re.search(r"STAT_SIZE\s*=\s*(\d+)", include("checkmate_common.p4"))[1])
    src_size = int(re.search(r"SRC_SIZE\s*=\s*(\d+)", include("checkmate_common.p4"))[1])
    assert {c.preamble.alias: c.size for c in info.counters} == {
        "ckm_stats": stat_size, "l2_miss": 1, "rewrite_miss": 1, "src_check": src_size}


def source_names(arch: str) -> set[str]:
    """p4info.names() of the program as its source declares it (parse_program)."""
    prog = parse_program(arch)
    out = set()
    for t, d in prog["tables"].items():
        out.add(f"table {t}")
        out |= {f"key {t}.{k}/{w}" for k, w in d["keys"]}
        out |= {"action NoAction" for a in d["actions"] if a == "NoAction"}
    for a, params in prog["actions"].items():
        out.add(f"action {a}")
        out |= {f"param {a}.{p}/{w}" for p, w in params}
    out |= {f"direct_counter {c}" for c in prog["direct"]}
    return out | {f"counter {c}" for c in prog["counters"]}


@pytest.mark.parametrize("arch", ARCHS)
def test_compiler_p4info_has_the_sources_names(arch):
    """What p4c emitted has the names and widths the sources declare (ids, the "pipe."
    spelling and counter kinds aside); otherwise the fixture is stale (tests/test_p4_compile.py
    compares it with a fresh compile), and the failure says which and what differs."""
    compiled = p4info_mod.names(compiled_p4info(arch))
    src = source_names(arch)
    fixture = compiled_fixture(arch).relative_to(P4.parent)
    missing, extra = src - compiled, compiled - src
    assert not missing and not extra, (
        f"{fixture} is stale: the sources have {sorted(missing)} it lacks and it has "
        f"{sorted(extra)} they lack; regenerate it with `make p4-fixtures`")
    assert p4info_mod.names(p4info(arch)) == src, f"handwritten_{arch}.p4info.txtpb is stale"
    # and the controller accepts it, resolving every table by name
    schema = p4tables.Schema(compiled_p4info(arch))
    assert set(schema.tables) == set(p4tables.TABLES) | set(p4tables.OPTIONAL_TABLES)


def test_both_programs_have_the_same_tables_and_actions():
    v1, tna = parse_program("v1model"), parse_program("tna")
    assert v1["tables"] == tna["tables"]
    assert v1["actions"] == tna["actions"]


def test_driver_schema_loads_both_p4infos():
    for info in [p4info(a) for a in ARCHS] + [compiled_p4info(a) for a in ARCHS]:
        schema = p4tables.Schema(info)
        for spec in p4tables.entries(plan_mod.build(config.load(config.default_path()))):
            assert schema.from_proto(schema.to_proto(spec)) == spec
    assert all(p4tables.Schema(p4info(a)).source_checked for a in ARCHS)
    assert all(p4tables.Schema(compiled_p4info(a)).source_checked for a in ARCHS)
    # a build from before the source check (fc59cb5) loads, without it
    assert not any(p4tables.Schema(unchecked_p4info(a)).source_checked for a in ARCHS)


def test_ckm_header_view_is_generated_and_matches_wire_fields():
    text = (P4 / "include" / "ckm_headers.p4").read_text()
    assert text == wire_gen.p4_view(), "regenerate with python -m checkmate.protocol.wire_gen"
    assert header_types()["ckm_h"] == {f.name: f.size * 8 for f in wire.FIELDS}
    assert list(header_types()["ckm_h"]) == [f.name for f in wire.FIELDS]
    # The programs use the generated view, through the shared include chain.
    assert '#include "ckm_headers.p4"' in include("checkmate_common.p4")
    assert '#include "checkmate_common.p4"' in include("checkmate_parser.p4")
    for arch in ARCHS:
        assert '#include "include/checkmate_parser.p4"' in source(arch)
        assert "header ckm_h" not in source(arch)
    # Every ckm field the P4 code touches exists with the width the controller writes.
    used = set()
    for text in [source(a) for a in ARCHS] + [include("checkmate_parser.p4")]:
        used |= set(re.findall(r"hdr\.ckm\.(\w+)", text))
    names = {f.name for f in wire.FIELDS}
    assert used and used <= names | {"isValid", "setValid"}
    widths = {f.name: f.size * 8 for f in wire.FIELDS}
    keys = dict(parse_program("v1model")["tables"]["CkmIngress.ckm_replicate"]["keys"])
    assert keys["job_id"] == widths["job_id"] and keys["partition"] == widths["partition"]
    rw = dict(parse_program("v1model")["actions"]["CkmEgress.rewrite_shadow"])
    assert rw["epoch"] == widths["epoch"] and rw["token"] == widths["token"]


def _macros() -> dict[str, int]:
    text = include("ckm_headers.p4")
    return {k: int(v, 0) for k, v in re.findall(r"#define\s+(\w+)\s+(\w+)", text)
            if re.fullmatch(r"(0x)?[0-9a-fA-F]+", v)}


def test_parser_port_masks_cover_exactly_the_ckm_range():
    text = include("checkmate_parser.p4")
    pairs = [(int(v, 16), int(m, 16)) for v, m in
             re.findall(r"16w0x([0-9a-f]+)\s*&&&\s*16w0x([0-9a-f]+)\s*:\s*ckm_port", text)]
    covered = {p for p in range(1 << 16) if any(p & m == v for v, m in pairs)}
    assert covered == set(range(wire.CKM_PORT_BASE, wire.CKM_PORT_BASE + wire.CKM_PORT_COUNT))
    assert "CKM_MAGIC" in text and "CKM_VERSION" in text
    assert _macros()["CKM_MAGIC"] == wire.MAGIC and _macros()["CKM_VERSION"] == wire.VERSION


def test_constants_agree_with_controller():
    common = include("checkmate_common.p4")
    consts = {n: v for n, v in re.findall(r"const\s+bit<\d+>\s+(\w+)\s*=\s*([^;]+);", common)}
    env = dict(_macros())
    value = {n: eval(v, {}, env) for n, v in consts.items()}  # noqa: S307 - our own file
    assert value["CKM_CONTROLLER_PORT"] == config.CONTROLLER_PORT
    assert value["FLOOD_GROUP"] == plan_mod.FLOOD_GROUP
    assert value["CKM_COS"] == pfc.CKM_PRIORITY and value["CKM_QID"] == pfc.CKM_QID
    stats = sorted((v, n) for n, v in value.items() if n.startswith("STAT_") and n != "STAT_SIZE")
    assert [n.removeprefix("STAT_").lower() for _, n in stats] == \
        ["plain", "replicated", "no_entry", "malformed", "handshake", "spoofed", "parser_error"]
    assert len(stats) <= value["STAT_SIZE"]
    assert value["CKM_DSCP"] == pfc.CKM_DSCP and value["ETHERTYPE_VLAN"] == 0x8100
    assert [v for v, _ in stats] == list(range(len(stats)))
    assert tuple(n.removeprefix("STAT_").lower() for _, n in stats) == p4rt_driver.STAT_NAMES


@pytest.mark.parametrize("arch", ARCHS)
def test_shadow_copy_rewrites_checksums_and_egress_by_rid(arch):
    text = source(arch)
    eg = block(text, text.index("control CkmEgress("))
    assert "hdr.udp.checksum = 0" in eg
    assert "egress_rid != 0" in eg
    if arch == "v1model":
        assert "update_checksum(" in text and "meta.shadow_copy == 1" in text
    else:
        assert "ipv4_checksum.update(" in text and "meta.shadow_copy == 1" in text
        assert "ig_tm_md.qid = (QueueId_t)CKM_QID" in text
        assert "ig_tm_md.ingress_cos = CKM_COS" in text


INGRESS_PORT = {"v1model": "std_md.ingress_port", "tna": "ig_intr_md.ingress_port"}
MCAST = {"v1model": "std_md.mcast_grp", "tna": "ig_tm_md.mcast_grp_a"}


@pytest.mark.parametrize("arch", ARCHS)
def test_replicate_copies_only_from_the_entrys_ingress_port(arch):
    """The entry's action only records the group and the source host's port; the group is
    set, and the copy counted, only inside the comparison with the frame's ingress port;
    the other branch counts spoofed and leaves the datagram to L2 forwarding."""
    text = source(arch)
    ig = block(text, text.index("control CkmIngress("))
    params = dict(parse_program(arch)["actions"]["CkmIngress.replicate"])
    assert params == {"group": 16, "ingress_port": 9}
    action = block(ig, ig.index("action replicate("))
    assert MCAST[arch] not in action and "STAT_REPLICATED" not in action
    apply = block(ig, ig.index("apply {"))
    hit = apply.index("ckm_replicate.apply().hit")
    check = f"if ({INGRESS_PORT[arch]} == meta.repl_port)"
    assert apply.index(check) > hit
    copy = block(apply, apply.index(check))
    assert f"{MCAST[arch]} = meta.repl_group;" in copy and "outcome = STAT_REPLICATED;" in copy
    assert apply.count(f"{MCAST[arch]} = meta.repl_group") == 1
    after = apply[apply.index(check) + len(check):]
    spoofed = block(after, after.index("else"))
    assert "outcome = STAT_SPOOFED;" in spoofed and MCAST[arch] not in spoofed
    assert "steered" not in spoofed  # falls through to l2_fwd: forwarded plainly
    # fragments are never copied (docs/protocol.md): only unfragmented REPLICATE looks up
    assert "(hdr.ipv4.flags & IPV4_FLAG_MF) == 0" in apply[:hit]


def _length_body() -> str:
    text = include("checkmate_checks.p4")
    return block(text, text.index("control CkmLengthCheck("))


def _table_action_body(body: str, table: str) -> str:
    """The body of the action ``table`` always runs: a keyless table whose only action is
    its const default action."""
    tb = block(body, body.index(f"table {table} {{"))
    assert "key" not in tb, table
    (action,) = re.findall(r"const default_action = (\w+)\(\);", tb)
    assert [a.strip() for a in block(tb, tb.index("actions")).split(";") if a.strip()] == [
        action]
    return block(body, body.index(f"action {action}()"))


def _meta_widths() -> dict[str, int]:
    common = include("checkmate_common.p4")
    struct = block(common, common.index("struct ckm_meta_t"))
    return {n: int(w) for w, n in re.findall(r"bit<(\d+)>\s+(\w+);", struct)}


@functools.cache
def _length_program():
    """CkmLengthCheck's apply block as written (the text of checkmate_checks.p4, translated
    line by line to Python): metadata assignments truncated to their declared widths,
    slices, constants and macros from the P4 files. Only the constructs that control uses
    are translated; anything else fails the translation."""
    env = _consts()
    checks = include("checkmate_checks.p4")
    for name, value in re.findall(r"#define\s+(\w+)\s+(\(.*\))", checks):
        env[name] = eval(value, {}, env)  # noqa: S307 - our own file
    widths = _meta_widths()
    body = block(_length_body(), _length_body().index("apply {"))
    py, depth = [], 0

    def expr(e: str) -> str:
        e = re.sub(r"([\w.]+)\[(\d+):(\d+)\]", r"_sl(\1, \2, \3)", e)
        e = e.replace("&&", " and ").replace("||", " or ").replace(" / ", " // ")
        e = re.sub(r"hdr\.(\w+)\.(\w+)", r"hdr_\1_\2", e)
        return re.sub(r"meta\.(\w+)", r"meta['\1']", e)

    lines = []
    for line in body.splitlines()[1:-1]:
        if m := re.fullmatch(r"(\w+)\.apply\(\);", line.strip()):  # its action's lines
            lines += _table_action_body(_length_body(), m.group(1)).splitlines()
        else:
            lines.append(line)
    for line in lines:
        line = line.strip()
        if not line:
            continue
        if m := re.fullmatch(r"(?:} else )?if \((.*)\) {", line):
            depth -= line.startswith("}")
            py.append("    " * depth + ("elif " if line.startswith("}") else "if ")
                      + expr(m.group(1)) + ":")
            depth += 1
        elif line == "}":
            depth -= 1
        elif m := re.fullmatch(r"meta\.(\w+) = (.*);", line):
            py.append("    " * depth + f"meta['{m.group(1)}'] = ({expr(m.group(2))}) "
                      f"& {(1 << widths[m.group(1)]) - 1}")
        elif m := re.fullmatch(r"ok = (true|false);", line):
            py.append("    " * depth + f"ok = {m.group(1) == 'true'}")
        else:
            raise AssertionError(f"CkmLengthCheck: untranslated line {line!r}")
    return compile("\n".join(py), "CkmLengthCheck", "exec"), env


def p4_length_check(udp_length: int, count: int, dtype: int) -> bool:
    """What the P4 length check decides for these header values (_length_program)."""
    code, env = _length_program()
    scope = {**env, "meta": {}, "ok": None, "hdr_udp_length": udp_length,
             "hdr_ckm_count": count, "hdr_ckm_dtype": dtype,
             "_sl": lambda v, hi, lo: (v >> lo) & ((1 << (hi - lo + 1)) - 1)}
    exec(code, scope)  # noqa: S102 - our own P4, translated above
    return scope["ok"]


def kernel_length_rule(udp_length: int, count: int, dtype: int) -> bool:
    """dataplane/bpf/ckm_switch.c, length_ok and its caller: a UDP length of at least the
    UDP and ckm headers, a known dtype, and count * size (64-bit, no wrap) equal to the
    payload."""
    if udp_length < 8 + wire.HEADER_LEN:
        return False
    size = {int(d): wire.DTYPE_SIZE[d] for d in wire.DType}.get(dtype)
    return size is not None and count * size == udp_length - 8 - wire.HEADER_LEN


def test_length_check_is_the_kernel_switchs_rule():
    """The same rule as the kernel switch, over the boundaries where a 16-bit form could
    differ: counts at and past each bound, products that wrap 16 bits onto a valid
    payload, UDP lengths shorter than the headers, unknown dtypes."""
    dtypes = [int(d) for d in wire.DType] + [len(wire.DType), 0xFF]
    counts = {0, 1, 2, 3, (1 << 14) - 1, 1 << 14, (1 << 14) + 1, (1 << 15) - 1, 1 << 15,
              (1 << 16) - 1, 1 << 16, (1 << 16) + 1, 1 << 31, (1 << 32) - 1}
    for size in set(wire.DTYPE_SIZE.values()):
        top = (65535 - 8 - wire.HEADER_LEN) // size
        counts |= {top - 1, top, top + 1, top + (1 << 16) // size}
    lengths = {0, 1, 8, 63, 64, 65, 65534, 65535}
    for c in counts:
        for size in set(wire.DTYPE_SIZE.values()):
            lengths |= {(64 + c * size) % (1 << 16), (c * size) % (1 << 16)}
    cases = [(n, c, d) for n in sorted(lengths) for c in sorted(counts) for d in dtypes]
    wrong = [x for x in cases if p4_length_check(*x) != kernel_length_rule(*x)]
    assert wrong == []
    # the cases the kernel switch is sent in test_dataplane, with their written verdicts
    for count, dtype, payload, ok in LENGTH_RULE_CASES:
        udp_length = 8 + wire.HEADER_LEN + payload
        assert p4_length_check(udp_length, count, dtype) == ok, (count, dtype, payload)
        assert kernel_length_rule(udp_length, count, dtype) == ok, (count, dtype, payload)
    assert sum(kernel_length_rule(*x) for x in cases) > 20  # the accepting side is covered
    # and a datagram the senders build passes it
    h = wire.Header(flags=wire.Flags.REPLICATE, count=5, dtype=wire.DType.FLOAT32)
    assert p4_length_check(8 + len(wire.encode(h, bytes(20))), 5, int(wire.DType.FLOAT32))


def test_length_check_has_the_form_tofino_computes():
    """What bf-p4c rejected (docs/architecture.md, "Compiling for Tofino"): the value of a
    comparison assigned in an action, and 32-bit arithmetic on computed values. Here: only
    16-bit metadata, each computed once from packet fields and constants before any test,
    none from another; comparisons only in if-conditions; ok only ever a constant."""
    body = _length_body()
    apply = block(body, body.index("apply {"))
    # The lengths are computed in the action of a keyless, hidden table applied before
    # any test: the compiler cannot fold them into the gateways ("condition expression
    # too complex" when they were assigned in the apply block), and P4Info omits it.
    (table,) = re.findall(r"^\s*(\w+)\.apply\(\);", apply, re.M)
    assert apply.index(f"{table}.apply();") < apply.index("if (")
    assert re.search(rf"@hidden table {table} {{", body)
    action = _table_action_body(body, table)
    assert re.search(r"@hidden action \w+\(\) {", body)
    assert "bit<32>" not in apply + action and "(bit<" not in apply + action
    assigns = re.findall(r"^\s*([\w.]+)\s*=\s*([^;]+);", apply, re.M)
    assert {t for t, _ in assigns} == {"ok"}
    assert all(v in ("true", "false") for _, v in assigns)
    computed = re.findall(r"^\s*([\w.]+)\s*=\s*([^;]+);", action, re.M)
    assert len(computed) == 5
    for target, value in computed:
        assert not re.search(r"==|!=|<|>", value), (target, value)
        assert target.startswith("meta.len_") and "meta." not in value, (target, value)
        assert _meta_widths()[target.removeprefix("meta.")] == 16
    sizes = {k: v for k, v in _macros().items() if k.endswith("_SIZE")}
    assert sizes == {f"CKM_DT_{d.name}_SIZE": wire.DTYPE_SIZE[d] for d in wire.DType}
    for d in wire.DType:  # one branch per dtype, bounded before its compare
        branch = block(apply, apply.index(f"hdr.ckm.dtype == CKM_DT_{d.name})"))
        assert f"hdr.ckm.count[15:0] <= CKM_MAX_PAYLOAD / CKM_DT_{d.name}_SIZE" in branch
        assert f"meta.len_{d.name.lower()} == meta.len_payload" in branch
    common = include("checkmate_common.p4")
    overhead = re.search(r"CKM_UDP_OVERHEAD\s*=\s*([^;]+);", common)[1]
    assert eval(overhead, {}, _macros()) == 8 + wire.HEADER_LEN  # noqa: S307 - our own file


@pytest.mark.parametrize("arch", ARCHS)
def test_only_well_formed_ckm_is_steered(arch):
    """The length check runs first; a datagram failing it counts malformed (or a parser
    error) and takes the plain path (no punt, no copy), like one the parser rejected."""
    text = source(arch)
    assert '#include "include/checkmate_checks.p4"' in text
    ig = block(text, text.index("control CkmIngress("))
    apply = block(ig, ig.index("apply {"))
    first = apply.index("ckm_length.apply(hdr, meta, well_formed);")
    assert first < apply.index("if (well_formed)")
    wf = block(apply, apply.index("if (well_formed)"))
    assert "counted = true;" in wf
    assert "ckm_punt.apply()" in wf and "ckm_replicate.apply()" in wf
    assert "STAT_MALFORMED" not in wf and "STAT_PARSER_ERROR" not in wf
    assert apply.count("ckm_punt.apply()") == apply.count("ckm_replicate.apply()") == 1
    rest = apply[apply.index("if (well_formed)"):]
    malformed = block(rest, rest.index("else if (meta.ckm_port == 1)"))
    assert "outcome = STAT_MALFORMED;" in malformed and "counted = true;" in malformed


# -- rules of the compilers -------------------------------------------------------------
def _ingress(arch: str) -> str:
    text = source(arch)
    return block(text, text.index("control CkmIngress("))


def _actions(body: str) -> dict[str, str]:
    return {m.group(1): block(body, m.end()) for m in
            re.finditer(r"action\s+(\w+)\s*\([^)]*\)", body)}


@pytest.mark.parametrize("arch", ARCHS)
def test_indexed_counters_are_counted_once_outside_actions(arch):
    """Tofino: an indexed counter may be accessed once per packet, and an action that counts
    a direct counter may not also index another counter (the errors bf-p4c and p4c's
    Tofino backend gave). One call site, in the apply block, not inside an action, makes
    "at most one access per packet" hold on every path."""
    prog = parse_program(arch)
    for ctrl in ("CkmIngress", "CkmEgress"):
        text = source(arch)
        body = block(text, text.index(f"control {ctrl}("))
        indexed = [c.split(".")[1] for c in prog["counters"] if c.startswith(ctrl + ".")]
        direct = [c.split(".")[1] for c in prog["direct"] if c.startswith(ctrl + ".")]
        for name, act in _actions(body).items():
            assert not any(f"{c}.count(" in act for c in indexed), f"{ctrl}.{name}"
        for c in indexed:
            assert body.count(f"{c}.count(") == 1, c
            apply = block(body, body.index("apply {"))
            assert f"{c}.count(" in apply, c
        for c in direct:  # direct counters only ever inside actions, without an index
            assert all(re.search(rf"{c}\.count\(\)", a) or f"{c}." not in a
                       for a in _actions(body).values())
            assert f"{c}." not in block(body, body.index("apply {")), c
    assert prog["counters"] == {"CkmIngress.ckm_stats", "CkmIngress.l2_miss",
                                "CkmIngress.src_check", "CkmEgress.rewrite_miss"}


@pytest.mark.parametrize("arch", ARCHS)
def test_every_ckm_port_outcome_is_one_stats_index(arch):
    """Each branch sets the local outcome; the single count is guarded by `counted`, which
    exactly the ckm-port branches set (well-formed, parser error, malformed)."""
    apply = block(_ingress(arch), _ingress(arch).index("apply {"))
    assert "bit<32> outcome = STAT_PLAIN;" in apply and "bool counted = false;" in apply
    tail = block(apply, apply.index("if (counted)"))
    assert tail.strip() == "ckm_stats.count(outcome);"
    assert apply.count("counted = true;") == 3
    assert apply.index("if (counted)") > apply.rindex("outcome = ")
    for stat in ("HANDSHAKE", "REPLICATED", "SPOOFED", "NO_ENTRY", "PARSER_ERROR",
                 "MALFORMED"):
        assert apply.count(f"outcome = STAT_{stat};") == 1, stat


PARSER_ERR = {"v1model": "std_md.parser_error != error.NoError",
              "tna": "ig_prsr_md.parser_err != 0"}


@pytest.mark.parametrize("arch", ARCHS)
def test_parser_errors_are_consumed_and_misses_counted(arch):
    """Tofino drops a frame with a parser error unless ingress reads parser_err; both
    programs read it, count STAT_PARSER_ERROR and let the frame go on to L2 forwarding.
    l2_fwd's default flood() has no entry for its direct counter: misses count l2_miss."""
    apply = block(_ingress(arch), _ingress(arch).index("apply {"))
    branch = block(apply, apply.index(f"else if ({PARSER_ERR[arch]})"))
    assert "outcome = STAT_PARSER_ERROR;" in branch
    assert "drop" not in branch and "mark_to_drop" not in apply
    miss = block(apply, apply.index("if (!l2_fwd.apply().hit)"))
    assert miss.strip().startswith("l2_miss.count(0);")
    text = source(arch)
    eg = block(text, text.index("control CkmEgress("))
    eg_apply = block(eg, eg.index("apply {"))
    miss = block(eg_apply, eg_apply.index("if (!shadow_rewrite.apply().hit)"))
    assert miss.strip() == "rewrite_miss.count(0);"


LOSSLESS = {"v1model": ["std_md.priority = CKM_COS;"],
            "tna": ["ig_tm_md.qid = (QueueId_t)CKM_QID;", "ig_tm_md.ingress_cos = CKM_COS;"]}


@pytest.mark.parametrize("arch", ARCHS)
def test_lossless_class_by_ckm_dscp_or_pcp(arch):
    checks = include("checkmate_checks.p4")
    ctl = block(checks, checks.index("control CkmLossless("))
    assert "lossless = well_formed;" in ctl
    assert block(ctl, ctl.index("if (hdr.ipv4.dscp == CKM_DSCP)")).strip() == "lossless = true;"
    assert block(ctl, ctl.index("if (hdr.vlan.pcp == CKM_COS)")).strip() == "lossless = true;"
    assert ctl.index("if (hdr.ipv4.isValid())") < ctl.index("hdr.ipv4.dscp")
    assert ctl.index("if (hdr.vlan.isValid())") < ctl.index("hdr.vlan.pcp")
    apply = block(_ingress(arch), _ingress(arch).index("apply {"))
    assert "ckm_lossless.apply(hdr, well_formed, lossless);" in apply
    body = block(apply, apply.index("if (lossless)"))
    assert all(s in body for s in LOSSLESS[arch])
    assert all(apply.count(s) == 1 for s in LOSSLESS[arch])


@pytest.mark.parametrize("arch", ARCHS)
def test_deparsers_emit_the_vlan_tag_in_place(arch):
    text = source(arch)
    emits = re.findall(r"pkt\.emit\(hdr\.(\w+)\);", text)
    order = [h for h in emits if h != "bridge"]
    n = {"v1model": 1, "tna": 2}[arch]
    assert order == ["ethernet", "vlan", "arp", "ipv4", "udp", "ckm"] * n


# -- the shared parser, run on frames ---------------------------------------------------
def _consts() -> dict[str, int]:
    env = dict(_macros())
    common = include("checkmate_common.p4")
    for n, v in re.findall(r"const\s+bit<\d+>\s+(\w+)\s*=\s*([^;]+);", common):
        env[n] = eval(v, {}, env)  # noqa: S307 - our own file
    return env


def _value(expr: str, env: dict[str, int]) -> int:
    expr = expr.strip()
    if "++" in expr:  # (bit<A>)X ++ (bit<B>)Y
        out = 0
        if expr.startswith("((") and expr.endswith(")"):
            expr = expr[1:-1]
        for part in expr.split("++"):
            w, inner = re.fullmatch(r"\s*\(bit<(\d+)>\)(\w+)\s*", part).groups()
            out = out << int(w) | _value(inner, env)
        return out
    m = re.fullmatch(r"(\d+)w(0x[0-9a-fA-F]+|\d+)", expr)
    if m:
        return int(m.group(2), 0)
    return env[expr] if expr in env else int(expr, 0)


def _split_top(text: str) -> list[str]:
    out, depth, cur = [], 0, ""
    for ch in text:
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    return [*out, cur]


def run_parser(frame: bytes) -> tuple[dict[str, dict[str, int]], dict[str, int], str]:
    """Interpret CkmPacketParser on ``frame``: (headers extracted, meta set, last state).
    Handles what the shared parser uses: extract, meta assignments, lookahead, select on
    fields or tuples with value, value &&& mask and default cases."""
    text = include("checkmate_parser.p4")
    body = block(text, text.index("parser CkmPacketParser("))
    states = {m.group(1): block(body, m.start()) for m in
              re.finditer(r"state\s+(\w+)\s*{", body)}
    types = header_types()
    struct = headers_struct()
    env = _consts()
    bits = "".join(f"{b:08b}" for b in frame)
    pos, hdr, meta, state = 0, {}, {}, "start"
    for _ in range(20):
        st = states[state]
        for name in re.findall(r"pkt\.extract\((\w+)\);", st):
            fields = {}
            for f, w in types[struct[name]].items():
                if pos + w > len(bits):
                    return hdr, meta, f"error:{state}"
                fields[f] = int(bits[pos:pos + w], 2)
                pos += w
            hdr[name] = fields
        for k, v in re.findall(r"meta\.(\w+)\s*=\s*(\w+);", st):
            meta[k] = _value(v, env)
        nxt = re.search(r"transition\s+(\w+)\s*;", st)
        if nxt:
            return hdr, meta, state if nxt.group(1) == "accept" else nxt.group(1)
        sel = re.search(r"transition\s+select\((.*?)\)\s*{", st, re.S)
        keys = []
        for k in _split_top(sel.group(1)):
            k = k.strip()
            if k.startswith("pkt.lookahead<bit<"):
                w = int(re.search(r"bit<(\d+)>", k).group(1))
                if pos + w > len(bits):
                    return hdr, meta, f"error:{state}"
                keys.append(int(bits[pos:pos + w], 2))
            else:
                h, f = k.split(".")
                keys.append(hdr[h][f])
        cases = block(st, sel.end() - 1)
        target = None
        for case, dest in re.findall(r"([^;:]+?)\s*:\s*(\w+)\s*;", cases):
            case = case.strip()
            if case == "default":
                target = dest
                break
            vals = _split_top(case[1:-1]) if case.startswith("(") and len(keys) > 1 \
                else [case]
            ok = True
            for key, v in zip(keys, vals, strict=True):
                if "&&&" in v:
                    val, mask = (_value(x, env) for x in v.split("&&&"))
                    ok &= key & mask == val
                else:
                    ok &= key == _value(v, env)
            if ok:
                target = dest
                break
        if target == "accept":
            return hdr, meta, state
        state = target
    raise AssertionError("parser loop")


def _ckm_frame(vlan_pcp: int | None, dport: int = 47001, dscp: int = 24) -> bytes:
    from scapy.layers.inet import IP, UDP
    from scapy.layers.l2 import Dot1Q, Ether

    payload = wire.encode(wire.Header(flags=wire.Flags.REPLICATE, job_id=7, epoch=1, token=2,
                                      iteration=3, count=4, seq=5, partition=1,
                                      dtype=wire.DType.FLOAT32), bytes(16))
    l2 = Ether(dst="02:00:0a:4d:00:0b", src="02:00:0a:4d:00:0a")
    if vlan_pcp is not None:
        l2 = l2 / Dot1Q(prio=vlan_pcp, vlan=10)
    return bytes(l2 / IP(src="10.77.0.10", dst="10.77.0.11", tos=dscp << 2)
                 / UDP(sport=40000, dport=dport) / payload)


def test_parser_recognises_vlan_tagged_ckm_and_reads_pcp_and_dscp():
    hdr, meta, last = run_parser(_ckm_frame(vlan_pcp=3))
    assert last == "parse_ckm" and meta["ckm_port"] == 1
    assert hdr["vlan"]["pcp"] == pfc.CKM_PRIORITY and hdr["vlan"]["vid"] == 10
    assert hdr["ipv4"]["dscp"] == pfc.CKM_DSCP
    assert hdr["ckm"]["magic"] == wire.MAGIC and hdr["ckm"]["partition"] == 1
    assert hdr["ckm"]["job_id"] == 7 and hdr["udp"]["dst_port"] == 47001


def test_parser_untagged_ckm_and_plain_traffic():
    hdr, meta, last = run_parser(_ckm_frame(vlan_pcp=None))
    assert last == "parse_ckm" and "vlan" not in hdr and hdr["ckm"]["count"] == 4
    hdr, meta, last = run_parser(_ckm_frame(vlan_pcp=0, dport=53, dscp=0))
    assert last == "parse_udp" and "ckm" not in hdr and meta["ckm_port"] == 0
    # a ckm port with a payload shorter than the header is a parser error, not ckm
    frame = _ckm_frame(vlan_pcp=3)
    hdr, meta, last = run_parser(frame[:14 + 4 + 20 + 8 + 10])
    assert last == "error:parse_ckm" and meta["ckm_port"] == 1 and "ckm" not in hdr


# -- build commands ----------------------------------------------------------------------
#: The P4Info suffixes p4c knows ("unknown file kind; known suffixes are .bin, .txt, .json,
#: and .txtpb", its answer to .binpb).
P4C_P4INFO_SUFFIXES = {".bin", ".txt", ".json", ".txtpb"}


def _commands(text: str) -> list[list[str]]:
    """Shell commands in ``text`` (comment stars and indentation stripped, backslash
    continuations joined), each as its words."""
    lines = [re.sub(r"^\s*\*?\s*", "", ln) for ln in text.splitlines()]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    return [ln.split() for ln in joined.splitlines()
            if ln.split() and ln.split()[0] in ("mkdir", "p4c-bm2-ss", "bf-p4c")]


@pytest.mark.parametrize("arch", ARCHS)
def test_build_commands_work_as_written(arch):
    """The commands in the program's header and in docs/architecture.md are the same, make
    the folder they write into, give p4c only P4Info suffixes it knows, and write where
    the controller reads (control/pipeline.py)."""
    from checkmate.control import pipeline

    raw = (P4 / f"checkmate_{arch}.p4").read_text()
    header = raw[:raw.index("*/")]
    doc = (P4.parent / "docs" / "architecture.md").read_text()
    doc = doc[doc.index("<!-- p4-build-commands -->"):doc.index("<!-- /p4-build-commands -->")]
    compiler = {"v1model": "p4c-bm2-ss", "tna": "bf-p4c"}[arch]
    program = f"p4/{pipeline.PROGRAMS[arch]}.p4"
    cmds = [c for c in _commands(header) if c[0] == "mkdir" or c[0] == compiler]
    assert [c for c in _commands(doc) if c[-1] == program or
            (c[0] == "mkdir" and c[-1].endswith(pipeline.PROGRAMS[arch]))] == cmds
    (mkdir, compile_), = [cmds]
    folder = f"build/p4/{pipeline.PROGRAMS[arch]}"
    assert mkdir == ["mkdir", "-p", folder]
    assert compile_[-1] == program
    out = compile_[compile_.index("-o") + 1]
    assert out == (folder if arch == "tna" else f"{folder}/{pipeline.PROGRAMS[arch]}.json")
    files = compile_[compile_.index("--p4runtime-files") + 1].split(",")
    assert all(Path(f).suffix in P4C_P4INFO_SUFFIXES for f in files), files
    assert all(str(Path(f).parent) == folder for f in files), files
    names = [Path(f).name for f in files]
    assert set(names) <= set(pipeline.P4INFO_FILES)
    if arch == "tna":  # the binary one carries Tofino extern payloads through
        assert "p4info.bin" in names
    for inc in ("p4", "p4/include"):
        assert inc in [compile_[i + 1] for i, w in enumerate(compile_) if w == "-I"]


def test_parser_reads_nothing_uninitialized():
    """p4c warned "may be uninitialized" for what the callers passed in and for the
    parsers' out meta: the shared parser takes only out parameters and sets every metadata
    field in its first state."""
    text = include("checkmate_parser.p4")
    sig = re.search(r"parser CkmPacketParser\(([^)]*)\)", text).group(1)
    params = [p.split() for p in sig.split(",")][1:]  # after packet_in
    assert all(p[0] == "out" for p in params), params
    assert [p[2] for p in params] == [h for h in headers_struct() if h != "bridge"] + ["meta"]
    body = block(text, text.index("parser CkmPacketParser("))
    start = block(body, body.index("state start"))
    assert set(re.findall(r"meta\.(\w+)\s*=", start)) == set(_meta_widths())
    for arch in ARCHS:
        calls = re.findall(r"packet_parser\.apply\(([^)]*)\);", source(arch))
        assert calls and all([a.strip() for a in c.split(",")][1:] == [
            f"hdr.{p[2]}" for p in params[:-1]] + ["meta"] for c in calls), calls


DROP = {"v1model": "drop();", "tna": "ig_dprsr_md.drop_ctl = 1;"}


#: The MAC comparison: whole on v1model; on Tofino 1 as its high 16 and low 32 bits (one
#: gateway takes at most 44 bits of PHV input: "condition too complex" for 48).
MAC_CHECK = {"v1model": ["if (hdr.ethernet.src_addr == meta.bind_mac)"],
             "tna": ["if (hdr.ethernet.src_addr[47:32] == meta.bind_mac[47:32])",
                     "if (hdr.ethernet.src_addr[31:0] == meta.bind_mac[31:0])"]}
#: The ARP sender's checks, the IP last (a sender IP is checked only with its MAC right).
ARP_CHECK = {"v1model": ["if (hdr.arp.hw_len != 6 || hdr.arp.proto_len != 4)",
                         "else if (hdr.arp.sender_mac != meta.bind_mac)",
                         "else if (hdr.arp.sender_ip == meta.bind_ip)"],
             "tna": ["if (hdr.arp.hw_len != 6)", "else if (hdr.arp.proto_len != 4)",
                     "else if (hdr.arp.sender_mac[47:32] != meta.bind_mac[47:32])",
                     "else if (hdr.arp.sender_mac[31:0] != meta.bind_mac[31:0])",
                     "else if (hdr.arp.sender_ip == meta.bind_ip)"]}


@pytest.mark.parametrize("arch", ARCHS)
def test_every_frame_is_source_checked_first_and_dropped_when_foreign(arch):
    """Issue 23: the source check comes before anything else in ingress (length check,
    punt, replication, L2, classification), compares the Ethernet source with the MAC bound
    to the ingress port and an IPv4 source with the bound address, and a frame that fails
    (or enters a port with no binding) is counted once in src_check, dropped and goes no
    further; the binding's action only records the addresses."""
    ig = _ingress(arch)
    apply = block(ig, ig.index("apply {"))
    first = apply.index("if (port_bind.apply().hit)")
    for later in ("ckm_length.apply", "ckm_punt.apply", "ckm_replicate.apply",
                  "l2_fwd.apply", "ckm_lossless.apply"):
        assert apply.index(later) > first, later
    ip_rule = block(apply, first)
    for cond in MAC_CHECK[arch]:  # nested: every bit of the MAC compared
        ip_rule = block(ip_rule, ip_rule.index(cond))
    assert "else if (!hdr.ipv4.isValid())" in ip_rule
    assert "else if (hdr.ipv4.src_addr == meta.bind_ip)" in ip_rule
    assert "source_bad = SRC_BAD_IP;" in ip_rule
    # An ARP frame's sender is a source too (the kernel switch's rule): Ethernet/IPv4
    # lengths, every bit of the sender MAC, then the sender IP, before anything else.
    arp = block(ip_rule, ip_rule.index("if (hdr.arp.isValid())"))
    assert ip_rule.index("if (hdr.arp.isValid())") < ip_rule.index("else if (!hdr.ipv4.")
    for cond in ARP_CHECK[arch]:
        assert cond in arp, cond
    assert arp.index(ARP_CHECK[arch][-1]) > max(arp.index(c) for c in ARP_CHECK[arch][:-1])
    assert arp.count("source_ok = true;") == 1
    assert arp.count("source_bad = SRC_BAD_MAC;") == len(MAC_CHECK[arch])
    assert "bool source_ok = false;" in apply and "bit<32> source_bad = SRC_BAD_MAC;" in apply
    assert apply.count("source_ok = true;") == 3
    fail = block(apply, apply.index("if (!source_ok)"))
    assert [ln.strip() for ln in fail.strip().splitlines()] == [
        "src_check.count(source_bad);", DROP[arch], "exit;"]
    assert apply.index("if (!source_ok)") < apply.index("if (hdr.ckm.isValid())")
    action = block(ig, ig.index("action bind_source("))
    assert "meta.bind_mac = mac;" in action and "meta.bind_ip = ip;" in action
    assert "drop" not in action and "src_check" not in action
    assert dict(parse_program(arch)["tables"]["CkmIngress.port_bind"]["keys"]) == {
        "ingress_port": 9}
