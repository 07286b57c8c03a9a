"""A session's rendezvous store on the teacher (distill_common/rendezvous.py: SessionStore), the
operations the Rendezvous RPC serves: each against a plain dict of what was written, its
quota, its bounded waits, and its keys deleted when the session ends. Over real gRPC, with
the token and the session's secret: tests/test_data_plane_security.py."""

from __future__ import annotations

import asyncio
import time

import pytest

from distill_common import rendezvous
from distill_common.proto.teacher.v1 import teacher_pb2 as pb
from distill_common.rendezvous import RendezvousError, SessionStore

Op = pb.RendezvousRequest.Op


def serve(store: SessionStore, op, *keys: str, **fields) -> pb.RendezvousResponse:
    return asyncio.run(store.serve(pb.RendezvousRequest(op=op, keys=keys, **fields)))


def test_operations_match_a_dict_of_what_was_written():
    store = SessionStore(timeout_s=5.0)
    expected: dict[str, bytes] = {}
    serve(store, Op.SET, "a", value=b"1")
    expected["a"] = b"1"
    serve(store, Op.SET, "b", value=b"\x00\xff")
    expected["b"] = b"\x00\xff"
    assert serve(store, Op.GET, "b", wait_s=1).value == expected["b"]
    assert serve(store, Op.ADD, "n", amount=5).number == 5
    assert serve(store, Op.ADD, "n", amount=-2).number == 3
    expected["n"] = b"3"
    assert serve(store, Op.CHECK, "a", "b").found and not serve(store, Op.CHECK, "a", "zz").found
    assert serve(store, Op.COMPARE_SET, "a", expected=b"2", value=b"x").value == b"1"  # not swapped
    assert serve(store, Op.COMPARE_SET, "a", expected=b"1", value=b"x").value == b"x"
    expected["a"] = b"x"
    assert serve(store, Op.DELETE, "b").found and not serve(store, Op.DELETE, "b").found
    del expected["b"]
    assert serve(store, Op.NUM_KEYS).number == len(expected)
    for key, value in expected.items():
        assert store.store.get(key) == value  # what the teacher's end of the group reads
    store.store.set("teacher-key", b"t")  # what the teacher's end writes, the student reads
    assert serve(store, Op.GET, "teacher-key", wait_s=1).value == b"t"


def test_waits_are_bounded_and_return_once_the_key_comes(monkeypatch):
    monkeypatch.setattr(rendezvous, "MAX_WAIT_S", 0.5)  # its default, 5 s, is what the wait is cut to
    store = SessionStore(timeout_s=5.0)
    started = time.monotonic()
    assert not serve(store, Op.GET, "late", wait_s=0.3).found
    assert 0.25 <= time.monotonic() - started < 2.0
    started = time.monotonic()
    assert not serve(store, Op.WAIT, "late", wait_s=10).found, "the teacher waits MAX_WAIT_S at most per call"
    assert 0.45 <= time.monotonic() - started < 2.5

    async def set_later():
        await asyncio.sleep(0.2)
        store.store.set("late", b"here")

    async def both():
        setter = asyncio.create_task(set_later())
        response = await store.serve(pb.RendezvousRequest(op=Op.GET, keys=["late"], wait_s=5))
        await setter
        return response

    started = time.monotonic()
    assert asyncio.run(both()).value == b"here"
    assert time.monotonic() - started < 2.0


def test_a_sessions_quota_of_keys_and_bytes_is_refused_with_the_limits():
    store = SessionStore(timeout_s=5.0)
    for i in range(rendezvous.MAX_KEYS):
        serve(store, Op.SET, f"k{i}", value=b"v")
    serve(store, Op.SET, "k0", value=b"w")  # rewriting a key adds none
    with pytest.raises(RendezvousError, match=f"at most {rendezvous.MAX_KEYS} keys") as info:
        serve(store, Op.SET, "one-more", value=b"v")
    assert info.value.kind == "quota"
    serve(store, Op.DELETE, "k0")
    serve(store, Op.SET, "one-more", value=b"v")  # a deleted key frees its room

    store = SessionStore(timeout_s=5.0)
    with pytest.raises(RendezvousError, match=f"{rendezvous.MAX_BYTES} bytes"):
        serve(store, Op.SET, "big", value=b"x" * rendezvous.MAX_BYTES)
    assert not store.store.check(["big"]), "a refused write writes nothing"


def test_the_keys_are_deleted_when_the_session_ends_and_calls_refused():
    store = SessionStore(timeout_s=5.0)
    serve(store, Op.SET, "a", value=b"1")
    store.store.set("0/0", b"the teacher's address")
    store.close()
    assert store.store.num_keys() == 0
    for op, fields in ((Op.GET, {"wait_s": 0.1}), (Op.SET, {"value": b"1"}), (Op.CHECK, {})):
        with pytest.raises(RendezvousError, match="has ended") as info:
            serve(store, op, "a", **fields)
        assert info.value.kind == "ended"


def test_malformed_calls_are_refused():
    store = SessionStore(timeout_s=5.0)
    with pytest.raises(RendezvousError, match="needs one key") as info:
        serve(store, Op.SET, value=b"1")
    assert info.value.kind == "invalid"
    with pytest.raises(RendezvousError, match="unknown rendezvous operation"):
        serve(store, Op.OP_UNSPECIFIED, "a")
    serve(store, Op.SET, "a", value=b"not a number")
    with pytest.raises(RendezvousError, match="ADD") as info:
        serve(store, Op.ADD, "a", amount=1)
    assert info.value.kind == "invalid"
    for wait_s in (float("nan"), float("-inf"), -1.0):  # answered at once, not waited on forever
        assert not serve(store, Op.WAIT, "absent", wait_s=wait_s).found


def test_a_call_names_a_handful_of_keys_at_most():
    store = SessionStore(timeout_s=5.0)
    keys = [f"k{i}" for i in range(rendezvous.MAX_KEYS_PER_CALL + 1)]
    for op in (Op.WAIT, Op.CHECK):
        with pytest.raises(RendezvousError, match=f"more than the {rendezvous.MAX_KEYS_PER_CALL} a call may") as info:
            serve(store, op, *keys, wait_s=1)
        assert info.value.kind == "invalid"
    assert not serve(store, Op.CHECK, *keys[:-1]).found


def test_waits_wake_when_a_key_is_written_and_never_poll():
    """A wait is woken by writes to its keys only: the teacher's end writing from a thread
    (the group's constructor), the student's through the RPC; other writes and time alone
    leave it asleep (its keys are checked once per wake)."""
    store = SessionStore(timeout_s=5.0)
    checks = []
    inner_check = store.store.check

    def counted_check(keys):
        checks.append(list(keys))
        return inner_check(keys)

    store.store.check = counted_check

    async def scenario():
        waits = [asyncio.create_task(store.serve(pb.RendezvousRequest(op=Op.WAIT, keys=[f"k{i}", "shared"], wait_s=5)))
                 for i in range(50)]
        await asyncio.sleep(0.5)
        assert len(checks) == 50, "waiting calls checked their keys again without a write"
        await store.serve(pb.RendezvousRequest(op=Op.SET, keys=["unrelated"], value=b"x"))
        await asyncio.sleep(0.1)
        assert len(checks) == 50, "a write to another key woke the waits"
        for i in range(50):
            await store.serve(pb.RendezvousRequest(op=Op.SET, keys=[f"k{i}"], value=b"x"))
        started = time.monotonic()
        # The teacher's own end, from a thread of its own, as the group constructor writes.
        await asyncio.to_thread(store.store.set, "shared", b"teacher")
        answers = await asyncio.wait_for(asyncio.gather(*waits), 2)
        return answers, time.monotonic() - started

    answers, woke_after_s = asyncio.run(scenario())
    assert all(answer.found for answer in answers)
    assert woke_after_s < 0.5
    # 50 first checks, then one per wake: after its own key's write and the shared key's, or once
    # for both when they come before the wait runs again.
    assert 100 <= len(checks) <= 150, len(checks)


def test_closing_the_session_wakes_its_waits():
    store = SessionStore(timeout_s=5.0)

    async def scenario():
        wait = asyncio.create_task(store.serve(pb.RendezvousRequest(op=Op.WAIT, keys=["never"], wait_s=5)))
        await asyncio.sleep(0.1)
        started = time.monotonic()
        store.close()
        with pytest.raises(RendezvousError) as info:
            await asyncio.wait_for(wait, 2)
        return info.value.kind, time.monotonic() - started

    kind, after_s = asyncio.run(scenario())
    assert kind == "ended" and after_s < 0.5
