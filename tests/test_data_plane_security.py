"""No unauthenticated path into a session (docs/security.md), tried as an attacker would, on loopback.

One teacher with --auth-token, started as tests/tampering_teacher.py: the real server, whose
data plane goes wrong on purpose for jobs named "stale..." and "fail..." only.

- Attack 1 of issue 13: the teacher's store port answered anyone; a process with no token
  pre-wrote `refused` marks for a student's future batches, which made it skip receives and
  resolve later batches with earlier batches' outputs. Now nothing listens but gRPC and
  HTTP, a session's rendezvous keys are out of reach without the token and its own secret,
  its events out of reach of another stream, and the student's outputs stay the local model's.
- A data plane out of step with the batches (the previous batch's outputs under the next
  batch's id, as that attack caused) is caught by the per-batch header: the session is
  joined again and the batches sent again, or they fail; no future gets wrong outputs.
- A batch the teacher fails (`Delivery.fail`) fails alone, with the teacher's reason.
"""

from __future__ import annotations

import datetime
import os
from pathlib import Path

import grpc
import pytest
import torch
import torch.distributed as dist

from distill_common import rendezvous
from distill_common.channel import SESSION_SECRET_KEY
from distill_common.proto.teacher.v1 import teacher_pb2 as pb
from distill_common.proto.teacher.v1 import teacher_pb2_grpc as pb_grpc
from student_trainer import TeacherClient
from student_trainer.errors import BatchFailed, OutOfStep
from teacher_server.launcher import ServerProcess, child_env
from tests.helpers import build_tiny_model, wait_until

TOKEN = "s3cret-token"
VOCAB = 384
TOLERANCE = 1e-4
Op = pb.RendezvousRequest.Op


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("teacher") / "model", vocab_size=VOCAB)


@pytest.fixture(scope="module")
def server(model_dir):
    server = ServerProcess("--model", str(model_dir), "--max-batch-tokens", "256", "--max-seq-len", "64",
                           "--heartbeat-interval-s", "0.5", module="tests.tampering_teacher",
                           env=child_env(TEACHER_AUTH_TOKEN=TOKEN, TAMPER_AT="2"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def local(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir).eval()


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(server.address) as channel:
        yield pb_grpc.TeacherServiceStub(channel)


AUTH = (("authorization", f"Bearer {TOKEN}"),)


def as_session(joined: pb.JoinResponse) -> tuple:
    """The metadata of a call about the session `joined`: the token and the session's secret."""
    return AUTH + ((SESSION_SECRET_KEY, joined.session_secret),)


def reference(local, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return local(ids).logits


def listening_ports(pid: int) -> set[int]:
    """The TCP ports process `pid` listens on (its sockets in /proc/net/tcp{,6} in state LISTEN). Linux."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    ports = set()
    for table in ("tcp", "tcp6"):
        path = Path(f"/proc/{pid}/net/{table}")
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def pre_write_refusals(port: int, wire_ids: range) -> int:
    """Attack 1 on a torch store at `port`: lists its keys and marks the given batches of every
    session found there refused. Returns how many marks it wrote (0: no store answered)."""
    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=3))
        keys = store.list_keys()
    except Exception:  # not a store
        return 0
    prefixes = {key.split("/")[1] for key in keys if key.startswith("teacher-session/")}
    for prefix in prefixes:
        for wire_id in wire_ids:
            store.set(f"teacher-session/{prefix}/ready/{wire_id}", "refused")
    return len(prefixes) * len(wire_ids)


def rendezvous_code(stub, metadata, session_id: str, op, *keys: str, **fields) -> grpc.StatusCode:
    request = pb.RendezvousRequest(session_id=session_id, op=op, keys=keys, **fields)
    try:
        stub.Rendezvous(request, timeout=10, metadata=metadata)
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def test_attack_1_no_store_no_rendezvous_or_events_without_credentials_outputs_stay_exact(server, stub, local):
    # Before any session: the teacher listens on its gRPC and HTTP ports and nothing else.
    extra_ports = listening_ports(server.proc.pid) - {server.grpc_port, server.http_port}
    peer = pb.PeerInfo(device_type="cpu", torch_version=torch.__version__)
    with TeacherClient(server.address, "cpu", auth_token=TOKEN, job_id="victim", max_inflight=2) as victim:
        batches = [torch.randint(0, VOCAB, (2, 8)) for _ in range(12)]  # one shape: stale outputs would fit
        futures = [victim.submit(ids) for ids in batches[:2]]
        victim_id = victim.session_id

        # 1. The old path: whatever else listens, tried as the store it was, before the
        #    victim submits the batches it marks.
        marks = sum(pre_write_refusals(port, range(2, 12)) for port in extra_ports)
        futures += [victim.submit(ids) for ids in batches[2:]]
        for i, (ids, future) in enumerate(zip(batches, futures)):
            out = future.result(timeout=120)
            assert out.batch_id == i
            assert (out.logits - reference(local, ids)).abs().max().item() <= TOLERANCE, f"batch {i}"
        assert victim.reconnects == 0

        # 2. The victim's rendezvous keys: without the token, and with another session's secret
        #    (the attacker holds the token and a session of its own).
        mine = stub.Join(pb.JoinRequest(job_id="attacker", outputs=pb.OutputSpec(logits=True), peer=peer),
                         timeout=10, metadata=AUTH)
        attempts = [(Op.GET, ("student-arrived",), {"wait_s": 0.1}), (Op.CHECK, ("0/0",), {}),
                    (Op.NUM_KEYS, (), {}), (Op.SET, ("0/1",), {"value": b"127.0.0.1:1"}),
                    (Op.DELETE, ("0/0",), {}), (Op.ADD, ("n",), {"amount": 1}),
                    (Op.COMPARE_SET, ("0/1",), {"expected": b"", "value": b"x"})]
        for op, keys, fields in attempts:
            assert rendezvous_code(stub, as_session(mine)[1:], victim_id, op, *keys,
                                   **fields) == grpc.StatusCode.UNAUTHENTICATED, op
            # The attacker's own session secret names no session of the victim's: NOT_FOUND, as for
            # a session that does not exist; with no session secret at all, PERMISSION_DENIED.
            assert rendezvous_code(stub, as_session(mine), victim_id, op, *keys,
                                   **fields) == grpc.StatusCode.NOT_FOUND, op
            assert rendezvous_code(stub, AUTH, victim_id, op, *keys, **fields) == grpc.StatusCode.PERMISSION_DENIED
        stub.Leave(pb.LeaveRequest(session_id=mine.session_id), timeout=10, metadata=as_session(mine))

        # 3. The victim's events: a second stream for its session is refused before it takes
        #    anything (no batch id used up, no event diverted), and the victim goes on.
        hijack = pb.SubmitRequest(session_id=victim_id, batch_id=12,
                                  input_ids=pb.Tensor(dtype="int64", shape=[1, 1], data=bytes(8)))
        # Without the victim's session secret it is refused before anything else is looked at.
        replies = list(stub.SubmitStream(iter([hijack]), timeout=10, metadata=AUTH))
        assert [(r.batch_id, r.error_code) for r in replies] == [(12, grpc.StatusCode.PERMISSION_DENIED.value[0])]
        # With it (leaked), a second stream still cannot take the session's events.
        leaked = AUTH + ((SESSION_SECRET_KEY, victim._connection.session.joined.session_secret),)
        replies = list(stub.SubmitStream(iter([hijack]), timeout=10, metadata=leaked))
        assert [(r.batch_id, r.error_code) for r in replies] == [(12, grpc.StatusCode.FAILED_PRECONDITION.value[0])]
        assert "another stream submits to session" in replies[0].error_message
        ids = torch.randint(0, VOCAB, (2, 8))
        out = victim.submit(ids).result(timeout=120)
        assert out.batch_id == 12 and (out.logits - reference(local, ids)).abs().max().item() <= TOLERANCE
    assert marks == 0 and not extra_ports, f"the teacher listens on {extra_ports} besides gRPC and HTTP"


def test_a_sessions_rendezvous_is_confined_bounded_and_gone_when_it_ends(server, stub):
    peer = pb.PeerInfo(device_type="cpu", torch_version=torch.__version__)
    joined = stub.Join(pb.JoinRequest(job_id="rendezvous", outputs=pb.OutputSpec(logits=True), peer=peer),
                       timeout=10, metadata=AUTH)
    other = stub.Join(pb.JoinRequest(job_id="rendezvous", outputs=pb.OutputSpec(logits=True), peer=peer),
                      timeout=10, metadata=AUTH)
    me = joined.session_id
    assert joined.session_secret != other.session_secret
    assert joined.data_plane_host == "127.0.0.1"

    def call(op, *keys, session_id=me, **fields):
        request = pb.RendezvousRequest(session_id=session_id, op=op, keys=keys, **fields)
        return stub.Rendezvous(request, timeout=10, metadata=as_session(joined))

    call(Op.SET, "k", value=b"mine")
    assert call(Op.GET, "k", wait_s=1).value == b"mine"
    # Another session's keys are another store: the same key is not there, and its secret is not ours.
    with pytest.raises(grpc.RpcError) as info:  # our session's secret does not open the other session
        call(Op.GET, "k", session_id=other.session_id, wait_s=0.1)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert not stub.Rendezvous(pb.RendezvousRequest(session_id=other.session_id, op=Op.CHECK, keys=["k"]),
                               timeout=10, metadata=as_session(other)).found
    # A quota of bytes per session (and of keys: tests/test_rendezvous.py), refused with the limit.
    with pytest.raises(grpc.RpcError) as info:
        call(Op.SET, "big", value=b"x" * rendezvous.MAX_BYTES)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and str(rendezvous.MAX_BYTES) in info.value.details()
    # A wait is bounded by the teacher whatever is asked.
    assert not call(Op.WAIT, "never", wait_s=0.2).found
    # The session ends: its keys with it.
    stub.Leave(pb.LeaveRequest(session_id=me), timeout=10, metadata=as_session(joined))
    with pytest.raises(grpc.RpcError) as info:
        call(Op.GET, "k", wait_s=0.1)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    stub.Leave(pb.LeaveRequest(session_id=other.session_id), timeout=10, metadata=as_session(other))


def sent_all(server, session_id: str, batches: int) -> dict | None:
    """The session on /v1/status once the teacher counts `batches` sent."""
    import requests

    sessions = requests.get(f"{server.http}/v1/status", timeout=10,
                            headers={"Authorization": f"Bearer {TOKEN}"}).json()["sessions"]
    mine = {s["session_id"]: s for s in sessions}.get(session_id)
    return mine if mine and mine["batches_sent"] == batches else None


def submit_all(teacher: TeacherClient, batches: list[torch.Tensor]) -> list:
    """Each batch's output, or the exception its future (or, once the client broke, its submit) raised."""
    futures = []
    for ids in batches:
        try:
            futures.append(teacher.submit(ids))
        except Exception as e:
            futures.append(e)
    results = []
    for future in futures:
        try:
            results.append(future if isinstance(future, Exception) else future.result(timeout=120))
        except Exception as e:
            results.append(e)
    return results


def test_a_stale_batch_under_the_next_id_is_caught_by_its_header_and_sent_again(server, local):
    """The teacher sends batch 2 the outputs of batch 1 (same shape) under batch 2's announcement:
    the header says batch 1, so the client gives the session up, joins again and sends the
    batches it has not delivered; every future gets its own batch's outputs."""
    batches = [torch.randint(0, VOCAB, (2, 8)) for _ in range(6)]
    with TeacherClient(server.address, "cpu", auth_token=TOKEN, job_id="stale-rejoin", max_inflight=2) as teacher:
        results = submit_all(teacher, batches)
        reconnects = teacher.reconnects
    assert "TAMPERED stale" in server.log
    for i, (ids, out) in enumerate(zip(batches, results)):
        assert not isinstance(out, Exception), (i, out)
        assert (out.logits - reference(local, ids)).abs().max().item() <= TOLERANCE, f"batch {i}"
    assert reconnects == 1


def test_without_a_reconnect_the_mismatch_fails_the_batches_never_with_wrong_outputs(server, local):
    batches = [torch.randint(0, VOCAB, (2, 8)) for _ in range(5)]
    with TeacherClient(server.address, "cpu", auth_token=TOKEN, job_id="stale-final", max_inflight=2,
                       reconnect_timeout_s=0) as teacher:
        results = submit_all(teacher, batches)
    for i in (0, 1):
        assert (results[i].logits - reference(local, batches[i])).abs().max().item() <= TOLERANCE, f"batch {i}"
    for i in (2, 3, 4):
        assert isinstance(results[i], OutOfStep), (i, results[i])
    assert "batch 2's receives got another batch's outputs (header: batch 1" in str(results[2])


def test_a_batch_the_teacher_fails_fails_alone_with_its_reason(server, local):
    """Delivery.fail on batch 2: its future raises BatchFailed with the teacher's reason, it is not
    sent again, and the batches before and after it get their outputs on the same session."""
    batches = [torch.randint(0, VOCAB, (2, 8)) for _ in range(5)]
    with TeacherClient(server.address, "cpu", auth_token=TOKEN, job_id="fail-one", max_inflight=2) as teacher:
        results = submit_all(teacher, batches)
        assert teacher.reconnects == 0
        # batches_sent is counted once the teacher sees its send complete, a moment after the student.
        session = wait_until(lambda: sent_all(server, teacher.session_id, 4), 10, "the teacher's count of sends")
        assert session["state"] == "ready" and session["inflight"] == 0
    assert isinstance(results[2], BatchFailed) and "injected by the test teacher" in str(results[2])
    for i in (0, 1, 3, 4):
        assert (results[i].logits - reference(local, batches[i])).abs().max().item() <= TOLERANCE, f"batch {i}"
