"""docs/protocol.md's worked examples, checked against the code both ways: what the code
encodes from each example's fields must be the documented bytes, and what it decodes from
the documented bytes must be the documented fields (MACs and proofs verified)."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import numpy as np
import pytest

from checkmate.protocol import auth, datamac, handshake, repair, wire
from checkmate.protocol.frames import send_frame

DOC = Path(__file__).resolve().parent.parent / "docs" / "protocol.md"
KINDS = {"gradient", "control", "run-keys", "repair-request", "handshake-register",
         "handshake-registered", "handshake-refusal", "service-auth"}


def _examples() -> dict[str, dict]:
    blocks = re.findall(r"```ckm-example\n(.*?)\n```", DOC.read_text(), flags=re.S)
    out = {}
    for b in blocks:
        ex = json.loads(b)
        out[ex["example"]] = ex
    return out


EXAMPLES = _examples()


def _bytes(lines: list[str]) -> bytes:
    return bytes.fromhex("".join(lines))


def _fields(h: wire.Header) -> dict[str, int]:
    return {f.name: getattr(h, f.name) for f in wire.FIELDS
            if f.name not in ("magic", "version", "crc32c")}


def test_every_kind_of_message_has_an_example():
    assert set(EXAMPLES) == KINDS


@pytest.mark.parametrize("name", ["gradient", "control", "repair-request"])
def test_datagram_examples(name):
    ex = EXAMPLES[name]
    data = _bytes(ex["datagram"])
    h, payload = wire.decode(data)
    assert _fields(h) == ex["header"]
    if name == "gradient":
        payload_in = np.array(ex["payload_f32le"], dtype="<f4").tobytes()
        assert h.crc32c == ex["crc32c"] == wire.crc(payload_in)
        key = datamac.data_key(bytes.fromhex(ex["secret"]))
        assert [hex(k) for k in key] == ex["data_key"]
        tag = datamac.data_tag(key, h.job_id, h.flags, h.iteration, h.offset, h.count,
                               h.partition, h.dtype, h.crc32c)
        assert (h.fec_index, h.fec_k, h.fec_m, h.fec_group) == tag
        assert int(ex["tag56"], 16) == (tag[0] << 48) | (tag[1] << 40) | (tag[2] << 32) | tag[3]
        # and the shadow's batch check accepts exactly this datagram
        ring = np.frombuffer(data, np.uint8)
        ok = datamac.check_batch(np.uint64(key[0]), np.uint64(key[1]), ring,
                                 np.array([len(data)]), len(data), np.zeros(1, np.uint8))
        assert ok[0] == 1
        forged = bytearray(data)
        forged[31] ^= 1  # another offset, same tag
        ok = datamac.check_batch(np.uint64(key[0]), np.uint64(key[1]),
                                 np.frombuffer(bytes(forged), np.uint8),
                                 np.array([len(data)]), len(data), np.zeros(1, np.uint8))
        assert ok[0] == 0
    elif name == "control":
        body = ex["payload_text"].encode()
        mac = datamac.control_mac(datamac.control_key(bytes.fromhex(ex["secret"])),
                                  h.job_id, h.iteration, body)
        assert mac.hex() == ex["control_mac"]
        payload_in = body + mac
        assert h.fec_group == len(payload_in)  # CONTROL: total message length
        # each fragment's own 32-bit tag, in seq, over the header with fec_group
        key = datamac.data_key(bytes.fromhex(ex["secret"]))
        assert h.seq == int(ex["tag32"], 16) == datamac.control_tag(key, data[:wire.HEADER_LEN])
        ok = datamac.check_batch(np.uint64(key[0]), np.uint64(key[1]),
                                 np.frombuffer(data, np.uint8), np.array([len(data)]),
                                 len(data), np.zeros(1, np.uint8))
        assert ok[0] == 1
    else:
        payload_in = repair.encode_ranges([tuple(r) for r in ex["ranges"]])
        assert repair.decode_ranges(payload) == [tuple(r) for r in ex["ranges"]]
        # every repair request is tagged as a gradient is, over its own fields
        key = datamac.data_key(bytes.fromhex(ex["secret"]))
        tag = datamac.data_tag(key, h.job_id, h.flags, h.iteration, h.offset, h.count,
                               h.partition, h.dtype, wire.crc(payload_in))
        assert (h.fec_index, h.fec_k, h.fec_m, h.fec_group) == tag
        assert int(ex["tag56"], 16) == (tag[0] << 48) | (tag[1] << 40) | (tag[2] << 32) | tag[3]
    assert bytes(payload) == payload_in
    assert wire.encode(wire.Header(**ex["header"]), payload_in) == data


def test_handshake_request_example():
    ex = EXAMPLES["handshake-register"]
    key = auth.handshake_key(bytes.fromhex(ex["secret"]))
    raw = ex["json"].encode()
    h = wire.Header(flags=wire.Flags.HANDSHAKE, job_id=ex["job_id"], seq=ex["seq"],
                    partition=ex["partition"], dtype=wire.DType.BYTES,
                    count=len(raw) + auth.MAC_BYTES)
    mac = auth.request_mac(key, wire.pack_header(h), raw)
    assert mac.hex() == ex["mac"]
    data = _bytes(ex["datagram"])
    assert wire.encode(h, raw + mac) == data
    m = handshake.parse(data)
    body = json.loads(raw)
    assert m.body == body and m.raw == raw and m.mac == mac
    # verifies at the example's own time, and is refused as a replay right after
    guard = auth.ReplayGuard()
    now = body["ts"] / 1000
    guard.check(body["nonce"], body["ts"], now)
    with pytest.raises(auth.AuthError, match="replayed"):
        guard.check(body["nonce"], body["ts"], now)
    with pytest.raises(auth.AuthError, match="bad MAC"):
        handshake.verify_request(auth.handshake_key(bytes(32)), m, auth.ReplayGuard())


def test_handshake_reply_examples():
    req = handshake.parse(_bytes(EXAMPLES["handshake-register"]["datagram"]))
    ex = EXAMPLES["handshake-registered"]
    key = auth.handshake_key(bytes.fromhex(ex["secret"]))
    body = json.loads(ex["json"])
    data = _bytes(ex["datagram"])
    assert handshake.reply(key, req, body) == data
    m = handshake.parse(data)
    assert m.mac.hex() == ex["mac"] and m.raw == ex["json"].encode()
    assert (m.header.epoch, m.header.token) == (body["epoch"], body["token"])
    assert m.header.flags == wire.Flags.HANDSHAKE | wire.Flags.ACK
    assert handshake.verify_reply(key, m, ex["request_nonce"])
    refusal = EXAMPLES["handshake-refusal"]
    data = _bytes(refusal["datagram"])
    assert handshake.refusal(req.header) == data
    m = handshake.parse(data)
    assert m.mac == handshake.NO_MAC and m.raw == refusal["json"].encode()
    assert m.header.job_id == 0 and m.header.flags == wire.Flags.HANDSHAKE | wire.Flags.NACK


def test_service_auth_example():
    ex = EXAMPLES["service-auth"]
    key = auth.service_key(bytes.fromhex(ex["secret"]))
    assert auth.client_proof(key, ex["challenge"], ex["nonce"]) == ex["client_proof"]
    assert auth.server_proof(key, ex["challenge"], ex["nonce"]) == ex["server_proof"]

    class Capture:
        data = b""

        def sendall(self, b: bytes) -> None:
            self.data += bytes(b)

    c = Capture()
    send_frame(c, {"op": "auth", "nonce": ex["nonce"], "proof": ex["client_proof"]})
    frame = _bytes(ex["frame"])
    assert c.data == frame
    (n,) = struct.unpack("!I", frame[:4])
    assert json.loads(frame[4:4 + n]) == {"op": "auth", "nonce": ex["nonce"],
                                          "proof": ex["client_proof"], "nbytes": 0}
    assert len(frame) == 4 + n


def test_run_keys_example():
    ex = EXAMPLES["run-keys"]
    secret = bytes.fromhex(ex["secret"])
    rs = datamac.run_secret(secret, ex["run"])
    assert rs.hex() == ex["run_secret"]
    assert [hex(k) for k in datamac.data_key(rs)] == ex["data_key"]
    assert datamac.control_key(rs).hex() == ex["control_key"]
