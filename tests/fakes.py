"""Helpers and test doubles shared by test files (one place, not imported across tests).

Two shared concepts have a module of their own beside this one: shadow_cluster.py (real
shadow nodes on loopback and the job spec they serve) and handshake_service.py (the
controller's handshake service over FakeSwitch; it reads the job secret on import).
"""

from __future__ import annotations

import ipaddress
import socket
import time
from collections.abc import Callable
from pathlib import Path

import torch


def free_port() -> int:
    """A TCP port on 127.0.0.1 nobody listens on right now (for MASTER_PORT)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- the ckm length rule -----------------------------------------------------------------
#: (count, dtype, payload bytes, well-formed) where a bounded 16-bit form of the rule (the
#: P4 programs' CkmLengthCheck) could part from count * size == payload over unbounded
#: integers (the kernel switch's 64-bit length_ok): products that wrap 16 or 32 bits onto
#: the real payload, counts past each dtype's bound, an unknown dtype. The verdicts are
#: written out, not computed; test_dataplane sends them through the kernel switch and
#: test_p4_sources runs them through the P4 text.
LENGTH_RULE_CASES = [
    (1, 0, 4, True), (3, 1, 6, True), (3, 2, 6, True), (16, 3, 16, True),
    (4, 0, 12, False),                # count disagrees with the payload
    ((1 << 14) + 1, 0, 4, False),     # float32: 16385 * 4 = 65540, 4 in 16 bits
    ((1 << 15) + 1, 1, 2, False),     # bfloat16: 32769 * 2, 2 in 16 bits
    ((1 << 15) + 1, 2, 2, False),     # float16 likewise
    ((1 << 16) + 1, 3, 1, False),     # bytes: count[15:0] is 1
    ((1 << 30) + 1, 0, 4, False),     # float32: 4 in 32 bits
    (4, 4, 16, False),                # unknown dtype
]


# -- P4Runtime ---------------------------------------------------------------------------
# The compiler's P4Info fixtures (tests/fixtures/p4c/README.md) and a P4Runtime switch
# double for the controller tests.

P4C_FIXTURES = Path(__file__).resolve().parent / "fixtures" / "p4c"
#: The compiler fixtures are p4c's output for the current sources: tests/test_p4_compile.py
#: compiles p4/ and fails on any difference (regenerate: `make p4-fixtures`).
#: p4c's output for p4/ at fc59cb5, before the per-port source check (issue 23: no
#: port_bind, bind_source, port_bind_counter, src_check): a build the controller runs
#: against saying UNPROTECTED (control/drivers/p4tables.py OPTIONAL_TABLES).
UNCHECKED_AT = "fc59cb5"
#: An older compiler output (p4/ at 293beb8), before the replicate entry's ingress_port
#: parameter and the l2_miss/rewrite_miss counters: a stale build for the refusal tests.
STALE_AT = "293beb8"


def fixture_p4info(name: str):
    """A P4Info fixture as parsed by the controller (Tofino extern payloads dropped)."""
    from checkmate.control import p4info

    path = P4C_FIXTURES / name
    return p4info.parse_text(path.read_text(), str(path)).p4info


def compiled_fixture(arch: str) -> Path:
    return P4C_FIXTURES / f"checkmate_{arch}.p4info.txtpb"


def compiled_p4info(arch: str):
    """p4c's P4Info for ``arch`` (tests/fixtures/p4c, compiled from the current p4/)."""
    return fixture_p4info(compiled_fixture(arch).name)


def unchecked_p4info(arch: str):
    """p4c's P4Info for ``arch`` as it was at UNCHECKED_AT: no per-port source check."""
    return fixture_p4info(f"checkmate_{arch}.p4info.{UNCHECKED_AT}.txtpb")


def stale_p4info(arch: str):
    """p4c's P4Info for ``arch`` as it was at STALE_AT: a build the sources outgrew."""
    return fixture_p4info(f"checkmate_{arch}.p4info.{STALE_AT}.txtpb")


def ip(s: str) -> int:
    return int(ipaddress.IPv4Address(s))


class FakeSwitch:
    """P4Runtime TEST DOUBLE of a switch's server, answering as PI's server does (the one in
    simple_switch_grpc, which Stratum and the SDE's server resemble here): an in-process
    gRPC server on loopback speaking p4.v1.P4Runtime.

    Modelled, because the controller relies on it: arbitration (the highest election id is
    primary, a lower one gets ALREADY_EXISTS); FAILED_PRECONDITION for Get/Write/Read while
    no pipeline is set; SetForwardingPipelineConfig only from the primary and only with a
    P4Info and a non-empty device config; writes validated against the loaded P4Info as a
    switch does (unknown table/action ids, incomplete or too wide or non-canonical values,
    default-only actions in entries, duplicate inserts, missing modify/delete targets);
    reads of entries, groups, direct counters and indexed counters (every index of the
    counter's size, from ``counts``); unknown counter ids are NOT_FOUND.

    Not modelled: packet processing (counters move only when a test sets ``counts`` or
    ``direct_counts``), table capacity, ternary/LPM/range matches, multicast replicas
    checked against real ports, Tofino extern reads (ExternEntry), packet-in/out, roles,
    per-update error details (PI answers a failed batch with UNKNOWN and one status per
    update; this double aborts with the first error's own code), and the device config is
    stored, not interpreted."""

    def __init__(self, p4info=None) -> None:
        import threading
        from concurrent import futures

        import grpc

        from checkmate.control import p4proto

        self.pb = pb = p4proto.p4runtime()
        self.p4info = p4info
        self.device_config = b""
        self.pipeline_sets = 0
        self.entries: dict[tuple, object] = {}
        self.groups: dict[int, object] = {}
        self.updates: list = []  # every applied Update, in order
        self.primary_election: int | None = None
        self.direct_counts: dict[tuple, tuple[int, int]] = {}
        self.counts: dict[tuple[str, int], tuple[int, int]] = {}  # (counter name, index)
        self.lock = threading.Lock()
        # A compiled Tofino pipeline config is about 5 MB, past gRPC's 4 MB default: the
        # servers this stands for take up to 256 MiB: Stratum's --grpc_max_recv_msg_size
        # defaults to 256 * 1024 * 1024 (stratum/stratum, stratum/hal/lib/common/hal.cc, its
        # DEFINE_uint32), and PI's server sets SetMaxReceiveMessageSize(256*1024*1024)
        # (p4lang/PI, proto/server/pi_server.cpp, PIGrpcServerRunAddr).
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=8),
                                  options=[("grpc.max_receive_message_length", 256 << 20)])
        u = grpc.unary_unary_rpc_method_handler
        handlers = {
            "Write": u(self.Write, pb.WriteRequest.FromString,
                       pb.WriteResponse.SerializeToString),
            "Read": grpc.unary_stream_rpc_method_handler(
                self.Read, pb.ReadRequest.FromString, pb.ReadResponse.SerializeToString),
            "GetForwardingPipelineConfig": u(
                self.GetPipe, pb.GetForwardingPipelineConfigRequest.FromString,
                pb.GetForwardingPipelineConfigResponse.SerializeToString),
            "SetForwardingPipelineConfig": u(
                self.SetPipe, pb.SetForwardingPipelineConfigRequest.FromString,
                pb.SetForwardingPipelineConfigResponse.SerializeToString),
            "StreamChannel": grpc.stream_stream_rpc_method_handler(
                self.Stream, pb.StreamMessageRequest.FromString,
                pb.StreamMessageResponse.SerializeToString),
        }
        self.server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(p4proto.SERVICE, handlers),))
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.stop(0)

    # -- service -------------------------------------------------------------------------
    def _need_pipeline(self, context) -> None:
        import grpc

        if self.p4info is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          "no forwarding pipeline config set for this device")

    def Stream(self, requests, context):
        import grpc

        for req in requests:
            if req.HasField("arbitration"):
                eid = req.arbitration.election_id.low
                with self.lock:
                    if self.primary_election is None or eid >= self.primary_election:
                        self.primary_election = eid
                        code = 0
                    else:
                        code = grpc.StatusCode.ALREADY_EXISTS.value[0]
                resp = self.pb.StreamMessageResponse()
                resp.arbitration.CopyFrom(req.arbitration)
                resp.arbitration.status.code = code
                yield resp

    def GetPipe(self, req, context):
        self._need_pipeline(context)
        resp = self.pb.GetForwardingPipelineConfigResponse()
        resp.config.p4info.CopyFrom(self.p4info)
        return resp

    def SetPipe(self, req, context):
        import grpc

        if req.election_id.low != self.primary_election:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, "not primary")
        if not req.config.p4info.tables or not req.config.p4_device_config:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "P4Info and device config needed")
        self.p4info = req.config.p4info
        self.device_config = req.config.p4_device_config
        self.pipeline_sets += 1
        return self.pb.SetForwardingPipelineConfigResponse()

    def _check_entry(self, te, context) -> tuple:
        import grpc

        from checkmate.control import p4proto

        tables = {t.preamble.id: t for t in self.p4info.tables}
        actions = {a.preamble.id: a for a in self.p4info.actions}
        t = tables.get(te.table_id)
        if t is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown table {te.table_id}")
        widths = {f.id: f.bitwidth for f in t.match_fields}
        if sorted(m.field_id for m in te.match) != sorted(widths):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "match fields incomplete")
        for m in te.match:
            v = m.exact.value
            if not v or (len(v) > 1 and v[0] == 0) or int.from_bytes(v, "big") >> widths[
                    m.field_id]:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, "non-canonical/too wide")
        aid = te.action.action.action_id
        refs = {r.id for r in t.action_refs if r.scope != p4proto.p4info().ActionRef.DEFAULT_ONLY}
        if aid not in refs:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"action {aid} not in table")
        pw = {p.id: p.bitwidth for p in actions[aid].params}
        if sorted(p.param_id for p in te.action.action.params) != sorted(pw):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "action params incomplete")
        for p in te.action.action.params:
            if int.from_bytes(p.value, "big") >> pw[p.param_id]:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, "param too wide")
        return (te.table_id, tuple(sorted((m.field_id, m.exact.value) for m in te.match)))

    def Write(self, req, context):
        import grpc

        self._need_pipeline(context)
        if req.election_id.low != self.primary_election:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, "not primary")
        pb = self.pb
        with self.lock:
            for up in req.updates:
                ent = up.entity
                if ent.HasField("table_entry"):
                    key = self._check_entry(ent.table_entry, context)
                    store = self.entries
                    val = ent.table_entry
                else:
                    g = ent.packet_replication_engine_entry.multicast_group_entry
                    key, store, val = g.multicast_group_id, self.groups, g
                if up.type == pb.Update.INSERT and key in store:
                    context.abort(grpc.StatusCode.ALREADY_EXISTS, f"{key} exists")
                if up.type in (pb.Update.MODIFY, pb.Update.DELETE) and key not in store:
                    context.abort(grpc.StatusCode.NOT_FOUND, f"{key} missing")
                if up.type == pb.Update.DELETE:
                    del store[key]
                else:
                    store[key] = type(val)()
                    store[key].CopyFrom(val)
                self.updates.append(up)
        return pb.WriteResponse()

    def Read(self, req, context):
        import grpc

        self._need_pipeline(context)
        resp = self.pb.ReadResponse()
        counters = {c.preamble.id: c for c in self.p4info.counters}
        with self.lock:
            for ent in req.entities:
                if ent.HasField("table_entry"):
                    for (tid, _), te in sorted(self.entries.items()):
                        if ent.table_entry.table_id in (0, tid):
                            resp.entities.add().table_entry.CopyFrom(te)
                elif ent.HasField("packet_replication_engine_entry"):
                    for _gid, g in sorted(self.groups.items()):
                        out = resp.entities.add()
                        out.packet_replication_engine_entry.multicast_group_entry.CopyFrom(g)
                elif ent.HasField("direct_counter_entry"):
                    want = ent.direct_counter_entry.table_entry.table_id
                    for key, te in sorted(self.entries.items()):
                        if want in (0, key[0]):
                            out = resp.entities.add().direct_counter_entry
                            out.table_entry.CopyFrom(te)
                            pk, by = self.direct_counts.get(key, (0, 0))
                            out.data.packet_count, out.data.byte_count = pk, by
                elif ent.HasField("counter_entry"):
                    c = counters.get(ent.counter_entry.counter_id)
                    if c is None:
                        context.abort(grpc.StatusCode.NOT_FOUND,
                                      f"unknown counter {ent.counter_entry.counter_id}")
                    for i in range(c.size):
                        out = resp.entities.add().counter_entry
                        out.counter_id = c.preamble.id
                        out.index.index = i
                        pk, by = self.counts.get((c.preamble.name, i), (0, 0))
                        out.data.packet_count, out.data.byte_count = pk, by
        yield resp

    # -- decoding for assertions, from the P4Info by name (independent of the driver) ---
    def table(self, alias: str) -> set[tuple]:
        t = next(t for t in self.p4info.tables if t.preamble.alias == alias)
        actions = {a.preamble.id: a for a in self.p4info.actions}
        fnames = {f.id: f.name for f in t.match_fields}
        out = set()
        for (tid, _), te in self.entries.items():
            if tid != t.preamble.id:
                continue
            a = actions[te.action.action.action_id]
            pn = {p.id: p.name for p in a.params}
            m = tuple(sorted((fnames[x.field_id], int.from_bytes(x.exact.value, "big"))
                             for x in te.match))
            p = tuple(sorted((pn[x.param_id], int.from_bytes(x.value, "big"))
                             for x in te.action.action.params))
            out.add((m, a.preamble.alias, p))
        return out

    def group_map(self) -> dict[int, set[tuple[int, int]]]:
        return {gid: {(r.egress_port, r.instance) for r in g.replicas}
                for gid, g in self.groups.items()}


# ----- the NCCL harness's workload (tests/test_nccl_ring.py, tests/test_nccl_switch.py) -----
BUCKETS = [70_001, 5_003, 3]  # flat order; none a multiple of the chunk
BUFFSIZE = 1 << 15  # 4096-element chunks: bucket 0 takes two loops of the ring
ITERATIONS = 3


def python_ring_replicas(ring_kit, seed: int, world: int, partitions: int) -> dict:
    """What the Python ring (checkmate.train.ring) hands the shadows for the harness's
    inputs: iteration -> flat reduced vector assembled from its REPLICATE pieces."""
    import numpy as np
    import torch

    from checkmate.testbed import nccl_harness as H

    total = sum(BUCKETS)
    got = {it: np.full(total, np.nan, np.float32) for it in range(1, ITERATIONS + 1)}
    cover = {it: np.zeros(total, np.int32) for it in got}

    def on_reduced(rank, it, bucket, off, part, payload, switched):
        assert switched  # every rank its own node: the switch copies each piece
        v = np.frombuffer(payload, "<f4")
        got[it][off:off + v.size] = v
        cover[it][off:off + v.size] += 1

    rings = ring_kit.make(world, total, partitions, chunk=2229, on_reduced=on_reduced)
    try:
        for it in got:
            base = 0
            for b, n in enumerate(BUCKETS):
                futs = [rg.submit(torch.from_numpy(H.inputs(seed, it, b, r, n)), base, it, b)
                        for r, rg in enumerate(rings)]
                for f in futs:
                    f.wait()
                base += n
    finally:
        ring_kit.close_all(rings)
    for it in got:
        assert cover[it].min() == 1 and cover[it].max() == 1
    return got


# ----- multi-process trainer tests (test_ddp_hook, test_fsdp2, test_gockpt) -----------------
def run_ranks(script: str, arg: str, world: int, timeout: float = 240,
              env: dict[str, str] | None = None) -> list:
    """Run ``python script arg`` once per rank (RANK, WORLD_SIZE, MASTER_ADDR/PORT set, one
    thread each) and wait for all; the CompletedProcess of each rank, in rank order. A rank
    still running at ``timeout`` is killed."""
    import os
    import subprocess
    import sys

    base = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
            "WORLD_SIZE": str(world), "OMP_NUM_THREADS": "1", **(env or {})}
    procs = [subprocess.Popen([sys.executable, script, arg], env={**base, "RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(world)]
    done = []
    for p in procs:
        try:
            o, e = p.communicate(timeout=timeout)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
        done.append(subprocess.CompletedProcess(p.args, p.returncode, o, e))
    return done


def exit_worker(code: int) -> None:
    """End a ``run_ranks`` worker with ``code`` the way ``checkmate launch`` ends its workers
    (checkmate.train.run_script): flush, then ``os._exit``. After ``destroy_process_group``
    the interpreter's teardown of torch's native gloo/store threads aborts the process now
    and then ("terminate called without an active exception", exit -6; seen in 1 of about
    30 runs on a loaded 2-core machine, every rank having already printed its line and
    chosen its status). The tests assert what the worker decided, not torch's teardown."""
    import os
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def rank_main(train: Callable[[int, int], int]) -> None:
    """The whole life of a ``run_ranks`` worker: ``train(rank, world)`` inside a gloo process
    group (one torch thread). A CheckmateError is what a user sees from the session: the one
    line ``checkmate: error: ...`` and status 2. Never returns (``exit_worker``)."""
    import os
    import sys

    import torch
    import torch.distributed as dist

    from checkmate.errors import CheckmateError

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        code = train(rank, world)
    except CheckmateError as e:
        print(f"checkmate: error: {e}", file=sys.stderr, flush=True)
        code = 2
    finally:
        dist.destroy_process_group()
    exit_worker(code)


def host_layout(net: str, ips: list[str], rank: int, world: int, seed: int, **kw: object):
    """A host-mode JobLayout for job 7: trainers at ``net``.10+rank on loopback, the shadows
    of ``loopback_shadows`` at ``ips`` (partition i at ips[i]), the standard ports."""
    from checkmate.config import cluster as cfgmod
    from checkmate.train import JobLayout, ShadowTarget

    return JobLayout(
        job_id=7, rank=rank, world=world,
        trainers=[(f"{net}.{10 + r}", cfgmod.TRAINER_PORT) for r in range(world)],
        shadows=[ShadowTarget(p, ip, cfgmod.SHADOW_PORT) for p, ip in enumerate(ips)],
        shadow_tcp=[(ip, cfgmod.RESTORE_PORT) for ip in ips], mode="host", seed=seed, **kw)


def lose_every(sess: object, k: int) -> None:
    """Drop every ``k``-th copy a session sends to the shadows, on its way: the shadows must
    repair what they miss."""
    send, sent = sess.sender.copy, [0]

    def lossy(*a: object) -> None:
        sent[0] += 1
        if sent[0] % k:
            send(*a)
    sess.sender.copy = lossy


def assert_state_equal(a: dict, b: dict, what: str) -> None:
    """Two state dicts hold the same keys and bit-identical tensors."""
    import torch

    assert a.keys() == b.keys(), what
    for k in a:
        assert torch.equal(a[k], b[k]), f"{what}: {k}"


def assert_optim_equal(a: dict, b: dict, what: str, lrs: bool = True) -> None:
    """Two optimizer state dicts hold bit-identical state (and the same rates)."""
    import torch

    assert a["state"].keys() == b["state"].keys(), what
    for i, st in a["state"].items():
        assert st.keys() == b["state"][i].keys(), f"{what}: state {i}"
        for slot, t in st.items():
            assert torch.equal(torch.as_tensor(t), torch.as_tensor(b["state"][i][slot])), \
                f"{what}: state {i} {slot}"
    if lrs:
        assert [g["lr"] for g in a["param_groups"]] == [g["lr"] for g in b["param_groups"]], \
            what


def wait_status(client, pred, timeout: float = 20.0) -> dict:  # noqa: ANN001
    """Poll a ShadowClient's status until ``pred(status)`` holds; AssertionError on timeout."""
    end = time.monotonic() + timeout
    while True:
        st = client.status()
        if pred(st):
            return st
        if time.monotonic() > end:
            raise AssertionError(f"timed out; status {st}")
        time.sleep(0.02)


# ----- process trees (test_launch, test_testbed_lifeline: nothing may outlive its parent) -----
def children(pid: int) -> list[int]:
    """The PIDs whose parent is ``pid`` right now (from /proc)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(d.name))
    return out


def alive(pid: int) -> bool:
    """``pid`` exists and has not ended (a zombie has)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended


# ----- a small torch model (test_persist and the fresh process it loads checkpoints in) -----
class TinyNet(torch.nn.Module):
    """Embedding, linear, batch norm (buffers for the spec to carry) and a head: small."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(13, 6)
        self.fc = torch.nn.Linear(6, 5)
        self.bn = torch.nn.BatchNorm1d(5)
        self.out = torch.nn.Linear(5, 3)


def tiny_net_groups(m):
    """TinyNet's two AdamW groups: the weights with decay; the biases and norm without, at
    lr 2e-3."""
    return [{"params": [m.emb.weight, m.fc.weight, m.out.weight], "weight_decay": 0.05},
            {"params": [m.fc.bias, m.bn.weight, m.bn.bias, m.out.bias], "weight_decay": 0.0,
             "lr": 2e-3}]


def same_state(a: object, b: object) -> bool:
    """Two saved states (nested dicts, lists, tensors) equal bit for bit, dtypes included."""
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_state(a[k], b[k])
                                                                      for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_state(x, y) for x, y in zip(a, b, strict=True))
    return a == b


#: Runs in a host's namespace (a shadow's, a node's): receive one ckm datagram on argv[1],
#: print its header (the namespace tests of the controller and the handshake).
DATAGRAM_RECEIVER = r"""
import json, socket, sys
from checkmate.protocol import wire
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind(("0.0.0.0", int(sys.argv[1])))
s.settimeout(5)
print("READY", flush=True)
try:
    data = s.recv(65535)
except TimeoutError:
    print("TIMEOUT"); sys.exit(0)
h, _ = wire.decode(data)
print(json.dumps({"epoch": h.epoch, "token": h.token, "partition": h.partition}), flush=True)
"""
