"""Tenants: sessions are capabilities, per-job tokens, and joins that never form their group.

One teacher with the operator's token (TEACHER_AUTH_TOKEN) and two job tokens (--job-tokens).

- A token holder who reads another job's session id (status, metrics, or a guess) can
  neither submit to, renew nor end that session: every call about a session needs the secret
  its Join returned. The victim's outputs stay exactly the local model's.
- A job token joins only as its job, within its weight and session limits, and sees only its
  job's sessions.
- Joins whose group never forms fill --max-sessions; the teacher ends them after
  --join-timeout-s and a real student, whose first Join is refused for capacity, asks again
  and gets its session within its own join timeout.
"""

from __future__ import annotations

import json
import logging
import time

import grpc
import pytest
import requests
import torch

from distill_common.channel import SESSION_SECRET_KEY
from distill_common.settings import ConfigError
from distill_common.proto.teacher.v1 import teacher_pb2 as pb
from distill_common.proto.teacher.v1 import teacher_pb2_grpc as pb_grpc
from student_trainer import TeacherClient
from student_trainer.errors import InvalidRequest, PermissionRefused
from teacher_server.config import JobToken, ServerConfig
from teacher_server.launcher import ServerProcess, child_env
from tests.helpers import build_tiny_model, wait_until

OPERATOR = "operator-token-0123456789"
TOKEN_A = "job-a-token-0123456789abcdef"
TOKEN_B = "job-b-token-0123456789abcdef"
MAX_SESSIONS = 4
JOB_A_SESSIONS = 2
JOB_B_SESSIONS = 3
PER_JOB = 3  # --max-sessions-per-job: the operator's joins, per job id
JOIN_TIMEOUT_S = 2.0  # the teacher's: a session still connecting after this is ended
VOCAB = 384
TOLERANCE = 1e-4


def bearer(token: str) -> tuple:
    return (("authorization", f"Bearer {token}"),)


def with_secret(token: str, secret: str) -> tuple:
    return bearer(token) + ((SESSION_SECRET_KEY, secret),)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("teacher") / "model", vocab_size=VOCAB)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    tokens = tmp_path_factory.mktemp("secrets") / "job-tokens.json"
    tokens.write_text(json.dumps({"team-a": {"token": TOKEN_A, "max_weight": 2, "max_sessions": JOB_A_SESSIONS},
                                  "team-b": {"token": TOKEN_B, "max_sessions": JOB_B_SESSIONS}}))
    server = ServerProcess("--model", str(model_dir), "--job-tokens", str(tokens), "--max-sessions",
                           str(MAX_SESSIONS), "--max-sessions-per-job", str(PER_JOB), "--join-timeout-s",
                           str(JOIN_TIMEOUT_S), "--max-batch-tokens", "256", "--max-seq-len", "64",
                           env=child_env(TEACHER_AUTH_TOKEN=OPERATOR, OMP_NUM_THREADS="1"))
    yield server
    assert server.stop() == 0, server.log


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(server.address) as channel:
        yield pb_grpc.TeacherServiceStub(channel)


@pytest.fixture(scope="module")
def reference(model_dir):
    """The teacher's model run here, the straightforward way."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def logits(ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits

    return logits


def raw_join(stub, token: str, job_id: str = "", weight: float = 0.0) -> pb.JoinResponse:
    """A Join made with the bare stub: no group ever forms behind it."""
    peer = pb.PeerInfo(device_type="cpu", torch_version=torch.__version__)
    return stub.Join(pb.JoinRequest(job_id=job_id, outputs=pb.OutputSpec(logits=True), peer=peer, weight=weight),
                     timeout=10, metadata=bearer(token))


def leave(stub, token: str, joined: pb.JoinResponse) -> None:
    stub.Leave(pb.LeaveRequest(session_id=joined.session_id), timeout=10,
               metadata=with_secret(token, joined.session_secret))


def code_of(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code(), info.value.details()


def status(stub, token: str) -> dict[str, pb.SessionStatus]:
    return {s.session_id: s for s in stub.GetStatus(pb.GetStatusRequest(), timeout=10, metadata=bearer(token)).sessions}


def ids_tensor(ids: torch.Tensor) -> pb.Tensor:
    return pb.Tensor(dtype="int64", shape=list(ids.shape), data=ids.numpy().astype("<i8").tobytes())


# ---- the --job-tokens file (no server) ----------------------------------------------------


def test_the_job_tokens_file_is_read_at_start_up(tmp_path):
    path = tmp_path / "tokens.json"
    path.write_text(json.dumps({"team-a": {"token": TOKEN_A, "max_weight": 4, "max_sessions": 8},
                                "team-b": {"token": TOKEN_B}}))
    config = ServerConfig(auth_token=OPERATOR, job_tokens=str(path))
    assert config.job_token_entries == (JobToken("team-a", TOKEN_A, 4.0, 8), JobToken("team-b", TOKEN_B))
    assert TOKEN_A not in repr(config)


BAD_FILES = {
    "not JSON": ('{"team-a": {"token": "x"},\n  oops}', "not valid JSON at line 2, column 3"),
    "not an object of jobs": ('["team-a"]', "expected an object of jobs"),
    "an entry that is not an object": ('{"team-a": "TOKEN"}', "job 'team-a': expected an object"),
    "a misspelt key": ('{"team-a": {"token": "%s", "max_sesions": 2}}' % TOKEN_A,
                       "job 'team-a': unknown key 'max_sesions'"),
    "a short token": ('{"team-a": {"token": "short"}}', "job 'team-a': key 'token' must be a string of at least 16"),
    "the operator's token": ('{"team-a": {"token": "%s"}}' % OPERATOR, "job 'team-a': key 'token' is the operator's"),
    "one token for two jobs": ('{"team-a": {"token": "%s"}, "team-b": {"token": "%s"}}' % (TOKEN_A, TOKEN_A),
                               "job 'team-b': key 'token' is also another job's token"),
    "a job twice": ('{"team-a": {"token": "%s"}, "team-a": {"token": "%s"}}' % (TOKEN_A, TOKEN_B),
                    "key 'team-a' appears twice"),
    "a weight below 1": ('{"team-a": {"token": "%s", "max_weight": 0.5}}' % TOKEN_A,
                         "job 'team-a': key 'max_weight' must be a finite number >= 1, got 0.5"),
    "an infinite weight": ('{"team-a": {"token": "%s", "max_weight": Infinity}}' % TOKEN_A,
                           "key 'max_weight' must be a finite number"),
    "a fractional session count": ('{"team-a": {"token": "%s", "max_sessions": 1.5}}' % TOKEN_A,
                                   "job 'team-a': key 'max_sessions' must be an integer >= 1, got 1.5"),
}


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_a_bad_job_tokens_file_names_the_flag_and_where_it_is_wrong_never_a_token(tmp_path, case):
    text, words = BAD_FILES[case]
    path = tmp_path / "tokens.json"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        ServerConfig(auth_token=OPERATOR, job_tokens=str(path))
    message = str(info.value)
    assert message.startswith(f"--job-tokens {path}: ") and words in message, message
    assert TOKEN_A not in message and OPERATOR not in message


def test_job_tokens_need_the_operators_token_and_a_readable_file(tmp_path):
    with pytest.raises(ConfigError, match="--job-tokens needs --auth-token"):
        ServerConfig(auth_token="", job_tokens=str(tmp_path / "tokens.json"))
    with pytest.raises(ConfigError, match=f"--job-tokens {tmp_path / 'missing.json'}: cannot read it"):
        ServerConfig(auth_token=OPERATOR, job_tokens=str(tmp_path / "missing.json"))


# ---- sessions are capabilities ------------------------------------------------------------


def test_a_token_holder_cannot_act_on_another_jobs_session(server, stub, reference):
    generator = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, VOCAB, (2, 12), generator=generator) for _ in range(6)]
    with TeacherClient(server.address, "cpu", auth_token=TOKEN_A, job_id="team-a") as victim:
        outputs = [victim.submit(ids).result(timeout=60) for ids in batches[:3]]
        victim_id = victim.session_id
        # The premise: the victim's id is readable, by the operator (status, metrics), or guessed.
        assert victim_id in status(stub, OPERATOR)
        metrics = requests.get(f"{server.http}/metrics", headers={"Authorization": f"Bearer {OPERATOR}"}, timeout=10)
        assert f'session="{victim_id}"' in metrics.text
        next_id = status(stub, OPERATOR)[victim_id].batches_submitted  # the victim's next batch id
        assert next_id == 3

        for token in (TOKEN_B, OPERATOR):  # another job's token, and the shared one
            for metadata, refused in ((bearer(token), grpc.StatusCode.PERMISSION_DENIED),
                                      (with_secret(token, "guessed-" + "0" * 35), grpc.StatusCode.NOT_FOUND)):
                submit = pb.SubmitRequest(session_id=victim_id, batch_id=next_id, input_ids=ids_tensor(batches[3]))
                for call in (lambda: stub.Submit(submit, timeout=10, metadata=metadata),
                             lambda: stub.Heartbeat(pb.HeartbeatRequest(session_id=victim_id), timeout=10,
                                                    metadata=metadata),
                             lambda: stub.Leave(pb.LeaveRequest(session_id=victim_id), timeout=10,
                                                metadata=metadata)):
                    code, details = code_of(call)
                    assert code == refused, (token == OPERATOR, code, details)
                answers = list(stub.SubmitStream(iter([submit]), timeout=10, metadata=metadata))
                assert [a.error_code for a in answers] == [refused.value[0]], answers
        # Even the victim's own secret, leaked, does not let another job's token act on it.
        leaked = with_secret(TOKEN_B, victim._connection.session.joined.session_secret)
        code, details = code_of(lambda: stub.Heartbeat(pb.HeartbeatRequest(session_id=victim_id), timeout=10,
                                                        metadata=leaked))
        assert code == grpc.StatusCode.NOT_FOUND, details

        outputs += [victim.submit(ids).result(timeout=60) for ids in batches[3:]]
        assert victim.session_id == victim_id and victim.reconnects == 0  # never evicted
        assert status(stub, OPERATOR)[victim_id].batches_submitted == len(batches)  # nothing foreign accepted
    for ids, out in zip(batches, outputs):
        assert torch.allclose(out.logits, reference(ids), atol=TOLERANCE, rtol=0), (out.logits - reference(ids)).abs().max()


# ---- job tokens ---------------------------------------------------------------------------


def test_a_job_token_joins_only_as_its_job_within_its_limits_and_sees_only_its_sessions(server, stub):
    with pytest.raises(PermissionRefused, match="may join only as job 'team-b'"):
        TeacherClient(server.address, "cpu", auth_token=TOKEN_B, job_id="team-a", join_timeout_s=10)
    with pytest.raises(InvalidRequest, match="max_weight 2.0 of job 'team-a' in the teacher's --job-tokens"):
        TeacherClient(server.address, "cpu", auth_token=TOKEN_A, job_id="team-a", weight=3.0, join_timeout_s=10)

    a = [raw_join(stub, TOKEN_A, "team-a") for _ in range(JOB_A_SESSIONS)]
    b = raw_join(stub, TOKEN_B)  # no job id: the token's
    try:
        code, details = code_of(lambda: raw_join(stub, TOKEN_A, "team-a"))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, details
        assert f"max_sessions {JOB_A_SESSIONS} of job 'team-a' in the teacher's --job-tokens" in details

        every = status(stub, OPERATOR)
        assert {every[j.session_id].job_id for j in a} == {"team-a"} and every[b.session_id].job_id == "team-b"
        assert set(status(stub, TOKEN_B)) == {b.session_id}  # not team-a's
        assert set(status(stub, TOKEN_A)) == {j.session_id for j in a}
    finally:
        for joined in a:
            leave(stub, TOKEN_A, joined)
        leave(stub, TOKEN_B, b)

    # The operator's joins: any job id, at most --max-sessions-per-job of one.
    ops = [raw_join(stub, OPERATOR, "ops") for _ in range(PER_JOB)]
    try:
        code, details = code_of(lambda: raw_join(stub, OPERATOR, "ops"))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and f"--max-sessions-per-job {PER_JOB}" in details, details
    finally:
        for joined in ops:
            leave(stub, OPERATOR, joined)
    # HTTP is the operator's alone.
    for token in (TOKEN_A, TOKEN_B):
        reply = requests.get(f"{server.http}/v1/status", headers={"Authorization": f"Bearer {token}"}, timeout=10)
        assert reply.status_code == 401


# ---- joins that never form their group ---------------------------------------------------


def test_joins_that_never_form_their_group_do_not_lock_a_real_student_out(server, stub, reference, caplog):
    # One job's token cannot fill the teacher: its cap holds.
    first_join_at = time.monotonic()
    flood_b = [raw_join(stub, TOKEN_B) for _ in range(JOB_B_SESSIONS)]
    code, details = code_of(lambda: raw_join(stub, TOKEN_B))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_sessions 3 of job 'team-b'" in details, details
    # Joins under several job ids (the operator's token) fill --max-sessions, and never connect.
    flood = [raw_join(stub, OPERATOR, "flood")]
    code, details = code_of(lambda: raw_join(stub, OPERATOR, "flood-2"))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and f"--max-sessions {MAX_SESSIONS}" in details, details
    flooded_at = time.monotonic()

    ids = torch.randint(0, VOCAB, (2, 10))
    with caplog.at_level(logging.WARNING, logger="student_trainer.client"):
        with TeacherClient(server.address, "cpu", auth_token=TOKEN_A, job_id="team-a", join_timeout_s=30) as student:
            joined_at = time.monotonic()
            out = student.submit(ids).result(timeout=60)
    assert torch.allclose(out.logits, reference(ids), atol=TOLERANCE, rtol=0)
    # It got in once the teacher ended the joins still connecting (no slot was free before
    # JOIN_TIMEOUT_S after the first of them), well within its own join timeout.
    assert joined_at - first_join_at >= JOIN_TIMEOUT_S and joined_at - flooded_at <= JOIN_TIMEOUT_S + 8, \
        (joined_at - first_join_at, joined_at - flooded_at)
    assert any("has no room for this session yet" in r.getMessage() and "--max-sessions" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]
    flooded = {j.session_id for j in flood_b + flood}
    wait_until(lambda: not flooded & set(status(stub, OPERATOR)), 10, "the flood's sessions to end")
