"""The verbs receiver's checks and bench, run inside the soft-RoCE guest (testbed.guest).

``python -m checkmate.testbed.verbs_checks checks OUT.json`` runs two real shadow nodes of
the same one-partition job on loopback in the guest: one fed over UDP, one over a UD queue
pair on rxe0 (``--transport verbs``). Both are seeded alike and get the same datagrams
(every iteration's gradient pieces and control message, shuffled; one iteration with
pieces held back and sent late; duplicates; bad input) and must commit the same bytes as
an optimizer stepped directly. The results go to OUT.json for tests/test_verbs.py.

``... bench OUT.json`` measures the receive thread's CPU per datagram, UDP vs verbs, in
alternated rounds (medians) and prints ``verbs ratio: <udp / verbs>``. Under TCG the
numbers only compare the two paths with each other.
"""

from __future__ import annotations

import json
import os
import random
import socket
import sys
import time
from typing import Any

import numpy as np

from checkmate.protocol import auth
from checkmate.shadow.feed import control_body, control_datagrams, grad_datagrams
from checkmate.shadow.kernels import make_optimizer
from checkmate.shadow.node import NodeOptions, ShadowNode
from checkmate.shadow.verbs import VerbsSender
from checkmate.spec.model import ModelSpec
from checkmate.train.shadow_client import ShadowClient, fetch_all, seed_share, wait_ready

JOB = 21
LRS = [0.01, 0.003]
CHUNK = 200  # floats per piece: 800-byte payloads fit rxe's 1024-byte path MTU


def _spec() -> ModelSpec:
    return ModelSpec.build(
        JOB, [("emb", (400, 16)), ("w1", (16, 64)), ("b1", (64,)), ("w2", (64, 10))], "adamw",
        [{"params": ["emb", "w2"], "lr": LRS[0], "weight_decay": 0.1, "amsgrad": False},
         {"params": ["w1", "b1"], "lr": LRS[1], "weight_decay": 0.0, "amsgrad": False}],
        1, buffers=[("bn.mean", (3,), "float32")])


class Pair:
    """A UDP-fed and a verbs-fed shadow of the same job, and senders for both."""

    def __init__(self, device: str, secret: bytes, slots: int = 1024) -> None:
        self.spec = spec = _spec()
        self.secret = secret
        common = {"bind": "127.0.0.1", "port": 0, "restore_bind": "127.0.0.1",
                  "restore_port": 0, "secret": secret, "controller": None}
        self.udp = ShadowNode(NodeOptions(0, 1, JOB, **common)).start()
        self.verbs = ShadowNode(NodeOptions(0, 1, JOB, transport="verbs", device=device,
                                            verbs_slots=slots, **common)).start()
        self.nodes = {"udp": self.udp, "verbs": self.verbs}
        self.tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.vtx = VerbsSender(device, self.verbs.verbs.address, slot_bytes=1024)
        rng = np.random.default_rng(5)
        self.rng = rng
        self.flat = {s: np.zeros(spec.total, np.float32) for s in spec.slots}
        self.flat["param"][:] = rng.standard_normal(spec.total).astype(np.float32)
        self.ref = make_optimizer(spec, 0, spec.total)
        self.ref.load(self.flat, 0)
        # as trainers do: a seed sent while a shadow still compiles waits behind the compiler
        # (a guest under TCG on a busy host: past the seed's timeout)
        wait_ready([("127.0.0.1", n.tcp_port) for n in self.nodes.values()])
        for n in self.nodes.values():
            seed_share([("127.0.0.1", n.tcp_port)], spec, self.flat, 0, 1)
        self.wait(lambda st: st["seeded"], "seeded")

    def status(self, name: str) -> dict[str, Any]:
        with ShadowClient(("127.0.0.1", self.nodes[name].tcp_port)) as c:
            return c.status()

    def wait(self, cond: Any, what: str, timeout: float = 120.0) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if all(cond(self.status(n)) for n in self.nodes):
                return
            time.sleep(0.05)
        raise AssertionError(f"timed out waiting for {what}: "
                             f"{ {n: self.status(n) for n in self.nodes} }")

    def datagrams(self, it: int, grad: np.ndarray) -> list[bytes]:
        body = control_body(it, LRS, None, False, {"bn.mean": "AAAAAAAAAAAAAAAA"},
                            {"it": it})
        return (list(grad_datagrams(JOB, it, 0, 0, grad, chunk=CHUNK, secret=self.secret))
                + list(control_datagrams(JOB, it, body, frag=600, secret=self.secret)))

    def send(self, dgrams: list[bytes]) -> None:
        """The same datagrams to both shadows; the verbs side paced so that its receive
        ring (1024 slots) never runs empty of posted buffers (a UD datagram that finds no
        posted receive is dropped by the device, as a full socket buffer drops one)."""
        addr = ("127.0.0.1", self.udp.udp_port)
        vr = self.verbs.verbs
        for d in dgrams:
            self.tx.sendto(d, addr)
            while self.vtx.sent - vr.stats["completions"] > vr.ring.slots // 2:
                time.sleep(0.001)
            self.vtx.send(d)
        self.vtx.flush()

    def close(self) -> None:
        self.vtx.close()
        self.tx.close()
        for n in self.nodes.values():
            n.stop()


def _checks(pair: Pair, iterations: int) -> dict[str, Any]:
    spec, rng = pair.spec, pair.rng
    out: dict[str, Any] = {"iterations": iterations}
    held: list[bytes] = []
    late_it = 3
    sent = 0
    for it in range(1, iterations + 1):
        grad = rng.standard_normal(spec.total).astype(np.float32)
        dg = pair.datagrams(it, grad)
        random.Random(it).shuffle(dg)  # out of order within the iteration
        if it == 2:
            dg += dg[:5]  # duplicates
        if it == late_it:
            held, dg = dg[:7], dg[7:]  # lost for now: the iteration cannot commit
        pair.send(dg)
        sent += len(dg)
        pair.ref.step(grad, LRS, None)
        if it == late_it:
            # everything before the hole commits; the hole is never stepped over
            pair.wait(lambda st: st["latest"] == late_it - 1, f"iteration {late_it - 1}")
            time.sleep(0.5)
            out["held_back_latest"] = {n: pair.status(n)["latest"] for n in pair.nodes}
        if it == late_it + 2:
            pair.send(held)  # the missing pieces arrive late, after later iterations
            sent += len(held)
    pair.wait(lambda st: st["latest"] == iterations, f"iteration {iterations}")
    ref = pair.ref.snapshot()
    for name, node in pair.nodes.items():
        full = fetch_all([("127.0.0.1", node.tcp_port)], iterations, spec=spec)
        out[f"{name}_equals_reference"] = all(
            np.array_equal(full.slots[s], ref[s]) for s in spec.slots)
        out[f"{name}_bytes"] = {s: full.slots[s].tobytes().hex()[:64] for s in spec.slots}
    a = fetch_all([("127.0.0.1", pair.udp.tcp_port)], iterations, spec=spec)
    b = fetch_all([("127.0.0.1", pair.verbs.tcp_port)], iterations, spec=spec)
    out["verbs_equals_udp"] = all(a.slots[s].tobytes() == b.slots[s].tobytes()
                                  for s in spec.slots)
    out["datagrams_sent"] = sent
    st = {n: pair.status(n) for n in pair.nodes}
    out["received"] = {n: st[n]["received"] for n in st}
    out["drops_before_bad"] = {n: st[n]["drops"] for n in st}
    out["verbs_status"] = st["verbs"]["verbs"]
    # the 40 bytes before a datagram: the GRH, for RoCEv2 over IPv4 the packet's IPv4
    # header in its last 20 bytes (version 4, from the guest's own address)
    u8 = np.frombuffer(pair.verbs.verbs._arr, np.uint8)
    grh = u8[:40]
    out["grh"] = {"ipv4_version": int(grh[20] >> 4), "protocol": int(grh[29]),
                  "src": ".".join(str(int(x)) for x in grh[32:36]),
                  "datagram_magic": u8[40:42].tobytes().hex()}

    # bad input, the same to both: each dropped and counted under its reason
    good = pair.datagrams(iterations + 1, np.zeros(spec.total, np.float32))[0]
    bad = {
        "short": good[:20],
        "magic": b"\x00\x00" + good[2:],
        "mac": good[:45] + bytes([good[45] ^ 0xFF]) + good[46:],
        "crc": good[:-1] + bytes([good[-1] ^ 0x01]),
        "length": good[:-4],
    }
    before = {n: dict(st[n]["drops"]) for n in st}
    for d in bad.values():
        pair.send([d] * 3)
    time.sleep(1.0)
    after = {n: pair.status(n)["drops"] for n in pair.nodes}
    out["bad_input"] = {n: {k: after[n].get(k, 0) - before[n].get(k, 0) for k in
                            set(after[n]) | set(before[n])} for n in pair.nodes}
    out["latest_after_bad"] = {n: pair.status(n)["latest"] for n in pair.nodes}

    # the trainers' own sender in host mode over verbs (ShadowSender.use_verbs): the whole
    # partition's gradient as one copy, cut into UD-sized pieces, and the control message
    from checkmate.train.replicate import ShadowSender, ShadowTarget

    it = iterations + 1
    grad = rng.standard_normal(spec.total).astype(np.float32)
    sender = ShadowSender(JOB, [ShadowTarget(0, "127.0.0.1", pair.verbs.udp_port)],
                          pair.secret)
    sender.use_verbs(0, VerbsSender(_device(), pair.verbs.verbs.address, slot_bytes=1024))
    try:
        sender.copy(it, 0, 0, 0, grad.tobytes())
        body = json.loads(control_body(it, LRS, None, False,
                                       {"bn.mean": "AAAAAAAAAAAAAAAA"}, {"it": it}))
        sender.control(it, body)
        sender.verbs[0].flush()
        pieces = sender.sent_datagrams
    finally:
        sender.close()
    for d in pair.datagrams(it, grad):
        pair.tx.sendto(d, ("127.0.0.1", pair.udp.udp_port))
    pair.ref.step(grad, LRS, None)
    pair.wait(lambda st: st["latest"] == it, f"iteration {it} from ShadowSender")
    ref = pair.ref.snapshot()
    full = fetch_all([("127.0.0.1", pair.verbs.tcp_port)], it, spec=spec)
    out["trainer_sender"] = {
        "pieces": pieces, "floats": int(spec.total),
        "equals_reference": all(np.array_equal(full.slots[s], ref[s]) for s in spec.slots)}
    return out


def _device() -> str:
    return os.environ.get("CKM_VERBS_DEVICE", "rxe0")


def _thread_cpu(name: str) -> float:
    """CPU seconds of this process's thread named ``name`` (/proc task comm)."""
    tck = os.sysconf("SC_CLK_TCK")
    for tid in os.listdir("/proc/self/task"):
        base = f"/proc/self/task/{tid}"
        try:
            with open(f"{base}/comm") as f:
                if f.read().strip() != name:
                    continue
            with open(f"{base}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / tck
        except OSError:
            continue
    raise RuntimeError(f"no thread named {name}")


def _bench(pair: Pair, rounds: int, iterations: int) -> dict[str, Any]:
    """Receive-thread CPU per datagram, UDP vs verbs, the same datagrams, alternated."""
    spec, rng = pair.spec, pair.rng
    per: dict[str, list[float]] = {"udp": [], "verbs": []}
    it = 0
    for r in range(rounds):
        order = ["udp", "verbs"] if r % 2 == 0 else ["verbs", "udp"]
        for name in order:
            node = pair.nodes[name]
            thread = "shadow-verbs" if name == "verbs" else "shadow-recv"
            first = it + 1
            batches = []
            for _ in range(iterations):
                it += 1
                batches.append(pair.datagrams(it, rng.standard_normal(spec.total).astype(
                    np.float32)))
            n = sum(len(b) for b in batches)
            c0 = _thread_cpu(thread)
            for b in batches:
                if name == "udp":
                    for d in b:
                        pair.tx.sendto(d, ("127.0.0.1", node.udp_port))
                        pair.vtx.send(d)  # both shadows stay on the same iterations
                else:
                    pair.send(b)
            pair.wait(lambda st, last=it: st["latest"] == last, f"bench iteration {it}")
            per[name].append((_thread_cpu(thread) - c0) / n * 1e6)
            del first
    med = {k: float(np.median(v)) for k, v in per.items()}
    return {"rounds": rounds, "cpu_us_per_datagram": per, "median": med,
            "ratio": med["udp"] / med["verbs"] if med["verbs"] else None}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    mode, out_path = argv[0], argv[1]
    device = _device()
    secret = auth.load_secret()  # $CHECKMATE_SECRET_FILE, made by the harness
    pair = Pair(device, secret, int(os.environ.get("CKM_VERBS_SLOTS", "1024")))
    try:
        if mode == "checks":
            result = _checks(pair, int(os.environ.get("CKM_VERBS_ITERATIONS", "16")))
        else:
            result = _bench(pair, int(os.environ.get("CKM_VERBS_ROUNDS", "4")),
                            int(os.environ.get("CKM_VERBS_ITERATIONS", "4")))
            print(f"verbs ratio: {result['ratio']:.3f}", flush=True)
    finally:
        pair.close()
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1, sort_keys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
