"""The data plane: a process group made for one session, outside both default worlds.

`init_process_group` can be called once per process and `new_group` only splits the
default world, but a student job keeps its own DDP world and the teacher its own
tensor-parallel world. So a session's group is built by hand on the teacher's
TCPStore under a PrefixStore that only the admitted student knows:
``ProcessGroupNCCL(prefix_store, rank, 2, options)`` between GPUs, or
``ProcessGroupGloo(prefix_store, rank, 2, options)`` when either side is on CPU.

What this is not: a general communicator. It carries point-to-point sends from the
teacher (rank 0) to one student (rank 1), in order; tags are only meaningful to gloo.
The difference between the two backends (where tensors live, which stream a receive
runs on, how a transfer is waited for) stays inside `SessionGroup`: callers send,
receive and wait the same way over either.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import logging
import os
import queue
import socket
import threading
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from distill_common.announcements import Announcements

log = logging.getLogger(__name__)

TEACHER_RANK = 0
STUDENT_RANK = 1
GROUP_SIZE = 2


class TransferError(RuntimeError):
    """A send or receive on a session group failed or timed out; the group is unusable."""


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


def local_address_towards(host: str, port: int) -> str:
    """The local IP address this machine uses to reach host:port (no packet is sent)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    except socket.gaierror as e:
        raise ConnectionError(f"cannot resolve teacher host {host!r}: {e}") from e
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(address)
        return probe.getsockname()[0]


def connect_store(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    """A client of the teacher's TCPStore."""
    try:
        return dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                             timeout=datetime.timedelta(seconds=timeout_s))
    except Exception as e:  # torch raises DistStoreError / RuntimeError subclasses
        raise ConnectionError(
            f"cannot reach the teacher's store at {host}:{port} within {timeout_s:.0f}s: {e}. "
            "Is --store-port reachable from this machine?") from e


@dataclass
class SessionGroup:
    """One session's two-rank group: sending, receiving, and waiting on its work with a deadline."""

    backend: str
    rank: int
    pg: object
    device: torch.device
    timeout_s: float
    # The session's announcements over the store connection the group was built on.
    announcements: Announcements | None = None
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


def build_group(store: dist.Store, prefix: str, *, backend: str, rank: int, device: torch.device,
                timeout_s: float, gloo_host: str = "") -> SessionGroup:
    """Builds the session group on `store` under `prefix`; blocks until the peer arrives.

    Group formation waits for the other side at most `timeout_s` (gloo connects in the
    constructor; NCCL connects at the first transfer, which `handshake` makes).
    """
    prefix_store = dist.PrefixStore(f"teacher-session/{prefix}", store)
    timeout = datetime.timedelta(seconds=timeout_s)
    # The group constructors block until the peer arrives and hold the GIL meanwhile: in
    # the teacher that would freeze every other session's RPCs behind a student that
    # joined and never came. So the student says it is here first, and the teacher
    # waits for that on the store (GIL released) before it builds its end.
    if rank == TEACHER_RANK:
        try:
            prefix_store.wait(["student-arrived"], timeout)
        except Exception as e:
            raise TransferError(f"the student did not build its end of the session group within {timeout_s:.0f}s "
                                f"({e})") from e
    else:
        prefix_store.set("student-arrived", "1")
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        # A communicator error or timeout in a session group must clean up that group
        # only: the default (tear down the process) would let one student kill the teacher.
        with _env(TORCH_NCCL_ASYNC_ERROR_HANDLING="2"):
            pg = dist.ProcessGroupNCCL(prefix_store, rank, GROUP_SIZE, options)
    elif backend == "gloo":
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=gloo_host)] if gloo_host else \
            [dist.ProcessGroupGloo.create_default_device()]
        try:
            pg = dist.ProcessGroupGloo(prefix_store, rank, GROUP_SIZE, options)
        except Exception as e:
            raise TransferError(f"session group did not form within {timeout_s:.0f}s: {e}") from e
    else:
        raise ValueError(f"unknown backend {backend!r}; use 'nccl' or 'gloo'")
    return SessionGroup(backend=backend, rank=rank, pg=pg, device=device, timeout_s=timeout_s,
                        announcements=Announcements(store, prefix))


def prefix_token(prefix: str) -> int:
    """The handshake value both sides derive from the secret store prefix."""
    return int(hashlib.sha256(prefix.encode()).hexdigest()[:15], 16)


def handshake(group: SessionGroup, token: int, timeout_s: float) -> None:
    """One small transfer teacher → student that proves the group works end to end.

    It also makes NCCL create its communicator now, off the engine's critical path.
    The student checks the token so a group formed under a wrong prefix fails loudly.
    """
    buffer = torch.tensor([token if group.rank == TEACHER_RANK else -1], dtype=torch.int64,
                          device=group.tensor_device)
    if group.rank == TEACHER_RANK:
        group.wait(group.send(buffer), timeout_s, what="session handshake send")
    else:
        group.wait(group.recv(buffer), timeout_s, what="session handshake receive")
        got = int(buffer.item())
        if got != token:
            raise TransferError(f"session handshake carried {got}, expected {token}: "
                                "the group formed with the wrong peer")
