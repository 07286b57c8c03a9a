"""Malformed and adversarial requests at every RPC (hypothesis): the server answers each
with a status code, never crashes, and serves a normal client afterwards."""

from __future__ import annotations

import grpc
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from distill_common.channel import SESSION_SECRET_KEY
from distill_common.proto.teacher.v1 import teacher_pb2 as pb
from student_trainer import Logits, TeacherClient, TopK
from teacher_server.launcher import ServerProcess
from tests.helpers import build_tiny_model

METHODS = ("GetInfo", "Join", "Submit", "Heartbeat", "Leave", "GetStatus", "Rendezvous")
EXAMPLES = 150
CASES: dict[str, int] = {}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = build_tiny_model(tmp_path_factory.mktemp("teacher") / "model")
    server = ServerProcess("--model", str(model_dir), "--max-batch-tokens", "512", "--max-seq-len", "128",
                           "--join-timeout-s", "2", "--max-sessions", "1000")
    yield server
    print(f"\nfuzz cases run: {CASES} (total {sum(CASES.values())})")
    server.stop()


@pytest.fixture(scope="module")
def channel(server):
    with grpc.insecure_channel(server.address, options=[("grpc.max_send_message_length", 64 << 20)]) as channel:
        yield channel


def _answered(channel, method: str, payload: bytes, metadata: tuple = ()) -> grpc.StatusCode:
    call = channel.unary_unary(f"/teacher.v1.TeacherService/{method}")
    try:
        call(payload, timeout=20, metadata=metadata)
        return grpc.StatusCode.OK
    except grpc.RpcError as e:
        assert e.code() != grpc.StatusCode.DEADLINE_EXCEEDED, f"{method} did not answer: {e.details()}"
        assert e.code() != grpc.StatusCode.UNKNOWN, f"{method} failed unexpectedly: {e.details()}"
        return e.code()


dims = st.lists(st.integers(min_value=-(2**62), max_value=2**62) | st.integers(-2, 300), max_size=4)
tensors = st.builds(pb.Tensor, dtype=st.sampled_from(["int32", "int64", "bool", "float32", "", "int8", "x" * 300]),
                    shape=dims, data=st.binary(max_size=4096))
session_ids = st.text(max_size=40) | st.sampled_from(["", "0" * 16])
submits = st.builds(pb.SubmitRequest, session_id=session_ids, batch_id=st.integers(0, 2**64 - 1),
                    input_ids=tensors, attention_mask=tensors)
joins = st.builds(pb.JoinRequest, job_id=st.text(max_size=300), job_rank=st.integers(-(2**31), 2**31 - 1),
                  outputs=st.builds(pb.OutputSpec, logits=st.booleans(), topk=st.integers(-(2**31), 2**31 - 1),
                                    hidden_layers=st.lists(st.integers(-(2**31), 2**31 - 1), max_size=5),
                                    dtype=st.sampled_from(["", "float32", "bfloat16", "float64", "\x00"])),
                  peer=st.builds(pb.PeerInfo, device_type=st.sampled_from(["cpu", "cuda", "tpu", ""]),
                                 device_uuid=st.text(max_size=40),
                                 torch_version=st.sampled_from([torch.__version__, "1.0", "", "9.9"]),
                                 nccl_version=st.text(max_size=10)),
                  max_inflight=st.integers(-(2**31), 2**31 - 1), vocab_size=st.integers(-(2**62), 2**62),
                  weight=st.floats(allow_nan=True, allow_infinity=True))
messages = {
    "Submit": submits, "Join": joins,
    "Heartbeat": st.builds(pb.HeartbeatRequest, session_id=session_ids),
    "Leave": st.builds(pb.LeaveRequest, session_id=session_ids, drain=st.booleans()),
    "GetInfo": st.just(pb.GetInfoRequest()), "GetStatus": st.just(pb.GetStatusRequest()),
    "Rendezvous": st.builds(pb.RendezvousRequest, session_id=session_ids,
                            op=st.integers(-3, 12), keys=st.lists(st.text(max_size=300), max_size=5),
                            value=st.binary(max_size=4096), expected=st.binary(max_size=64),
                            amount=st.integers(-(2**63), 2**63 - 1),
                            wait_s=st.floats(allow_nan=True, allow_infinity=True)),
}
fuzz = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))


@fuzz
@given(method=st.sampled_from(METHODS), payload=st.binary(max_size=2048))
def test_random_bytes(channel, method, payload):
    CASES["random bytes"] = CASES.get("random bytes", 0) + 1
    _answered(channel, method, payload)


@fuzz
@given(data=st.data())
def test_wrong_and_hostile_fields(channel, data):
    method = data.draw(st.sampled_from(["Submit", "Join", "Heartbeat", "Leave", "Rendezvous"]))
    message = data.draw(messages[method])
    CASES[method] = CASES.get(method, 0) + 1
    _answered(channel, method, message.SerializeToString())


def test_oversized_message_is_refused(channel):
    code = _answered(channel, "Submit", b"\x0a" + b"\xff" * (20 << 20))
    assert code in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INVALID_ARGUMENT)
    CASES["oversized"] = 1


def test_replayed_and_foreign_ids_on_a_live_session(server, channel):
    with TeacherClient(server.address, "cpu") as client:
        client.submit(torch.randint(0, 384, (1, 4))).result(timeout=60)
        ids = pb.Tensor(dtype="int32", shape=[1, 4], data=bytes(16))
        # With the session's secret (as the student itself could): ids out of order are refused.
        secret = ((SESSION_SECRET_KEY, client._connection.session.joined.session_secret),)
        for batch_id in (0, 0, 5, 2**63):  # replayed, replayed again, skipped ahead, huge
            code = _answered(channel, "Submit", pb.SubmitRequest(session_id=client.session_id, batch_id=batch_id,
                                                                   input_ids=ids).SerializeToString(), secret)
            assert code == grpc.StatusCode.INVALID_ARGUMENT
        CASES["replayed ids"] = 4
        # The session is undisturbed by the foreign submits.
        assert client.submit(torch.randint(0, 384, (2, 3))).result(timeout=60).logits.shape == (2, 3, 384)


@fuzz
@given(data=st.data())
def test_hostile_rendezvous_calls_on_a_live_session(server, channel, live_session, data):
    """With the session's id and secret (its own student gone rogue) or without the secret:
    any operation, any keys, values and waits is answered, and touches no other session."""
    session_id, secret = live_session
    request = data.draw(messages["Rendezvous"])
    request.session_id = session_id
    metadata = ((SESSION_SECRET_KEY, secret),) if data.draw(st.booleans()) else ()
    request.wait_s = min(request.wait_s, 0.05) if request.wait_s == request.wait_s else request.wait_s
    CASES["Rendezvous, live session"] = CASES.get("Rendezvous, live session", 0) + 1
    code = _answered(channel, "Rendezvous", request.SerializeToString(), metadata)
    assert code != grpc.StatusCode.INTERNAL


@pytest.fixture(scope="module")
def live_client(server):
    with TeacherClient(server.address, "cpu") as client:
        yield client


@pytest.fixture(scope="module")
def live_session(live_client):
    """A session whose group formed: its id and secret."""
    return live_client.session_id, live_client._connection.session.joined.session_secret


def test_the_rogue_calls_left_the_live_session_serving(live_client):
    assert live_client.submit(torch.randint(0, 384, (2, 5))).result(timeout=60).logits.shape == (2, 5, 384)


def test_a_normal_client_is_served_after_the_fuzzing(server):
    assert server.proc.poll() is None, server.log
    with TeacherClient(server.address, "cpu", outputs=(Logits(), TopK(3))) as client:
        out = client.submit(torch.randint(0, 384, (2, 9))).result(timeout=60)
    assert out.logits.shape == (2, 9, 384) and out.topk_indices.shape == (2, 9, 3)
    assert "Traceback" not in server.log, server.log[-3000:]
