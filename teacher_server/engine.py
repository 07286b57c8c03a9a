"""The engine: one thread owns the model and the order of events.

gRPC handlers validate, then call `admit`, `submit`, `heartbeat` or `leave`, which
only touch queues under a lock and return. The engine thread packs the pending
batches of all ready sessions into one forward up to the token budget (each session
in its submit order, sessions picked by weighted fair share), splits the outputs per
session and posts each session's sends on its own group. A sender thread per
session waits for those sends with a deadline, so a slow or dead student holds up
nobody but itself.

Tensor parallelism: the engine runs on rank 0 only. Its runner broadcasts each forward
to the other ranks (teacher_server/parallel.py), which run the same sharded forward; the
logits come back gathered on rank 0, which alone sends to students, so joins and leaves
need not reach the other ranks and they build no session groups.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass

import torch

from distill_common import tracing
from distill_common.outputs import BatchOutputs, ForwardNeeds
from distill_common.session_group import (TEACHER_RANK, SessionGroup, TransferError, build_group, connect_store,
                                          handshake, mark_refused, prefix_token, ready_store_of)
from teacher_server.cache import OutputCache
from teacher_server.errors import InvalidArgument, NotFound, ResourceExhausted, Unavailable
from teacher_server.metrics import Metrics
from teacher_server.model_runner import ModelRunner
from teacher_server.sessions import Batch, Session

log = logging.getLogger(__name__)

def pack(batches: list[tuple[torch.Tensor, torch.Tensor]], pinned: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward's ids and mask: the (ids, mask) batches one after the other, rows right-padded.

    Pinned (for a CUDA model): the copy to the device is then truly asynchronous. From
    pageable memory it would wait for the device to finish the previous forward, and the
    engine could not launch one forward while the other runs.
    """
    rows = sum(ids.shape[0] for ids, _ in batches)
    seq = max(ids.shape[1] for ids, _ in batches)
    input_ids = torch.zeros(rows, seq, dtype=torch.int64, pin_memory=pinned)
    mask = torch.zeros(rows, seq, dtype=torch.int64, pin_memory=pinned)
    row = 0
    for ids, batch_mask in batches:
        b, s = ids.shape
        input_ids[row:row + b, :s] = ids
        mask[row:row + b, :s] = batch_mask
        row += b
    return input_ids, mask


@dataclass
class _Planned:
    session: Session
    batch: Batch
    row: int  # first row of this batch in the packed forward (or of the identical batch it shares)
    computed: bool = True  # owns its rows in the forward; False: shares another's rows, or `cached`
    cached: BatchOutputs | None = None  # served from the output cache, no forward


@dataclass
class _Job:
    """The fair-share unit: every session (rank) of one job_id shares one clock and one weight."""

    weight: float
    sessions: int = 0
    # Weighted tokens scheduled for the job (tokens / weight): the least-served job goes first.
    virtual_tokens: float = 0.0


@dataclass
class _Launched:
    """A forward whose sends are posted; its batches are announced once the device finished it."""

    start: float
    tokens: int
    finished: object  # a torch.cuda.Event recorded after the forward and the sends' inputs; None on CPU
    announcements: list  # (session, group, batch_id)


@dataclass
class _SendJob:
    batch: Batch
    works: list
    tensors: list  # held until the sends complete: NCCL reads them asynchronously
    nbytes: int


class Engine:
    def __init__(self, runner: ModelRunner, metrics: Metrics, *, store, advertise_host: str,
                 max_batch_tokens: int, max_sessions: int, lease_s: float, join_timeout_s: float,
                 transfer_timeout_s: float, cache_bytes: int = 0):
        self.runner = runner
        self.metrics = metrics
        self.cache = OutputCache(cache_bytes)
        metrics.watch_cache(self.cache)
        self._jobs: dict[str, _Job] = {}
        self.store = store
        self.advertise_host = advertise_host
        self.max_batch_tokens = max_batch_tokens
        self.max_sessions = max_sessions
        self.lease_s = lease_s
        self.join_timeout_s = join_timeout_s
        self.transfer_timeout_s = transfer_timeout_s
        self._sessions: dict[str, Session] = {}
        self._senders: dict[str, queue.Queue] = {}
        self._cond = threading.Condition()
        self._accepting = True
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self._launched: queue.Queue = queue.Queue()
        self._announcer = threading.Thread(target=self._announce_loop, name="announcer", daemon=True)
        self.error: BaseException | None = None
        self._next_lease_check = 0.0  # monotonic time of the next look for expired leases

    # ---- lifecycle ---------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()
        self._announcer.start()

    @property
    def healthy(self) -> bool:
        # runner.healthy: False once a tensor-parallel world broke (a rank died or hung).
        return self._thread.is_alive() and self.error is None and self.runner.healthy

    @property
    def accepting(self) -> bool:
        return self._accepting and self.healthy

    def stop_accepting(self) -> None:
        with self._cond:
            self._accepting = False

    def drain(self, timeout_s: float) -> bool:
        """Waits until every submitted batch is sent; True when it finished in time."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while any(s.inflight for s in self._sessions.values() if s.state in ("ready", "draining")):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(min(remaining, 0.1))
        return True

    def stop(self) -> None:
        for session in list(self._sessions.values()):
            self._end(session, "shutdown", "the teacher is shutting down")
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout=10)
        self._launched.put(None)
        self._announcer.join(timeout=10)

    # ---- control, from the gRPC handlers: validate-free, quick ---------------------

    def admit(self, session: Session) -> None:
        with self._cond:
            if not self.accepting:
                raise Unavailable("the teacher is shutting down or unhealthy; join another replica or retry later")
            live = sum(1 for s in self._sessions.values() if s.alive)
            if live >= self.max_sessions:
                raise ResourceExhausted(f"the teacher already serves {live} sessions (--max-sessions "
                                        f"{self.max_sessions}); retry later or raise --max-sessions")
            job = self._jobs.get(session.job_id)
            if job is not None and job.weight != session.weight:
                raise InvalidArgument(f"job {session.job_id!r} already has weight {job.weight:g} (set by the rank "
                                      f"that joined first), this session asks {session.weight:g}: give every rank "
                                      "of a job the same weight")
            if job is None:
                # A new job starts at the least-served job's clock: it gets its fair share
                # from now on, not a burst that makes up for the time before it joined.
                clocks = [j.virtual_tokens for j in self._jobs.values()]
                job = self._jobs[session.job_id] = _Job(session.weight, virtual_tokens=min(clocks, default=0.0))
            # Within a job, ranks take turns by their own (unweighted) clocks.
            clocks = [s.virtual_tokens for s in self._sessions.values() if s.alive and s.job_id == session.job_id]
            session.virtual_tokens = min(clocks, default=0.0)
            job.sessions += 1
            self._sessions[session.session_id] = session
        self.metrics.sessions_joined.inc()
        self.metrics.sessions_connected.inc()
        threading.Thread(target=self._connect, args=(session,), name=f"connect-{session.session_id}",
                         daemon=True).start()

    def session(self, session_id: str) -> Session:
        with self._cond:
            session = self._sessions.get(session_id)
        if session is None or not session.alive:
            raise NotFound(f"session {session_id!r} is unknown or has ended; join again")
        return session

    def submit(self, session: Session, batch: Batch) -> int:
        with self._cond:
            if not session.alive or session.state == "draining":
                raise NotFound(f"session {session.session_id} has ended ({session.failure or session.state}); join again")
            self._wake_job(session.job_id)
            session.pending.append(batch)
            session.batches_submitted += 1
            inflight = session.inflight
            self._cond.notify_all()
        self.metrics.inflight.labels(session.session_id, session.job_id).set(inflight)
        self._update_queue_depth()
        return inflight

    def refuse(self, session: Session, batch_id: int) -> None:
        """Marks a refused batch where the student of a stream_refusals_only session waits for it."""
        if not session.stream_refusals_only:
            return
        try:
            if session.group is not None:
                session.group.refuse(batch_id)
            else:  # refused while the group still forms
                mark_refused(ready_store_of(self.store, session.store_prefix), batch_id)
        except Exception as e:  # the student's wait then times out and it joins again
            log.warning("session %s: could not mark batch %d refused: %s", session.session_id, batch_id, e)

    def _wake_job(self, job_id: str) -> None:
        """A job with nothing outstanding that submits again starts no further back than
        the busy jobs: time spent idle is not credit for a burst later (held: self._cond)."""
        busy_clocks = []
        for s in self._sessions.values():
            if s.alive and s.inflight:
                if s.job_id == job_id:
                    return  # still busy: its clock runs on
                busy_clocks.append(self._jobs[s.job_id].virtual_tokens)
        if busy_clocks:
            job = self._jobs[job_id]
            job.virtual_tokens = max(job.virtual_tokens, min(busy_clocks))

    def heartbeat(self, session: Session) -> None:
        session.last_heartbeat = time.monotonic()

    def leave(self, session: Session, drain: bool) -> None:
        with self._cond:
            if drain and session.inflight and session.state == "ready":
                session.state = "draining"  # ended by the sender once the last batch is out
                return
        self._end(session, "left")

    def sessions(self) -> list[Session]:
        with self._cond:
            return [s for s in self._sessions.values() if s.alive]

    def queue_depth(self) -> int:
        with self._cond:
            return sum(len(s.pending) for s in self._sessions.values())

    # ---- session groups ----------------------------------------------------------

    def _connect(self, session: Session) -> None:
        """Builds the teacher's end of the session group (blocks until the student's end)."""
        try:
            # A store client of its own: one client serialises its operations, so a wait
            # for a student that never comes would hold up every other session's.
            store = connect_store("127.0.0.1", self.store.port, self.join_timeout_s)
            group = build_group(store, session.store_prefix, backend=session.backend, rank=TEACHER_RANK,
                                device=self.runner.device, timeout_s=self.join_timeout_s,
                                gloo_host=self.advertise_host)
            handshake(group, prefix_token(session.store_prefix), self.join_timeout_s)
        except Exception as e:
            log.warning("session %s (job %s rank %d) did not connect: %s", session.session_id, session.job_id,
                        session.job_rank, e)
            self._end(session, "join_failed", f"the session group did not form: {e}")
            return
        sends: queue.Queue = queue.Queue()
        with self._cond:
            if not session.alive:  # left or expired while connecting
                group.abort()
                return
            session.group = group
            session.state = "ready"
            session.last_heartbeat = time.monotonic()
            self._senders[session.session_id] = sends
            self._cond.notify_all()
        threading.Thread(target=self._send_loop, args=(session, group, sends), name=f"send-{session.session_id}",
                         daemon=True).start()
        log.info("session %s ready: job %s rank %d, %s", session.session_id, session.job_id, session.job_rank,
                 session.backend, extra={"session_id": session.session_id, "job_id": session.job_id})

    def _send_loop(self, session: Session, group: SessionGroup, sends: queue.Queue) -> None:
        """Waits, in order, for each batch's sends to complete; fails the session on timeout."""
        while True:
            job = sends.get()
            if job is None:
                return
            tracing.mark("t_watch", job.batch.batch_id)
            try:
                for work in job.works:
                    group.wait(work, self.transfer_timeout_s, what=f"sending batch {job.batch.batch_id}")
            except TransferError as e:
                log.warning("session %s: %s", session.session_id, e)
                self._end(session, "transfer_failed", str(e))
                return
            tracing.mark("t_sent", job.batch.batch_id)
            labels = (session.session_id, session.job_id)
            with self._cond:
                session.batches_sent += 1
                session.batches_sending -= 1
                session.tokens_served += job.batch.tokens
                session.bytes_sent += job.nbytes
                finished = session.state == "draining" and session.inflight == 0
                self._cond.notify_all()
            self.metrics.batches.labels(*labels).inc()
            self.metrics.tokens.labels(*labels).inc(job.batch.tokens)
            self.metrics.bytes_sent.labels(*labels).inc(job.nbytes)
            self.metrics.inflight.labels(*labels).set(session.inflight)
            del job
            if finished:
                self._end(session, "left")
                return

    def _end(self, session: Session, reason: str, failure: str = "") -> None:
        """Ends a session: drops its queue, aborts its group, forgets its metrics."""
        with self._cond:
            if not session.alive:
                return
            session.state = "closed" if reason == "left" else "failed"
            session.failure = failure
            session.pending.clear()
            if self._sessions.pop(session.session_id, None) is not None:
                job = self._jobs.get(session.job_id)
                if job is not None:
                    job.sessions -= 1
                    if job.sessions <= 0:
                        del self._jobs[session.job_id]
            sends = self._senders.pop(session.session_id, None)
            self._cond.notify_all()
        if sends is not None:
            sends.put(None)
        if session.group is not None:
            # Aborting never waits for the peer, which may be dead; other groups are untouched.
            session.group.abort()
        self.metrics.sessions_connected.dec()
        self.metrics.sessions_ended.labels(reason).inc()
        self.metrics.forget_session(session.session_id, session.job_id)
        self._update_queue_depth()
        log.info("session %s ended: %s%s", session.session_id, reason, f" ({failure})" if failure else "",
                 extra={"session_id": session.session_id, "job_id": session.job_id})

    def _update_queue_depth(self) -> None:
        self.metrics.queue_depth.set(self.queue_depth())

    # ---- the loop ------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            while True:
                plan = self._next_plan()
                if plan is None:
                    return
                if plan:
                    self._execute(plan)
        except BaseException as e:  # the engine is dead: /readyz turns 503 and the error is logged
            self.error = e
            log.exception("engine loop died")
            raise

    def _expire_leases(self) -> None:
        now = time.monotonic()
        # Also called before every plan: a teacher kept busy by some students must still
        # drop a frozen one on time. Twice a second is often enough.
        if now < self._next_lease_check:
            return
        self._next_lease_check = now + 0.5
        for session in [s for s in self._sessions.values() if s.state in ("ready", "draining")]:
            if now - session.last_heartbeat > self.lease_s:
                threading.Thread(target=self._end, args=(session, "expired",
                                 f"no heartbeat for {self.lease_s:.0f}s"), daemon=True).start()

    def _next_plan(self) -> list[_Planned] | None:
        """Waits for work, then picks batches for one forward (None: the engine stops)."""
        with self._cond:
            self._expire_leases()
            plan = self._pick()
            while not plan:
                if self._stopping:
                    return None
                tracing.mark("e_wait", -1)
                self._cond.wait(timeout=0.5)
                tracing.mark("e_wake", -1)
                self._expire_leases()
                plan = self._pick()
            for planned in plan:
                tracing.mark("t_pick", planned.batch.batch_id)
                planned.session.pending.popleft()
                planned.session.batches_sending += 1
        self._update_queue_depth()
        return plan

    def _pick(self) -> list[_Planned]:
        """Weighted fair share between jobs: the job least served (tokens / weight) goes
        first, and within it the rank least served. Identical batches share work: one
        already in this forward lends its rows, one in the output cache needs no forward;
        neither counts against the token budget (both count as served for the share)."""
        taken: dict[str, int] = {}
        plan: list[_Planned] = []
        in_forward: dict[bytes, _Planned] = {}
        rows = seq = 0
        candidates = [s for s in self._sessions.values() if s.state in ("ready", "draining") and s.pending]
        while candidates:
            candidates.sort(key=lambda s: (self._jobs[s.job_id].virtual_tokens, s.virtual_tokens))
            session = candidates[0]
            index = taken.get(session.session_id, 0)
            # Outputs computed but not yet received stay in teacher memory: a session may
            # hold at most its max_inflight of them (checked again at Submit).
            if index >= len(session.pending) or session.batches_sending + index >= session.max_inflight:
                candidates.pop(0)
                continue
            batch = session.pending[index]
            b, s = batch.input_ids.shape
            twin = in_forward.get(batch.key)
            cached = None if twin is not None else self.cache.get(batch.key, session.outputs.needs)
            if twin is not None:
                plan.append(_Planned(session, batch, twin.row, computed=False))
            elif cached is not None:
                plan.append(_Planned(session, batch, 0, computed=False, cached=cached))
            else:
                if rows and (rows + b) * max(seq, s) > self.max_batch_tokens:
                    candidates.pop(0)  # does not fit this forward; the next one starts with it
                    continue
                planned = _Planned(session, batch, rows)
                plan.append(planned)
                in_forward[batch.key] = planned
                rows, seq = rows + b, max(seq, s)
            taken[session.session_id] = index + 1
            job = self._jobs[session.job_id]
            job.virtual_tokens += batch.tokens / job.weight
            session.virtual_tokens += batch.tokens
        return plan

    def _execute(self, plan: list[_Planned]) -> None:
        computed = [p for p in plan if p.computed]
        shared = sum(1 for p in plan if not p.computed and p.cached is None)
        if shared:
            self.cache.note_shared_in_forward(shared)
        derived: dict = {}  # what sessions that share a batch and ask the same get, computed once
        if not computed:  # every batch came from the cache: no forward to wait for or count
            self._hand_to_announcer(time.monotonic(), 0, [self._send(p, p.cached, derived) for p in plan])
            return
        # `computed` is in row order (_pick gives each its rows in turn).
        input_ids, mask = pack([(p.batch.input_ids, p.batch.attention_mask) for p in computed],
                               pinned=self.runner.device.type == "cuda")
        rows, seq = input_ids.shape
        wanted = [p.session for p in plan]
        if self.cache.enabled:  # entries keep what any live session needs, so later ones hit
            wanted += self.sessions()
        needs = ForwardNeeds.union(session.outputs.needs for session in wanted)
        start = time.monotonic()
        tracing.mark("t_inputs", plan[0].batch.batch_id)
        try:
            out = self.runner.forward(input_ids, mask, hidden=needs.hidden_states)
            tracing.mark("t_launched", plan[0].batch.batch_id)
        except Exception as e:  # e.g. out of memory: those sessions fail, the teacher stays up
            # (The busy clock is the announcer's: a launch that failed at once adds nothing to it.)
            log.exception("forward of %d x %d failed", rows, seq)
            for session in {id(p.session): p.session for p in plan}.values():
                self._end(session, "forward_failed", f"the teacher's forward failed: {e}")
            return
        launched = time.monotonic()
        produced: dict[int, BatchOutputs] = {}  # by first row: what each computed batch is served from
        for p in computed:
            b, s = p.batch.input_ids.shape
            outputs = BatchOutputs.of_rows(out, needs, slice(p.row, p.row + b), s)
            produced[p.row] = self.cache.put(p.batch.key, outputs)  # `outputs` itself with the cache off
        announcements = [self._send(p, p.cached if p.cached is not None else produced[p.row], derived)
                         for p in plan]
        self._hand_to_announcer(start, rows * seq, announcements)
        log.debug("forward %d x %d (%d batches): launched in %.1f ms, sends posted in %.1f ms", rows, seq, len(plan),
                  (launched - start) * 1e3, (time.monotonic() - launched) * 1e3)

    def _hand_to_announcer(self, start: float, tokens: int, announcements: list) -> None:
        """The engine does not wait for the device: it goes on to pack and launch the next
        forward while this one runs, and the announcer thread tells the students."""
        finished = None
        if self.runner.device.type == "cuda":
            finished = torch.cuda.Event()
            # On the model's device: this thread's current device may be another one.
            finished.record(torch.cuda.current_stream(self.runner.device))
        self._launched.put(_Launched(start, tokens, finished, [a for a in announcements if a is not None]))

    def _announce_loop(self) -> None:
        """Announces each forward's batches once the device finished it, in launch order.

        Announcing only then keeps a student's receive from being posted while the teacher
        still computes: a posted NCCL receive spins on the student's GPU, taking SMs from
        its training for as long as it waits. This thread also keeps the forward clock:
        a forward is busy from its launch (or the end of the one before, as they queue on
        one stream) until the device finished it.
        """
        previous_end = 0.0
        while True:
            launched = self._launched.get()
            if launched is None:
                return
            start = max(launched.start, previous_end)
            counted = launched.tokens > 0  # 0: outputs all from the cache, no forward ran
            if counted:
                self.metrics.forward_started(start)
            try:
                if launched.finished is not None:
                    launched.finished.synchronize()  # the GIL is released while the device works
            except Exception as e:  # a device error: those sessions fail; the engine's next forward says more
                if counted:
                    self.metrics.forward_failed(start, time.monotonic())
                for session, _, _ in launched.announcements:
                    self._end(session, "forward_failed", f"the teacher's forward failed on the device: {e}")
                continue
            if counted:
                previous_end = time.monotonic()
                self.metrics.record_forward(start, previous_end, launched.tokens)
            for session, group, batch_id in launched.announcements:
                try:
                    group.announce(batch_id)
                except Exception as e:
                    self._end(session, "transfer_failed", f"announcing batch {batch_id} failed: {e}")
                    continue
                tracing.mark("t_announced", batch_id)

    def _send(self, p: _Planned, out: BatchOutputs, derived: dict):
        """Derives what this session asked for from the batch's outputs and posts the sends.

        `derived` holds what this forward already derived, by (outputs, request, transport):
        sessions that share a batch and ask the same are sent the same tensors.
        Returns what the announcer needs once the forward is done: (session, group, batch id),
        or None when the session ended meanwhile.
        """
        session, batch = p.session, p.batch
        with self._cond:
            sends = self._senders.get(session.session_id)
            group = session.group
        if sends is None or group is None:
            return None  # ended meanwhile
        key = (id(out), session.outputs, session.backend)
        tensors = derived.get(key)
        if tensors is None:
            tensors = derived[key] = group.to_send(session.outputs.derive(out, batch))
        try:
            works = group.send_all(tensors)
        except Exception as e:
            self._end(session, "transfer_failed", f"posting the send of batch {batch.batch_id} failed: {e}")
            return None
        tracing.mark("t_forward", batch.batch_id)
        sends.put(_SendJob(batch, works, tensors, sum(t.numel() * t.element_size() for t in tensors)))
        # Announced by the announcer thread, not the sender thread (busy waiting for the
        # previous batch): the student posts this batch's receives as soon as the forward
        # is done, so consecutive transfers run back to back.
        return session, group, batch.batch_id
