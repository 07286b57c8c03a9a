"""A pool of teacher replicas behind one name: which replica a session joins.

The address a client is given may name several replicas of one teacher
(distill_common/replicas.py: a comma list, `dns:NAME:PORT`, `file:PATH`, each resolved again
at every join, so replicas that come and go are seen). A single address is a pool of one:
the client joins it as it always did, asking nothing else.

Placement (`Pool.choose`): each replica's GetStatus lists its sessions (those of this job
among them), the sum of the weights it applies to its jobs (`weight_total`) and how loaded it is
(batches queued for its --max-inflight, its busy fraction, the outputs it holds against
--max-held-bytes, its sessions against --max-sessions). A session goes where its job has the
fewest sessions, then where the weight is least (a job of weight w and n ranks brings w / n a
session), then where the load is least (in steps of 0.1), then, among equals, to the replica its
job rank points at. Joins at the same moment see the same sums and would all take the same
replica: so after its first Join a session looks again (`Pool.better_replica`, after a random
pause) and, while its group has not formed, moves to a replica that has become the better place
(sessions that landed together thus spread, the first to look moving first). Ranks of a job
place themselves in rank order: a rank's first join waits (up to LOWER_RANKS_WAIT_S) until its
job's lower ranks are in place (their groups formed), so each sees where the others went: ranks
that place themselves at once, each guessing where the others go, guess from different views
when other jobs join meanwhile, and may land together (tests/test_pool.py). Lower ranks still
missing after the wait are placed first, as they would place themselves. A replica that
does not answer within a few seconds is passed over.

A job's weight over the pool: the Join says how many ranks the job has (JoinRequest.job_size),
and each replica applies the job's weight times the share of those ranks it serves. Its ranks
are spread first because a data-parallel job steps at the pace of its slowest rank: a rank on a
replica busier than its job's others holds the whole job to that replica's pace, and what the
job leaves unused elsewhere goes to the jobs beside it. A job whose ranks are spread evenly over
every replica is served in proportion to its weight on each, so over the pool too; a job of
fewer ranks than replicas has them on as many replicas, and the weights break the ties.
Least weight first, without spreading, left a job's two ranks on one replica when that was
lightest, and the jobs that joined later had to share what was left unevenly: three replicas,
three jobs of two ranks with weights 1, 1, 2, each job stepping at its slowest rank's pace, put
some job more than 20% off its weight's share of the tokens (up to 59%) in 128 of the 720 orders
the six ranks can join in one after another; spread first, every order is within 2%
(tests/test_scheduler.py simulates it with the replicas' own scheduler). What it does not do:
move a session that serves, so jobs that leave can leave the shares uneven until the next joins.
Replicas that run at different speeds hold the jobs with a rank on the slower one to its pace, and
give the slack of the faster ones to the jobs that can use it: the shares then drift from the
weights (work conservation, not a bug of placement).

Identity (`Pool.check_same`): replicas of a pool must serve the same teacher, or a student
moved from one to another would get other outputs mid-run. At the first join every replica
that answers is compared with the one joined (architecture, shapes, dtype, tensor-parallel
size, quantization, tokenizer and weights fingerprints); one that differs is refused by name.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import grpc

from distill_common.proto.teacher.v1 import teacher_pb2 as pb
from distill_common.replicas import ReplicasError, replica_addresses, single
from student_trainer.errors import Incompatible, TeacherError, TeacherUnavailable

log = logging.getLogger("student_trainer.client")

# How long a replica's GetStatus may take before placement passes it over.
STATUS_TIMEOUT_S = 3.0
# A rank's first join waits at most this long for its job's lower ranks to be in place on a replica,
# asking this often: ranks that start together then place themselves one after another, each seeing
# the others.
LOWER_RANKS_WAIT_S = 10.0
LOWER_RANKS_POLL_S = 0.1
# After its first Join a session looks again, this many times, each after a random pause of at most
# SETTLE_PAUSE_S (so that sessions that landed together do not all look at once), and moves to a
# replica that has become the better place before its group forms.
SETTLE_LOOKS = 2
SETTLE_PAUSE_S = 0.5
# Fields of TeacherInfo every replica of a pool must agree on.
IDENTITY = ("architecture", "vocab_size", "hidden_size", "num_layers", "dtype", "tp_size", "tokenizer_fingerprint",
            "weights_fingerprint", "topk_form")


def identity(info: pb.TeacherInfo) -> dict:
    fields = {name: getattr(info, name) for name in IDENTITY}
    quantization = info.quantization
    fields["quantization"] = (quantization.format, quantization.scaling, tuple(quantization.full_precision_layers))
    return fields


def load(status: pb.StatusResponse) -> float:
    """How busy a replica is: batches queued per --max-inflight, its busy fraction, outputs held per
    --max-held-bytes and sessions per --max-sessions, added up."""
    info = status.info
    return (status.queue_depth / max(1, info.max_inflight) + status.busy_fraction
            + (status.held_bytes / status.held_bytes_limit if status.held_bytes_limit else 0.0)
            + status.sessions_total / max(1, info.max_sessions))


def place(candidates: dict[str, tuple[int, float, float]], order: list[str], job_rank: int, session_weight: float,
          joined_ranks: set[int] = frozenset()) -> str:
    """The replica rank `job_rank` of a job goes to, of `candidates` (address -> the sessions of the
    job it serves, its weight total and its load): the fewest sessions of the job, then the least
    weight, then the least load in steps of 0.1, then the one at the rank's turn in `order` (every
    replica of the pool, in its order).

    Ranks of a job that join at once see the same sums. So that they spread as if they had
    joined one after another, the job's lower ranks not yet seen anywhere (not in
    `joined_ranks`) are placed first, each adding a session and `session_weight` where it would go."""
    job_sessions = {address: sessions for address, (sessions, _, _) in candidates.items()}
    weights = {address: weight for address, (_, weight, _) in candidates.items()}

    def best(rank: int) -> str:
        return min(candidates, key=lambda address: (job_sessions[address], round(weights[address], 6),
                                                    round(candidates[address][2], 1),
                                                    (order.index(address) - rank) % len(order)))

    for earlier in range(job_rank):
        if earlier not in joined_ranks:
            where = best(earlier)
            job_sessions[where] += 1
            weights[where] += session_weight
    return best(job_rank)


class Pool:
    """The replicas an address names, a channel to each (made by `connect`), and placement."""

    def __init__(self, spec: str, connect: Callable[[str], object]):
        self.spec = spec.strip()
        if not self.spec:
            raise ValueError("the teacher's address is empty: give host:port, a comma list, dns:NAME:PORT or "
                             "file:PATH")
        self._connect = connect
        self._channels: dict[str, object] = {}
        self._lock = threading.Lock()

    @property
    def single(self) -> bool:
        """One fixed address: no placement, no status calls (a client of one teacher)."""
        return single(self.spec)

    def addresses(self) -> list[str]:
        """The replicas' addresses now (a name resolved, a file read, again at each call)."""
        try:
            return replica_addresses(self.spec)
        except ReplicasError as e:
            raise TeacherUnavailable(str(e), grpc.StatusCode.UNAVAILABLE) from None

    def channel(self, address: str):
        with self._lock:
            channel = self._channels.get(address)
            if channel is None:
                channel = self._channels[address] = self._connect(address)
            return channel

    def statuses(self, addresses: list[str]) -> dict[str, pb.StatusResponse]:
        """GetStatus of each replica that answers in time, by address."""
        def ask(address: str):
            try:
                return address, self.channel(address).call("GetStatus", pb.GetStatusRequest(),
                                                            timeout_s=STATUS_TIMEOUT_S)
            except TeacherError as e:
                log.debug("teacher replica %s did not answer: %s", address, e)
                return address, None

        with ThreadPoolExecutor(max_workers=min(16, len(addresses))) as pool:
            return {address: status for address, status in pool.map(ask, addresses) if status is not None}

    def choose(self, job_id: str, job_rank: int, session_weight: float, avoid: str = "",
               lower_ranks_wait_s: float = 0.0) -> tuple[str, dict[str, pb.StatusResponse]]:
        """The replica a session of `job_id` should join (see the module's docstring), and the
        statuses it was chosen from. `avoid`: a replica just lost, taken only if no other answers.
        `lower_ranks_wait_s`: how long to wait for the job's lower ranks to show on a replica
        before placing this one (those still missing then are placed as they would place themselves)."""
        addresses = self.addresses()
        if self.single:
            return addresses[0], {}
        deadline = time.monotonic() + lower_ranks_wait_s
        while True:
            statuses = self.statuses(addresses)
            listed = [s for status in statuses.values() for s in status.sessions if s.job_id == job_id]
            joined_ranks = {s.job_rank for s in listed}
            # A lower rank is where it stays once its group formed (`Pool.better_replica` may move it before).
            missing = set(range(job_rank)) - {s.job_rank for s in listed if s.state != "connecting"}
            if not missing or not statuses or time.monotonic() >= deadline:
                break
            time.sleep(LOWER_RANKS_POLL_S)
            addresses = self.addresses()
        if missing and lower_ranks_wait_s:
            log.info("ranks %s of job %s not in place on a replica of %s after %.0fs: placing rank %d as if they "
                     "were", sorted(missing), job_id, self.spec, lower_ranks_wait_s, job_rank)
        candidates = [a for a in addresses if a in statuses and a != avoid] or [a for a in addresses if a in statuses]
        if not candidates:
            raise TeacherUnavailable(f"no replica of the teacher pool {self.spec} answered ({', '.join(addresses)})",
                                     grpc.StatusCode.UNAVAILABLE)

        chosen = place({address: (sum(s.job_id == job_id for s in statuses[address].sessions),
                                  statuses[address].weight_total, load(statuses[address])) for address in candidates},
                       addresses, job_rank, session_weight, joined_ranks)
        return chosen, statuses

    def better_replica(self, job_id: str, job_rank: int, session_weight: float, session_id: str,
                       current: str) -> str | None:
        """After session `session_id` joined `current`: a replica that is now a better place for it
        (fewer of its job's sessions, or less weight, counting it nowhere), else None. Joins at the
        same moment see the same sums and may land together; the first of them to look again moves."""
        addresses = self.addresses()
        statuses = self.statuses(addresses)
        if current not in statuses:
            return None
        candidates = {}
        for address, status in statuses.items():
            mine = any(s.session_id == session_id for s in status.sessions)
            candidates[address] = (sum(s.job_id == job_id and s.session_id != session_id for s in status.sessions),
                                   status.weight_total - (session_weight if mine else 0.0), load(status))
        best = place(candidates, [a for a in addresses if a in statuses], job_rank, session_weight, set(range(job_rank)))
        here, there = candidates[current], candidates[best]
        return best if (there[0], round(there[1], 6)) < (here[0], round(here[1], 6)) else None

    def check_same(self, joined_address: str, joined: pb.TeacherInfo, statuses: dict[str, pb.StatusResponse]) -> None:
        """Incompatible naming the first replica whose teacher differs from the one joined."""
        mine = identity(joined)
        for address, status in statuses.items():
            if address == joined_address:
                continue
            theirs = identity(status.info)
            differs = [f"{name} {mine[name]!r} here, {theirs[name]!r} there" for name in mine
                       if mine[name] != theirs[name]]
            if differs:
                raise Incompatible(
                    f"teacher pool {self.spec}: replica {address} serves another teacher than {joined_address} "
                    f"({'; '.join(differs)}): a student moved between them would get other outputs mid-run. Serve "
                    "the same model, dtype, quantization and tensor-parallel size on every replica, or take it out "
                    "of the pool", grpc.StatusCode.FAILED_PRECONDITION)

    def close(self) -> None:
        with self._lock:
            channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            channel.close()
