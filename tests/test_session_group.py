"""A session group's transport over a real two-rank gloo group (distill_common/session_group.py),
formed as the server and the client form it: the teacher's end on the session's own store,
the student's on a RendezvousStore whose every operation reaches that store through the
teacher's Rendezvous logic (distill_common/rendezvous.py; here called in-process, not over
gRPC). What the teacher derives arrives on the student as the request lays it out, behind
a header the student checks; a group whose peer does not know the session's secret is refused."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from distill_common import wire
from distill_common.outputs import BatchOutputs, HiddenStates, Logits, OutputRequest, TeacherFacts, TopK, output_spec
from distill_common.rendezvous import RendezvousStore, SessionStore
from distill_common.session_group import (HEADER_LAYOUT, STUDENT_RANK, TEACHER_RANK, HeaderMismatch, TransferError,
                                          build_group, handshake)

SPEC = output_spec([Logits(), TopK(3), HiddenStates((2, 0))], "float16")
FACTS = TeacherFacts(vocab_size=11, hidden_size=6, num_layers=2, dtype=torch.float32)


SECRET = b"the session's secret"


def student_store(session: SessionStore) -> RendezvousStore:
    """The student's store, each operation served by the teacher's SessionStore (as Rendezvous does
    once the service checked the call's session secret)."""
    def call(request, timeout_s):
        return asyncio.run(session.serve(request))

    return RendezvousStore(call, "session", timeout_s=10.0)


def run_both(teacher, student, timeout_s: float = 60.0) -> list[BaseException]:
    """Runs `teacher(group)` and `student(group)` on the two ends of one fresh session group;
    returns what either raised."""
    session = SessionStore(timeout_s=10.0)
    errors = []

    def side(rank: int, body) -> None:
        group = None
        try:
            store = session.store if rank == TEACHER_RANK else student_store(session)
            group = build_group(store, backend="gloo", rank=rank, device=torch.device("cpu"), timeout_s=10.0,
                                gloo_host="127.0.0.1")
            body(group, SECRET)
        except BaseException as e:  # reported by the main thread
            errors.append(e)
        finally:
            if group is not None:
                group.abort()

    threads = [threading.Thread(target=side, args=(TEACHER_RANK, teacher)),
               threading.Thread(target=side, args=(STUDENT_RANK, student))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=timeout_s)
    assert not any(thread.is_alive() for thread in threads), "a side did not finish"
    return errors


def test_outputs_cross_a_real_gloo_group_behind_their_header():
    """Teacher: derive, `to_send`, header then outputs; student: `post_receives` from the layout
    alone, `check_header` against what it sent, then `delivered`, then assemble. What arrives is
    what the teacher derived, in wire order."""
    request = OutputRequest.resolve(SPEC, FACTS)
    forward = BatchOutputs(torch.randn(2, 5, 11), {layer: torch.randn(2, 5, 6) for layer in range(3)})
    keys = [wire.batch_key(torch.randint(0, 11, (2, 5)), torch.ones(2, 5, dtype=torch.int64)) for _ in range(2)]
    received = []

    def teacher(group, secret):
        handshake(group, secret, 10.0)
        for wire_id, key in enumerate(keys):  # a second batch: the order holds from one batch to the next
            tensors = group.to_send(request.derive(forward, batch=None))
            assert all(t.device.type == "cpu" for t in tensors)  # gloo sends host memory
            for work in group.send_all([group.header(wire_id, key), *tensors]):
                group.wait(work, what=f"sending batch {wire_id}")

    def student(group, secret):
        handshake(group, secret, 10.0)
        for wire_id, key in enumerate(keys):
            buffers, works = group.post_receives([HEADER_LAYOUT, *request.layout(2, 5)])
            for work in works:
                group.wait(work, what=f"receiving batch {wire_id}")
            group.check_header(buffers[0], wire_id, key)
            received.append(request.assemble(wire_id, group.delivered(buffers[1:])))

    assert not run_both(teacher, student)
    assert [out.batch_id for out in received] == [0, 1]
    for out in received:
        assert torch.equal(out.logits, forward.logits.half())
        values, indices = torch.topk(forward.logits, 3, dim=-1)
        logprobs = values - forward.logits.logsumexp(-1, keepdim=True)  # as TopK computes them
        assert torch.equal(out.topk_values, logprobs.half()) and torch.equal(out.topk_indices, indices.int())
        assert list(out.hidden_states) == [2, 0]
        assert all(torch.equal(out.hidden_states[layer], forward.hidden[layer].half()) for layer in (2, 0))


@pytest.mark.parametrize("sent", ["another batch id", "other token ids"])
def test_a_header_of_another_batch_is_refused(sent):
    """Buffers out of step with the batches (a send skipped, reordered, or other token ids under
    the expected id) raise HeaderMismatch: the outputs are never handed on."""
    ids = torch.randint(0, 11, (2, 5))
    key = wire.batch_key(ids, torch.ones_like(ids))
    other_key = wire.batch_key(ids.flip(0), torch.ones_like(ids))
    header = {"another batch id": (4, key), "other token ids": (3, other_key)}[sent]
    caught = []

    def teacher(group, secret):
        group.wait(group.send(group.header(*header)))

    def student(group, secret):
        buffers, works = group.post_receives([HEADER_LAYOUT])
        group.wait(works[0])
        with pytest.raises(HeaderMismatch) as info:
            group.check_header(buffers[0], 3, key)
        caught.append(str(info.value))
        group.check_header(buffers[0], *header)  # the header says what it carries

    assert not run_both(teacher, student)
    assert caught and "batch 3's receives got" in caught[0] and "nothing of it was used" in caught[0]


def test_request_key_is_the_key_of_what_the_teacher_decodes():
    """The student's digest of what it sent equals the teacher's batch key of what it decoded
    (int64 ids and mask; a mask of ones when none was sent; a bool mask as 0/1)."""
    ids = torch.randint(0, 100, (3, 7), dtype=torch.int32)
    mask = torch.ones(3, 7, dtype=torch.bool)
    mask[1, 4:] = False
    decoded_ids = ids.to(torch.int64)
    assert wire.request_key(wire.encode(ids), None) == wire.batch_key(decoded_ids, torch.ones_like(decoded_ids))
    assert wire.request_key(wire.encode(ids), wire.encode(mask)) == wire.batch_key(decoded_ids, mask.to(torch.int64))
    assert wire.request_key(wire.encode(ids), wire.encode(mask)) != wire.request_key(wire.encode(ids), None)


def test_a_peer_that_does_not_know_the_secret_is_refused_by_the_teacher():
    """The teacher checks that the peer that formed the group is the student that joined: one
    that forms it without the session's secret fails the handshake on both ends."""
    teacher_error = []

    def teacher(group, secret):
        with pytest.raises(TransferError, match="did not prove it is the student") as info:
            handshake(group, secret, 10.0)
        teacher_error.append(info.value)

    def impostor(group, secret):
        with pytest.raises(TransferError, match="did not prove it is the teacher"):
            handshake(group, b"not the secret" * 3, 10.0)

    assert not run_both(teacher, impostor)
    assert teacher_error


def test_join_time_outputs_are_made_once_while_sessions_send_them_and_freed_after():
    """Sessions joining at once share one copy of what they are sent at join (a float32 head is
    2 GiB for a 128k vocabulary); nobody holds it once their sends are done."""
    from teacher_server.delivery import SharedTensors

    made = []

    def make():
        made.append(torch.ones(3))
        return [made[-1]]

    shared = SharedTensors()
    first = shared.get(("head", torch.float32), make)
    second = shared.get(("head", torch.float32), make)
    other = shared.get(("head", torch.bfloat16), make)
    assert first is second and first is not other and len(made) == 2
    del first, second, other
    again = shared.get(("head", torch.float32), make)
    assert len(made) == 3 and again.tensors[0] is made[-1]  # the old copy went with its holders
