"""Every bad input gets its status code and a message that says what to change; the
server keeps serving."""

from __future__ import annotations

import os
import signal
import time

import grpc
import numpy as np
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from distill_common.channel import SESSION_SECRET_KEY
from distill_common.proto.teacher.v1 import teacher_pb2 as pb
from distill_common.proto.teacher.v1 import teacher_pb2_grpc as pb_grpc
from student_trainer import TeacherClient
from student_trainer.errors import InvalidRequest, LimitExceeded
from teacher_server.launcher import ServerProcess
from tests.helpers import build_tiny_model, start_student, wait_for_line

VOCAB = 384
MAX_SEQ = 64
MAX_TOKENS = 256


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = build_tiny_model(tmp_path_factory.mktemp("teacher") / "model", vocab_size=VOCAB)
    server = ServerProcess("--model", str(model_dir), "--max-batch-tokens", str(MAX_TOKENS), "--max-seq-len",
                           str(MAX_SEQ), "--lease-s", "2", "--heartbeat-interval-s", "0.5", "--join-timeout-s", "120")
    server.model_dir = model_dir
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    with TeacherClient(server.address, "cpu") as client:
        yield client


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(server.address) as channel:
        yield pb_grpc.TeacherServiceStub(channel)


def _code(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code(), info.value.details()


def _tensor(array: np.ndarray, dtype: str | None = None) -> pb.Tensor:
    return pb.Tensor(dtype=dtype or str(array.dtype), shape=list(array.shape), data=array.astype("<" + array.dtype.str[1:]).tobytes())


class RawSession:
    """A session joined with the bare stub: its group never forms, so it stays
    'connecting' (for --join-timeout-s) and accepts Submits without a student behind it.
    Calls about it carry `metadata`: its secret."""

    def __init__(self, stub, **join_fields):
        peer = pb.PeerInfo(device_type="cpu", torch_version=torch.__version__)
        self.joined = stub.Join(pb.JoinRequest(outputs=pb.OutputSpec(logits=True), peer=peer, **join_fields),
                                timeout=10)
        self.session_id = self.joined.session_id
        self.metadata = ((SESSION_SECRET_KEY, self.joined.session_secret),)
        self.next_batch_id = 0

    def request(self, **fields) -> pb.SubmitRequest:
        request = pb.SubmitRequest(session_id=self.session_id, batch_id=self.next_batch_id)
        for name, value in fields.items():
            getattr(request, name).CopyFrom(value) if isinstance(value, pb.Tensor) else setattr(request, name, value)
        if request.batch_id == self.next_batch_id:
            self.next_batch_id += 1  # the expected id is used up, accepted or refused
        return request


@pytest.fixture(scope="module")
def raw(stub):
    return RawSession(stub)


def _assert_healthy(server):
    with grpc.insecure_channel(server.address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    assert server.proc.poll() is None


ids_ok = np.zeros((2, 8), dtype=np.int32)

BAD_SUBMITS = {
    "ids outside the vocabulary": (dict(input_ids=_tensor(np.full((2, 8), VOCAB, np.int32))),
                                   grpc.StatusCode.INVALID_ARGUMENT, "[0, 384)"),
    "negative ids": (dict(input_ids=_tensor(np.full((1, 3), -1, np.int64))), grpc.StatusCode.INVALID_ARGUMENT,
                     "[0, 384)"),
    "ids that are not integers": (dict(input_ids=_tensor(np.zeros((2, 8), np.float32))),
                                  grpc.StatusCode.INVALID_ARGUMENT, "integers"),
    "ids and mask of different shapes": (dict(input_ids=_tensor(ids_ok), attention_mask=_tensor(np.ones((2, 7), np.int64))),
                                         grpc.StatusCode.INVALID_ARGUMENT, "differs"),
    "an empty batch": (dict(input_ids=_tensor(np.zeros((0, 8), np.int32))), grpc.StatusCode.INVALID_ARGUMENT,
                       "empty"),
    "no input_ids at all": (dict(), grpc.StatusCode.INVALID_ARGUMENT, "2-D"),
    "a sequence over --max-seq-len": (dict(input_ids=_tensor(np.zeros((1, MAX_SEQ + 1), np.int32))),
                                      grpc.StatusCode.INVALID_ARGUMENT, "--max-seq-len"),
    "a batch over --max-batch-tokens": (dict(input_ids=_tensor(np.zeros((5, MAX_SEQ), np.int32))),
                                        grpc.StatusCode.RESOURCE_EXHAUSTED, "--max-batch-tokens"),
    "bytes that do not match the shape": (dict(input_ids=pb.Tensor(dtype="int32", shape=[2, 8], data=b"\0" * 10)),
                                          grpc.StatusCode.INVALID_ARGUMENT, "bytes"),
    "a huge declared shape": (dict(input_ids=pb.Tensor(dtype="int32", shape=[1, 2**62], data=b"")),
                              grpc.StatusCode.INVALID_ARGUMENT, "--max-seq-len"),
    "a mask that is not 0/1": (dict(input_ids=_tensor(ids_ok), attention_mask=_tensor(np.full((2, 8), 2, np.int64))),
                               grpc.StatusCode.INVALID_ARGUMENT, "0 and 1"),
    "a batch id out of order": (dict(input_ids=_tensor(ids_ok), batch_id=99), grpc.StatusCode.INVALID_ARGUMENT,
                                "out of order"),
    "a replayed batch id": (dict(input_ids=_tensor(ids_ok), batch_id=0), grpc.StatusCode.INVALID_ARGUMENT,
                            "out of order"),
    # More dimensions than numpy holds (64): one element, whose bytes match the shape.
    "a mask of 100 dimensions": (dict(input_ids=_tensor(ids_ok),
                                      attention_mask=pb.Tensor(dtype="int64", shape=[1] * 100, data=bytes(8))),
                                 grpc.StatusCode.INVALID_ARGUMENT, "100 dimensions"),
    # A message that quotes the shape is cut short enough for a status (16 KiB of trailers).
    "ids of 8,000 dimensions": (dict(input_ids=pb.Tensor(dtype="int32", shape=[10**6] * 8_000)),
                                 grpc.StatusCode.INVALID_ARGUMENT, "more bytes)"),
}


@pytest.mark.parametrize("case", list(BAD_SUBMITS))
def test_bad_submit(server, raw, stub, case):
    fields, code, words = BAD_SUBMITS[case]
    request = raw.request(**fields)
    got, details = _code(lambda: stub.Submit(request, timeout=10, metadata=raw.metadata))
    assert got == code, (got, details)
    assert words in details, details
    _assert_healthy(server)


def test_unknown_session(server, stub):
    secret = ((SESSION_SECRET_KEY, "any"),)
    got, details = _code(lambda: stub.Submit(pb.SubmitRequest(session_id="nope", input_ids=_tensor(ids_ok)), timeout=10,
                                             metadata=secret))
    assert got == grpc.StatusCode.NOT_FOUND and "join again" in details
    got, _ = _code(lambda: stub.Heartbeat(pb.HeartbeatRequest(session_id="nope"), timeout=10, metadata=secret))
    assert got == grpc.StatusCode.NOT_FOUND


def test_expired_session_is_not_found(server, stub, tmp_path):
    # A student frozen with SIGSTOP keeps its sockets open but stops heartbeating: its
    # lease (2 s here) runs out and its session ends.
    student = start_student(server.address, server.model_dir, tmp_path / "s.json", "--batches", "1000",
                            "--pause-s", "0.05")
    try:
        _, session_id, secret = wait_for_line(student, "JOINED").split()
        os.kill(student.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 15
        while True:
            code, details = None, ""
            try:
                stub.Submit(pb.SubmitRequest(session_id=session_id, batch_id=0, input_ids=_tensor(ids_ok)), timeout=10,
                            metadata=((SESSION_SECRET_KEY, secret),))
            except grpc.RpcError as e:
                code, details = e.code(), e.details()
            if code == grpc.StatusCode.NOT_FOUND:
                break
            assert time.monotonic() < deadline, f"session not expired after 15 s: {code} {details}"
            time.sleep(0.2)
        assert "join again" in details
    finally:
        os.kill(student.pid, signal.SIGKILL)
        student.wait(10)
    _assert_healthy(server)


def test_malformed_message(server):
    with grpc.insecure_channel(server.address) as channel:
        for method in ("Submit", "Join", "Heartbeat"):
            call = channel.unary_unary(f"/teacher.v1.TeacherService/{method}")
            got, details = _code(lambda: call(b"\xff\xff\xff\xff", timeout=10))
            assert got == grpc.StatusCode.INVALID_ARGUMENT, (method, got, details)
            assert "malformed" in details
    _assert_healthy(server)


BAD_JOINS = {
    "nothing requested": (pb.OutputSpec(), grpc.StatusCode.INVALID_ARGUMENT, "no outputs"),
    "a hidden layer out of range": (pb.OutputSpec(hidden_layers=[3]), grpc.StatusCode.INVALID_ARGUMENT, "0 (embeddings) .. 2"),
    "k over the vocabulary": (pb.OutputSpec(topk=VOCAB + 1), grpc.StatusCode.INVALID_ARGUMENT, "topk"),
    "an unknown dtype": (pb.OutputSpec(logits=True, dtype="float8"), grpc.StatusCode.INVALID_ARGUMENT, "dtype"),
    "a logit subset of 100 dimensions": (pb.OutputSpec(logit_subset=pb.Tensor(dtype="int32", shape=[1] * 100,
                                                                              data=bytes(4))),
                                         grpc.StatusCode.INVALID_ARGUMENT, "100 dimensions"),
    # Thousands of layers (a request well under --max-request-bytes): the message names a few, or
    # it would exceed what grpc carries in a status (16 KiB), and the student would be told
    # RESOURCE_EXHAUSTED, which it takes for a full teacher and asks again.
    "20,000 hidden layers out of range": (pb.OutputSpec(hidden_layers=[1000] * 20_000),
                                          grpc.StatusCode.INVALID_ARGUMENT, "and 19992 more"),
    "20,000 repeated hidden layers": (pb.OutputSpec(hidden_layers=[1] * 20_000), grpc.StatusCode.INVALID_ARGUMENT,
                                      "repeat a layer"),
    "20,000 attention layers": (pb.OutputSpec(attention_layers=[1] * 20_000), grpc.StatusCode.INVALID_ARGUMENT,
                                "repeat a layer"),
    "20,000 auxiliary layers": (pb.OutputSpec(aux_hidden_states=pb.AuxHiddenStates(layers=[1] * 20_000)),
                                grpc.StatusCode.INVALID_ARGUMENT, "exactly 3"),
}


@pytest.mark.parametrize("case", list(BAD_JOINS))
def test_bad_join(server, stub, case):
    outputs, code, words = BAD_JOINS[case]
    peer = pb.PeerInfo(device_type="cpu", torch_version=torch.__version__)
    got, details = _code(lambda: stub.Join(pb.JoinRequest(outputs=outputs, peer=peer), timeout=10))
    assert got == code and words in details, (got, details[:300])
    assert len(details) < 2000, details[:300]


def test_incompatible_students_are_refused(server, stub):
    peer = pb.PeerInfo(device_type="cpu", torch_version="1.13.1")
    got, details = _code(lambda: stub.Join(pb.JoinRequest(outputs=pb.OutputSpec(logits=True), peer=peer), timeout=10))
    assert got == grpc.StatusCode.FAILED_PRECONDITION and "torch" in details
    peer = pb.PeerInfo(device_type="cpu", torch_version=torch.__version__)
    got, details = _code(lambda: stub.Join(pb.JoinRequest(outputs=pb.OutputSpec(logits=True), peer=peer,
                                                          vocab_size=VOCAB + 1), timeout=10))
    assert got == grpc.StatusCode.FAILED_PRECONDITION and "same tokenizer" in details
    # Hidden states only: any vocabulary is fine (the group is never formed: the
    # session simply times out on the teacher's side).
    stub.Join(pb.JoinRequest(outputs=pb.OutputSpec(hidden_layers=[1]), peer=peer, vocab_size=VOCAB + 1), timeout=10)


def test_client_raises_python_exceptions_that_say_what_to_change(server, client):
    # The teacher's refusals arrive on the future: submit() itself never waits on an RPC.
    with pytest.raises(InvalidRequest, match=r"\[0, 384\)"):
        client.submit(torch.full((1, 4), VOCAB)).result(timeout=30)
    with pytest.raises(LimitExceeded, match="--max-batch-tokens"):
        client.submit(torch.zeros(5, MAX_SEQ, dtype=torch.int64)).result(timeout=30)
    with pytest.raises(ValueError, match="int32, int64 or bool"):  # caught before it leaves the student
        client.submit(torch.zeros(1, 4))
    # The session is still good after the refusals.
    out = client.submit(torch.randint(0, VOCAB, (2, 6))).result(timeout=60)
    assert out.logits.shape == (2, 6, VOCAB)


def test_a_good_batch_is_accepted_after_the_refusals(raw, stub):
    reply = stub.Submit(raw.request(input_ids=_tensor(np.ones((2, 8), np.int32))), timeout=10, metadata=raw.metadata)
    assert reply.batch_id == raw.next_batch_id - 1 and reply.inflight == 1


def test_submit_stream_answers_each_batch_in_order(raw, stub):
    good = lambda: raw.request(input_ids=_tensor(np.ones((1, 4), np.int32)))  # noqa: E731
    requests = [good(), raw.request(input_ids=_tensor(np.full((1, 4), VOCAB, np.int32))), good(),
                raw.request(input_ids=_tensor(np.ones((1, 4), np.int32)), batch_id=10**6)]
    replies = list(stub.SubmitStream(iter(requests), timeout=10, metadata=raw.metadata))
    assert [r.batch_id for r in replies] == [r.batch_id for r in requests]
    assert [r.error_code for r in replies] == [0, grpc.StatusCode.INVALID_ARGUMENT.value[0], 0,
                                              grpc.StatusCode.INVALID_ARGUMENT.value[0]]
    assert "[0, 384)" in replies[1].error_message and "out of order" in replies[3].error_message


def test_submit_stream_of_a_refusals_only_session_answers_only_refusals(stub):
    """JoinRequest.stream_refusals_only (what TeacherClient asks for): an accepted batch gets
    no answer (its announcement comes as an event once it is sent: this session's group never
    forms, so none comes), a refused one is answered with the reason."""
    raw = RawSession(stub, stream_refusals_only=True)
    assert raw.joined.stream_refusals_only
    good = lambda: raw.request(input_ids=_tensor(np.ones((1, 4), np.int32)))  # noqa: E731
    requests = [good(), raw.request(input_ids=_tensor(np.full((1, 4), VOCAB, np.int32))), good(), good(),
                raw.request(input_ids=_tensor(np.zeros((5, MAX_SEQ), np.int32)))]
    replies = list(stub.SubmitStream(iter(requests), timeout=10, metadata=raw.metadata))
    assert [(r.batch_id, r.error_code, r.HasField("events")) for r in replies] == [
        (1, grpc.StatusCode.INVALID_ARGUMENT.value[0], False), (4, grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], False)]
    assert "[0, 384)" in replies[0].error_message and "--max-batch-tokens" in replies[1].error_message
