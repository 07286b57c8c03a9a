"""A session's rendezvous: the keys both ends of its group exchange, reached only over gRPC.

A process group forms on a `torch.distributed.Store`: gloo's ranks exchange their
addresses there, NCCL's the unique id of their communicator. torch's TCPStore would do,
but it has no authentication: anyone who reaches its port can list every key, read and
write them. So the teacher opens no store port. Each session's keys live in the
teacher's process, in a store of the session's own (`SessionStore`, a `dist.HashStore`
the teacher's end of the group is built on directly), and the student reaches them only
through the `Rendezvous` RPC: over the token-checked, TLS-able channel, with the
session's secret (checked by the service like every call about a session), which travels
only in the student's `Join` answer. A call reaches its own session's keys and no other's;
the keys are deleted when the session ends.

The student's end is built on `RendezvousStore`, a `dist.Store` implemented in Python
whose every operation is one `Rendezvous` call. Two facts about such a store (torch 2.11
and 2.13): C++ keeps only a pointer to it, so the Python object must outlive every use
(the session group holds it: a store collected early answers "Not implemented" to C++);
and the group constructors release the interpreter lock while they wait on it, so the
calls it makes from C++ threads can run.

Bounds, each a refusal that names the limit: a session's store holds at most
`MAX_KEYS` keys and `MAX_BYTES` bytes written by its student (a gloo or NCCL group
needs a handful of keys and well under a KiB); a call names at most `MAX_KEYS_PER_CALL`
keys (counted before any is read), carries at most `MAX_REQUEST_BYTES` (checked by the
service before the request is parsed) and waits at most `MAX_WAIT_S` (the student asks
again until its own deadline). A
waiting call costs nothing until one of its keys is written: every write, the student's
through the RPC and the teacher's own end's from the threads that build its group, wakes
the calls waiting on that key (`_NotifyingStore`), which then check their keys once.
"""

from __future__ import annotations

import asyncio
import datetime
import math
import threading
import time
from collections.abc import Callable

import torch.distributed as dist

from distill_common.proto.teacher.v1 import teacher_pb2 as pb

MAX_KEYS = 64
MAX_BYTES = 64 << 10
MAX_WAIT_S = 5.0
MAX_KEYS_PER_CALL = 8
# The largest request a call needs: a COMPARE_SET's expected and new value, each at most what the
# session's store holds, and 4 KiB for its keys and other fields. The service refuses a larger
# one before parsing it.
MAX_REQUEST_BYTES = 2 * MAX_BYTES + (4 << 10)
_Op = pb.RendezvousRequest.Op


class RendezvousError(RuntimeError):
    """A rendezvous call refused; `kind` says why: "quota", "invalid" or "ended"."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


class SessionStore:
    """Teacher: one session's rendezvous keys, in this process, and the `Rendezvous` calls on them.

    `store` is what the teacher's end of the session group is built on. The service lets a
    call reach it only with the session's secret, and only while the session lives (`close`
    deletes the keys).
    """

    def __init__(self, timeout_s: float):
        """`timeout_s`: how long the teacher's own waits on the store last (its join timeout)."""
        self.store = _NotifyingStore(timeout_s, self._written_to)
        self._written: dict[str, int] = {}  # by key: the bytes the student's calls hold there
        self._closed = False
        self._lock = threading.Lock()  # the quota's count and the waiters; the store itself is thread-safe
        # By key: the (loop, event) of each call waiting on it.
        self._waiters: dict[str, set[tuple[asyncio.AbstractEventLoop, asyncio.Event]]] = {}

    async def serve(self, request: pb.RendezvousRequest) -> pb.RendezvousResponse:
        """One call, whose session secret the service checked. Raises RendezvousError."""
        try:
            return await self._serve(request)
        except RendezvousError:
            raise
        except (ValueError, RuntimeError) as e:  # the store's own refusal: ADD to a value that is no number
            keys = list(request.keys[:MAX_KEYS_PER_CALL])
            raise RendezvousError("invalid", f"rendezvous {_op_name(request.op)} on {keys}: {e}") from e

    async def _serve(self, request: pb.RendezvousRequest) -> pb.RendezvousResponse:
        op = request.op
        if op not in _Op.values() or op == _Op.OP_UNSPECIFIED:
            raise RendezvousError("invalid", f"unknown rendezvous operation {op}")
        if op in (_Op.GET, _Op.WAIT):
            keys = self._keys(request, one=op == _Op.GET)
            found = await self._wait(keys, request.wait_s)
            if op == _Op.WAIT or not found:
                return pb.RendezvousResponse(found=found)
            return pb.RendezvousResponse(found=True, value=self._store().get(keys[0]))
        if op == _Op.CHECK:
            return pb.RendezvousResponse(found=self._store().check(self._keys(request)))
        if op == _Op.NUM_KEYS:
            return pb.RendezvousResponse(number=self._store().num_keys())
        key = self._keys(request, one=True)[0]
        if op == _Op.SET:
            self._account(key, request.value)
            self._store().set(key, request.value)
            return pb.RendezvousResponse()
        if op == _Op.ADD:
            self._account(key, b"-" + b"9" * 19)  # the widest an int64 in decimal can grow to
            return pb.RendezvousResponse(number=self._store().add(key, request.amount))
        if op == _Op.COMPARE_SET:
            self._account(key, request.value)
            return pb.RendezvousResponse(value=self._store().compare_set(key, request.expected, request.value))
        if op == _Op.DELETE:
            with self._lock:
                self._written.pop(key, None)
            return pb.RendezvousResponse(found=self._store().delete_key(key))
        raise RendezvousError("invalid", f"unknown rendezvous operation {op}")  # new in the proto, not served here

    def close(self) -> None:
        """The session ended: its keys are deleted, later calls refused, waiting ones woken (to be refused)."""
        with self._lock:
            self._closed = True
            self._written.clear()
            waiters = {waiter for by_key in self._waiters.values() for waiter in by_key}
        for key in self.store.inner.list_keys():
            self.store.inner.delete_key(key)
        for loop, event in waiters:
            _wake(loop, event)

    # ---- helpers -------------------------------------------------------------------

    def _store(self) -> dist.Store:
        if self._closed:
            raise RendezvousError("ended", "the session has ended; its rendezvous keys are gone: join again")
        return self.store

    @staticmethod
    def _keys(request: pb.RendezvousRequest, one: bool = False) -> list[str]:
        """The call's keys, counted before any is read into a list."""
        count = len(request.keys)
        if count > MAX_KEYS_PER_CALL:
            raise RendezvousError("invalid", f"rendezvous {_op_name(request.op)} names {count} keys, more than the "
                                  f"{MAX_KEYS_PER_CALL} a call may (a process group waits on one or two at a time)")
        keys = list(request.keys)
        if not keys or (one and len(keys) != 1) or any(not key for key in keys):
            raise RendezvousError("invalid", f"rendezvous {_op_name(request.op)} needs {'one key' if one else 'keys'}, "
                                  f"got {len(keys)}")
        return keys

    def _account(self, key: str, value: bytes) -> None:
        """Counts a write by the student against the session's quota, or refuses it."""
        with self._lock:
            if self._closed:
                raise RendezvousError("ended", "the session has ended; its rendezvous keys are gone: join again")
            keys = len(self._written) + (key not in self._written)
            written = len(key.encode()) + len(value)
            size = sum(self._written.values()) - self._written.get(key, 0) + written
            if keys > MAX_KEYS or size > MAX_BYTES:
                raise RendezvousError("quota", f"a session's rendezvous holds at most {MAX_KEYS} keys and {MAX_BYTES} "
                                      f"bytes written by its student; this write would make {keys} keys, {size} bytes")
            self._written[key] = written

    async def _wait(self, keys: list[str], wait_s: float) -> bool:
        """Whether `keys` are all set within `wait_s` (at most MAX_WAIT_S); checked again only
        when one of them is written."""
        deadline = time.monotonic() + (min(max(wait_s, 0.0), MAX_WAIT_S) if math.isfinite(wait_s) else 0.0)
        waiter = (asyncio.get_running_loop(), asyncio.Event())
        with self._lock:  # registered before the first check: a write between the two still wakes it
            for key in keys:
                self._waiters.setdefault(key, set()).add(waiter)
        try:
            while not self._store().check(keys):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                try:
                    await asyncio.wait_for(waiter[1].wait(), remaining)
                except asyncio.TimeoutError:
                    pass
                waiter[1].clear()
            return True
        finally:
            with self._lock:
                for key in keys:
                    by_key = self._waiters.get(key)
                    if by_key is not None:
                        by_key.discard(waiter)
                        if not by_key:
                            del self._waiters[key]

    def _written_to(self, key: str) -> None:
        """A key was written (from any thread): the calls waiting on it check their keys."""
        with self._lock:
            waiters = list(self._waiters.get(key, ()))
        for loop, event in waiters:
            _wake(loop, event)


def _wake(loop: asyncio.AbstractEventLoop, event: asyncio.Event) -> None:
    try:
        loop.call_soon_threadsafe(event.set)
    except RuntimeError:  # the loop closed: the server is gone, and the call with it
        pass


class _NotifyingStore(dist.Store):
    """The teacher's end of a session's store: a `dist.HashStore` (`inner`) that reports each
    key written, so that calls waiting on it wake then instead of polling.

    The group constructors call it from C++ threads (as they call `RendezvousStore`); the
    same two facts hold: the owner (SessionStore) keeps it alive, and the interpreter lock is
    released while C++ waits.
    """

    def __init__(self, timeout_s: float, written: Callable[[str], None]):
        super().__init__()
        self.inner = dist.HashStore()
        self.inner.set_timeout(datetime.timedelta(seconds=timeout_s))
        self.set_timeout(datetime.timedelta(seconds=timeout_s))
        self._written = written

    def set(self, key: str, value) -> None:
        self.inner.set(key, value)
        self._written(key)

    def get(self, key: str) -> bytes:
        return self.inner.get(key)

    def add(self, key: str, amount: int) -> int:
        number = self.inner.add(key, amount)
        self._written(key)
        return number

    def compare_set(self, key: str, expected, desired) -> bytes:
        value = self.inner.compare_set(key, expected, desired)
        self._written(key)
        return value

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        if timeout is None:
            self.inner.wait(list(keys))
        else:
            self.inner.wait(list(keys), timeout)

    def check(self, keys: list[str]) -> bool:
        return self.inner.check(list(keys))

    def delete_key(self, key: str) -> bool:
        return self.inner.delete_key(key)

    def num_keys(self) -> int:
        return self.inner.num_keys()


class RendezvousStore(dist.Store):
    """Student: the session's rendezvous keys, each operation one `Rendezvous` call.

    `call(request, timeout_s)` makes the call (with the channel's token) and returns the
    response or raises. Blocking operations (`get`, `wait`) wait up to the store's timeout,
    asking again after each bounded wait on the teacher. Keep this object alive as long
    as the group built on it (see the module's docstring).
    """

    def __init__(self, call: Callable[[pb.RendezvousRequest, float], pb.RendezvousResponse], session_id: str,
                 timeout_s: float, rpc_timeout_s: float = 30.0):
        super().__init__()
        self._call = call
        self._session_id = session_id
        self._rpc_timeout_s = rpc_timeout_s
        self._clones: list[RendezvousStore] = []  # kept alive with this one (C++ holds no Python reference)
        self.set_timeout(datetime.timedelta(seconds=timeout_s))

    def _do(self, op: int, keys: list[str], **fields) -> pb.RendezvousResponse:
        request = pb.RendezvousRequest(session_id=self._session_id, op=op, keys=keys, **fields)
        return self._call(request, self._rpc_timeout_s + fields.get("wait_s", 0.0))

    def _wait_for(self, keys: list[str], timeout: datetime.timedelta | None, *, value: bool) -> bytes | None:
        timeout_s = (timeout or self.timeout).total_seconds()
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            response = self._do(_Op.GET if value else _Op.WAIT, keys, wait_s=max(0.0, min(remaining, MAX_WAIT_S)))
            if response.found:
                return response.value
            if time.monotonic() >= deadline:
                raise dist.DistStoreError(f"rendezvous keys {keys} of session {self._session_id} were not set within "
                                          f"{timeout_s:.0f}s: the other end of the session group did not come")

    def set(self, key: str, value) -> None:
        self._do(_Op.SET, [key], value=_bytes(value))

    def get(self, key: str) -> bytes:
        return self._wait_for([key], None, value=True)

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        self._wait_for(list(keys), timeout, value=False)

    def check(self, keys: list[str]) -> bool:
        return self._do(_Op.CHECK, list(keys)).found

    def add(self, key: str, amount: int) -> int:
        return self._do(_Op.ADD, [key], amount=amount).number

    def compare_set(self, key: str, expected, desired) -> bytes:
        return self._do(_Op.COMPARE_SET, [key], expected=_bytes(expected), value=_bytes(desired)).value

    def delete_key(self, key: str) -> bool:
        return self._do(_Op.DELETE, [key]).found

    def num_keys(self) -> int:
        return self._do(_Op.NUM_KEYS, []).number

    def clone(self) -> "RendezvousStore":
        clone = RendezvousStore(self._call, self._session_id, self.timeout.total_seconds(),
                                self._rpc_timeout_s)
        self._clones.append(clone)
        return clone


def _op_name(op: int) -> str:
    return _Op.Name(op) if op in _Op.values() else str(op)


def _bytes(value) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)
