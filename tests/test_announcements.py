"""What became of each batch (distill_common/announcements.py): the teacher's outbox, the student's board.

The teacher announces a batch once its sends are posted and its outputs exist, or fails
it; the events go out on the session's submit stream, coalesced (each response costs the
serving thread). The student waits for the word on each batch before posting its receives.
"""

from __future__ import annotations

import threading
import time

import pytest

from distill_common.announcements import ANNOUNCED, SETTLED, Board, NotAnnounced, Outbox


class Wakes:
    """A stream's wake-up callback that counts its calls."""

    def __init__(self):
        self.count = 0

    def __call__(self) -> None:
        self.count += 1


def test_events_coalesce_into_one_response_and_wake_the_stream_once():
    outbox, wake = Outbox(), Wakes()
    assert outbox.attach(wake)
    assert outbox.take() is None and wake.count == 0
    outbox.announce([0, 1])
    outbox.fail(2, "out of memory deriving top-k")
    outbox.announce([3])
    assert wake.count == 1, "woken when the outbox stops being empty, not per event"
    response = outbox.take()
    assert list(response.events.announced) == [0, 1, 3]
    assert [(f.batch_id, f.reason) for f in response.events.failed] == [(2, "out of memory deriving top-k")]
    assert not response.batch_id and not response.error_code  # answers no request
    assert outbox.take() is None
    outbox.announce([4])
    assert wake.count == 2 and list(outbox.take().events.announced) == [4]
    outbox.announce([])
    assert wake.count == 2 and outbox.take() is None


def test_one_stream_takes_a_sessions_events_and_events_wait_for_it():
    outbox, first, second = Outbox(), Wakes(), Wakes()
    outbox.announce([0])  # before any stream attached: kept
    assert outbox.attach(first) and first.count == 1, "woken at once for what was pending"
    assert not outbox.attach(second), "another stream does not get this session's events"
    outbox.detach(second)  # not attached: changes nothing
    outbox.announce([1])
    assert list(outbox.take().events.announced) == [0, 1]
    outbox.detach(first)
    assert outbox.attach(second)


def test_a_closed_outbox_drops_its_events():
    outbox, wake = Outbox(), Wakes()
    outbox.attach(wake)
    outbox.announce([0])
    outbox.close()
    outbox.announce([1])
    outbox.fail(2, "gone")
    assert outbox.take() is None and wake.count == 1


def test_the_board_hands_each_word_once_and_waits_for_one_to_come():
    board = Board()
    board.tell(0, ANNOUNCED)  # heard before the receiving thread looks
    board.tell(1, SETTLED)
    assert board.await_word(0, timeout_s=5.0) == ANNOUNCED
    assert board.await_word(1, timeout_s=5.0) == SETTLED
    with pytest.raises(NotAnnounced, match="batch 0 within 0s"):
        board.await_word(0, timeout_s=0.2)  # forgotten once read

    timer = threading.Timer(0.3, board.tell, args=(7, ANNOUNCED))
    timer.start()
    started = time.monotonic()
    assert board.await_word(7, timeout_s=5.0) == ANNOUNCED
    assert 0.25 <= time.monotonic() - started < 3.0
    timer.join()


def test_a_word_that_never_comes_is_an_error_naming_the_batch_and_closing_ends_the_wait():
    board = Board()
    with pytest.raises(NotAnnounced, match="batch 3 within 1s"):
        board.await_word(3, timeout_s=1.0)
    timer = threading.Timer(0.3, board.close)
    timer.start()
    started = time.monotonic()
    assert board.await_word(4, timeout_s=10.0) is None
    assert time.monotonic() - started < 3.0
    timer.join()
