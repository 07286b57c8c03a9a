"""The teacher's side of a session's transport process (teacher_server/session_process.py) trusts
nothing the process sends: a process that a hostile peer took over, crashed or confused is
played here by workers of the test's own, started the way the teacher starts the real one.
Each one's session fails with a reason that says what happened; nothing it sent is unpickled,
and the teacher's process is untouched.
"""

from __future__ import annotations

import datetime
import json
import os
import pickle
import signal
import sys
import time

import pytest
import torch
import torch.distributed as dist

from distill_common.session_group import TransferError
from teacher_server import session_process


def _report_then_wait(ctl, store_conn, spec, *messages: bytes) -> None:
    for message in messages:
        ctl.send_bytes(message)
    time.sleep(30)  # killed by the teacher's side long before


def huge_report(ctl, store_conn, spec):
    _report_then_wait(ctl, store_conn, spec, b"{" + b" " * (1 << 20) + b"}")


def unknown_send(ctl, store_conn, spec):
    _report_then_wait(ctl, store_conn, spec, json.dumps({"op": "formed"}).encode(),
                      json.dumps({"op": "sent", "seq": 999}).encode())


class _Boom:
    def __reduce__(self):
        return (os.system, ("touch /tmp/teacher-unpickled-a-report",))


def pickled_report(ctl, store_conn, spec):
    _report_then_wait(ctl, store_conn, spec, pickle.dumps(_Boom()))


def crash(ctl, store_conn, spec):
    os.kill(os.getpid(), signal.SIGSEGV)


def store_abuse(ctl, store_conn, spec):
    """Too many keys (refused, the process told why), then a value over the bound (the session ends)."""
    store_conn.send_bytes(json.dumps({"m": "check", "k": [f"k{i}" for i in range(100)]}).encode())
    reply = json.loads(store_conn.recv_bytes())
    ctl.send_bytes(json.dumps({"op": "failed", "message": f"store said {reply}"}).encode())
    time.sleep(30)


def store_oversized(ctl, store_conn, spec):
    store_conn.send_bytes(json.dumps({"m": "set", "k": ["0/1"]}).encode())
    store_conn.send_bytes(b"x" * (1 << 20))
    time.sleep(30)


def store_waits_long(ctl, store_conn, spec):
    """A rendezvous key that never comes, waited for as long as the store allows."""
    store_conn.send_bytes(json.dumps({"m": "wait", "k": ["never"], "t": 60}).encode())
    time.sleep(60)


def start(monkeypatch, worker, timeout_s: float = 5) -> session_process.IsolatedGroup:
    monkeypatch.setattr(session_process, "_worker", worker)
    store = dist.HashStore()
    store.set_timeout(datetime.timedelta(seconds=timeout_s))
    return session_process.IsolatedGroup(store, session_id="test", backend="gloo", device=torch.device("cpu"),
                                         timeout_s=timeout_s, transfer_timeout_s=5, gloo_host="127.0.0.1",
                                         secret=b"s" * 32)


def ended(group: session_process.IsolatedGroup, timeout_s: float = 20) -> str:
    with pytest.raises(TransferError) as failure:
        group.wait_formed(timeout_s)
        group.wait(group.send_all([torch.zeros(4)])[0], timeout_s)
    return str(failure.value)


def gone(group: session_process.IsolatedGroup, timeout_s: float = 20) -> bool:
    deadline = time.monotonic() + timeout_s
    while group._process.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    return not group._process.is_alive()


def test_a_report_over_its_bound_ends_the_session_and_its_process(monkeypatch):
    group = start(monkeypatch, huge_report)
    reason = ended(group)
    assert "closed its pipe" in reason or "malformed" in reason, reason
    group.abort()
    assert gone(group)


def test_a_report_of_a_send_not_in_flight_is_malformed(monkeypatch):
    group = start(monkeypatch, unknown_send)
    assert "malformed report" in ended(group)
    assert gone(group), "the teacher's side did not end a process that sent a malformed report"


def test_a_pickled_report_is_never_unpickled(monkeypatch, tmp_path):
    marker = "/tmp/teacher-unpickled-a-report"
    if os.path.exists(marker):
        os.unlink(marker)
    group = start(monkeypatch, pickled_report)
    assert "malformed report" in ended(group)
    assert not os.path.exists(marker)
    assert gone(group)


def test_a_crashed_process_is_named_by_its_signal(monkeypatch):
    group = start(monkeypatch, crash)
    assert "ended by SIGSEGV" in ended(group)


def test_store_requests_are_bounded(monkeypatch):
    group = start(monkeypatch, store_abuse)
    reason = ended(group)
    assert "store keys must be 1 to 8 strings" in reason, reason
    group.abort()
    group = start(monkeypatch, store_oversized)
    assert "malformed store request" in ended(group)
    assert gone(group)


def test_an_aborted_group_leaves_no_thread_in_a_store_wait(monkeypatch):
    """A session ended while its group forms: its store thread, waiting on the session's store
    for the peer's keys, ends at once, not at the wait's timeout (a thread still in the store's
    C++ when the teacher exits aborts it: "terminate called without an active exception")."""
    group = start(monkeypatch, store_waits_long, timeout_s=60)
    store_thread = next(t for t in group._threads if t.name.startswith("transport-store"))
    time.sleep(1.0)  # the request is in, the wait begun
    assert store_thread.is_alive()
    started = time.monotonic()
    group.abort()
    group.join(timeout_s=5)
    assert not any(t.is_alive() for t in group._threads), [t.name for t in group._threads if t.is_alive()]
    assert time.monotonic() - started < 2
    assert gone(group)


@pytest.mark.parametrize("timeout_s", [0.0, 0.0005, 0.1004, 0.2009, 0.3])
def test_a_store_wait_ends_at_its_timeout_whatever_its_last_slice(timeout_s):
    """c10d counts a wait's timeout in whole milliseconds and takes 0 for none: a last slice under
    a millisecond must not become a wait without end."""
    import threading

    failures = []

    def wait() -> None:
        try:
            session_process._wait_keys(dist.HashStore(), ["never"], timeout_s, lambda: False)
        except dist.DistStoreError as e:
            failures.append(str(e))

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    thread.join(timeout_s + 2)
    assert not thread.is_alive(), f"a wait of {timeout_s} s did not end"
    assert failures and "not set within" in failures[0]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_the_teacher_that_imports_the_transport_does_not_die_with_its_parent():
    """teacher_server.die_with_parent arms SIGKILL on parent death where it is imported (the
    transports' forkserver) and in each transport process. This process imported session_process
    as the teacher does, and must not be armed: the kernel ties the signal to the thread that
    started the process, so a teacher started from a thread (a supervisor's, a test's) was killed
    as soon as that thread ended."""
    import ctypes

    signal_number = ctypes.c_int(-1)
    assert ctypes.CDLL("libc.so.6", use_errno=True).prctl(2, ctypes.byref(signal_number)) == 0  # PR_GET_PDEATHSIG
    assert signal_number.value == 0
