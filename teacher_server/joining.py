"""The Join's checks, and the cross-tokenizer plumbing a session sets up at its Join.

A Join is checked here before the engine admits it: the names it carries, its job
against the caller's token, the outputs it asks for (resolved against the teacher's
facts, bounded by --max-output-bytes), the student's torch/NCCL/GPU against the
teacher's (which picks the session's backend), its in-flight bound and weight. A
cross-tokenizer session sends its vocabulary, matched here with the teacher's
tokenizer (read once, at the first such Join), and each of its batches is re-tokenized
here into the teacher's tokens (distill_common/alignment.py). The session's own
rendezvous store (distill_common/rendezvous.py) is made with it.

Cheap checks come first: a Join is checked in full (`checked`: its sizes, counts and
limits, and by the service the session caps) before its vocabulary is matched, and a
batch's rows are checked before any is re-tokenized. The work that remains, matching a
vocabulary and re-tokenizing a batch, is CPU time a caller spends of the teacher: it runs
in `ChargedWork`'s threads, charged to the caller's job, so that it does not stop the
event loop and one job's work waits behind its own, not in front of another job's.
"""

from __future__ import annotations

import asyncio
import math
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from distill_common.alignment import (AlignmentError, BatchTooLarge, StudentVocabulary, TeacherTokenizer,
                                      VocabularyMatch, align_batch)
from distill_common.outputs import (ALIGNMENT, CrossTokenizerKind, OutputRequest, OutputSpecError, TeacherFacts,
                                    VocabularyMismatch)
from distill_common.proto.teacher.v1 import teacher_pb2 as pb
from distill_common.rendezvous import SessionStore
from distill_common.session_group import device_uuid
from distill_common.wire import batch_key
from teacher_server.config import ServerConfig
from teacher_server.edge import Caller
from teacher_server.errors import FailedPrecondition, InvalidArgument, PermissionDenied, ResourceExhausted
from teacher_server.model_runner import ModelRunner
from teacher_server.sessions import Batch, Session, SessionAlignment


# What the charged work may run at once: one piece per job, and this many, all jobs together. The
# work holds the interpreter lock most of its time, so more threads would not run it faster; the
# bound also bounds the memory it holds (a vocabulary of --max-student-vocab entries and its match,
# a batch of --max-batch-tokens tokens, per piece).
CHARGED_WORKERS = 4


class ChargedWork:
    """CPU work a request costs the teacher past its checks, run in threads and charged to a job.

    One job's pieces run one at a time, in the order they came: a job that sends many waits
    behind itself, and another job's piece waits for at most one piece of each other job (and
    a free worker, CHARGED_WORKERS of them). A piece whose caller went away still holds its
    job's turn until its thread finishes, so cancelling calls buys no more threads.
    """

    def __init__(self, workers: int = CHARGED_WORKERS):
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="charged-work")
        self._turns: dict[str, _Turn] = {}  # by job id, while a piece of the job runs or waits

    async def run(self, job_id: str, work, *args):
        """`work(*args)` in a worker thread, once the job's earlier pieces are done; its result or error."""
        loop = asyncio.get_running_loop()
        turn = self._turns.get(job_id)
        if turn is None:
            turn = self._turns[job_id] = _Turn()
        turn.users += 1
        try:
            await turn.lock.acquire()
        except BaseException:
            self._leave(job_id, turn)
            raise
        try:
            future = self._pool.submit(work, *args)
        except BaseException:
            self._done(job_id, turn)
            raise
        future.add_done_callback(lambda _: _call_soon(loop, self._done, job_id, turn))
        try:
            return await asyncio.wrap_future(future, loop=loop)
        finally:
            # A refusal's traceback holds this frame, which would hold the future, which holds the
            # refusal: a cycle that keeps the piece's memory (a vocabulary and its match) until a full
            # garbage collection, hundreds of MiB under a flood of refused Joins.
            del future

    def waiting(self, job_id: str) -> int:
        """Pieces of the job running or waiting for their turn."""
        turn = self._turns.get(job_id)
        return turn.users if turn is not None else 0

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _done(self, job_id: str, turn: "_Turn") -> None:
        turn.lock.release()
        self._leave(job_id, turn)

    def _leave(self, job_id: str, turn: "_Turn") -> None:
        turn.users -= 1
        if not turn.users and self._turns.get(job_id) is turn:
            del self._turns[job_id]


class _Turn:
    """One job's place in ChargedWork: its lock (held while a piece of it runs), and its pieces
    running or waiting."""

    def __init__(self):
        self.lock = asyncio.Lock()
        self.users = 0


def _call_soon(loop: asyncio.AbstractEventLoop, callback, *args) -> None:
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:  # the loop closed: the server is gone, and the work's caller with it
        pass


@dataclass
class CheckedJoin:
    """A Join that passed every check made without matching its vocabulary (`Joining.checked`)."""

    request: pb.JoinRequest
    job_id: str
    outputs: OutputRequest  # resolved; not yet aligned with the student's vocabulary
    backend: str
    max_inflight: int
    weight: float


class Joining:
    """Turns a JoinRequest into a Session, checked (`checked`, then `session`); re-tokenizes a
    cross-tokenizer session's batches (`retokenized`)."""

    def __init__(self, runner: ModelRunner, config: ServerConfig, facts: TeacherFacts):
        self.runner = runner
        self.config = config
        self.info = runner.info
        self.teacher_uuid = device_uuid(self.info.device)
        self.facts = facts  # what a session's outputs are checked against
        self.work = ChargedWork()  # vocabularies matched and batches re-tokenized, charged to their job
        self._teacher_tokens: TeacherTokenizer | None = None  # read at the first cross-tokenizer Join
        self._teacher_tokens_lock = threading.Lock()

    def checked(self, request: pb.JoinRequest, caller: Caller) -> CheckedJoin:
        """Every check of a Join that needs no vocabulary matched: names, the job against the
        caller's token, the outputs (their size for the smallest match a vocabulary can have),
        the peer, the student vocabulary's size, in-flight bound and weight."""
        _check_printable("job_id", request.job_id)
        for name in ("device_type", "device_uuid", "torch_version", "nccl_version"):
            _check_printable(f"peer.{name}", getattr(request.peer, name))
        job_id = request.job_id[:128]
        if caller.job_id is not None and job_id not in ("", caller.job_id):
            raise PermissionDenied(f"this job token may join only as job {caller.job_id!r}, not {job_id!r}: set the "
                                   f"client's job_id to {caller.job_id!r} (or leave it empty), or use that job's token")
        job_id = caller.job_id or job_id or "unnamed"
        try:
            outputs = OutputRequest.resolve(request.outputs, self.facts)
        except OutputSpecError as e:
            raise InvalidArgument(str(e)) from e
        entries = self._check_vocabulary_size(request, outputs)
        # Outputs grow with the match, which has at least one entry: refused now if even that is too much.
        self._check_output_bytes(outputs.aligned(entries, 1) if entries else outputs)
        backend = self._check_peer(request.peer)
        try:
            outputs.check_student(request.vocab_size, request.tokenizer_fingerprint)
        except VocabularyMismatch as e:
            raise FailedPrecondition(str(e)) from e
        max_inflight = request.max_inflight or self.config.max_inflight
        if max_inflight < 0 or max_inflight > self.config.max_inflight:
            raise InvalidArgument(f"max_inflight {request.max_inflight} is outside 1..{self.config.max_inflight} "
                                  "(the teacher's --max-inflight)")
        weight = request.weight or 1.0
        if not weight > 0 or weight != weight or weight == float("inf"):
            raise InvalidArgument(f"weight {request.weight} must be a positive finite number")
        if weight > caller.max_weight:
            raise InvalidArgument(f"weight {weight} exceeds {caller.limit('max_weight')}: ask for less, or raise "
                                  "that limit")
        if request.job_size < 0 or request.job_rank >= request.job_size > 0:
            raise InvalidArgument(f"job_size {request.job_size} must be 0 (unknown) or more than job_rank "
                                  f"{request.job_rank}: the job's ranks over every replica of its pool")
        return CheckedJoin(request, job_id, outputs, backend, max_inflight, weight)

    async def session(self, join: CheckedJoin) -> Session:
        """The session a checked Join asks for; not yet admitted. A cross-tokenizer session's
        vocabulary is matched in `work`, charged to its job."""
        outputs, alignment = join.outputs, None
        if outputs.cross_tokenizer:
            alignment = await self.work.run(join.job_id, self._alignment, join.request, outputs)
            outputs = outputs.aligned(len(alignment.vocabulary), alignment.match.size)
            self._check_output_bytes(outputs)
        request = join.request
        return Session(job_id=join.job_id, job_rank=request.job_rank, job_size=request.job_size, outputs=outputs,
                       backend=join.backend, peer_device_type=request.peer.device_type, max_inflight=join.max_inflight,
                       weight=join.weight, stream_refusals_only=request.stream_refusals_only, alignment=alignment,
                       rendezvous=SessionStore(self.config.join_timeout_s))

    def _check_vocabulary_size(self, request: pb.JoinRequest, outputs: OutputRequest) -> int:
        """A cross-tokenizer Join's vocabulary against its limits, as sizes only: its entries (0
        for a session of the teacher's tokens)."""
        if not outputs.cross_tokenizer:
            if request.HasField("student_vocabulary"):
                raise InvalidArgument("student_vocabulary was sent, but the outputs asked are shaped to the teacher's "
                                      "tokens: leave it out, or ask for cross_tokenizer outputs")
            return 0
        if not request.HasField("student_vocabulary"):
            raise InvalidArgument("cross_tokenizer outputs need the student's vocabulary: send "
                                  "JoinRequest.student_vocabulary (the bytes each id stands for)")
        try:
            StudentVocabulary.check_size(request.student_vocabulary, self.config.student_vocab_limit)
        except AlignmentError as e:
            raise InvalidArgument(str(e)) from e
        return len(request.student_vocabulary.token_lengths)

    def _alignment(self, request: pb.JoinRequest, outputs: OutputRequest) -> SessionAlignment:
        """A cross-tokenizer session's vocabulary, checked, and its match with the teacher's (in a worker thread)."""
        try:
            vocabulary = StudentVocabulary.from_proto(request.student_vocabulary, self.config.student_vocab_limit)
        except AlignmentError as e:
            raise InvalidArgument(str(e)) from e
        teacher = self._teacher_tokenizer()
        by_prefix = any(getattr(kind, "by_prefix", False) for kind in outputs)
        match = VocabularyMatch.build(vocabulary.pieces, teacher.pieces, by_prefix=by_prefix)
        if not match.size:
            raise FailedPrecondition("no piece of the student's vocabulary is spelled by any of the teacher's: "
                                     "is student_vocabulary the bytes each id stands for?")
        return SessionAlignment(vocabulary, match)

    def _teacher_tokenizer(self) -> TeacherTokenizer:
        """The teacher's tokenizer, read once, at the first cross-tokenizer Join (from any worker thread)."""
        with self._teacher_tokens_lock:
            return self._read_teacher_tokenizer()

    def _read_teacher_tokenizer(self) -> TeacherTokenizer:
        if self._teacher_tokens is None:
            tokenizer = getattr(self.runner, "tokenizer", None)
            if tokenizer is None:
                raise FailedPrecondition("this teacher has no tokenizer (its --model is no directory with one), so it "
                                         "cannot re-tokenize a student's text: serve a model directory with its "
                                         "tokenizer, or distil with the teacher's tokenizer")
            try:
                self._teacher_tokens = TeacherTokenizer(tokenizer)
            except AlignmentError as e:
                raise FailedPrecondition(f"the teacher's tokenizer cannot be aligned by bytes: {e}") from e
        return self._teacher_tokens

    def _check_output_bytes(self, outputs: OutputRequest) -> None:
        """Refuses outputs larger than --max-output-bytes for the largest batch the session may send
        (`ServerConfig.largest_batches`: the longest sequences, and the most tokens).

        The tensors derived for a batch are held in teacher memory until the student has them;
        what the kinds send once at join (the output head, in the session's dtype) is held while
        it is sent, so it counts too.
        """
        once = sum(math.prod(spec.shape) * spec.dtype.itemsize for spec in outputs.join_layout())
        need, rows, seq = max((once + sum(math.prod(spec.shape) * spec.dtype.itemsize
                                          for spec in outputs.layout(rows, seq)), rows, seq)
                              for rows, seq in self.config.largest_batches())
        limit = self.config.output_bytes_limit(self.facts)
        if need > limit:
            default = "" if self.config.max_output_bytes else (
                ", by default what full logits, top-k, every hidden state and the log-probabilities take in float32")
            at_join = f" ({_mib(once)} of it sent once at join: the output head)" if once else ""
            raise FailedPrecondition(
                f"the outputs asked ({outputs}) take {_mib(need)}{at_join} for a batch of {rows} x {seq} tokens (the "
                f"largest --max-batch-tokens and --max-seq-len allow), more than the teacher's --max-output-bytes, "
                f"{_mib(limit)}{default}: ask for less (top-k instead of logits, fewer hidden layers, a smaller "
                "logit subset, a smaller dtype), or start the teacher with a larger --max-output-bytes")

    def _check_peer(self, peer: pb.PeerInfo) -> str:
        if peer.device_type not in ("cpu", "cuda"):
            raise InvalidArgument(f"peer.device_type {peer.device_type!r} must be 'cpu' or 'cuda'")
        teacher_major = torch.__version__.split(".")[0]
        if peer.torch_version.split(".")[0] != teacher_major:
            raise FailedPrecondition(f"student torch {peer.torch_version or '(unknown)'} cannot talk to the teacher's "
                                     f"torch {torch.__version__}: use torch {teacher_major}.x on the student")
        if not (peer.device_type == "cuda" and self.info.device.type == "cuda"):
            return "gloo"
        if peer.device_uuid and peer.device_uuid == self.teacher_uuid:
            raise FailedPrecondition(
                f"the student's GPU ({peer.device_uuid}) is the one the teacher uses: NCCL cannot put two ranks of "
                "one communicator on one GPU. Run the student on another GPU (CUDA_VISIBLE_DEVICES)")
        if peer.nccl_version.split(".")[:2] != self.info.nccl_version.split(".")[:2]:
            raise FailedPrecondition(
                f"the student's NCCL {peer.nccl_version or '(none)'} differs from the teacher's "
                f"{self.info.nccl_version}: install the same torch/NCCL build on both sides")
        return "nccl"

    async def retokenized(self, batch: Batch, session: Session) -> Batch:
        """A cross-tokenizer session's batch as the teacher's forward takes it: its rows' text in the
        teacher's tokens, aligned with the student's (distill_common/alignment.py). Re-tokenized in
        `work`, charged to the session's job."""
        return await self.work.run(session.job_id, self._retokenized, batch, session.alignment)

    def _retokenized(self, batch: Batch, alignment: SessionAlignment) -> Batch:
        # Refused as soon as the batch is known to be too large: before any row is encoded when the
        # rows' bytes show it, else after the row that shows it. A batch refused costs at most what
        # one of --max-batch-tokens teacher tokens (and one more row) costs to accept.
        try:
            aligned = align_batch(batch.input_ids, batch.attention_mask, batch.data.pop(CrossTokenizerKind.batch_field),
                                  alignment.vocabulary, self._teacher_tokenizer(), alignment.match,
                                  max_teacher_tokens=self.config.max_seq_len,
                                  max_batch_tokens=self.config.max_batch_tokens)
        except BatchTooLarge as e:
            raise ResourceExhausted(f"batch {batch.batch_id}: {e}") from e
        except AlignmentError as e:
            raise InvalidArgument(f"batch {batch.batch_id}: {e}") from e
        return Batch(batch_id=batch.batch_id, input_ids=aligned.teacher_ids, attention_mask=aligned.teacher_mask,
                     data={ALIGNMENT: aligned}, student_shape=(batch.rows, batch.seq_len),
                     student_key=batch_key(batch.input_ids, batch.attention_mask))


def _check_printable(name: str, value: str) -> None:
    """Refuses a client's string with control characters: it goes into log lines and status,
    where a newline would forge a line of its own."""
    bad = next((c for c in value if not c.isprintable()), None)
    if bad is not None:
        raise InvalidArgument(f"{name} contains the control character {bad!r}: use printable characters only")


def _mib(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):.1f} MiB ({nbytes} bytes)"
