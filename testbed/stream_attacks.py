"""Hostile datagrams and messages at a testbed's shadows, for the chaos suite's attack cases
(issue 23; the switch- and service-level attacks are checkmate.testbed.attacks).

    python -m checkmate.testbed.stream_attacks forged-control|deep-json|other-partition|
        refused-peers|replay|capture
        --config CFG --out FILE [--capture FILE ...] [--steps N] [--ifname IF]

Run inside a host's namespace (the chaos run starts it with the cluster's ``popen``) until
SIGTERM, then writes ``{"kind", "sent"}`` to ``--out``. What an attacker could read on the
wire (the sessions' epochs and tokens travel in the clear; a shadow's progress shows in its
traffic) it is given through the job secret, as the testbed's stand-in for sniffing; what
it sends it makes as an attacker could:

- ``forged-control``: a host without the secret. Every 0.5 s, to every shadow, one CONTROL
  fragment for each iteration 1..steps with the current epoch and token, a random payload
  and a random message length up to 64 MiB (one forged fragment per iteration froze the
  shadows of issue 23 and made each reserve the announced length).
- ``deep-json``: a holder of the secret (trusted, but its bad input must not kill a thread):
  every 0.2 s, for the iterations 2..4 ahead of each shadow's newest commit, a ~2 KB
  control message of deeply nested JSON with a valid MAC and fragment tags of the run.
- ``other-partition``: a holder of the secret (an insider, issue 35): every 0.2 s, for the
  iterations 1..3 ahead of each shadow's newest commit, a well-formed control message with
  a valid MAC of the run but addressed to another partition, with learning rate 9.0. A
  shadow that took it would commit with that rate and differ from its trainers from then
  on; it must drop it (counted under ``partition``) before using any of its fields.
- ``refused-peers``: a holder of the secret, over each shadow's authenticated TCP service:
  every 0.3 s a ``peers`` request that must be refused (a bad run id, then an empty owner
  range, with the real run id). Before issue 35 a refused one still reset
  the shadow's run keys and it dropped the whole real run; each must be refused and
  counted (``tcp_refused``), and the run end bit-exact and protected.
- ``capture`` (in a shadow's namespace): record every ckm datagram that reaches the shadow
  (AF_PACKET on ``--ifname``) to ``--out``, length-prefixed: a capture of one run.
- ``replay``: once every shadow was seeded by the current run, send what ``--capture``
  files hold (another run of the same job and secret) to the shadow of each datagram's
  partition, re-stamped with the current epoch and token as the switch stamps copies; again
  every 3 s. Without per-run keys they were committed (issue 23).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import struct
import sys
import threading
import time
from pathlib import Path
from typing import Any

from checkmate.config import cluster as cfgmod
from checkmate.errors import CheckmateError, cli_guard
from checkmate.protocol import wire

KINDS = ("forged-control", "deep-json", "other-partition", "refused-peers", "replay",
         "capture")
_REC = struct.Struct("!I")


class _Attack:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.cfg = cfgmod.load(args.config)
        self.stop = threading.Event()
        self.sent = 0
        self.accepted = 0  # requests a shadow should have refused and took
        self.sessions: dict[int, dict[str, Any]] = {}
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)

    # -- what the wire shows ---------------------------------------------------------------
    def refresh(self) -> None:
        """Epoch, token and address of every partition's session (clear text on the wire;
        asked of the controller here)."""
        from checkmate.train.layout import query_sessions

        try:
            regs = query_sessions((self.cfg.switch.ip, cfgmod.CONTROLLER_PORT),
                                  self.cfg.job_id)
        except (CheckmateError, OSError):
            return
        self.sessions = {int(p): v for p, v in regs.items()}

    def statuses(self) -> dict[int, dict[str, Any]]:
        """Each shadow's run and newest commit (a holder of the secret can ask)."""
        from checkmate.train.shadow_client import ShadowClient

        out = {}
        for h in self.cfg.shadows:
            try:
                with ShadowClient((h.ip, cfgmod.RESTORE_PORT), 2.0) as c:
                    out[h.partition] = c.status()
            except (CheckmateError, OSError):
                continue
        return out

    def send(self, p: int, data: bytes) -> None:
        s = self.sessions.get(p)
        if s is None:
            return
        d = bytearray(data)
        d[8:16] = struct.pack("!II", int(s["epoch"]), int(s["token"]))
        try:
            self.sock.sendto(bytes(d), (s["ip"], int(s["port"])))
            self.sent += 1
        except OSError:
            pass

    # -- the attacks -------------------------------------------------------------------------
    def forged_control(self) -> None:
        rng = random.Random(1)
        while not self.stop.wait(0.5):
            self.refresh()
            for p in self.sessions:
                for it in range(1, self.args.steps + 1):
                    size = 1024
                    total = rng.choice([size + it, 5000, 64 << 20, rng.randrange(size, 1 << 26)])
                    payload = rng.randbytes(size)
                    h = wire.Header(flags=wire.Flags.CONTROL, job_id=self.cfg.job_id,
                                    iteration=it, offset=0, count=size, partition=p,
                                    dtype=wire.DType.BYTES, fec_group=total,
                                    seq=rng.randrange(1 << 32))
                    self.send(p, wire.encode(h, payload))

    def deep_json(self) -> None:
        from checkmate.protocol import auth
        from checkmate.shadow.feed import control_datagrams

        secret = auth.load_secret()
        deep = b'{"iteration": 0, "lrs": [0.001], "x": ' + b"[" * 1000 + b"]" * 1000 + b"}"
        while not self.stop.wait(0.2):
            self.refresh()
            for p, st in self.statuses().items():
                latest = st.get("latest")
                if latest is None or not st.get("run"):
                    continue
                for it in range(latest + 2, latest + 5):
                    for d in control_datagrams(self.cfg.job_id, it, deep, frag=1400,
                                               partition=p, secret=secret, run=st["run"]):
                        self.send(p, d)

    def other_partition(self) -> None:
        from checkmate.protocol import auth
        from checkmate.shadow.feed import control_datagrams

        secret = auth.load_secret()
        parts = len(self.cfg.shadows)
        while not self.stop.wait(0.2):
            self.refresh()
            for p, st in self.statuses().items():
                latest = st.get("latest")
                if latest is None or not st.get("run") or parts < 2:
                    continue
                other = (p + 1) % parts
                for it in range(latest + 1, latest + 4):
                    body = json.dumps({"iteration": it, "lrs": [9.0] * 8, "clip_coef": None,
                                       "skip": False, "buffers": {}, "extra": {}}).encode()
                    for d in control_datagrams(self.cfg.job_id, it, body, frag=1400,
                                               partition=other, secret=secret,
                                               run=st["run"]):
                        self.send(p, d)

    def refused_peers(self) -> None:
        from checkmate.train.shadow_client import ShadowClient

        bad_run = {"op": "peers", "run": "not-a-run-id", "owners": []}
        while not self.stop.wait(0.3):
            for h in self.cfg.shadows:
                try:
                    with ShadowClient((h.ip, cfgmod.RESTORE_PORT), 2.0) as c:
                        run = c.status().get("run") or "0" * 32
                        for req in (bad_run, {"op": "peers", "run": run,
                                              "trainers": [["10.0.0.1", 47000]],
                                              "owners": [[5, 3, 0]]}):
                            try:
                                c.request(req)
                            except CheckmateError:
                                self.sent += 1  # refused, as it must be
                            else:
                                self.accepted += 1
                except (CheckmateError, OSError):
                    continue

    def capture(self) -> None:
        port = cfgmod.SHADOW_PORT
        s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0800))
        s.bind((self.args.ifname, 0))
        s.settimeout(0.2)
        limit = 200 << 20
        with open(self.args.out + ".bin", "wb") as f:
            while not self.stop.is_set() and f.tell() < limit:
                try:
                    frame = s.recv(65536)
                except TimeoutError:
                    continue
                except OSError:
                    break
                ip = frame[14:]
                if len(ip) < 28 or ip[9] != 17 or (ip[6] & 0x3F) or ip[7]:
                    continue  # not UDP, or an IP fragment
                udp = ip[(ip[0] & 0x0F) * 4:]
                if int.from_bytes(udp[2:4], "big") != port:
                    continue
                d = udp[8:]
                if len(d) >= wire.HEADER_LEN and d[:2] == b"\xc4\xec":
                    f.write(_REC.pack(len(d)) + d)
                    self.sent += 1
        s.close()

    def replay(self) -> None:
        captured: list[tuple[int, bytes]] = []
        for path in self.args.capture:
            raw = Path(path).read_bytes()
            at = 0
            while at + 4 <= len(raw):
                (n,) = _REC.unpack_from(raw, at)
                d = raw[at + 4:at + 4 + n]
                at += 4 + n
                captured.append((wire.decode_header(d).partition, d))
        # Wait until the current run seeded every shadow and named its run: from then on a
        # datagram of the other run would have been taken.
        while not self.stop.wait(0.1):
            sts = self.statuses()
            if len(sts) == len(self.cfg.shadows) and all(
                    st.get("run") and st.get("seeded") for st in sts.values()):
                break
        while not self.stop.is_set():
            self.refresh()
            for i, (p, d) in enumerate(captured):
                self.send(p, d)
                if i % 64 == 63:
                    time.sleep(0.001)  # paced: a loss in the socket would hide nothing
            self.stop.wait(3.0)


@cli_guard("testbed stream_attacks")
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m checkmate.testbed.stream_attacks",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("kind", choices=KINDS)
    ap.add_argument("--config", required=True)
    ap.add_argument("--out", required=True, help="stats JSON (capture: FILE.bin too)")
    ap.add_argument("--capture", action="append", default=[], help="replay: capture files")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--ifname", default="", help="capture: the interface to read")
    args = ap.parse_args(argv)
    a = _Attack(args)
    signal.signal(signal.SIGTERM, lambda *_: a.stop.set())
    signal.signal(signal.SIGINT, lambda *_: a.stop.set())
    t0 = time.monotonic()
    try:
        getattr(a, args.kind.replace("-", "_"))()
    finally:
        Path(args.out).write_text(json.dumps({"kind": args.kind, "sent": a.sent,
                                              "accepted": a.accepted,
                                              "seconds": round(time.monotonic() - t0, 1),
                                              "pid": os.getpid()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())


# ----------------------------------------------------------------------------- the chaos run
def _spawn(cl: Any, host: str, kind: str, out: Path, extra: list[str]) -> Any:
    import subprocess

    argv = [sys.executable, "-m", "checkmate.testbed.stream_attacks", kind, "--config",
            str(cl.config_path), "--out", str(out), *extra]
    log = open(out.with_suffix(".log"), "ab")  # noqa: SIM115
    try:
        return cl.popen(host, argv, {}, stdout=log, stderr=log, stdin=subprocess.DEVNULL)
    finally:
        log.close()


def start(run: Any, captures: list[Path]) -> list[tuple[str, Any, Path]]:
    """Start the scenario's attacks from the last trainer's host (its own source address:
    what it sends crosses the switch as plain traffic)."""
    cl, sc = run.cl, run.sc
    if cl.mode != "switch":
        raise CheckmateError("scenario stream_attacks need --mode switch")
    host = cl.cfg.trainers[-1].name
    out = []
    for kind in sc.stream_attacks:
        extra = ["--steps", str(sc.steps)]
        for c in captures:
            extra += ["--capture", str(c)]
        k = "replay" if kind == "replay-other-run" else kind
        out.append((kind, _spawn(cl, host, k, run.dir / f"attack-{kind}.json", extra),
                    run.dir / f"attack-{kind}.json"))
    return out


def stop(procs: list[tuple[str, Any, Path]]) -> dict[str, int]:
    """SIGTERM each attacker and read how many datagrams it sent (idempotent)."""
    sent = {}
    for kind, p, stats in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout=20)
        except Exception:  # noqa: BLE001 - a stuck attacker is killed, never waited on
            p.kill()
            p.wait()
        try:
            said = json.loads(stats.read_text())
            sent[kind] = int(said["sent"])
            if said.get("accepted"):  # what a shadow should have refused and took
                sent[f"{kind} accepted"] = int(said["accepted"])
        except (OSError, ValueError, KeyError):
            sent[kind] = 0
    return sent


def capture_run(sc: Any, cl: Any, workdir: Path, progress: Any) -> list[Path]:
    """Run A of the replay case: the same job (same secret and job id) with another seed
    for up to 30 iterations, every shadow's incoming ckm traffic recorded."""
    from dataclasses import replace

    from checkmate.testbed.runner import Run

    other = replace(sc, seed=sc.seed + 1, steps=min(sc.steps, 30), kill_at=None, faults=[],
                    shadow_kills=[], controller_restart_at=None, disk_limit=None, attacks=[])
    run = Run(cl, other, workdir, "capture", progress)
    procs: list[tuple[str, Any, Path]] = []
    try:
        run.start_shadows()
        for h in cl.cfg.shadows:
            stats = run.dir / f"capture-{h.name}.json"
            procs.append(("capture", _spawn(cl, h.name, "capture", stats,
                                            ["--ifname", cl.ifname(h.name)]), stats))
        time.sleep(1.0)  # the capture sockets are open before the first datagram
        run.start_trainers(resume=False)
        run.follow(None)
    finally:
        sent = sum(stop(procs).values())
        run.stop()
    if not sent:
        raise CheckmateError("replay-other-run: nothing was captured in run A")
    return [Path(f"{stats}.bin") for _, _, stats in procs]


def check(run: Any, sent: dict[str, int]) -> tuple[list[str], dict[str, Any]]:
    """Problems of an attacked run beyond the usual bit-exact checks: every attack sent,
    its datagrams were counted as dropped, no receive thread failed or restarted."""
    problems = []
    sts = run.result.shadow_status
    drops = {k: sum(int(st.get("drops", {}).get(k, 0)) for st in sts)
             for k in ("mac", "control_invalid", "control_range", "control_expired",
                       "partition", "tcp_refused")}
    for kind, n in sent.items():
        if kind.endswith(" accepted"):
            problems.append(f"attack {kind[:-9]}: {n} request(s) a shadow should have "
                            "refused were taken")
        elif not n:
            problems.append(f"attack {kind} sent nothing")
    forged = sum(n for k, n in sent.items() if k in ("forged-control", "replay-other-run"))
    if forged and drops["mac"] < forged // 2:
        problems.append(f"{forged} forged or replayed datagrams sent, only {drops['mac']} "
                        "counted as mac drops")
    if sent.get("deep-json") and not drops["control_invalid"]:
        problems.append("deep-json: no control message was refused (control_invalid 0)")
    if sent.get("refused-peers") and drops["tcp_refused"] < sent["refused-peers"]:
        problems.append(f"refused-peers: {sent['refused-peers']} refusals, only "
                        f"{drops['tcp_refused']} counted (tcp_refused)")
    if sent.get("other-partition") and not drops["partition"]:
        problems.append("other-partition: no control message for another partition was "
                        "dropped (partition 0)")
    for st in sts:
        rx = st.get("receiver") or {}
        if not rx.get("alive") or rx.get("restarts"):
            problems.append(f"shadow {st.get('partition')}: receive thread alive "
                            f"{rx.get('alive')}, restarts {rx.get('restarts')}")
    return problems, {"sent": sent, "drops": drops}
