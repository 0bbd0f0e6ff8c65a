"""The clock clients without a daemon, and the wire framing they share with it."""

from __future__ import annotations

import json
import socket
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kareus.daemon_client import (
    DaemonConnection,
    DaemonError,
    NullClockClient,
    RecordingClockClient,
    connect,
    protocol,
)


def test_null_client_does_nothing_and_never_fails():
    client = connect(None)
    assert isinstance(client, NullClockClient)
    client.request_clock(1200, instruction="F0")
    client.upload_schedule([1200, 1100])
    client.advance()
    client.reset()
    client.close()
    assert not client.degraded


def test_missing_daemon_gives_a_degraded_null_client(tmp_path):
    client = connect(str(tmp_path / "nothing.sock"))
    assert isinstance(client, NullClockClient)
    assert client.degraded
    assert "cannot connect" in client.degraded_reason
    with pytest.raises(DaemonError, match="cannot connect"):
        connect(str(tmp_path / "nothing.sock"), required=True)


def test_recording_client_logs_requests_and_cycles_the_schedule():
    client = RecordingClockClient()
    client.request_clock(1410, instruction="s0.F0")
    client.upload_schedule([1200, 1050])
    for _ in range(3):
        client.advance()
    client.close()
    client.close()
    assert [r.instruction for r in client.log] == ["s0.F0", "schedule[0]", "schedule[1]", "schedule[0]", "reset"]
    assert client.clocks_mhz() == [1410, 1200, 1050, 1200, None]
    times = [r.time_s for r in client.log]
    assert times == sorted(times)


def test_frames_round_trip_and_limits_are_enforced():
    frame = protocol.encode_frame({"v": 1, "id": 3, "op": "status"})
    length = protocol.frame_length(frame[:4])
    assert protocol.decode_body(frame[4 : 4 + length]) == {"v": 1, "id": 3, "op": "status"}
    assert protocol.check_request({"v": 1, "id": 3, "op": "status"}) == (3, "status")
    with pytest.raises(protocol.ProtocolError, match="exceeds the limit"):
        protocol.frame_length((protocol.MAX_FRAME_BYTES + 1).to_bytes(4, "big"))
    with pytest.raises(protocol.ProtocolError, match="exceeds the limit"):
        protocol.encode_frame({"blob": "x" * protocol.MAX_FRAME_BYTES})
    with pytest.raises(protocol.ProtocolError, match="JSON object"):
        protocol.decode_body(b"[1, 2]")
    with pytest.raises(protocol.ProtocolError, match="not UTF-8 JSON"):
        protocol.decode_body(b"\xff\xfe")
    for version in (2, True, 1.0, "1"):
        with pytest.raises(protocol.ProtocolError) as info:
            protocol.check_request({"v": version, "op": "status"})
        assert info.value.code == protocol.E_VERSION
    with pytest.raises(protocol.ProtocolError) as info:
        protocol.check_request({"v": 1, "op": "format_disk"})
    assert info.value.code == protocol.E_UNKNOWN_OP
    with pytest.raises(protocol.ProtocolError, match="id"):
        protocol.check_request({"v": 1, "id": True, "op": "status"})


def test_connection_raises_the_daemons_refusal(tmp_path):
    """A one-shot peer that refuses everything: the refusal surfaces as DaemonError with its code."""
    path = str(tmp_path / "peer.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)

    def refuse_one() -> None:
        peer, _ = server.accept()
        with peer:
            header = peer.recv(4)
            body = peer.recv(protocol.frame_length(header))
            request = json.loads(body)
            peer.sendall(protocol.encode_frame(protocol.error_reply(request["id"], "refused", "not your GPU")))

    thread = threading.Thread(target=refuse_one)
    thread.start()
    with DaemonConnection(path, timeout_s=5) as connection, pytest.raises(DaemonError) as info:
        connection.lock(["GPU-x"], 1200)
    thread.join()
    server.close()
    assert info.value.code == "refused"
    assert "not your GPU" in str(info.value)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20,
)


@given(st.binary(max_size=300))
@settings(max_examples=300, deadline=None)
def test_any_bytes_decode_to_an_object_or_a_protocol_error(body):
    try:
        assert isinstance(protocol.decode_body(body), dict)
    except protocol.ProtocolError as error:
        assert error.code == protocol.E_INVALID


@given(st.dictionaries(st.sampled_from(["v", "id", "op", "gpus"]), json_values, max_size=4))
@settings(max_examples=300, deadline=None)
def test_any_envelope_is_accepted_only_when_well_formed(message):
    try:
        request_id, op = protocol.check_request(message)
    except protocol.ProtocolError as error:
        assert error.code in (protocol.E_INVALID, protocol.E_VERSION, protocol.E_UNKNOWN_OP)
    else:
        assert type(message["v"]) is int and message["v"] == 1 and op in protocol.OPS and isinstance(request_id, int) and request_id >= 0
