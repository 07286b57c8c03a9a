"""How TeacherClient joins the teacher, notices its session failed, and joins again.

The first join: `TeacherChannel.wait_for_server`, then `join_first`, which asks again while the teacher
is full (the connection module's FirstJoin decides), then `connect`, which forms the
session's group over its rendezvous keys and receives what the kinds asked sent once.

After it: heartbeats (`send_heartbeats`) and the session's own threads report a failure to
`session_failed`, which asks the connection's state machine (student_trainer/connection.py)
what it leads to. On REJOIN, `rejoin` runs on a thread of its own: it leaves the lost
session (the teacher says why it ended it), joins again with the first Join's request and
backoff until the connection's deadline, refuses a teacher that came back different
(`check_same_teacher`, `check_same_join_data`: its outputs would not continue the run), and
makes the new session current and sends it every undelivered batch, in submit order
(`install`). Every decision is the connection's; this module carries it out on what it
shares with the client, its `Link` (student_trainer/link.py): the channel, the undelivered
batches and the locks over them (`cond` and `submit_lock`).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from functools import partial

import grpc
import torch

from distill_common import wire
from distill_common.outputs import JoinData, OutputRequest
from distill_common.proto.teacher.v1 import teacher_pb2 as pb
from distill_common.quantization import Quantization
from distill_common.rendezvous import RendezvousStore
from distill_common.session_group import STUDENT_RANK, build_group, handshake, local_address_towards
from student_trainer.connection import Action, FirstJoin, State
from student_trainer.errors import Incompatible, TeacherError
from student_trainer.link import Link, TeacherInfo
from student_trainer.pool import LOWER_RANKS_WAIT_S, SETTLE_LOOKS, SETTLE_PAUSE_S
from student_trainer.session import Session

# The client's logger: what a TeacherClient says about its connection is one log, whichever module says it.
log = logging.getLogger("student_trainer.client")


def session_weight(join_request: pb.JoinRequest) -> float:
    """The weight one session of the job brings to a replica of a pool: the job's, over its ranks."""
    return (join_request.weight or 1.0) / max(1, join_request.job_size)


def choose_first(pool, join_request: pb.JoinRequest, deadline: float) -> tuple[str, dict]:
    """The replica the first Join goes to (student_trainer/pool.py), and the statuses it was chosen
    from; while no replica of a pool answers, asked again until `deadline` (the join timeout)."""
    # Ranks of a known job size place themselves in rank order (student_trainer/pool.py).
    wait_s = LOWER_RANKS_WAIT_S if join_request.job_size > 0 else 0.0
    while True:
        try:
            return pool.choose(join_request.job_id, join_request.job_rank, session_weight(join_request),
                               lower_ranks_wait_s=max(0.0, min(wait_s, deadline - 1.0 - time.monotonic())))
        except TeacherError as e:
            if time.monotonic() + 1.0 >= deadline:
                pool.close()
                raise
            log.warning("%s; asking again", e)
            time.sleep(1.0)


def join_first(link: Link, first_join: FirstJoin) -> pb.JoinResponse:
    """The first Join, asked again while the teacher is full (FirstJoin decides), within join_timeout_s."""
    while True:
        try:
            return link.channel.call("Join", link.join_request, timeout_s=max(
                0.1, min(link.channel.rpc_timeout_s, first_join.deadline - time.monotonic())))
        except TeacherError as e:
            pause_s = first_join.refused(e)
            if pause_s is None:
                link.channel.close()
                raise first_join.final(e) from None
            log.warning("%s", first_join.waiting(e, pause_s))
            time.sleep(pause_s)


def settle(link: Link, joined: pb.JoinResponse, chosen: str, first_join: FirstJoin) -> tuple[pb.JoinResponse, str]:
    """After the first Join to `chosen` of a pool: looks again (Pool.better_replica) and, where another
    replica has become the better place (a join at the same moment landed here too), leaves and
    joins that one, before the session's group forms. Returns the Join in force and its replica."""
    pool, request = link.pool, link.join_request
    for _ in range(SETTLE_LOOKS):
        time.sleep(random.uniform(0.0, SETTLE_PAUSE_S))
        better = pool.better_replica(request.job_id, request.job_rank, session_weight(request), joined.session_id,
                                     chosen)
        if better is None:
            break
        channel = pool.channel(better)
        try:
            moved = channel.call("Join", request, timeout_s=max(
                0.1, min(channel.rpc_timeout_s, first_join.deadline - time.monotonic())))
        except TeacherError as e:  # gone meanwhile, or full: it stays where it is
            log.info("teacher replica %s looked a better place than %s but did not take the join (%s): staying",
                     better, chosen, e)
            break
        log.info("teacher replica %s is a better place than %s now (joins at the same moment landed together): "
                 "session %s moved there as %s before it started", better, chosen, joined.session_id,
                 moved.session_id)
        link.channel.leave(joined, timeout_s=min(link.channel.rpc_timeout_s, 5.0))
        link.channel, joined, chosen = channel, moved, better
    return joined, chosen


def matched_student_ids(joined: pb.JoinResponse) -> torch.Tensor | None:
    """Cross-tokenizer outputs: the student ids of ProjectedNext's columns, int64 [M] (None otherwise)."""
    if not joined.HasField("alignment"):
        return None
    return wire.decode(joined.alignment.matched_student_ids, what="matched_student_ids", dtypes=wire.ID_DTYPES,
                       max_elements=max(1, joined.alignment.student_vocab_size)).long()


def connect(link: Link, joined: pb.JoinResponse, timeout_s: float) -> Session:
    """The session `joined` names, its group formed and the join-time outputs received (not yet started)."""
    # The session's rendezvous keys, over the client's channel: the token and the session's secret.
    channel = link.channel
    store = RendezvousStore(lambda request, call_timeout_s: channel.call("Rendezvous", request, call_timeout_s, joined),
                            joined.session_id, timeout_s, channel.rpc_timeout_s)
    # The address the teacher reaches this process at, where gloo listens (NCCL finds its own).
    local_host = local_address_towards(joined.data_plane_host)
    group = build_group(store, backend=joined.backend, rank=STUDENT_RANK, device=link.device,
                        timeout_s=timeout_s, gloo_host=local_host)
    try:
        handshake(group, joined.session_secret.encode(), timeout_s)  # each end proves it knows the secret
        joined_data = _receive_join_data(link.outputs, group, timeout_s)
    except BaseException:
        group.abort()
        raise
    session = Session(joined, group, link.outputs, link.channel.address, on_failure=partial(session_failed, link),
                      resolve=link.resolve)
    session.joined_data = joined_data
    return session


def _receive_join_data(outputs: OutputRequest, group, timeout_s: float) -> JoinData:
    """What the kinds asked send once, right after the handshake (the output head), or nothing."""
    layout = outputs.join_layout()
    if not layout:
        return JoinData()
    buffers, works = group.post_receives(layout)
    for work in works:
        group.wait(work, timeout_s, what="receiving the join-time outputs (the teacher's output head)")
    return outputs.join_assemble(group.delivered(buffers))


def send_heartbeats(link: Link) -> None:
    """The heartbeat thread: keeps the current session's lease, and reports the teacher gone."""
    while not link.wait_closed(link.heartbeat_interval_s):
        with link.cond:
            state, session = link.connection.state, link.connection.session
        if state is State.BROKEN:
            return
        if state is not State.CONNECTED:
            continue  # reconnecting: the next session's lease starts at its Join
        try:
            link.channel.call("Heartbeat", pb.HeartbeatRequest(session_id=session.session_id), joined=session.joined)
        except TeacherError as e:
            if link.connection.state is State.CLOSED:
                return
            log.warning("heartbeat failed: %s", e)
            session_failed(link, session, e, heartbeat=True)


def session_failed(link: Link, session: Session, error: TeacherError, heartbeat: bool = False) -> None:
    """A thread of `session` hit `error`: the connection decides whether to join again or fail for good."""
    with link.cond:
        connection = link.connection
        action = (connection.heartbeat_failed if heartbeat else connection.failed)(session, error,
                                                                                   list(link.undelivered))
        link.cond.notify_all()
    if action is Action.IGNORE:
        return
    session.stop()
    if action is Action.REJOIN:
        threading.Thread(target=rejoin, args=(link,), name="rejoin-teacher", daemon=True).start()
    else:
        link.fail_undelivered(connection.error)


def _broke(link: Link) -> None:
    """The connection broke while rejoining: the lost session is gone, every undelivered batch fails."""
    link.connection.session.stop()
    link.fail_undelivered(link.connection.error)


def rejoin(link: Link) -> None:
    """Joins again and sends the new session every undelivered batch, or fails them all.

    Retries with exponential backoff (jittered, capped) for at most reconnect_timeout_s.
    A refusal that retrying would not change (a different model, a wrong token) ends it
    at once.
    """
    with link.cond:
        if not link.connection.start_rejoining():
            return  # closed meanwhile
        lost, cause, deadline = link.connection.session, link.connection.cause, link.connection.deadline
    start = time.monotonic()
    log.warning("lost teacher %s (session %s): %s; joining again for up to %gs (reconnect_timeout_s)",
                link.channel.address, lost.session_id, cause, link.reconnect_timeout_s)
    # A teacher that is still up (it dropped the session, or the network blinked) frees its slot;
    # one that ended the session says why.
    answer = link.channel.leave(lost.joined, timeout_s=min(link.channel.rpc_timeout_s, 5.0))
    if answer is not None:
        with link.cond:
            link.connection.explained(answer)
    lost_at = link.channel.address  # a pool's other replicas are tried first (student_trainer/pool.py)
    attempt = 0
    while True:
        with link.cond:
            go = link.connection.may_attempt()
            broken = link.connection.state is State.BROKEN
        if not go:
            if broken:
                _broke(link)
            return
        attempt += 1
        try:
            session = join_again(link, deadline, lost_at)
        except Exception as e:
            with link.cond:
                pause_s = link.connection.attempt_failed(e)
                broken = link.connection.state is State.BROKEN
            if pause_s is None:
                if broken:
                    _broke(link)
                return
            log.warning("reconnect attempt %d to teacher %s failed, %.1fs after losing it: %s; next in %.1fs",
                        attempt, link.channel.address, time.monotonic() - start, e, pause_s)
            link.wait_closed(pause_s)
            continue
        try:
            resent = install(link, session, lost_since=start, lost=f"session {lost.session_id} on {lost_at}")
        except Exception:
            if link.connection.state is State.CLOSED:
                return  # closed while starting the new session
            raise
        if resent is not None:
            log.info("reconnected to teacher %s as session %s after %.1fs (attempt %d); re-submitted %d batches",
                     link.channel.address, session.session_id, time.monotonic() - start, attempt, resent)
        return


def join_again(link: Link, deadline: float, lost_at: str = "") -> Session:
    """One attempt: Join with the first Join's request (a pool's replica with most room, another
    than the one lost at `lost_at` if one answers), check the teacher serves the same, form the group."""
    pool = link.pool
    if pool is not None and not pool.single:
        address, _ = pool.choose(link.join_request.job_id, link.join_request.job_rank, session_weight(link.join_request),
                                 avoid=lost_at)
        if address != link.channel.address:
            log.warning("joining teacher replica %s (was %s)", address, link.channel.address)
            link.channel = pool.channel(address)
    joined = link.channel.call("Join", link.join_request, timeout_s=max(
        0.1, min(link.channel.rpc_timeout_s, deadline - time.monotonic())))
    try:
        check_same_teacher(link.channel.address, link.info, link.backend, link.output_dtype,
                           link.matched_student_ids, joined)
        # The group forms in about a second; a last attempt gets that much even past the deadline.
        session = connect(link, joined, min(link.join_timeout_s, max(1.0, deadline - time.monotonic())))
        try:
            check_same_join_data(link.joined, session.joined_data)
        except BaseException:
            session.stop()
            raise
        return session
    except BaseException:
        link.channel.leave(joined, timeout_s=min(link.channel.rpc_timeout_s, 5.0))
        raise


def check_same_join_data(before: JoinData, joined_data: JoinData) -> None:
    """A teacher that came back with another output head would change the loss mid-run."""
    head, before = joined_data.head, before.head
    if before is not None and (head is None or not torch.equal(head.weight, before.weight)
                               or (head.bias is None) != (before.bias is None)
                               or (head.bias is not None and not torch.equal(head.bias, before.bias))
                               or head.facts != before.facts):
        raise Incompatible("the teacher came back with another output head: its outputs would not continue "
                           "this run; restart the job against it", grpc.StatusCode.FAILED_PRECONDITION)


def check_same_teacher(address: str, before: TeacherInfo, backend: str, output_dtype: torch.dtype,
                       matched_before: torch.Tensor | None, joined: pb.JoinResponse) -> None:
    """Refuses a teacher whose outputs would not continue the run: `joined` against what the first
    Join granted (`before`, its backend and output dtype, the student ids a projection matched)."""
    info = joined.info
    changed = [f"{name} {getattr(before, name)} -> {getattr(info, name)}"
               for name in ("vocab_size", "hidden_size", "num_layers")
               if getattr(info, name) != getattr(before, name)]
    for name in ("tokenizer_fingerprint", "weights_fingerprint"):  # another replica of a pool, or a new checkpoint
        was, now = getattr(before, name, ""), getattr(info, name)
        if was and now and was != now:
            changed.append(f"{name} {was[:12]} -> {now[:12]}")
    if joined.backend != backend:
        changed.append(f"backend {backend} -> {joined.backend}")
    quantization = Quantization.from_info(info.quantization)
    if quantization != before.quantization:  # another precision is another distribution
        changed.append(f"decoder linears {before.quantization} -> {quantization}")
    if wire.parse_output_dtype(joined.output_dtype) != output_dtype:
        changed.append(f"output dtype {output_dtype} -> {joined.output_dtype}")
    if matched_before is not None:  # a projection onto other columns would be read as this one
        matched = matched_student_ids(joined)
        if matched is None or not torch.equal(matched, matched_before):
            changed.append("the student ids its vocabulary matches")
    if changed:
        raise Incompatible(f"the teacher came back different ({', '.join(changed)}): its outputs would not "
                           "continue this run; restart the job against it", grpc.StatusCode.FAILED_PRECONDITION)
    if info.model_name != before.model_name:
        log.warning("teacher %s came back serving %s (was %s)", address, info.model_name, before.model_name)


def install(link: Link, session: Session, lost_since: float, lost: str) -> int | None:
    """Makes `session` current and sends it every undelivered batch, in submit order. `lost_since`
    (monotonic) and `lost` (which session, where): the session before it, logged with the new
    one's first delivery.

    Returns how many were sent, or None when the client was closed meanwhile.
    """
    with link.submit_lock:  # no submit in between: it would go to the lost session or be sent twice
        with link.cond:
            installed = link.connection.rejoined(session)
            if installed:
                link.recovering = (session, lost_since, lost)
                hopeless = link.connection.not_to_resubmit(link.undelivered)
                failed = [(link.undelivered.pop(batch_id), error) for batch_id, error in hopeless.items()]
                batches = list(link.undelivered.values())
                link.cond.notify_all()  # close() waits for _undelivered to empty
        if not installed:
            session.stop()
            link.channel.leave(session.joined, timeout_s=min(link.channel.rpc_timeout_s, 5.0))
            return None
        link.heartbeat_interval_s = session.joined.heartbeat_interval_s
        if link.transfer_timeout_arg is None:
            link.transfer_timeout_s = session.joined.timeout_s
        link.start(session)
        for batch in batches:
            session.send(batch)
    link.reconnects += 1
    for batch, error in failed:  # taken out of _undelivered above: resolved here, once
        log.error("%s", error)
        batch.future.set_exception(error)
    return len(batches)
