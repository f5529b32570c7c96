"""A small P4Runtime client: primary arbitration, Write, Read, pipeline get/set.

Speaks the p4.v1.P4Runtime gRPC service directly with the message classes of
:mod:`checkmate.control.p4proto`; every failure becomes one CheckmateError line.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable

from checkmate.control import p4proto
from checkmate.errors import CheckmateError
from checkmate.extras import needs

with needs("switch"):
    import grpc


class TargetUnreachable(CheckmateError):
    """No P4Runtime server answers at the switch's address."""


def _rpc_error(what: str, e: grpc.RpcError) -> CheckmateError:
    code = e.code().name if hasattr(e, "code") and e.code() else "UNKNOWN"
    details = e.details() if hasattr(e, "details") else str(e)
    return CheckmateError(f"P4Runtime {what} failed: {code}: {details}")


class P4RuntimeClient:
    """One connection to one device, as its primary controller (election id ``election``)."""

    def __init__(self, address: str, device_id: int = 0, election: int = 1,
                 timeout: float = 5.0) -> None:
        self.address = address
        self.device_id = device_id
        self.election = election
        self.timeout = timeout
        self.pb = p4proto.p4runtime()
        self._channel: grpc.Channel | None = None
        self._requests: queue.Queue = queue.Queue()
        self._responses: queue.Queue = queue.Queue()
        self._reader: threading.Thread | None = None

    # -- connection ----------------------------------------------------------------------
    def connect(self) -> None:
        ch = grpc.insecure_channel(self.address)
        try:
            grpc.channel_ready_future(ch).result(timeout=self.timeout)
        except grpc.FutureTimeoutError:
            ch.close()
            raise TargetUnreachable(
                f"no P4Runtime server answers at {self.address} "
                f"(waited {self.timeout:g} s)") from None
        self._channel = ch
        pb = self.pb
        call = ch.stream_stream(
            p4proto.METHODS["StreamChannel"],
            request_serializer=pb.StreamMessageRequest.SerializeToString,
            response_deserializer=pb.StreamMessageResponse.FromString,
        )
        stream = call(iter(self._requests.get, None))
        self._reader = threading.Thread(target=self._read_stream, args=(stream,), daemon=True)
        self._reader.start()
        self._requests.put(pb.StreamMessageRequest(arbitration=pb.MasterArbitrationUpdate(
            device_id=self.device_id, election_id=pb.Uint128(high=0, low=self.election))))
        try:
            msg = self._responses.get(timeout=self.timeout)
        except queue.Empty:
            self.close()
            raise TargetUnreachable(f"P4Runtime server at {self.address} did not answer "
                                    "the arbitration request") from None
        if isinstance(msg, Exception):
            self.close()
            raise msg
        status = msg.arbitration.status
        if status.code != 0:
            self.close()
            raise CheckmateError(f"not primary controller of device {self.device_id} at "
                                 f"{self.address}: {status.message or status.code}")

    def _read_stream(self, stream: Iterable) -> None:
        try:
            for msg in stream:
                if msg.HasField("arbitration"):
                    self._responses.put(msg)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.CANCELLED:
                self._responses.put(_rpc_error("StreamChannel", e))

    def close(self) -> None:
        self._requests.put(None)
        if self._channel is not None:
            self._channel.close()
            self._channel = None

    def __enter__(self) -> P4RuntimeClient:
        self.connect()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- RPCs ----------------------------------------------------------------------------
    def _unary(self, name: str, req, resp_type):
        assert self._channel is not None, "connect() first"
        call = self._channel.unary_unary(
            p4proto.METHODS[name], request_serializer=type(req).SerializeToString,
            response_deserializer=resp_type.FromString)
        try:
            return call(req, timeout=self.timeout)
        except grpc.RpcError as e:
            raise _rpc_error(name, e) from None

    def write(self, updates: list) -> None:
        if not updates:
            return
        pb = self.pb
        req = pb.WriteRequest(device_id=self.device_id,
                              election_id=pb.Uint128(high=0, low=self.election),
                              updates=updates)
        self._unary("Write", req, pb.WriteResponse)

    def read(self, entities: list) -> list:
        assert self._channel is not None, "connect() first"
        pb = self.pb
        call = self._channel.unary_stream(
            p4proto.METHODS["Read"], request_serializer=pb.ReadRequest.SerializeToString,
            response_deserializer=pb.ReadResponse.FromString)
        out = []
        try:
            for resp in call(pb.ReadRequest(device_id=self.device_id, entities=entities),
                             timeout=self.timeout):
                out.extend(resp.entities)
        except grpc.RpcError as e:
            raise _rpc_error("Read", e) from None
        return out

    def get_p4info(self):
        """The device's P4Info, or None when no pipeline is loaded.

        Real servers (PI's in simple_switch_grpc, Stratum, the SDE's) answer FAILED_PRECONDITION
        when no pipeline has been set; an empty P4Info is taken to mean the same."""
        pb = self.pb
        req = pb.GetForwardingPipelineConfigRequest(
            device_id=self.device_id,
            response_type=pb.GetForwardingPipelineConfigRequest.P4INFO_AND_COOKIE)
        assert self._channel is not None, "connect() first"
        call = self._channel.unary_unary(
            p4proto.METHODS["GetForwardingPipelineConfig"],
            request_serializer=type(req).SerializeToString,
            response_deserializer=pb.GetForwardingPipelineConfigResponse.FromString)
        try:
            resp = call(req, timeout=self.timeout)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                return None
            raise _rpc_error("GetForwardingPipelineConfig", e) from None
        info = resp.config.p4info
        return info if len(info.tables) else None

    def set_pipeline(self, p4info, device_config: bytes) -> None:
        pb = self.pb
        req = pb.SetForwardingPipelineConfigRequest(
            device_id=self.device_id, election_id=pb.Uint128(high=0, low=self.election),
            action=pb.SetForwardingPipelineConfigRequest.VERIFY_AND_COMMIT,
            config=pb.ForwardingPipelineConfig(p4info=p4info, p4_device_config=device_config))
        self._unary("SetForwardingPipelineConfig", req, pb.SetForwardingPipelineConfigResponse)
