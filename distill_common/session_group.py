"""The data plane: a process group made for one session, outside both default worlds.

`init_process_group` can be called once per process and `new_group` only splits the
default world, but a student job keeps its own DDP world and the teacher its own
tensor-parallel world. So a session's group is built by hand on the session's own
rendezvous store (distill_common/rendezvous.py: in the teacher's process, reached by the
student only over the authenticated gRPC channel): ``ProcessGroupNCCL(store, rank, 2,
options)`` between GPUs, or ``ProcessGroupGloo(store, rank, 2, options)`` when either
side is on CPU.

What this is not: a general communicator. It carries point-to-point sends from the
teacher (rank 0) to one student (rank 1), in order; tags are only meaningful to gloo.
The difference between the two backends (where tensors live, which stream a receive
runs on, how a transfer is waited for) stays inside `SessionGroup`: callers send,
receive and wait the same way over either.

Every batch's outputs are preceded by a *header* (`header`, `check_header`): the batch's
id on the session's wire and 16 bytes of the BLAKE2b digest of its token ids and mask
(distill_common/wire.py: batch_key). The student checks both against what it sent for
that id before it uses the outputs, so buffers that got out of step with the batches
(a receive skipped, a send lost or reordered) are an error, never another batch's
outputs. One send of 24 bytes per batch, posted on the same stream right before the
outputs.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import hmac
import logging
import os
import queue
import socket
import threading
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

TEACHER_RANK = 0
STUDENT_RANK = 1
GROUP_SIZE = 2


# A batch's header: its wire id, then 16 bytes of its batch key as two int64.
HEADER_LAYOUT = ((3,), torch.int64)


class TransferError(RuntimeError):
    """A send or receive on a session group failed or timed out; the group is unusable."""


class HeaderMismatch(TransferError):
    """A batch's header names another batch than the one its receives were posted for:
    the data plane is out of step with the batches (nothing received is used)."""


@contextlib.contextmanager
def _env(**values: str):
    """Sets environment variables for the duration (read by the NCCL group's constructor)."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old


def nccl_version() -> str:
    if not torch.cuda.is_available():
        return ""
    try:
        version = torch.cuda.nccl.version()
    except Exception:  # a CUDA build without NCCL
        return ""
    return ".".join(str(part) for part in version) if isinstance(version, tuple) else str(version)


def device_uuid(device: torch.device) -> str:
    if device.type != "cuda":
        return ""
    return str(torch.cuda.get_device_properties(device).uuid)


def local_address_towards(host: str) -> str:
    """The local IP address this machine uses to reach `host` (no packet is sent)."""
    try:
        infos = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)  # any port: only the route matters
    except socket.gaierror as e:
        raise ConnectionError(f"cannot resolve teacher host {host!r}: {e}") from e
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(address)
        return probe.getsockname()[0]


def header_words(wire_id: int, key: bytes) -> list[int]:
    """The header of the batch `wire_id` whose batch key is `key`, as HEADER_LAYOUT's int64 words."""
    return [wire_id, int.from_bytes(key[:8], "little", signed=True), int.from_bytes(key[8:16], "little", signed=True)]


@dataclass
class SessionGroup:
    """One session's two-rank group: sending, receiving, and waiting on its work with a deadline."""

    backend: str
    rank: int
    pg: object
    device: torch.device
    timeout_s: float
    # What the group was built on. A store implemented in Python (the student's
    # RendezvousStore) must outlive the group: C++ holds no reference to the Python object.
    store: object = None
    # NCCL, student: the stream its receives run on (see `post_receives`).
    _receive_stream: object = field(default=None, init=False, repr=False)

    @property
    def peer(self) -> int:
        return STUDENT_RANK if self.rank == TEACHER_RANK else TEACHER_RANK

    @property
    def tensor_device(self) -> torch.device:
        """Where this transport reads and writes tensors: the GPU for NCCL, host memory for gloo."""
        return self.device if self.backend == "nccl" else torch.device("cpu")

    def send(self, tensor: torch.Tensor, tag: int = 0):
        return self.pg.send([tensor], self.peer, tag)

    def recv(self, tensor: torch.Tensor, tag: int = 0):
        return self.pg.recv([tensor], self.peer, tag)

    def to_send(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Teacher: `tensors` where this transport sends them from. gloo reads host memory, so
        outputs on a GPU are copied to the host here; NCCL sends device memory as it is."""
        return [tensor.to(self.tensor_device) for tensor in tensors]

    def send_all(self, tensors: list[torch.Tensor]) -> list:
        """Teacher: posts one send per tensor (from `to_send`), in order; returns their works.

        The transfer reads the tensors asynchronously: keep them alive and unchanged until
        every work completed (`wait`). NCCL's send waits on the current stream at call time:
        post it on the stream that produced the tensors.
        """
        return [self.send(tensor) for tensor in tensors]

    def send_batch(self, wire_id: int, key: bytes, tensors: list[torch.Tensor]) -> list:
        """Teacher: posts a batch's sends, its header (`header`) first; returns their works.
        The same rules as `send_all`: keep `tensors` alive and unchanged until every work completed."""
        header = self.header(wire_id, key)
        works = self.send_all([header, *tensors])
        works.append(_Holds(header))  # the header is read asynchronously too: held with the works
        return works

    def header(self, wire_id: int, key: bytes) -> torch.Tensor:
        """Teacher: the header to send before the outputs of batch `wire_id` (`key`: its batch key).

        On NCCL it is copied to the device on the current stream from pinned memory, without
        waiting: a pageable copy would wait for the forward still running on that stream.
        """
        words = torch.tensor(header_words(wire_id, key), dtype=torch.int64)
        if self.backend == "gloo":
            return words
        return words.pin_memory().to(self.device, non_blocking=True)

    def check_header(self, buffer: torch.Tensor, wire_id: int, key: bytes) -> None:
        """Student: raises HeaderMismatch unless `buffer` (received, its work completed) is the
        header of batch `wire_id` with batch key `key`."""
        if self.backend == "gloo":
            got = buffer.tolist()
        else:  # on the receive stream: the training step's kernels queue on the current one
            with torch.cuda.device(self.device), torch.cuda.stream(self._receive_stream):
                got = buffer.cpu().tolist()
        expected = header_words(wire_id, key)
        if got != expected:
            what = ("another batch's outputs" if got[0] != wire_id
                    else "outputs of other token ids under its batch id")
            raise HeaderMismatch(f"batch {wire_id}'s receives got {what} (header: batch {got[0]}, digest "
                                 f"{_digest_hex(got)}; expected digest {_digest_hex(expected)}): the data plane is "
                                 "out of step with the batches; nothing of it was used")

    def post_receives(self, layout) -> tuple[list[torch.Tensor], list]:
        """Student: one buffer per (shape, dtype) of `layout`, its receive posted, in order.

        Returns the buffers and the receives' works; once every work completed (`wait`),
        `delivered(buffers)` hands them to the consumer.
        """
        if self.backend == "gloo":  # gloo writes host memory; moved to the device in `delivered`
            buffers = [torch.empty(shape, dtype=dtype) for shape, dtype in layout]
            return buffers, [self.recv(buffer) for buffer in buffers]
        # NCCL makes its stream wait for the current stream when a receive is posted. On our
        # own idle stream the receive starts at once instead of queueing behind the training
        # step's kernels; the buffers are allocated there too, so the allocator never hands
        # NCCL memory that queued kernels of another stream still read.
        if self._receive_stream is None:
            self._receive_stream = torch.cuda.Stream(self.device)
        with torch.cuda.device(self.device), torch.cuda.stream(self._receive_stream):
            buffers = [torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype in layout]
            return buffers, [self.recv(buffer) for buffer in buffers]

    def delivered(self, buffers: list[torch.Tensor]) -> list[torch.Tensor]:
        """Student: received buffers (their works completed) as tensors on this side's device,
        safe to use on its current stream."""
        if self.backend == "gloo":
            return [buffer.to(self.device) for buffer in buffers]
        consumer = torch.cuda.current_stream(self.device)
        for buffer in buffers:  # allocated on the receive stream, freed later by the consumer's
            buffer.record_stream(consumer)
        return buffers

    def wait(self, work, timeout_s: float | None = None, what: str = "transfer") -> None:
        """Waits for `work` at most `timeout_s`; raises TransferError otherwise.

        gloo completes a work only inside wait(), which takes a timeout. NCCL's wait()
        only makes the current stream wait, so the transfer's completion is recorded as
        a CUDA event on a side stream and a waiter thread blocks on that event with the
        GIL released. Polling from Python instead would take the GIL hundreds of times a
        second from the training thread that shares this process.
        """
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        if isinstance(work, _Holds):
            return
        try:
            if self.backend == "gloo":
                work.wait(datetime.timedelta(seconds=timeout_s))
                return
            done = self._cuda_waiter().watch(work)
            if not done.wait(timeout_s):
                raise TransferError(f"{what} did not complete within {timeout_s:.1f}s")
            if done.error is not None:
                raise done.error
        except TransferError:
            raise
        except Exception as e:
            raise TransferError(f"{what} failed: {e}") from e

    def _cuda_waiter(self) -> "_CudaWaiter":
        if getattr(self, "_waiter", None) is None:
            self._waiter = _CudaWaiter(self.device)
        return self._waiter

    def abort(self) -> None:
        """Tears the group down without waiting for the peer (it may be dead)."""
        for method in ("abort", "shutdown"):
            fn = getattr(self.pg, method, None)
            if fn is None:
                continue
            try:
                fn()
                break
            except Exception as e:  # already broken: nothing more to free
                log.debug("session group %s() raised %s", method, e)
        if getattr(self, "_waiter", None) is not None:  # its thread ends once the aborted waits return
            self._waiter.close()


class _Holds:
    """Not a transfer: a tensor kept alive among a batch's works until they are waited for."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


class _Done(threading.Event):
    error: BaseException | None = None


class _CudaWaiter:
    """One thread that blocks, GIL released, on the completion events of a group's works, in order."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device=device)
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="nccl-waiter", daemon=True)
        self._thread.start()

    def watch(self, work) -> _Done:
        done = _Done()
        event = torch.cuda.Event()
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            work.wait()  # the side stream (not the CPU, not the compute stream) waits for the transfer
            event.record(self.stream)
        self._queue.put((event, done))
        return done

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            event, done = item
            try:
                event.synchronize()  # releases the GIL; returns once the transfer finished or was aborted
            except Exception as e:
                done.error = e
            done.set()

    def close(self) -> None:
        self._queue.put(None)


def _digest_hex(words: list[int]) -> str:
    return b"".join(w.to_bytes(8, "little", signed=True) for w in words[1:3]).hex()


def build_group(store: dist.Store, *, backend: str, rank: int, device: torch.device,
                timeout_s: float, gloo_host: str = "") -> SessionGroup:
    """Builds the session group on `store` (the session's own); blocks until the peer arrives.

    Group formation waits for the other side at most `timeout_s` (gloo connects in the
    constructor; NCCL connects at the first transfer, which `handshake` makes).
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    # The teacher builds its end only once the student said, through its rendezvous, that
    # it is here: a student that joined and never came holds no half-built group, and
    # the wait (GIL released) is on the session's own store.
    if rank == TEACHER_RANK:
        try:
            store.wait(["student-arrived"], timeout)
        except Exception as e:
            raise TransferError(f"the student did not build its end of the session group within {timeout_s:.0f}s "
                                f"({e})") from e
    else:
        store.set("student-arrived", "1")
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        # A communicator error or timeout in a session group must clean up that group
        # only: the default (tear down the process) would let one student kill the teacher.
        with _env(TORCH_NCCL_ASYNC_ERROR_HANDLING="2"):
            pg = dist.ProcessGroupNCCL(store, rank, GROUP_SIZE, options)
    elif backend == "gloo":
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=gloo_host)] if gloo_host else \
            [dist.ProcessGroupGloo.create_default_device()]
        try:
            pg = dist.ProcessGroupGloo(store, rank, GROUP_SIZE, options)
        except Exception as e:
            raise TransferError(f"session group did not form within {timeout_s:.0f}s: {e}") from e
    else:
        raise ValueError(f"unknown backend {backend!r}; use 'nccl' or 'gloo'")
    return SessionGroup(backend=backend, rank=rank, pg=pg, device=device, timeout_s=timeout_s, store=store)


def proof(secret: bytes, rank: int) -> list[int]:
    """What the end of rank `rank` sends to show it knows the session's secret: 16 bytes of
    HMAC-SHA256(secret, rank) as two int64 (the secret itself never crosses the data plane)."""
    mac = hmac.new(secret, f"teacher-session-rank-{rank}".encode(), hashlib.sha256).digest()
    return [int.from_bytes(mac[:8], "little", signed=True), int.from_bytes(mac[8:16], "little", signed=True)]


def handshake(group: SessionGroup, secret: bytes, timeout_s: float) -> None:
    """Each end proves over the formed group that it knows the session's secret.

    Teacher → student first: it also makes NCCL create its communicator now, off the
    engine's critical path, and the student learns that the group reached the teacher.
    Then student → teacher: the teacher learns that the peer that formed the group is the
    student that joined (the secret travelled only in that student's Join answer), and
    refuses the session otherwise. Raises TransferError on a wrong proof.
    """
    peer_proof = proof(secret, group.peer)
    mine = torch.tensor(proof(secret, group.rank), dtype=torch.int64, device=group.tensor_device)
    theirs = torch.zeros(2, dtype=torch.int64, device=group.tensor_device)
    if group.rank == TEACHER_RANK:
        group.wait(group.send(mine), timeout_s, what="session handshake send")
        group.wait(group.recv(theirs), timeout_s, what="session handshake receive")
    else:
        group.wait(group.recv(theirs), timeout_s, what="session handshake receive")
        group.wait(group.send(mine), timeout_s, what="session handshake send")
    if theirs.tolist() != peer_proof:
        who = "student" if group.rank == TEACHER_RANK else "teacher"
        raise TransferError(f"the peer that formed the session group did not prove it is the {who} of this session "
                            "(its handshake does not match the session's secret): group refused")
