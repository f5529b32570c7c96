"""The ckm NCCL net plugin's ABI: exported symbols, struct layouts and vtable order against
the documented NCCL plugin interface, NCCL's loader rules, and the settings it refuses.

No NCCL and no GPU here: the layout is NCCL's documented one (testbed/nccl_abi.LAYOUT), the
plugin is called through ctypes exactly as NCCL calls it."""

from __future__ import annotations

import ctypes as C
import os
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from checkmate.testbed import nccl_abi as abi

REPO = Path(__file__).resolve().parent.parent



def test_nccl_exports_only_the_plugin_versions(nccl_plugin):
    out = subprocess.run(["nm", "-D", "--defined-only", str(nccl_plugin)], capture_output=True,
                         text=True, check=True).stdout
    names = {line.split()[-1] for line in out.splitlines() if line.strip()}
    assert names == {"ncclNetPlugin_v12", "ncclNetPlugin_v11", "ncclNetPlugin_v10",
                     "ncclProfiler_v6", "ncclTunerPlugin_v5"}


@pytest.mark.parametrize("struct_name", sorted(abi.LAYOUT))
def test_nccl_ctypes_declarations_follow_the_documented_layout(struct_name):
    layout, ct = abi.LAYOUT[struct_name], abi.CTYPES[struct_name]
    assert C.sizeof(ct) == layout["sizeof"]
    got = {name: getattr(ct, name).offset for name, _ in ct._fields_}
    assert got == {k: v for k, v in layout.items() if k != "sizeof"}
    if struct_name.startswith("ncclNet_"):  # a vtable: the fields in documented order
        assert [n for n, _ in ct._fields_] == sorted(got, key=got.get)


def test_nccl_profiler_descriptor_members_at_documented_offsets():
    base = abi.EventDescr6.u.offset
    for path, want in abi.DESCR_MEMBERS.items():
        member, field = path.split(".")
        assert getattr(abi._Descr, member).offset == 0  # a union: every member at its start
        st = {"coll": abi._Coll, "proxyOp": abi._ProxyOp, "proxyStep": abi._ProxyStep,
              "netPlugin": abi._NetPlugin}[member]
        assert base + getattr(st, field).offset == want, path


def test_nccl_profiler_vtable_and_activation(nccl_plugin, tmp_path):
    """The profiler half asks NCCL for nothing unless the profiler identity is on."""
    prog = textwrap.dedent("""
        import ctypes as C, sys
        sys.path.insert(0, sys.argv[2])
        from checkmate.testbed import nccl_abi as abi
        lib = C.CDLL(sys.argv[1])
        p = abi.Profiler6.in_dll(lib, "ncclProfiler_v6")
        ctx, mask = C.c_void_p(), C.c_int(-1)
        r = p.init(C.byref(ctx), 1, C.byref(mask), b"c", 1, 4, 1, None)
        print(p.name.decode(), r, mask.value)
    """)
    from checkmate.testbed.nccl_harness import plugin_env

    base = {k: v for k, v in os.environ.items() if not k.startswith(("CKM_NCCL", "NCCL_"))}
    base.update(plugin_env(1, 4, 4, 1 << 22, [1000, 24], 2, 7, "127.0.0.1"))
    outs = []
    for ident in ("model", "profiler"):
        env = {**base, "CKM_NCCL_IDENTITY": ident}
        outs.append(subprocess.run([sys.executable, "-c", prog, str(nccl_plugin), str(REPO)],
                                   env=env, capture_output=True, text=True,
                                   check=True).stdout.split())
    want = abi.PROFILE_GROUP_API | abi.PROFILE_COLL_API | abi.PROFILE_COLL | \
        abi.PROFILE_PROXY_OP | abi.PROFILE_PROXY_STEP | abi.PROFILE_NET_PLUGIN
    assert outs == [["ckm", "0", "0"], ["ckm", "0", str(want)]]


def _raw(lib: C.CDLL, version: str) -> bytes:
    size = abi.LAYOUT[f"ncclNet_{version}_t"]["sizeof"]
    return C.string_at(C.addressof(C.c_char.in_dll(lib, f"ncclNetPlugin_{version}")), size)


def _slot(raw: bytes, version: str, name: str) -> int:
    return struct.unpack_from("<Q", raw, abi.LAYOUT[f"ncclNet_{version}_t"][name])[0]


def test_nccl_vtables_hold_each_function_at_its_documented_slot(nccl_plugin):
    lib = C.CDLL(str(nccl_plugin))
    raws = {v: _raw(lib, v) for v in ("v12", "v11", "v10")}
    for v, raw in raws.items():
        assert C.string_at(_slot(raw, v, "name")) == b"ckm"
        for name in ("getDeviceMr", "irecvConsumed", "makeVDevice"):
            assert _slot(raw, v, name) == 0, (v, name)  # host memory, no offload, no vNICs
        # devices() at its documented slot says one device
        n = C.c_int(0)
        assert C.CFUNCTYPE(C.c_int, C.POINTER(C.c_int))(_slot(raw, v, "devices"))(
            C.byref(n)) == 0 and n.value == 1
    # one implementation behind every version: same pointers slot by slot, but for the
    # adapters (getProperties per version; v10's init, listen and connect)
    for name in abi.LAYOUT["ncclNet_v10_t"]:
        if name in ("sizeof", "name", "getProperties", "init", "listen", "connect"):
            continue
        assert _slot(raws["v12"], "v12", name) == _slot(raws["v10"], "v10", name), name
    for name in abi.LAYOUT["ncclNet_v12_t"]:
        if name not in ("sizeof", "name", "getProperties"):
            assert _slot(raws["v12"], "v12", name) == _slot(raws["v11"], "v11", name), name
    for name in ("finalize", "setNetAttr", "init", "listen", "connect"):
        assert _slot(raws["v12"], "v12", name) != 0


@pytest.mark.parametrize("version", ["v12", "v11", "v10"])
def test_nccl_get_properties_fills_the_documented_offsets_and_no_more(nccl_plugin, version):
    lib = C.CDLL(str(nccl_plugin))
    lay = abi.LAYOUT[f"ncclNetProperties_{version}_t"]
    fn = C.CFUNCTYPE(C.c_int, C.c_int, C.c_void_p)(_slot(_raw(lib, version), version,
                                                          "getProperties"))
    buf = (C.c_uint8 * (lay["sizeof"] + 64))(*([0xA5] * (lay["sizeof"] + 64)))
    assert fn(0, buf) == 0
    raw = bytes(buf)
    assert raw[lay["sizeof"]:] == b"\xa5" * 64  # wrote nothing past the version's struct
    i32 = lambda off: struct.unpack_from("<i", raw, off)[0]  # noqa: E731
    assert C.string_at(struct.unpack_from("<Q", raw, lay["name"])[0]) == b"ckm0"
    assert i32(lay["ptrSupport"]) == abi.PTR_HOST
    assert i32(lay["maxRecvs"]) == 1 and i32(lay["netDeviceType"]) == 0
    assert i32(lay["vProps"]) == 1 and i32(lay["vProps"] + 4) == 0
    assert struct.unpack_from("<Q", raw, lay["maxP2pBytes"])[0] == 1 << 40
    assert struct.unpack_from("<Q", raw, lay["maxCollBytes"])[0] == 1 << 40
    if "maxMultiRequestSize" in lay:
        assert i32(lay["maxMultiRequestSize"]) == 1
    if "railId" in lay:
        assert struct.unpack_from("<hh", raw, lay["railId"]) == (-1, -1)
    assert fn(1, buf) == abi.INVALID_ARGUMENT  # one device only


def test_nccl_loader_rules_name_list_and_version_fallback(nccl_plugin):
    """NCCL_NET_PLUGIN as NCCL resolves it, in a fresh process with the plugin's folder on
    the dynamic linker's path (as LD_LIBRARY_PATH puts it on a cluster)."""
    prog = textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {str(REPO)!r})
        from checkmate.testbed import nccl_abi as abi
        print(json.dumps([
            abi.resolve("nosuch,ckm"),
            abi.resolve({str(nccl_plugin)!r}),
            abi.resolve("ckm", ("v10", "v9", "v8")),
            abi.resolve("ckm", ("v9", "v8", "v7", "v6")),
            abi.resolve("nosuch"),
        ]))
    """)
    env = {**os.environ, "LD_LIBRARY_PATH": str(nccl_plugin.parent)}
    out = subprocess.run([sys.executable, "-c", prog], env=env, capture_output=True,
                         text=True, check=True).stdout
    import json

    assert json.loads(out) == [["libnccl-net-ckm.so", "v12"], [str(nccl_plugin), "v12"],
                               ["libnccl-net-ckm.so", "v10"], None, None]


# ----- settings that would break the schedule model are refused at init ------------------
_INIT = textwrap.dedent("""
    import ctypes as C, sys
    sys.path.insert(0, sys.argv[2])
    from checkmate.testbed import nccl_abi as abi
    if len(sys.argv) > 3:  # libnccl's ncclGetVersion (the stand-in), as under real NCCL
        C.CDLL(sys.argv[3], mode=C.RTLD_GLOBAL)
    lib, v, net = abi.load(sys.argv[1])
    ctx = C.c_void_p()
    r = net.init(C.byref(ctx), 1, C.byref(abi.CommConfig(-1)), None, None)
    print("result", r)
""")


def _init(plugin: Path, env: dict[str, str], version: str | None = "22907"
          ) -> tuple[int, list[str]]:
    from checkmate.testbed.nccl_harness import plugin_env

    full = {k: v for k, v in os.environ.items() if not k.startswith(("CKM_NCCL", "NCCL_"))}
    full.update(plugin_env(1, 4, 4, 1 << 22, [1000, 24], 2, 7, "127.0.0.1"))
    full.update(env)
    for k in [k for k, v in full.items() if v is None]:
        del full[k]
    argv = [sys.executable, "-c", _INIT, str(plugin), str(REPO)]
    if version is not None:
        full["NCCL_STANDIN_VERSION"] = version
        argv.append(str(plugin.with_name("libnccl-standin.so")))
    p = subprocess.run(argv, env=full, capture_output=True, text=True, timeout=60)
    res = int(p.stdout.split()[-1])
    return res, [line for line in p.stderr.splitlines() if line.startswith("ckm-nccl:")]


@pytest.mark.parametrize("env,why", [
    ({"NCCL_ALGO": "Tree"}, "NCCL_ALGO=Ring"),
    ({"NCCL_ALGO": None}, "NCCL_ALGO=Ring"),
    ({"NCCL_PROTO": "LL128"}, "NCCL_PROTO=Simple"),
    ({"NCCL_MAX_NCHANNELS": "8"}, "NCCL_MAX_NCHANNELS=4"),
    ({"NCCL_BUFFSIZE": None}, "NCCL_BUFFSIZE pinned"),
    ({"NCCL_BUFFSIZE": "1000"}, "NCCL_BUFFSIZE=1000"),
    ({"CKM_NCCL_BUCKETS": "10,-3"}, "CKM_NCCL_BUCKETS=10,-3"),
    ({"CKM_NCCL_RANK": "4"}, "not a rank of the ring"),
    ({"CHECKMATE_SECRET_FILE": None}, "CHECKMATE_SECRET_FILE is not"),
    ({"CKM_NCCL_PARTITIONS": None}, "CKM_NCCL_PARTITIONS"),
    ({"CKM_NCCL_IP": "10.0.0.999"}, "not an IPv4 address"),
    ({"CKM_NCCL_PORT_BASE": "1000"}, "CKM_NCCL_PORT_BASE=1000"),
    ({"CKM_NCCL_IDENTITY": "guess"}, "expected model or profiler"),
])
def test_nccl_init_refuses_settings_that_break_the_model_with_one_line(nccl_plugin, env, why):
    res, lines = _init(nccl_plugin, env)
    assert res == abi.INVALID_USAGE
    assert len(lines) == 1 and why in lines[0], lines


def test_nccl_init_accepts_the_pinned_environment_and_plain_mode(nccl_plugin):
    assert _init(nccl_plugin, {}) == (abi.SUCCESS, [])
    # without CKM_NCCL_BUCKETS the plugin is a plain transport and needs none of it
    assert _init(nccl_plugin, {"CKM_NCCL_BUCKETS": None, "NCCL_ALGO": None, "NCCL_PROTO": None,
                          "NCCL_BUFFSIZE": None, "CHECKMATE_SECRET_FILE": None}) == (
        abi.SUCCESS, [])


@pytest.mark.parametrize("version,identity,why", [
    ("22803", "model", None), ("22809", "model", None), ("22902", "profiler", None),
    ("23007", "profiler", None),
    ("22707", "model", "NCCL 2.27.7 is not a release whose ring schedule was checked"),
    ("23100", "model", "NCCL 2.31.0 is not a release whose ring schedule was checked"),
    ("22802", "model", "NCCL 2.28.2 is not a release"),
    (None, "model", "ncclGetVersion is not in this process"),
    ("22809", "profiler", "needs profiler v6 (NCCL 2.29+)"),
])
def test_nccl_init_learns_the_release_and_refuses_unchecked_ones_untagged(nccl_plugin, version,
                                                                          identity, why):
    """The running release comes from ncclGetVersion in the process; one it was not checked
    against stops tagging with one line, and init still succeeds: NCCL runs untagged."""
    res, lines = _init(nccl_plugin, {"CKM_NCCL_IDENTITY": identity}, version)
    assert res == abi.SUCCESS
    if why is None:
        assert lines == []
    else:
        assert len(lines) == 1 and why in lines[0] and "continues untagged" in lines[0], lines
