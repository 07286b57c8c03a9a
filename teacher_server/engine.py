"""The engine: one thread owns the model and the order of events.

gRPC handlers validate, then call `admit`, `submit`, `heartbeat` or `leave`, which
only touch queues under a lock and return. The engine thread repeats one step: the
scheduler (teacher_server/scheduler.py) plans the next forward from the pending
batches of all ready sessions, the model runs it, and delivery
(teacher_server/delivery.py) posts each session's sends on its own group and
announces them on the session's submit stream once the device is done. The sessions'
lifecycle (admission, leases, ending) is teacher_server/lifecycle.py's; the engine holds
the forward and the condition both share.

One batch never stops the engine: a forward that fails is run again batch by batch, so
only the batches that cannot run fail; an error while keeping or deriving one batch's
outputs fails that batch; and an error the step did not foresee fails the step's
batches. A batch fails through `Delivery.fail`, which tells its student why; the engine
thread goes on with the next plan, and /healthz stays 200.

Tensor parallelism: the engine runs on rank 0 only. Its runner broadcasts each forward
to the other ranks (teacher_server/parallel.py), which run the same sharded forward; the
logits come back gathered on rank 0, which alone sends to students, so joins and leaves
need not reach the other ranks and they build no session groups.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import torch

from distill_common import tracing
from distill_common.outputs import BatchOutputs, ForwardNeeds
from teacher_server.cache import OutputCache
from teacher_server.delivery import Delivery
from teacher_server.errors import NotFound
from teacher_server.lifecycle import SessionLifecycle
from teacher_server.metrics import Metrics
from teacher_server.model_runner import ModelRunner
from teacher_server.scheduler import Planned, Scheduler
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


@dataclass(frozen=True)
class Failed:
    """A batch that could not be served, and why (the student is told)."""

    reason: str


@dataclass
class _Forward:
    """A launched forward (or none, when every batch came from the cache)."""

    start: float  # monotonic, before the launch
    launched: float
    shape: tuple[int, int]  # rows x sequence length of the packed forward; (0, 0): no forward ran
    outputs: list[BatchOutputs | Failed]  # what each planned batch is served from, in plan order

    @property
    def tokens(self) -> int:
        return self.shape[0] * self.shape[1]


class Engine:
    def __init__(self, runner: ModelRunner, metrics: Metrics, *, advertise_host: str,
                 max_batch_tokens: int, max_sessions: int, lease_s: float, join_timeout_s: float,
                 transfer_timeout_s: float, cache_bytes: int = 0, isolate_sessions: bool = True):
        self.runner = runner
        self.metrics = metrics
        self.cache = OutputCache(cache_bytes)
        metrics.watch_cache(self.cache)
        if runner.expert_load is not None:
            metrics.watch_experts(runner.expert_load)
        self.scheduler = Scheduler(max_batch_tokens=max_batch_tokens, max_sessions=max_sessions)
        # Guards the sessions and the scheduler; notified when there may be work to plan.
        self._cond = threading.Condition()
        self.lifecycle = SessionLifecycle(self.scheduler, metrics, self._cond, accepting=lambda: self.accepting,
                                          lease_s=lease_s, join_timeout_s=join_timeout_s)
        self.delivery = Delivery(metrics, advertise_host=advertise_host, device=runner.device,
                                 join_timeout_s=join_timeout_s, transfer_timeout_s=transfer_timeout_s,
                                 join_data=runner.join_data, isolate=isolate_sessions, formed=self.lifecycle.formed,
                                 sent=self.lifecycle.sent, failed=self.lifecycle.failed,
                                 released=self.lifecycle.released, end=self.lifecycle.end)
        self.lifecycle.attach(self.delivery)
        self._accepting = True
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
        self.error: BaseException | None = None

    # ---- start, health, stop ------------------------------------------------------

    def start(self) -> None:
        self._thread.start()
        self.delivery.start()

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
        return self.lifecycle.drain(timeout_s)

    def stop(self) -> None:
        for session in self.sessions():
            self.lifecycle.end(session, "shutdown", "the teacher is shutting down")
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout=10)
        self.delivery.stop()

    # ---- control, from the gRPC handlers: validate-free, quick ---------------------
    # Sessions come and go in teacher_server/lifecycle.py; batches enter the scheduler here.

    def admit(self, session: Session, max_job_sessions: int = 0, job_limit: str = "") -> None:
        """Admits a session; `max_job_sessions` (0: none) caps its job's sessions, `job_limit` says where it is set."""
        self.lifecycle.admit(session, max_job_sessions, job_limit)

    def check_room(self, job_id: str, weight: float, max_job_sessions: int = 0, job_limit: str = "") -> None:
        """Refuses a session `admit` would refuse now (the caps, the job's weight), admitting nothing."""
        self.lifecycle.check_room(job_id, weight, max_job_sessions, job_limit)

    def session(self, session_id: str) -> Session:
        return self.lifecycle.session(session_id)

    def ended(self, session_id: str) -> tuple[str, str, str] | None:
        """(secret, job id, why it ended) of a recently ended session; None if unknown or live."""
        return self.lifecycle.ended(session_id)

    def heartbeat(self, session: Session) -> None:
        self.lifecycle.heartbeat(session)

    def leave(self, session: Session, drain: bool) -> None:
        self.lifecycle.leave(session, drain)

    def sessions(self) -> list[Session]:
        return self.lifecycle.sessions()

    def submit(self, session: Session, batch: Batch) -> int:
        with self._cond:
            if not session.alive or session.state == "draining":
                raise NotFound(f"session {session.session_id} has ended ({session.failure or session.state}); join again")
            self.scheduler.submit(session, batch)
            session.batches_submitted += 1
            inflight = session.inflight
            self._cond.notify_all()
        self.metrics.inflight.labels(session.session_id, session.job_id).set(inflight)
        self.lifecycle.update_queue_depth()
        return inflight

    def queued(self, session: Session) -> int:
        """Batches of the session waiting for a forward."""
        with self._cond:
            return self.scheduler.queued(session)

    def queue_depth(self) -> int:
        return self.lifecycle.queue_depth()

    def weight_total(self) -> float:
        """The jobs' weights as the scheduler applies them here (a pool places sessions by it)."""
        with self._cond:
            return self.scheduler.weight_total()

    def held_bytes(self) -> int:
        """Outputs computed (or planned) and not yet received by their students."""
        with self._cond:
            return self.scheduler.held_bytes()

    # ---- the loop: plan -> forward -> deliver ------------------------------------------

    def _loop(self) -> None:
        try:
            while (plan := self._next_plan()) is not None:
                try:
                    self._step(plan)
                except Exception as e:  # unforeseen, in one step: its batches fail, the engine goes on
                    log.exception("serving %d batches failed", len(plan))
                    for p in plan:
                        self.delivery.fail(p.session, p.batch, f"the teacher failed serving it: {_describe(e)}")
        except BaseException as e:  # the engine is dead: /readyz turns 503 and the error is logged
            self.error = e
            log.exception("engine loop died")
            raise

    def _step(self, plan: list[Planned]) -> None:
        """Runs one plan: its forward, then each batch's sends (or its failure).

        When the packed forward fails, its batches run again batch by batch, each served as
        soon as it is computed (so no more of their outputs are held at once than before):
        only the batches that cannot run fail (an input the model refuses, a batch too large
        for memory alone), and the others are served as if nothing happened.
        """
        try:
            forward = self._forward(plan)
        except Exception as e:  # e.g. out of memory, or one batch the model refuses
            # (The busy clock is the announcer's: a launch that failed at once adds nothing to it.)
            reason = _describe(e)
            log.warning("forward of %s failed (%s)", _shape(plan), reason, exc_info=True)
        else:
            self._serve(plan, forward)
            return
        # Out of the handler: the failed forward's frames, and the tensors they hold, are freed
        # before anything runs again.
        self._run_each(plan, reason)

    def _run_each(self, plan: list[Planned], reason: str) -> None:
        """The forward of `plan` failed for `reason`: each computed batch (with the batches that
        share its rows) runs alone; batches from the cache are served as they are."""
        cached, parts = _parts(plan)
        if cached:
            self._serve(cached, self._forward(cached))  # no forward: served from the cache
        if len(parts) == 1 or not self.runner.healthy:  # nothing to split, or no forward can run again
            for p in (p for part in parts for p in part):
                self.delivery.fail(p.session, p.batch, f"the teacher's forward failed: {reason}")
            return
        log.warning("running the %d batches of the failed forward each alone", len(parts))
        for part in parts:
            try:
                if not self.runner.healthy:  # a tensor-parallel world broke on an earlier part
                    raise RuntimeError("the teacher's tensor-parallel world broke (see its log)")
                forward = self._forward(part)
            except Exception as e:
                batch = part[0].batch
                log.exception("forward of batch %d of session %s (%d x %d) failed", batch.batch_id,
                              part[0].session.session_id, batch.rows, batch.seq_len)
                for p in part:
                    self.delivery.fail(p.session, p.batch, f"the teacher's forward failed on this batch: "
                                                           f"{_describe(e)}")
                continue
            self._serve(part, forward)

    def _serve(self, plan: list[Planned], forward: _Forward) -> None:
        """Posts the sends of the plan's batches, or fails those whose outputs could not be kept."""
        served = []
        for p, out in zip(plan, forward.outputs):
            if isinstance(out, Failed):
                self.delivery.fail(p.session, p.batch, out.reason)
            else:
                served.append((p.session, p.batch, out))
        self.delivery.deliver(served, forward.start, forward.tokens)
        if forward.tokens:
            log.debug("forward %d x %d (%d batches): launched in %.1f ms, sends posted in %.1f ms",
                      *forward.shape, len(plan), (forward.launched - forward.start) * 1e3,
                      (time.monotonic() - forward.launched) * 1e3)

    def _next_plan(self) -> list[Planned] | None:
        """Waits for work, then takes the batches of one forward (None: the engine stops)."""
        with self._cond:
            self.lifecycle.expire_leases()
            plan = self.scheduler.plan(self._cached)
            while not plan:
                if self._stopping:
                    return None
                tracing.mark("e_wait", -1)
                self._cond.wait(timeout=0.5)
                tracing.mark("e_wake", -1)
                self.lifecycle.expire_leases()
                plan = self.scheduler.plan(self._cached)
            for planned in plan:
                tracing.mark("t_pick", planned.batch.batch_id)
        self.lifecycle.update_queue_depth()
        return plan

    def _cached(self, session: Session, batch: Batch) -> BatchOutputs | None:
        if batch.chunk is not None:  # its outputs depend on the chunks before it
            return None
        return self.cache.get(batch.key, session.outputs.needs)

    def _forward(self, plan: list[Planned]) -> _Forward:
        """Launches the forward of the plan's computed batches (does not wait for the device).

        Raises when the forward fails. Keeping one batch's outputs (its rows, a copy in the
        cache) that fails fails that batch only (its `Failed` in the outputs).
        """
        computed = [p for p in plan if p.computed]
        shared = sum(1 for p in plan if not p.computed and p.cached is None)
        if shared:
            self.cache.note_shared_in_forward(shared)
        if not computed:  # every batch came from the cache: no forward to wait for or count
            now = time.monotonic()
            return _Forward(now, now, (0, 0), [p.cached for p in plan])
        # `computed` is in row order (the scheduler gives each its rows in turn).
        input_ids, mask = pack([(p.batch.input_ids, p.batch.attention_mask) for p in computed],
                               pinned=self.runner.device.type == "cuda")
        rows, seq = input_ids.shape
        # A chunk of a longer sequence (the HTTP API's) runs alone on the cache of the ones before it.
        chunk = computed[0].batch.chunk if len(computed) == 1 else None
        wanted = [p.session for p in plan]
        if self.cache.enabled and chunk is None:  # entries keep what any live session needs, so later ones hit
            wanted += self.sessions()
        needs = ForwardNeeds.union(session.outputs.needs for session in wanted)
        start = time.monotonic()
        tracing.mark("t_inputs", plan[0].batch.batch_id)
        out = self.runner.forward(input_ids, mask, needs, chunk=chunk)
        tracing.mark("t_launched", plan[0].batch.batch_id)
        launched = time.monotonic()
        produced: dict[int, BatchOutputs | Failed] = {}  # by the batch's row in the plan
        row = 0  # in this forward: a part run alone has rows of its own
        for p in computed:
            b, s = p.batch.input_ids.shape
            try:
                outputs = BatchOutputs.of_rows(out, needs, slice(row, row + b), s)
                # `outputs` itself with the cache off; a chunk's are never asked again
                produced[p.row] = outputs if chunk is not None else self.cache.put(p.batch.key, outputs)
            except Exception as e:
                log.exception("keeping the outputs of batch %d of session %s failed", p.batch.batch_id,
                              p.session.session_id)
                produced[p.row] = Failed(f"keeping the teacher's outputs failed: {_describe(e)}")
            row += b
        return _Forward(start, launched, (rows, seq),
                        [p.cached if p.cached is not None else produced[p.row] for p in plan])


def _parts(plan: list[Planned]) -> tuple[list[Planned], list[list[Planned]]]:
    """The plan's batches served from the cache, and its computed batches each with the batches
    that share its rows (identical ones): the parts that can run alone."""
    cached = [p for p in plan if p.cached is not None]
    parts = {p.row: [p] for p in plan if p.computed}
    for p in plan:
        if not p.computed and p.cached is None:
            parts[p.row].append(p)
    return cached, list(parts.values())


def _shape(plan: list[Planned]) -> str:
    """The plan's forward as rows x length (batches), for the log."""
    computed = [p.batch for p in plan if p.computed]
    seq = max((b.seq_len for b in computed), default=0)
    return f"{sum(b.rows for b in computed)} x {seq} ({len(computed)} batches)"


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"
