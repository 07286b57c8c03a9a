"""The scheduler: which queued batches the next forward runs.

Weighted fair share between jobs: each job has a clock, the tokens scheduled for it
divided by its weight, and the least-served job goes first; within a job, the rank
(session) with the fewest tokens scheduled goes first. A forward holds batches up to a
token budget, and a session at most `max_inflight` batches planned or still being sent.

Outputs planned and not yet received wait in teacher memory. With a `held_bytes_limit`
they are held in two ways, and a session whose batch neither allows is not planned until its
student receives (backpressure):

- the pool, at most `held_bytes_limit` bytes in all: a session may take a batch from it while
  the pool has room and the session stays within its share (its job's share of the limit by
  weight, split evenly among the job's sessions), or holds nothing yet (one batch over its
  share, so that a batch larger than a share is served while the pool allows it);
- a job's floor, outside the pool: a job none of whose outputs are held may take one batch,
  whatever the pool holds. No other job can take it, so however much another job holds or
  however heavy it is, a job whose students receive what they are sent is planned at least
  one batch per round trip (in its turn by fair share: when the others have batches that can
  run, it gets its weight's share of forwards).

The total held is therefore at most `held_bytes_limit` plus one batch per job: the pool
bounded by the limit, each job at most one floor batch of at most the largest output a
session may ask (the teacher's --max-output-bytes). Shares change as jobs come and go; the
pool's bound does not. Outputs of a session that ended stay counted, in the pool and as its
job's, until the engine reports each released (`sent`): a send in progress keeps its
tensors until it completes or times out, and a job that leaves and joins again must not
hold a second share meanwhile.

No threads, no torch, no I/O: the engine calls it under its own lock, and tests drive
it directly. A session is the engine's object, of which the scheduler reads
`session_id`, `job_id`, `weight` and `max_inflight` and which it hands back in plans; a
batch is opaque but for `key` (a content digest: equal keys, equal outputs), `rows`,
`seq_len`, `tokens`, `output_bytes` (what its outputs take until received) and `alone` (it
runs in a forward with no other computed batch: the HTTP API's, whose forwards are bounded so
that another job's batch waits at most one of them).
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
    # Weighted tokens scheduled for the job (tokens / share): the least-served job goes first.
    virtual_tokens: float = 0.0
    # What its last planned batch added to `virtual_tokens`: the clock less this is where that
    # batch started, the virtual time a job that wakes while it is served starts from.
    last_charge: float = 0.0
    # When its clock last advanced (the scheduler's count of planned batches): of jobs whose clocks
    # are equal, the one served longest ago goes first, so that equal jobs take turns.
    charged_at: int = 0
    # The job's sessions over every replica of a pool (JoinRequest.job_size); 0: unknown.
    size: int = 0

    @property
    def share(self) -> float:
        """Its weight here: all of it, or, when its size over a pool is known, the part its
        sessions here are of that size (so that a job's weight holds over the pool)."""
        if not self.size:
            return self.weight
        return self.weight * min(self.sessions, self.size) / self.size


@dataclass
class _Queue:
    """One session's batches and clock."""

    session: object
    pending: deque = field(default_factory=deque)  # batches submitted, not yet planned
    sending: int = 0  # planned, sends not yet complete
    held: deque = field(default_factory=deque)  # _Held of those, in plan order
    held_bytes: int = 0  # all of them
    pool_bytes: int = 0  # those taken from the pool (held_bytes_limit): the others are its job's floor
    # Tokens scheduled for this session (unweighted): orders the ranks of one job.
    virtual_tokens: float = 0.0
    ready: bool = False  # its group formed: its batches may be planned

    @property
    def outstanding(self) -> int:
        return len(self.pending) + self.sending


@dataclass
class _Held:
    """One planned batch's outputs until its sends complete."""

    batch: object
    output_bytes: int
    floor: bool  # its job's floor batch, outside the pool


# Where a batch's outputs may be held: the pool (held_bytes_limit), its job's floor, or nowhere yet.
POOL, FLOOR = "pool", "floor"


def _no_cache(session, batch) -> None:
    return None


class Scheduler:
    def __init__(self, *, max_batch_tokens: int, max_sessions: int, held_bytes_limit: int = 0):
        self.max_batch_tokens = max_batch_tokens
        self.max_sessions = max_sessions
        self.held_bytes_limit = held_bytes_limit  # 0: outputs held are bounded by max_inflight only
        self._jobs: dict[str, _Job] = {}
        self._planned = 0  # batches planned so far: the jobs' `charged_at`
        self._queues: dict[str, _Queue] = {}  # by session_id, in admission order
        # Sessions removed while their outputs were held: counted until each is released (`sent`).
        self._ended: dict[str, _Queue] = {}

    def admit(self, session, max_job_sessions: int = 0, job_limit: str = "") -> None:
        """Gives a new session a queue; refuses it as `check_room` does."""
        self.check_room(session.job_id, session.weight, max_job_sessions, job_limit)
        job = self._jobs.get(session.job_id)
        if job is None:
            # A new job starts at the least-served job's clock: it gets its fair share
            # from now on, not a burst that makes up for the time before it joined.
            clocks = [j.virtual_tokens for j in self._jobs.values()]
            job = self._jobs[session.job_id] = _Job(session.weight, virtual_tokens=min(clocks, default=0.0),
                                                    size=getattr(session, "job_size", 0))
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
        """A planned batch of the session (`batch`; None: the oldest) finished sending, failed,
        or (the session removed) its outputs were released: they are no longer held."""
        ended = session.session_id not in self._queues
        queue = self._ended.get(session.session_id) if ended else self._queues[session.session_id]
        if queue is None:
            return
        queue.sending -= 1
        held = next((h for h in queue.held if h.batch is batch), None) if batch is not None else None
        if held is None and queue.held and not ended:  # an ended session's are released by name only
            held = queue.held[0]
        if held is not None:
            queue.held.remove(held)
            queue.held_bytes -= held.output_bytes
            queue.pool_bytes -= 0 if held.floor else held.output_bytes
        if ended and not queue.held:
            del self._ended[session.session_id]

    def _holding(self) -> list[_Queue]:
        """The queues whose outputs may be held: live sessions' and ended ones' not yet released."""
        return [*self._queues.values(), *self._ended.values()]

    def held_bytes(self) -> int:
        """Bytes of outputs planned and not yet received or released, all sessions together (the
        pool and the floors)."""
        return sum(q.held_bytes for q in self._holding())

    def pool_bytes(self) -> int:
        """Bytes of outputs held in the pool: at most `held_bytes_limit`."""
        return sum(q.pool_bytes for q in self._holding())

    def weight_total(self) -> float:
        """The jobs' weights as applied here (their shares): where a pool places a new session."""
        return sum(j.share for j in self._jobs.values())

    def held_share(self, session) -> float:
        """The bytes of outputs the session may hold from the pool: its job's share of
        `held_bytes_limit` by weight, split evenly among the job's sessions."""
        job = self._jobs[session.job_id]
        total_weight = sum(j.share for j in self._jobs.values())
        return self.held_bytes_limit * job.share / total_weight / job.sessions

    def _where_held(self, session, session_held: int, job_held: int, pool: int, need: int) -> str | None:
        """Where a batch whose outputs take `need` bytes may be held if planned for `session`
        (POOL, FLOOR, or None: not now), which holds `session_held` bytes (with what its job's
        ended sessions hold) and its job `job_held`, while the pool holds `pool` (each counting
        this plan's batches)."""
        if not self.held_bytes_limit:
            return POOL  # bounded by max_inflight only
        within_share = session_held == 0 or session_held + need <= self.held_share(session)
        if within_share and pool + need <= self.held_bytes_limit:
            return POOL
        if job_held == 0:
            return FLOOR
        return None

    def remove(self, session) -> None:
        """Forgets the session and its queued batches; a job goes with its last session. Its
        outputs still held stay counted until each is released (`sent`)."""
        queue = self._queues.pop(session.session_id, None)
        if queue is None:
            return
        if queue.held:
            queue.pending.clear()
            self._ended[session.session_id] = queue
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
        """A job with nothing outstanding that submits again starts no further back than where
        the busy jobs' last planned batches started (start-time fair queueing): time spent idle
        is not credit for a burst later, and a job that sends one batch at a time, behind the
        busy ones, goes before their next batches, waiting for what is being served rather than
        for another turn of theirs (within one batch of theirs)."""
        busy_starts = []
        for q in self._queues.values():
            if q.outstanding:
                if q.session.job_id == job_id:
                    return  # still busy: its clock runs on
                busy = self._jobs[q.session.job_id]
                busy_starts.append(busy.virtual_tokens - busy.last_charge)
        if busy_starts:
            job = self._jobs[job_id]
            job.virtual_tokens = max(job.virtual_tokens, min(busy_starts))

    def plan(self, lookup: Callable[[object, object], object] = _no_cache) -> list[Planned]:
        """The next forward's batches, taken off their queues (empty: nothing can run now).

        Identical batches share work: one already in this forward lends its rows, one
        that `lookup(session, batch)` finds (the output cache) needs no forward; neither
        counts against the token budget, and both count as served for the share. The
        budget counts padding (rows x the longest sequence); a batch larger than the
        budget alone runs alone, and so does a batch marked `alone` (only identical batches and
        cached ones join it).
        """
        taken: dict[str, int] = {}
        planning: dict[str, int] = {}  # by session: output bytes this plan adds
        job_held: dict[str, int] = {}  # by job: output bytes held, this plan's included
        for q in self._holding():  # a job that ended and joined again still holds what it held
            job_held[q.session.job_id] = job_held.get(q.session.job_id, 0) + q.held_bytes
        # What a job's ended sessions still hold counts against each of its sessions' shares.
        ended_held: dict[str, int] = {}
        for q in self._ended.values():
            ended_held[q.session.job_id] = ended_held.get(q.session.job_id, 0) + q.held_bytes
        pool = self.pool_bytes()
        plan: list[Planned] = []
        held_in: list[str] = []  # where each planned batch's outputs are held: POOL or FLOOR
        in_forward: dict[bytes, Planned] = {}
        rows = seq = 0
        closed = False  # an `alone` batch is in this forward: no other computed one joins it
        candidates = [q for q in self._queues.values() if q.ready and q.pending]
        while candidates:
            candidates.sort(key=lambda q: (self._jobs[q.session.job_id].virtual_tokens,
                                           self._jobs[q.session.job_id].charged_at, q.virtual_tokens))
            queue = candidates[0]
            session = queue.session
            index = taken.get(session.session_id, 0)
            # Outputs computed but not yet received stay in teacher memory: a session may
            # hold at most its max_inflight of them (checked again at Submit).
            if index >= len(queue.pending) or queue.sending + index >= session.max_inflight:
                candidates.pop(0)
                continue
            batch = queue.pending[index]
            session_held = queue.held_bytes + planning.get(session.session_id, 0) + ended_held.get(session.job_id, 0)
            where = self._where_held(session, session_held, job_held[session.job_id], pool, batch.output_bytes)
            if where is None:
                candidates.pop(0)  # no room for its outputs: planned again once its student receives
                continue
            b, s = batch.rows, batch.seq_len
            twin = in_forward.get(batch.key)
            cached = None if twin is not None else lookup(session, batch)
            if twin is not None:
                plan.append(Planned(session, batch, twin.row, computed=False))
            elif cached is not None:
                plan.append(Planned(session, batch, 0, computed=False, cached=cached))
            else:
                if rows and (closed or batch.alone or (rows + b) * max(seq, s) > self.max_batch_tokens):
                    candidates.pop(0)  # does not fit this forward; the next one starts with it
                    continue
                planned = Planned(session, batch, rows)
                plan.append(planned)
                in_forward[batch.key] = planned
                rows, seq = rows + b, max(seq, s)
                closed = batch.alone
            held_in.append(where)
            taken[session.session_id] = index + 1
            planning[session.session_id] = planning.get(session.session_id, 0) + batch.output_bytes
            job_held[session.job_id] += batch.output_bytes
            pool += batch.output_bytes if where == POOL else 0
            job = self._jobs[session.job_id]
            job.last_charge = batch.tokens / job.share
            job.virtual_tokens += job.last_charge
            self._planned += 1
            job.charged_at = self._planned
            queue.virtual_tokens += batch.tokens
        for planned, where in zip(plan, held_in):
            queue = self._queues[planned.session.session_id]
            queue.pending.popleft()
            queue.sending += 1
            floor = where == FLOOR
            queue.held.append(_Held(planned.batch, planned.batch.output_bytes, floor))
            queue.held_bytes += planned.batch.output_bytes
            queue.pool_bytes += 0 if floor else planned.batch.output_bytes
        return plan
