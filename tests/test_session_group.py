"""A session group: its announcement protocol on a real TCPStore, and its transport.

The teacher announces a batch once its sends are posted and its outputs exist; the
student waits for the announcement before posting its receives. A small NCCL send
completes before its receive is posted (NCCL buffers it at the peer), so an
announcement must stay until the student has read it: a teacher that deleted it on
send completion left the student waiting for a key that never came back.
"""

from __future__ import annotations

import datetime
import threading
import time

import pytest
import torch
import torch.distributed as dist

from distill_common.outputs import BatchOutputs, HiddenStates, Logits, OutputRequest, TeacherFacts, TopK, output_spec
from distill_common.session_group import (STUDENT_RANK, TEACHER_RANK, SessionGroup, TransferError, build_group,
                                          handshake, prefix_token)


@pytest.fixture()
def stores():
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=10))
    clients = [dist.TCPStore("127.0.0.1", master.port, is_master=False, wait_for_workers=False,
                             timeout=datetime.timedelta(seconds=10)) for _ in range(2)]
    yield [dist.PrefixStore("teacher-session/test/ready", client) for client in clients]


def _group(rank: int, store) -> SessionGroup:
    return SessionGroup(backend="gloo", rank=rank, pg=None, device=torch.device("cpu"), timeout_s=5.0,
                        ready_store=store)


def test_an_announcement_read_late_is_still_there_and_is_forgotten_once_read(stores):
    teacher, student = _group(TEACHER_RANK, stores[0]), _group(STUDENT_RANK, stores[1])
    for batch_id in range(3):
        teacher.announce(batch_id)  # all announced (and, with NCCL, possibly sent) before the student looks
    for batch_id in range(3):
        started = time.monotonic()
        student.await_announced(batch_id, timeout_s=5.0)
        assert time.monotonic() - started < 1.0
        assert not stores[0].check([str(batch_id)]), "the student forgets what it read: the store does not grow"


def test_the_student_waits_for_an_announcement_to_come(stores):
    teacher, student = _group(TEACHER_RANK, stores[0]), _group(STUDENT_RANK, stores[1])
    timer = threading.Timer(0.3, teacher.announce, args=(7,))
    timer.start()
    started = time.monotonic()
    student.await_announced(7, timeout_s=5.0)
    assert 0.25 <= time.monotonic() - started < 3.0
    timer.join()


def test_an_announcement_that_never_comes_is_a_transfer_error_naming_the_batch(stores):
    student = _group(STUDENT_RANK, stores[1])
    with pytest.raises(TransferError, match="batch 3 within 1s"):
        student.await_announced(3, timeout_s=1.0)



def test_a_refused_batch_ends_the_wait_also_when_the_student_marks_it(stores):
    """stream_refusals_only: the student waits for every batch it streamed. A refusal marks
    the batch (the teacher, or the student's own ack thread on another connection), and the
    wait returns False; the key is forgotten like an announcement."""
    teacher, student = _group(TEACHER_RANK, stores[0]), _group(STUDENT_RANK, stores[1])
    teacher.refuse(2)
    assert student.await_announced(2, timeout_s=5.0) is False
    assert not stores[0].check(["2"])
    from distill_common.session_group import mark_refused

    timer = threading.Timer(0.3, mark_refused, args=(stores[0], 3))  # another client of the same store
    timer.start()
    started = time.monotonic()
    assert student.await_announced(3, timeout_s=5.0) is False
    assert time.monotonic() - started < 3.0
    timer.join()
    teacher.announce(4)
    assert student.await_announced(4, timeout_s=5.0) is True


# ---- the transport over a real two-rank gloo group ------------------------------------------


def test_outputs_cross_a_real_gloo_group_as_the_request_lays_them_out():
    """Teacher: derive, `to_send`, `send_all`; student: `post_receives` from the layout alone,
    then `delivered`, then assemble. What arrives is what the teacher derived, in wire order."""
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=10))
    spec = output_spec([Logits(), TopK(3), HiddenStates((2, 0))], "float16")
    facts = TeacherFacts(vocab_size=11, hidden_size=6, num_layers=2, dtype=torch.float32)
    request = OutputRequest.resolve(spec, facts)
    forward = BatchOutputs(torch.randn(2, 5, 11), {layer: torch.randn(2, 5, 6) for layer in range(3)})
    batches = 2  # a second batch on the same group: the order holds from one batch to the next
    received, errors = [], []

    def side(rank: int) -> None:
        try:
            store = dist.TCPStore("127.0.0.1", master.port, is_master=False, wait_for_workers=False,
                                  timeout=datetime.timedelta(seconds=10))
            group = build_group(store, "transport-test", backend="gloo", rank=rank, device=torch.device("cpu"),
                                timeout_s=10.0, gloo_host="127.0.0.1")
            try:
                handshake(group, prefix_token("transport-test"), 10.0)
                for batch_id in range(batches):
                    if rank == TEACHER_RANK:
                        tensors = group.to_send(request.derive(forward, batch=None))
                        assert all(t.device.type == "cpu" for t in tensors)  # gloo sends host memory
                        for work in group.send_all(tensors):
                            group.wait(work, what=f"sending batch {batch_id}")
                    else:
                        buffers, works = group.post_receives(request.layout(2, 5))
                        for work in works:
                            group.wait(work, what=f"receiving batch {batch_id}")
                        received.append(request.assemble(batch_id, group.delivered(buffers)))
            finally:
                group.abort()
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=side, args=(rank,)) for rank in (TEACHER_RANK, STUDENT_RANK)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors, errors
    assert [out.batch_id for out in received] == list(range(batches))
    for out in received:
        assert torch.equal(out.logits, forward.logits.half())
        values, indices = torch.topk(forward.logits, 3, dim=-1)
        assert torch.equal(out.topk_values, values.half()) and torch.equal(out.topk_indices, indices.int())
        assert list(out.hidden_states) == [2, 0]
        assert all(torch.equal(out.hidden_states[layer], forward.hidden[layer].half()) for layer in (2, 0))
