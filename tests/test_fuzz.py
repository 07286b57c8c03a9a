"""Malformed and adversarial requests at every RPC (hypothesis): the server answers each
with a status code, never crashes, and serves a normal client afterwards."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import PreTrainedTokenizerFast

from distill_common.alignment import StudentVocabulary, row_texts

from distill_common.channel import SESSION_SECRET_KEY
from distill_common.proto.teacher.v1 import teacher_pb2 as pb
from student_trainer import Logits, TeacherClient, TopK
from teacher_server.launcher import ServerProcess
from tests.helpers import build_tiny_model
from tests.test_alignment import STUDENT_MERGES, TEACHER_MERGES, byte_level_tokenizer

METHODS = ("GetInfo", "Join", "Submit", "Heartbeat", "Leave", "GetStatus", "Rendezvous")
EXAMPLES = 150
CASES: dict[str, int] = {}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = build_tiny_model(tmp_path_factory.mktemp("teacher") / "model")
    # A tokenizer too, so that cross-tokenizer sessions are served (and their fields checked) here.
    PreTrainedTokenizerFast(tokenizer_object=byte_level_tokenizer(TEACHER_MERGES)).save_pretrained(model_dir)
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
        assert e.code() not in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL), \
            f"{method} failed unexpectedly: {e.details()}"
        return e.code()


dims = st.lists(st.integers(min_value=-(2**62), max_value=2**62) | st.integers(-2, 300), max_size=4)
tensors = st.builds(pb.Tensor, dtype=st.sampled_from(["int32", "int64", "bool", "float32", "", "int8", "x" * 300]),
                    shape=dims, data=st.binary(max_size=4096))


# Ids in the fuzz teacher's vocabulary (384) half the time, else near its ends or anywhere in int32.
id_ranges = st.sampled_from([(0, 383), (0, 383), (-2, 400), (-(2**31), 2**31 - 1)])


@st.composite
def id_tensors(draw, ndim: int) -> pb.Tensor:
    """Token ids as a student sends them, mostly well formed: ndim dimensions (sometimes another
    number), ids near the vocabulary (384) and past it, int32 or int64, the bytes matching the shape
    (sometimes not)."""
    if draw(st.integers(0, 3)):
        shape = draw(st.lists(st.integers(1, 6) | st.just(0), min_size=ndim, max_size=ndim))
    else:
        shape = draw(st.lists(st.integers(0, 3), max_size=3)  # the wrong number, or more than numpy holds (64)
                     | st.lists(st.just(1) | st.integers(0, 3), min_size=60, max_size=70))
    dtype = draw(st.sampled_from(["int32", "int32", "int64"]))
    count = int(np.prod(shape)) if shape else 1
    low, high = draw(id_ranges)
    values = draw(st.lists(st.integers(low, high), min_size=count, max_size=count))
    data = np.array(values, dtype="<i4" if dtype == "int32" else "<i8").tobytes()
    if draw(st.integers(0, 9)) == 0:  # a claimed shape its bytes disagree with
        data = data[:draw(st.integers(0, len(data)))] + draw(st.binary(max_size=8))
    return pb.Tensor(dtype=dtype, shape=shape, data=data)


def absent_or(strategy, absent):
    """Half the time the field's default (not asked): a spec whose every field is hostile is refused
    at its first kind, and the checks of the later ones would never run."""
    return st.just(absent) | strategy


layers = st.lists(st.integers(-(2**31), 2**31 - 1) | st.integers(-1, 4), max_size=5)
temperatures = (st.floats(allow_nan=True, allow_infinity=True)
                | st.sampled_from([0.0, -0.0, 1.0, 1e-3, 1e-40, 5e-324, 1e300, float("nan"), float("inf")]))
output_specs = st.builds(
    pb.OutputSpec, logits=st.booleans(), topk=absent_or(st.integers(-(2**31), 2**31 - 1) | st.integers(-1, 5), 0),
    hidden_layers=absent_or(layers, []), dtype=st.sampled_from(["", "float32", "bfloat16", "float64", "\x00"]),
    final_hidden=st.booleans(), attention_layers=absent_or(layers, []),
    logit_subset=st.none() | id_tensors(1) | tensors,
    aux_hidden_states=absent_or(st.builds(pb.AuxHiddenStates, layers=layers), None),
    argmax=st.booleans(), next_token_logprobs=st.booleans(),
    score_ids=absent_or(st.integers(-(2**31), 2**31 - 1) | st.integers(-1, 9), 0), logprob_temperature=temperatures,
    cross_tokenizer=absent_or(st.builds(
        pb.CrossTokenizerOutputs, span_logprobs=st.booleans(), projected=st.booleans(),
        projected_rest_topk=st.integers(-(2**31), 2**31 - 1) | st.integers(-1, 5),
        sorted_topk=st.integers(-(2**31), 2**31 - 1) | st.integers(-1, 5)), None))
# Student vocabularies: lengths that add up or not, huge or empty pieces, more entries than the limit (384).
vocabularies = st.builds(pb.StudentVocabulary, token_bytes=st.binary(max_size=2048),
                         token_lengths=st.lists(st.integers(0, 2**32 - 1) | st.integers(0, 8), max_size=500))
row_texts_messages = st.builds(pb.RowTexts, rows=st.lists(st.binary(max_size=64), max_size=8))
session_ids = st.text(max_size=40) | st.sampled_from(["", "0" * 16])
submits = st.builds(pb.SubmitRequest, session_id=session_ids, batch_id=st.integers(0, 2**64 - 1) | st.integers(0, 3),
                    input_ids=tensors | id_tensors(2), attention_mask=st.none() | tensors,
                    score_ids=st.none() | tensors | id_tensors(3), student_text=st.none() | row_texts_messages)
joins = st.builds(pb.JoinRequest, job_id=st.text(max_size=300), job_rank=st.integers(-(2**31), 2**31 - 1),
                  outputs=output_specs,
                  peer=st.builds(pb.PeerInfo, device_type=st.sampled_from(["cpu", "cuda", "tpu", ""]),
                                 device_uuid=st.text(max_size=40),
                                 torch_version=st.sampled_from([torch.__version__, "1.0", "", "9.9"]),
                                 nccl_version=st.text(max_size=10)),
                  max_inflight=st.integers(-(2**31), 2**31 - 1), vocab_size=st.integers(-(2**62), 2**62),
                  weight=st.floats(allow_nan=True, allow_infinity=True),
                  student_vocabulary=absent_or(vocabularies, None))
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


class OwnSession:
    """A session of the caller's own that asked for log-probabilities at SCORED ids (joined with the
    bare stub: its group never forms, and it takes Submits while it waits): a Submit to it in order,
    with its secret, reaches the check of every field, score_ids included. Joined again once it holds
    --max-inflight batches or has ended (--join-timeout-s)."""

    SCORED = 2

    def __init__(self, channel):
        self._join_call = channel.unary_unary("/teacher.v1.TeacherService/Join",
                                              response_deserializer=pb.JoinResponse.FromString)
        self._join()

    def _join(self) -> None:
        peer = pb.PeerInfo(device_type="cpu", torch_version=torch.__version__)
        outputs = pb.OutputSpec(logits=True, next_token_logprobs=True, score_ids=self.SCORED, logprob_temperature=0.5)
        joined = self._join_call(pb.JoinRequest(outputs=outputs, peer=peer).SerializeToString(), timeout=20)
        self.session_id, self.next_batch_id = joined.session_id, 0
        self.metadata = ((SESSION_SECRET_KEY, joined.session_secret),)

    def address(self, message: pb.SubmitRequest) -> tuple:
        """Makes `message` this session's next batch; the metadata to send it with."""
        message.session_id, message.batch_id = self.session_id, self.next_batch_id
        self.next_batch_id += 1
        return self.metadata

    def answered(self, code: grpc.StatusCode) -> None:
        if code in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.NOT_FOUND):
            self._join()


class OwnCrossSession(OwnSession):
    """The same for a session of cross-tokenizer outputs, joined with a real student vocabulary: a
    Submit to it reaches the alignment (text against ids, the teacher's re-tokenization)."""

    VOCABULARY = StudentVocabulary.of(byte_level_tokenizer(STUDENT_MERGES, special=("<|pad|>", "<|eos|>")))

    def _join(self) -> None:
        peer = pb.PeerInfo(device_type="cpu", torch_version=torch.__version__)
        outputs = pb.OutputSpec(cross_tokenizer=pb.CrossTokenizerOutputs(span_logprobs=True, projected=True,
                                                                          projected_rest_topk=2, sorted_topk=3))
        request = pb.JoinRequest(outputs=outputs, peer=peer)
        self.VOCABULARY.to_proto(request.student_vocabulary)
        joined = self._join_call(request.SerializeToString(), timeout=20)
        self.session_id, self.next_batch_id = joined.session_id, 0
        self.metadata = ((SESSION_SECRET_KEY, joined.session_secret),)


@pytest.fixture(scope="module")
def own_session(channel):
    return OwnSession(channel)


@pytest.fixture(scope="module")
def own_cross_session(channel):
    return OwnCrossSession(channel)


@fuzz
@given(data=st.data())
def test_wrong_and_hostile_fields(channel, own_session, own_cross_session, data):
    method = data.draw(st.sampled_from(["Submit", "Join", "Heartbeat", "Leave", "Rendezvous"]))
    message = data.draw(messages[method])
    own = method == "Submit" and data.draw(st.booleans())  # to a session of the caller's own, in order
    cross = own and data.draw(st.booleans())  # ... one of cross-tokenizer outputs
    case = f"{method}, own {'cross-tokenizer ' if cross else ''}session" if own else method
    CASES[case] = CASES.get(case, 0) + 1
    if not own:
        _answered(channel, method, message.SerializeToString())
        return
    if cross:
        _submit_cross(channel, own_cross_session, message, data)
        return
    # Mostly a batch as a student sends it, so that its ids to score are checked too: ids and ids to
    # score of the batch's shape (their values anywhere), and now and then the hostile fields drawn.
    if data.draw(st.integers(0, 3)):
        message.input_ids.CopyFrom(data.draw(id_tensors(2)))
        if data.draw(st.integers(0, 3)):
            message.ClearField("attention_mask")
    shape = list(message.input_ids.shape)
    if len(shape) == 2 and all(0 <= d < 64 for d in shape) and data.draw(st.integers(0, 3)):
        low, high = data.draw(id_ranges)
        values = data.draw(st.lists(st.integers(low, high), min_size=1, max_size=3))
        score_ids = np.resize(np.array(values, "<i4"), [*shape, OwnSession.SCORED])
        message.score_ids.CopyFrom(pb.Tensor(dtype="int32", shape=[*shape, OwnSession.SCORED], data=score_ids.tobytes()))
    metadata = own_session.address(message)  # after every draw: one may end the example early
    own_session.answered(_answered(channel, method, message.SerializeToString(), metadata))


def _submit_cross(channel, session: OwnCrossSession, message: pb.SubmitRequest, data) -> None:
    """Mostly ids of the student vocabulary with the text they spell (sometimes altered: a byte
    changed, cut or added), now and then the hostile fields drawn."""
    size = len(OwnCrossSession.VOCABULARY)
    if data.draw(st.integers(0, 3)):
        rows, seq = data.draw(st.integers(1, 4)), data.draw(st.integers(1, 12))
        ids = np.array(data.draw(st.lists(st.integers(0, size - 1) | st.integers(-2, size + 2), min_size=rows * seq,
                                          max_size=rows * seq)), dtype="<i4").reshape(rows, seq)
        mask = np.array(data.draw(st.lists(st.sampled_from([1, 1, 1, 0]), min_size=rows * seq,
                                           max_size=rows * seq)), dtype="<i4").reshape(rows, seq)
        message.input_ids.CopyFrom(pb.Tensor(dtype="int32", shape=[rows, seq], data=ids.tobytes()))
        message.attention_mask.CopyFrom(pb.Tensor(dtype="int32", shape=[rows, seq], data=mask.tobytes()))
        if ids.min() >= 0 and ids.max() < size:
            texts = row_texts(torch.from_numpy(ids.astype(np.int64)), torch.from_numpy(mask), session.VOCABULARY)
            if not data.draw(st.integers(0, 2)) and texts:  # one row's text altered
                row = data.draw(st.integers(0, len(texts) - 1))
                texts[row] = data.draw(st.sampled_from([texts[row][:-1], texts[row] + b"\xff", b"x" + texts[row][1:]]))
            message.student_text.CopyFrom(pb.RowTexts(rows=texts))
    metadata = session.address(message)
    session.answered(_answered(channel, "Submit", message.SerializeToString(), metadata))


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
