"""Sessions whose outputs come back into this process: the HTTP API's jobs.

A completions request is a batch of a job like any other: it runs in a `Session` admitted by
the engine (fair share by job and weight, the caps on sessions, --max-held-bytes, the cache of
identical batches, tensor parallelism, FP8), one per job and request shape, kept while
requests come (each one is its heartbeat) and ended by the engine's lease when they stop.
What differs is the end of its "group": a `LocalGroup` hands each batch's outputs to the
request waiting for them instead of sending them over a process group, and a `LocalOutbox`
fails that request when the batch fails.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from dataclasses import dataclass

import torch

from distill_common.announcements import Outbox
from distill_common.outputs import OutputRequest
from distill_common.rendezvous import SessionStore
from teacher_server.engine import Engine
from teacher_server.errors import ResourceExhausted, Unavailable
from teacher_server.model_runner import Chunk
from teacher_server.sessions import Batch, Session

log = logging.getLogger(__name__)

LOCAL_BACKEND = "local"


class BatchFailed(RuntimeError):
    """The engine could not serve a batch (the forward failed, the session ended): the reason."""


class _Pending:
    """The futures of a session's batches, by batch id, resolved from the engine's threads."""

    def __init__(self):
        self._lock = threading.Lock()
        self._futures: dict[int, concurrent.futures.Future] = {}
        self._closed = ""

    def add(self, batch_id: int) -> concurrent.futures.Future:
        future = concurrent.futures.Future()
        with self._lock:
            if self._closed:
                future.set_exception(BatchFailed(self._closed))
            else:
                self._futures[batch_id] = future
        return future

    def settle(self, batch_id: int, tensors: list[torch.Tensor] | None = None, reason: str = "") -> None:
        with self._lock:
            future = self._futures.pop(batch_id, None)
        if future is None or future.done():
            return
        if tensors is None:
            future.set_exception(BatchFailed(reason))
        else:
            future.set_result(tensors)

    def close(self, reason: str) -> None:
        with self._lock:
            self._closed = reason
            futures, self._futures = list(self._futures.values()), {}
        for future in futures:
            if not future.done():
                future.set_exception(BatchFailed(reason))


class LocalOutbox(Outbox):
    """A session's events, for the request waiting on each batch: a failed batch fails it."""

    def __init__(self, pending: _Pending):
        super().__init__()
        self._pending = pending

    def announce(self, batch_ids) -> None:  # the outputs reach the request through LocalGroup.wait
        return

    def fail(self, batch_id: int, reason: str) -> None:
        self._pending.settle(batch_id, reason=reason)

    def close(self) -> None:
        super().close()
        self._pending.close("the teacher ended this API session (idle past --lease-s, or shutting down); retry")


@dataclass
class _Work:
    batch_id: int
    tensors: list[torch.Tensor]


class LocalGroup:
    """The teacher's end of a session whose outputs stay in this process (Delivery's group interface)."""

    def __init__(self, pending: _Pending, device: torch.device):
        self._pending = pending
        self.tensor_device = device  # derived where the forward ran; copied to the host by `wait`

    def to_send(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        return tensors

    def send_batch(self, wire_id: int, key: bytes, tensors: list[torch.Tensor]) -> list:
        return [_Work(wire_id, tensors)]

    def send_all(self, tensors: list[torch.Tensor]) -> list:
        return []

    def wait(self, work: _Work, timeout_s: float | None = None, what: str = "transfer") -> None:
        """On the session's sender thread: the copy to the host (it waits for the forward), then the hand-over."""
        self._pending.settle(work.batch_id, [t.to("cpu") for t in work.tensors])

    def abort(self) -> None:
        self._pending.close("the API session ended")


async def _acquire_within(slots: asyncio.Semaphore, timeout_s: float) -> None:
    """One of a session's --max-inflight slots, within `timeout_s` (Unavailable after). Not
    wait_for: on Python 3.11 it can time out an acquire that has just succeeded, losing the slot."""
    acquiring = asyncio.ensure_future(slots.acquire())
    try:
        done, _ = await asyncio.wait({acquiring}, timeout=timeout_s)
    except BaseException:  # cancelled while waiting
        if not acquiring.cancel():  # it had the slot already: back it goes
            slots.release()
        raise
    if not done and acquiring.cancel():
        raise Unavailable(f"no slot of this request's session (--max-inflight batches) came free within {timeout_s:g} "
                          "s (--transfer-timeout-s): the teacher is overloaded; retry later")


def _call_soon(loop: asyncio.AbstractEventLoop, callback) -> None:
    """`callback` on `loop` from any thread; nothing once the loop has closed (the server gone)."""
    try:
        loop.call_soon_threadsafe(callback)
    except RuntimeError:
        pass


@dataclass
class Queued:
    """A batch ApiJobs.enqueue queued: its outputs to come, and the session it is queued in."""

    settled: asyncio.Future
    session: Session


class ApiJobs:
    """The sessions of the HTTP API, by (job, what its requests ask), made on first use.

    `submit` runs one batch and returns its tensors on the host; a session's batches wait for a
    slot of its --max-inflight here rather than being refused. Each runs in a forward of its
    own (`Batch.alone`): the route bounds their tokens (--api-chunk-tokens), so that a student's
    batch waits for one of them at most, and is never padded to a prompt's length.
    """

    # Request shapes one job may keep sessions for at once; the least recently used one ends past it.
    MAX_SHAPES_PER_JOB = 4

    def __init__(self, engine: Engine, *, max_inflight: int, timeout_s: float):
        self.engine = engine
        self.max_inflight = max_inflight
        self.timeout_s = timeout_s  # a batch not served in this long fails its request
        self._lock = threading.Lock()
        self._sessions: dict[tuple[str, OutputRequest], tuple[Session, _Pending, asyncio.Semaphore]] = {}

    def _session(self, job_id: str, outputs: OutputRequest, weight: float, max_job_sessions: int,
                 job_limit: str) -> tuple[Session, _Pending, asyncio.Semaphore]:
        key = (job_id, outputs)
        with self._lock:
            held = self._sessions.get(key)
            if held is not None and held[0].alive:
                self._sessions[key] = self._sessions.pop(key)  # most recently used last
                self.engine.heartbeat(held[0])
                return held
            self._sessions.pop(key, None)
            mine = [k for k in self._sessions if k[0] == job_id]
            stale = mine[0] if len(mine) >= self.MAX_SHAPES_PER_JOB else None
        if stale is not None:
            old = self._sessions.pop(stale, None)
            if old is not None:
                self.engine.leave(old[0], drain=True)
        pending = _Pending()
        session = Session(job_id=job_id, job_rank=0, outputs=outputs, backend=LOCAL_BACKEND, peer_device_type="http",
                          max_inflight=self.max_inflight, weight=weight, rendezvous=SessionStore(self.timeout_s),
                          outbox=LocalOutbox(pending), local_group=LocalGroup(pending, self.engine.runner.device))
        self.engine.admit(session, max_job_sessions, job_limit)  # ResourceExhausted / Unavailable as a Join's
        held = (session, pending, asyncio.Semaphore(self.max_inflight))
        with self._lock:
            self._sessions[key] = held
        return held

    async def submit(self, job_id: str, outputs: OutputRequest, input_ids: torch.Tensor,
                     attention_mask: torch.Tensor, data: dict[str, torch.Tensor] | None = None, *, weight: float = 1.0,
                     max_job_sessions: int = 0, job_limit: str = "", chunk: Chunk | None = None) -> list[torch.Tensor]:
        return await self.served(await self.enqueue(job_id, outputs, input_ids, attention_mask, data, weight=weight,
                                                    max_job_sessions=max_job_sessions, job_limit=job_limit,
                                                    chunk=chunk))

    async def enqueue(self, job_id: str, outputs: OutputRequest, input_ids: torch.Tensor,
                      attention_mask: torch.Tensor, data: dict[str, torch.Tensor] | None = None, *,
                      weight: float = 1.0, max_job_sessions: int = 0, job_limit: str = "",
                      chunk: Chunk | None = None, after: "Queued | None" = None) -> "Queued":
        """`submit` in two steps: returns once the batch is queued (after a slot), for `served`.
        A batch queued `after` another runs after it: one session's batches are planned first in,
        first out, so a long prompt's next chunk can wait in the queue while the one before it
        runs; where the job's session for these outputs is another one by now (the one before
        ended, or a newer request shape of the job took its place), it waits for that one first."""
        session, pending, slots = self._session(job_id, outputs, weight, max_job_sessions, job_limit)
        if after is not None and after.session is not session and not after.settled.done():
            await asyncio.wait({after.settled}, timeout=self.timeout_s)
        await _acquire_within(slots, self.timeout_s)
        loop = asyncio.get_running_loop()
        try:
            batch_id = session.next_batch_id
            session.next_batch_id += 1
            batch = Batch(batch_id=batch_id, input_ids=input_ids, attention_mask=attention_mask, data=data or {},
                          alone=True, chunk=chunk)
            batch.output_bytes = sum(int(torch.Size(spec.shape).numel()) * spec.dtype.itemsize
                                     for spec in outputs.layout(batch.rows, batch.seq_len))
            future = pending.add(batch_id)
        except BaseException:
            slots.release()
            raise
        # The slot is the batch's until the engine has settled it, also when its request is
        # cancelled (its client gone): the batch stays queued and runs, so a client that leaves
        # and comes back cannot queue more than --max-inflight batches per session.
        future.add_done_callback(lambda _: _call_soon(loop, slots.release))
        self.engine.submit(session, batch)
        self.engine.heartbeat(session)
        settled = asyncio.wrap_future(future)
        settled.add_done_callback(lambda f: f.cancelled() or f.exception())  # read, if nobody waits for it
        return Queued(settled, session)

    async def served(self, queued: "Queued") -> list[torch.Tensor]:
        """The tensors of a batch `enqueue` queued, within --transfer-timeout-s."""
        try:
            return await asyncio.wait_for(asyncio.shield(queued.settled), self.timeout_s)
        except asyncio.TimeoutError:  # the batch keeps its slot until the engine has settled it
            raise Unavailable(f"the teacher did not serve this request's batch within {self.timeout_s:g} s "
                              "(--transfer-timeout-s): it is overloaded; retry later") from None

    def close(self) -> None:
        with self._lock:
            held, self._sessions = list(self._sessions.values()), {}
        for session, _, _ in held:
            self.engine.leave(session, drain=False)


__all__ = ["ApiJobs", "BatchFailed", "Queued", "LOCAL_BACKEND", "LocalGroup", "LocalOutbox", "ResourceExhausted"]
