"""The scheduler: which queued batches the next forward runs.

Weighted fair share between jobs: each job has a clock, the tokens scheduled for it
divided by its weight, and the least-served job goes first; within a job, the rank
(session) with the fewest tokens scheduled goes first. A forward holds batches up to a
token budget, and a session at most `max_inflight` batches planned or still being sent.

Outputs planned and not yet received wait in teacher memory: with a `held_bytes_limit`,
each job may hold its share of it by weight (split evenly among its sessions), and a
session at its share is not planned until its student receives (backpressure). A session
holding nothing may take one batch over its share while the total stays within the limit,
or whatever it needs when nothing is held at all, so that a batch larger than a share is
still served; the total held is at most the limit plus one batch.

No threads, no torch, no I/O: the engine calls it under its own lock, and tests drive
it directly. A session is the engine's object, of which the scheduler reads
`session_id`, `job_id`, `weight` and `max_inflight` and which it hands back in plans; a
batch is opaque but for `key` (a content digest: equal keys, equal outputs), `rows`,
`seq_len`, `tokens` and `output_bytes` (what its outputs take until received).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from teacher_server.errors import InvalidArgument, ResourceExhausted


@dataclass
class Planned:
    """One batch of the next forward."""

    session: object
    batch: object
    row: int  # first row of this batch in the packed forward (or of the identical batch it shares)
    computed: bool = True  # owns its rows in the forward; False: shares another's rows, or `cached`
    cached: object = None  # served from the output cache, no forward: what the lookup returned


@dataclass
class _Job:
    """The fair-share unit: every session (rank) of one job_id shares one clock and one weight."""

    weight: float
    sessions: int = 0
    # Weighted tokens scheduled for the job (tokens / weight): the least-served job goes first.
    virtual_tokens: float = 0.0


@dataclass
class _Queue:
    """One session's batches and clock."""

    session: object
    pending: deque = field(default_factory=deque)  # batches submitted, not yet planned
    sending: int = 0  # planned, sends not yet complete
    held: deque = field(default_factory=deque)  # (batch, output bytes) of those, in plan order
    held_bytes: int = 0
    # Tokens scheduled for this session (unweighted): orders the ranks of one job.
    virtual_tokens: float = 0.0
    ready: bool = False  # its group formed: its batches may be planned

    @property
    def outstanding(self) -> int:
        return len(self.pending) + self.sending


def _no_cache(session, batch) -> None:
    return None


class Scheduler:
    def __init__(self, *, max_batch_tokens: int, max_sessions: int, held_bytes_limit: int = 0):
        self.max_batch_tokens = max_batch_tokens
        self.max_sessions = max_sessions
        self.held_bytes_limit = held_bytes_limit  # 0: outputs held are bounded by max_inflight only
        self._jobs: dict[str, _Job] = {}
        self._queues: dict[str, _Queue] = {}  # by session_id, in admission order

    def admit(self, session, max_job_sessions: int = 0, job_limit: str = "") -> None:
        """Gives a new session a queue; refuses it as `check_room` does."""
        self.check_room(session.job_id, session.weight, max_job_sessions, job_limit)
        job = self._jobs.get(session.job_id)
        if job is None:
            # A new job starts at the least-served job's clock: it gets its fair share
            # from now on, not a burst that makes up for the time before it joined.
            clocks = [j.virtual_tokens for j in self._jobs.values()]
            job = self._jobs[session.job_id] = _Job(session.weight, virtual_tokens=min(clocks, default=0.0))
        # Within a job, ranks take turns by their own (unweighted) clocks.
        clocks = [q.virtual_tokens for q in self._queues.values() if q.session.job_id == session.job_id]
        job.sessions += 1
        self._queues[session.session_id] = _Queue(session, virtual_tokens=min(clocks, default=0.0))

    def check_room(self, job_id: str, weight: float, max_job_sessions: int = 0, job_limit: str = "") -> None:
        """Refuses a session of `job_id` beyond max_sessions, beyond `max_job_sessions` of its job
        (0: no such cap; `job_limit` names where it is set), or with another weight than its job's."""
        if len(self._queues) >= self.max_sessions:
            raise ResourceExhausted(f"the teacher already serves {len(self._queues)} sessions (--max-sessions "
                                    f"{self.max_sessions}); retry later or raise --max-sessions")
        job = self._jobs.get(job_id)
        if max_job_sessions and job is not None and job.sessions >= max_job_sessions:
            raise ResourceExhausted(f"job {job_id!r} already has {job.sessions} sessions, its limit "
                                    f"({job_limit or max_job_sessions}); retry once one ends, or raise that limit")
        if job is not None and job.weight != weight:
            raise InvalidArgument(f"job {job_id!r} already has weight {job.weight:g} (set by the rank "
                                  f"that joined first), this session asks {weight:g}: give every rank "
                                  "of a job the same weight")

    def ready(self, session) -> None:
        """The session can receive: its batches may be planned from now on."""
        self._queues[session.session_id].ready = True

    def submit(self, session, batch) -> None:
        self._wake_job(session.job_id)
        self._queues[session.session_id].pending.append(batch)

    def sent(self, session, batch=None) -> None:
        """A planned batch of the session (`batch`; None: the oldest) finished sending or
        failed: its outputs are no longer held (nothing for a session removed)."""
        queue = self._queues.get(session.session_id)
        if queue is None:
            return
        queue.sending -= 1
        entry = next((e for e in queue.held if e[0] is batch), None) if batch is not None else None
        if entry is None and queue.held:
            entry = queue.held[0]
        if entry is not None:
            queue.held.remove(entry)
            queue.held_bytes -= entry[1]

    def held_bytes(self) -> int:
        """Bytes of outputs planned and not yet received, all sessions together."""
        return sum(q.held_bytes for q in self._queues.values())

    def held_share(self, session) -> float:
        """The bytes of outputs the session may hold: its job's share of `held_bytes_limit` by
        weight, split evenly among the job's sessions."""
        job = self._jobs[session.job_id]
        total_weight = sum(j.weight for j in self._jobs.values())
        return self.held_bytes_limit * job.weight / total_weight / job.sessions

    def _may_hold(self, queue: _Queue, planning: int, total: int, need: int) -> bool:
        """Whether a batch whose outputs take `need` bytes may be planned for `queue`'s session,
        which holds `planning` more in this plan, while `total` are held in all."""
        if not self.held_bytes_limit:
            return True
        held = queue.held_bytes + planning
        if held + need <= self.held_share(queue.session):
            return True
        return held == 0 and (total + need <= self.held_bytes_limit or total == 0)

    def remove(self, session) -> None:
        """Forgets the session and its queued batches; a job goes with its last session."""
        if self._queues.pop(session.session_id, None) is None:
            return
        job = self._jobs[session.job_id]
        job.sessions -= 1
        if job.sessions <= 0:
            del self._jobs[session.job_id]

    def queued(self, session) -> int:
        """Batches the session submitted that no plan has taken yet."""
        queue = self._queues.get(session.session_id)
        return len(queue.pending) if queue is not None else 0

    def queue_depth(self) -> int:
        return sum(len(q.pending) for q in self._queues.values())

    def _wake_job(self, job_id: str) -> None:
        """A job with nothing outstanding that submits again starts no further back than
        the busy jobs: time spent idle is not credit for a burst later."""
        busy_clocks = []
        for q in self._queues.values():
            if q.outstanding:
                if q.session.job_id == job_id:
                    return  # still busy: its clock runs on
                busy_clocks.append(self._jobs[q.session.job_id].virtual_tokens)
        if busy_clocks:
            job = self._jobs[job_id]
            job.virtual_tokens = max(job.virtual_tokens, min(busy_clocks))

    def plan(self, lookup: Callable[[object, object], object] = _no_cache) -> list[Planned]:
        """The next forward's batches, taken off their queues (empty: nothing can run now).

        Identical batches share work: one already in this forward lends its rows, one
        that `lookup(session, batch)` finds (the output cache) needs no forward; neither
        counts against the token budget, and both count as served for the share. The
        budget counts padding (rows x the longest sequence); a batch larger than the
        budget alone runs alone.
        """
        taken: dict[str, int] = {}
        planning: dict[str, int] = {}  # by session: output bytes this plan adds
        total_held = self.held_bytes() if self.held_bytes_limit else 0
        plan: list[Planned] = []
        in_forward: dict[bytes, Planned] = {}
        rows = seq = 0
        candidates = [q for q in self._queues.values() if q.ready and q.pending]
        while candidates:
            candidates.sort(key=lambda q: (self._jobs[q.session.job_id].virtual_tokens, q.virtual_tokens))
            queue = candidates[0]
            session = queue.session
            index = taken.get(session.session_id, 0)
            # Outputs computed but not yet received stay in teacher memory: a session may
            # hold at most its max_inflight of them (checked again at Submit).
            if index >= len(queue.pending) or queue.sending + index >= session.max_inflight:
                candidates.pop(0)
                continue
            batch = queue.pending[index]
            if not self._may_hold(queue, planning.get(session.session_id, 0), total_held, batch.output_bytes):
                candidates.pop(0)  # at its share of held outputs: planned again once its student receives
                continue
            b, s = batch.rows, batch.seq_len
            twin = in_forward.get(batch.key)
            cached = None if twin is not None else lookup(session, batch)
            if twin is not None:
                plan.append(Planned(session, batch, twin.row, computed=False))
            elif cached is not None:
                plan.append(Planned(session, batch, 0, computed=False, cached=cached))
            else:
                if rows and (rows + b) * max(seq, s) > self.max_batch_tokens:
                    candidates.pop(0)  # does not fit this forward; the next one starts with it
                    continue
                planned = Planned(session, batch, rows)
                plan.append(planned)
                in_forward[batch.key] = planned
                rows, seq = rows + b, max(seq, s)
            taken[session.session_id] = index + 1
            planning[session.session_id] = planning.get(session.session_id, 0) + batch.output_bytes
            total_held += batch.output_bytes
            job = self._jobs[session.job_id]
            job.virtual_tokens += batch.tokens / job.weight
            queue.virtual_tokens += batch.tokens
        for planned in plan:
            queue = self._queues[planned.session.session_id]
            queue.pending.popleft()
            queue.sending += 1
            queue.held.append((planned.batch, planned.batch.output_bytes))
            queue.held_bytes += planned.batch.output_bytes
        return plan
