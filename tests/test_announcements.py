"""The announce/refuse handshake (distill_common/announcements.py), on a real TCPStore.

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
import torch.distributed as dist

from distill_common.announcements import Announcements, NotAnnounced


@pytest.fixture()
def connections():
    """Two connections to one store: the teacher's (or the student's waking one), the student's waiting one."""
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=10))
    yield [Announcements(dist.TCPStore("127.0.0.1", master.port, is_master=False, wait_for_workers=False,
                                       timeout=datetime.timedelta(seconds=10)), "test") for _ in range(2)]


def test_an_announcement_read_late_is_still_there_and_is_forgotten_once_read(connections):
    teacher, student = connections
    for batch_id in range(3):
        teacher.announce(batch_id)  # all announced (and, with NCCL, possibly sent) before the student looks
    for batch_id in range(3):
        started = time.monotonic()
        student.await_announced(batch_id, timeout_s=5.0)
        assert time.monotonic() - started < 1.0
        assert not teacher.store.check([str(batch_id)]), "the student forgets what it read: the store does not grow"


def test_the_student_waits_for_an_announcement_to_come(connections):
    teacher, student = connections
    timer = threading.Timer(0.3, teacher.announce, args=(7,))
    timer.start()
    started = time.monotonic()
    student.await_announced(7, timeout_s=5.0)
    assert 0.25 <= time.monotonic() - started < 3.0
    timer.join()


def test_an_announcement_that_never_comes_is_an_error_naming_the_batch(connections):
    _, student = connections
    with pytest.raises(NotAnnounced, match="batch 3 within 1s"):
        student.await_announced(3, timeout_s=1.0)


def test_a_refused_batch_ends_the_wait_also_when_the_student_marks_it(connections):
    """stream_refusals_only: the student waits for every batch it streamed. A refusal marks
    the batch (the teacher, or the student itself on another connection), and the wait
    returns False; the key is forgotten like an announcement."""
    teacher, student = connections
    teacher.refuse(2)
    assert student.await_announced(2, timeout_s=5.0) is False
    assert not teacher.store.check(["2"])

    waking = teacher  # the student's other connection: the one its session group was built on
    timer = threading.Timer(0.3, waking.end_wait, args=(3,))
    timer.start()
    started = time.monotonic()
    assert student.await_announced(3, timeout_s=5.0) is False
    assert time.monotonic() - started < 3.0
    timer.join()
    teacher.announce(4)
    assert student.await_announced(4, timeout_s=5.0) is True
