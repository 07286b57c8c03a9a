"""A session's data plane in a process of its own, which may die alone.

The peer of a session group writes what the communication library's C++ reads: gloo's
rendezvous values (each side's address, whose encoded lengths gloo trusts), the preamble
and length of every message on the pair, NCCL's unique id, its bootstrap messages and the
connection details of its transports. Those bytes go from the socket straight into the
library: no check in Python can stand in front of them, and the libraries' own checks end
the process (a crafted gloo address made it copy past a buffer, SIGSEGV; a 24-byte answer
to a 16-byte receive made gloo throw from its event-loop thread, SIGABRT). A process group
is a trust domain, and the student is outside the teacher's.

So the teacher's end of every session group lives in a child process, the session's
*transport process* (`_worker`). Whatever its peer sends can at worst end that process:
the teacher sees it as a failed transfer of that session (its sends fail at once, with
the process's exit status), ends that session as it ends one whose student died, and
serves every other session without a pause.

What crosses between the teacher and a transport process:
- teacher → process, the teacher's own data (trusted direction): commands pickled by
  torch's ForkingPickler; host tensors as raw bytes on the same pipe, read into buffers
  the process allocates from the shapes it was told; CUDA tensors as IPC handles, whose
  event the process's stream waits on before it reads them (torch's reductions).
- process → teacher: never unpickled, never trusted. JSON messages of at most
  `_MAX_REPORT_BYTES`, each checked for its fields; anything else ends the session.
- the rendezvous: the process builds its group on `PipeStore`, whose every operation is a
  bounded message to the teacher, which runs it on the session's own store
  (rendezvous.SessionStore) with the same key, size and time limits as the student's
  `Rendezvous` calls.

Processes are forked from a server process that imported torch once (multiprocessing's
forkserver, started with the teacher: `start`), so a join does not pay for an interpreter
and torch's import, and no process is ever forked from the teacher itself (its threads and
CUDA context stay its own). A process dies with the teacher (PR_SET_PDEATHSIG, and it exits
when its pipe from the teacher closes).

What this does not cover: a transport process that a peer takes over by exploiting a bug
in the library (code execution, beyond a crash) runs as the teacher's user and, for NCCL,
has the teacher's output tensors mapped (CUDA IPC); docs/security.md says what follows.
"""

from __future__ import annotations

import datetime
import json
import logging
import math
import mmap
import multiprocessing
import multiprocessing.connection
import os
import queue
import signal
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from multiprocessing import reduction
from multiprocessing.reduction import ForkingPickler

from torch.multiprocessing.reductions import init_reductions

from distill_common.session_group import TEACHER_RANK, TransferError, build_group, handshake

log = logging.getLogger(__name__)

_MAX_REPORT_BYTES = 4096  # one message from a transport process: a few fields and a bounded error text
_MAX_KEY_BYTES = 512
_MAX_VALUE_BYTES = 64 << 10  # rendezvous.MAX_BYTES: a whole session's keys fit in it
_MAX_KEYS_PER_OP = 8
_STORE_METHODS = {"set", "get", "wait", "check", "add", "compare_set", "delete_key", "num_keys"}
# A transport process's store wait runs on the session's store in slices of this, so that a
# session ended while its group forms frees the thread at once: a thread still blocked in the
# store's C++ when the interpreter exits aborts the teacher (it retakes the interpreter lock
# in a noexcept destructor: "terminate called without an active exception").
_STORE_WAIT_SLICE_S = 0.1
_STORE_WAIT_MIN_S = 0.002  # what is left of a wait below this ends it: no slice under a millisecond
# die_with_parent first: armed before the seconds torch takes to import.
_PRELOAD = ["teacher_server.die_with_parent", "torch", "torch.distributed", __name__]

_context = multiprocessing.get_context("forkserver")


def start() -> None:
    """Starts the forkserver that transport processes are forked from (torch imported once in
    it), so that the first join does not wait for it. Idempotent."""
    _context.set_forkserver_preload(_PRELOAD)
    from multiprocessing import forkserver
    forkserver.ensure_running()


@dataclass(frozen=True)
class _Spec:
    """What a transport process is told at its start."""

    session_id: str
    backend: str
    device: str
    timeout_s: float  # forming the group and the handshake
    transfer_timeout_s: float  # one send (the teacher ends the session sooner if its own deadline passes)
    gloo_host: str
    secret: bytes
    log_level: int


class _RemoteWork:
    """One send of a transport process: done when the process reports it sent, failed when
    it reports a failure or exits."""

    def __init__(self, seq: int):
        self.seq = seq
        self.done = threading.Event()
        self.error: str | None = None


class IsolatedGroup:
    """Teacher: a session group whose end lives in a transport process; the interface
    teacher_server/delivery.py uses of `SessionGroup` (send, wait, abort).

    Sends are queued to a writer thread, so a transport process that stops reading holds
    up nobody but its own session: the engine's thread only pickles (and, for CUDA tensors,
    records the IPC event on the stream that produced them).
    """

    def __init__(self, store: dist.Store, *, session_id: str, backend: str, device: torch.device,
                 timeout_s: float, transfer_timeout_s: float, gloo_host: str, secret: bytes):
        self.backend = backend
        self.device = device
        self.timeout_s = timeout_s
        self.session_id = session_id
        self._store = store
        self._seq = 0
        self._works: dict[int, _RemoteWork] = {}
        self._lock = threading.Lock()
        self._failure: str | None = None
        self._formed = threading.Event()
        self._closed = False
        self._outbox: queue.Queue = queue.Queue()  # (frames) to write, then None
        ctl_parent, ctl_child = _context.Pipe(duplex=True)
        store_parent, store_child = _context.Pipe(duplex=True)
        spec = _Spec(session_id, backend, str(device), timeout_s, transfer_timeout_s, gloo_host, secret,
                     logging.getLogger().level)
        self._process = _context.Process(target=_worker, args=(ctl_child, store_child, spec),
                                         name=f"transport-{session_id}", daemon=True)
        self._process.start()
        ctl_child.close()
        store_child.close()
        self._ctl, self._store_conn = ctl_parent, store_parent
        self._threads = [threading.Thread(target=target, name=f"{name}-{session_id}", daemon=True)
                         for target, name in ((self._read_reports, "transport-reports"),
                                              (self._serve_store, "transport-store"),
                                              (self._write, "transport-writer"))]
        for thread in self._threads:
            thread.start()

    # ---- the interface Delivery uses ---------------------------------------------------

    @property
    def tensor_device(self) -> torch.device:
        """Where the teacher hands tensors over: NCCL sends device memory (it crosses by CUDA IPC),
        gloo host memory (copied here, so a gloo session's process never creates a CUDA context:
        518 MiB of the GPU each, measured on an H200)."""
        return self.device if self.backend == "nccl" else torch.device("cpu")

    def to_send(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        return [tensor.to(self.tensor_device).contiguous() for tensor in tensors]

    def wait_formed(self, timeout_s: float) -> None:
        """Blocks until the process formed the group and the peer proved the session's secret."""
        if not self._formed.wait(timeout_s) and self._failure is None:
            self._fail(f"the session group did not form within {timeout_s:.0f}s")
        if self._failure is not None:
            raise TransferError(self._failure)

    def send_batch(self, wire_id: int, key: bytes, tensors: list[torch.Tensor]) -> list:
        """Posts a batch's sends (its header, then `tensors`); returns the works to wait on."""
        return self._post(("batch", wire_id, key), tensors)

    def send_all(self, tensors: list[torch.Tensor]) -> list:
        return self._post(("tensors",), tensors)

    def wait(self, work: _RemoteWork, timeout_s: float | None = None, what: str = "transfer") -> None:
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        if not work.done.wait(timeout_s):
            raise TransferError(f"{what} did not complete within {timeout_s:.1f}s")
        if work.error is not None:
            raise TransferError(f"{what} failed: {work.error}")

    def abort(self) -> None:
        """Ends the transport process at once (its peer may be dead or hostile); other sessions are untouched."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._fail("the session was ended")
        while True:  # what was never written is dropped now, not when this object is collected
            try:
                self._outbox.get_nowait()
            except queue.Empty:
                break
        self._outbox.put(None)
        if self._process.is_alive():
            self._process.kill()
        for conn in (self._ctl, self._store_conn):
            conn.close()
        threading.Thread(target=self._process.join, args=(10,), name=f"transport-reap-{self.session_id}",
                         daemon=True).start()

    def join(self, timeout_s: float) -> None:
        """Waits, `timeout_s` at most in all, for the threads of an aborted group to end."""
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    @property
    def pid(self) -> int | None:
        return self._process.pid

    # ---- sends ---------------------------------------------------------------------

    def _post(self, what: tuple, tensors: list[torch.Tensor]) -> list:
        host = [t for t in tensors if t.device.type == "cpu"]
        described, offset = [], 0
        for t in tensors:  # host tensors: their place in the batch's shared memory; CUDA ones travel as IPC handles
            if t.device.type == "cpu":
                described.append((tuple(t.shape), t.dtype, None, offset))
                offset += _aligned(t.numel() * t.element_size())
            else:
                described.append((tuple(t.shape), t.dtype, t, 0))
        with self._lock:
            self._seq += 1
            work = self._works[self._seq] = _RemoteWork(self._seq)
            failure = self._failure
        if failure is not None:
            work.error = failure
            work.done.set()
            return [work]
        # Pickled here, on the caller's thread and stream: a CUDA tensor's IPC event is
        # recorded on the stream that produced it, and the process's stream waits for it.
        command = bytes(ForkingPickler.dumps(("send", work.seq, what, described, offset)))
        self._outbox.put((command, host, offset))
        return [work]

    def _write(self) -> None:
        """Hands each batch over: its host tensors copied into a memory file of its own (one copy;
        the process sends from it with no other), then the command and the file's descriptor."""
        while True:
            item = self._outbox.get()
            if item is None:
                return
            command, host, nbytes = item
            try:
                fd = _memory_file(host, nbytes) if nbytes else -1
                try:
                    self._ctl.send_bytes(command)
                    if fd >= 0:
                        reduction.send_handle(self._ctl, fd, self._process.pid)
                finally:
                    if fd >= 0:
                        os.close(fd)
            except (OSError, ValueError) as e:  # the process is gone or the pipe closed
                self._fail(f"the session's transport process stopped reading ({e})")
                return

    # ---- reports -------------------------------------------------------------------

    def _read_reports(self) -> None:
        """Reads what the process says; anything malformed ends the session."""
        try:
            while True:
                report = json.loads(self._ctl.recv_bytes(_MAX_REPORT_BYTES))
                if not isinstance(report, dict) or not isinstance(report.get("op"), str):
                    raise ValueError("a report that is not an object with an 'op'")
                op = report["op"]
                if op == "formed":
                    self._formed.set()
                elif op == "sent":
                    seq = report.get("seq")
                    with self._lock:
                        work = self._works.pop(seq, None) if isinstance(seq, int) else None
                    if work is None:
                        raise ValueError(f"a report of send {seq!r}, which is not in flight")
                    work.done.set()
                elif op == "failed":
                    self._fail(str(report.get("message", ""))[:2000])
                    return
                else:
                    raise ValueError(f"an unknown report {op!r}")
        except (EOFError, OSError) as e:
            self._fail(self._exit_reason(e))
        except (ValueError, UnicodeDecodeError) as e:  # json's errors are ValueErrors
            self._fail(f"the session's transport process sent a malformed report ({e})")
            self.abort()

    def _exit_reason(self, error: BaseException) -> str:
        if self._closed:
            return "the session was ended"
        self._process.join(2)
        code = self._process.exitcode
        if code is None:
            return f"the session's transport process closed its pipe ({error})"
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            return f"the session's transport process was ended by {name} (its peer may have sent what the " \
                   "communication library cannot take); the teacher and other sessions go on"
        return f"the session's transport process exited with status {code}"

    def _fail(self, reason: str) -> None:
        """Fails every send in flight and every later one with `reason` (the first reason wins)."""
        with self._lock:
            if self._failure is None:
                self._failure = reason
            works, self._works = list(self._works.values()), {}
        for work in works:
            work.error = self._failure
            work.done.set()
        self._formed.set()  # a formation waiting learns it failed

    # ---- the rendezvous ---------------------------------------------------------------

    def _serve_store(self) -> None:
        """Runs the process's store operations on the session's store, each checked and bounded."""
        try:
            while True:
                request = json.loads(self._store_conn.recv_bytes(_MAX_REPORT_BYTES))
                values = [self._store_conn.recv_bytes(_MAX_VALUE_BYTES) for _ in range(_value_count(request))]
                try:
                    reply, value = _run_store_op(self._store, request, values, self.timeout_s,
                                                 ended=lambda: self._closed or self._failure is not None)
                except (ValueError, RuntimeError) as e:  # DistStoreError is a RuntimeError
                    reply, value = {"ok": False, "error": str(e)[:1000]}, None
                self._store_conn.send_bytes(json.dumps(reply).encode())
                if value is not None:
                    self._store_conn.send_bytes(value)
        except EOFError:
            return  # the process ended; its reports say why
        except (OSError, ValueError, UnicodeDecodeError, TypeError) as e:  # OSError: a message over its bound
            if not self._closed:
                self._fail(f"the session's transport process sent a malformed store request ({e})")
                self.abort()


def _value_count(request) -> int:
    if not isinstance(request, dict) or request.get("m") not in _STORE_METHODS:
        raise ValueError("not a store request")
    return {"set": 1, "compare_set": 2}.get(request["m"], 0)


def _run_store_op(store: dist.Store, request: dict, values: list[bytes], max_timeout_s: float,
                  ended=lambda: False):
    keys = request.get("k")
    if (not isinstance(keys, list) or len(keys) > _MAX_KEYS_PER_OP
            or not all(isinstance(k, str) and 0 < len(k.encode()) <= _MAX_KEY_BYTES for k in keys)):
        raise ValueError(f"store keys must be 1 to {_MAX_KEYS_PER_OP} strings of at most {_MAX_KEY_BYTES} bytes")
    method = request["m"]
    if method != "num_keys" and not keys:
        raise ValueError(f"store {method} needs keys")
    timeout_s = request.get("t", max_timeout_s)
    if not isinstance(timeout_s, (int, float)) or not 0 <= timeout_s:
        raise ValueError("a store timeout must be a number of seconds")
    timeout_s = min(float(timeout_s), max_timeout_s)
    if method == "set":
        store.set(keys[0], values[0])
        return {"ok": True}, None
    if method == "get":
        _wait_keys(store, keys[:1], timeout_s, ended)
        return {"ok": True}, store.get(keys[0])
    if method == "wait":
        _wait_keys(store, keys, timeout_s, ended)
        return {"ok": True}, None
    if method == "check":
        return {"ok": True, "found": store.check(keys)}, None
    if method == "add":
        amount = request.get("n")
        if not isinstance(amount, int) or isinstance(amount, bool) or abs(amount) >= 1 << 62:
            raise ValueError("store add needs an integer amount")
        return {"ok": True, "n": store.add(keys[0], amount)}, None
    if method == "compare_set":
        return {"ok": True}, store.compare_set(keys[0], values[0], values[1])
    if method == "delete_key":
        return {"ok": True, "found": store.delete_key(keys[0])}, None
    return {"ok": True, "n": store.num_keys()}, None


def _wait_keys(store: dist.Store, keys: list[str], timeout_s: float, ended) -> None:
    """Waits until `keys` are set, `timeout_s` at most, in slices of _STORE_WAIT_SLICE_S
    between which `ended()` is asked. No slice is under a millisecond: c10d counts a wait's
    timeout in whole milliseconds, and 0 is no timeout at all."""
    deadline = time.monotonic() + timeout_s
    while not store.check(keys):
        remaining = deadline - time.monotonic()
        if remaining < _STORE_WAIT_MIN_S:
            raise dist.DistStoreError(f"not set within {timeout_s:.0f}s")
        if ended():
            raise dist.DistStoreError("the session was ended")
        try:
            store.wait(keys, datetime.timedelta(seconds=min(remaining, _STORE_WAIT_SLICE_S)))
        except dist.DistStoreError:  # this slice's timeout
            pass


# ---- the transport process ---------------------------------------------------------------


class PipeStore(dist.Store):
    """Transport process: the session's store, each operation one message to the teacher.

    Called from the group constructor's C++ threads; C++ keeps only a pointer, so the
    process keeps this object (and its clones) alive for the group's life.
    """

    def __init__(self, conn: multiprocessing.connection.Connection, timeout_s: float,
                 lock: threading.Lock | None = None):
        super().__init__()
        self._conn = conn
        self._lock = lock or threading.Lock()
        self._clones: list[PipeStore] = []
        self.set_timeout(datetime.timedelta(seconds=timeout_s))

    def _do(self, method: str, keys: list[str], *values: bytes, **fields):
        with self._lock:
            self._conn.send_bytes(json.dumps({"m": method, "k": list(keys), **fields}).encode())
            for value in values:
                self._conn.send_bytes(value)
            reply = json.loads(self._conn.recv_bytes())
            value = self._conn.recv_bytes() if reply.get("ok") and method in ("get", "compare_set") else None
        if not reply.get("ok"):
            raise dist.DistStoreError(f"session store {method} {keys}: {reply.get('error')}")
        return reply, value

    def _timeout_s(self, timeout) -> float:
        return (timeout or self.timeout).total_seconds()

    def set(self, key, value) -> None:
        self._do("set", [key], _bytes(value))

    def get(self, key) -> bytes:
        return self._do("get", [key], t=self._timeout_s(None))[1]

    def wait(self, keys, timeout=None) -> None:
        self._do("wait", list(keys), t=self._timeout_s(timeout))

    def check(self, keys) -> bool:
        return self._do("check", list(keys))[0]["found"]

    def add(self, key, amount) -> int:
        return self._do("add", [key], n=int(amount))[0]["n"]

    def compare_set(self, key, expected, desired) -> bytes:
        return self._do("compare_set", [key], _bytes(expected), _bytes(desired))[1]

    def delete_key(self, key) -> bool:
        return self._do("delete_key", [key])[0]["found"]

    def num_keys(self) -> int:
        return self._do("num_keys", [])[0]["n"]

    def clone(self) -> "PipeStore":
        clone = PipeStore(self._conn, self.timeout.total_seconds(), self._lock)
        self._clones.append(clone)
        return clone


def _bytes(value) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def _worker(ctl, store_conn, spec: _Spec) -> None:
    """The transport process: forms the group, proves the peer, then sends what the teacher hands over."""
    # Imported here, never in the teacher: the module arms where it is imported, and a teacher armed
    # would be killed when the thread that started it ends (the kernel ties the signal to the
    # parent thread). A fork clears the setting: armed again in each transport process.
    from teacher_server import die_with_parent

    die_with_parent.arm()
    logging.basicConfig(level=spec.log_level, format=f"%(asctime)s transport[{spec.session_id}] %(levelname)s "
                                                     "%(message)s")
    init_reductions()
    device = torch.device(spec.device)
    if spec.backend == "nccl":  # a gloo session's process never touches the GPU
        torch.cuda.set_device(device)

    def report(**fields) -> None:
        ctl.send_bytes(json.dumps(fields).encode())

    group = None
    try:
        store = PipeStore(store_conn, spec.timeout_s)
        group = build_group(store, backend=spec.backend, rank=TEACHER_RANK, device=device,
                            timeout_s=spec.timeout_s, gloo_host=spec.gloo_host)
        handshake(group, spec.secret, spec.timeout_s)
        report(op="formed")
        in_flight: queue.Queue = queue.Queue()
        waiter = threading.Thread(target=_wait_in_order, args=(group, in_flight, report, spec.transfer_timeout_s),
                                  daemon=True)
        waiter.start()
        while True:
            command = ForkingPickler.loads(ctl.recv_bytes())  # the teacher's own pickle
            if command[0] != "send":
                break
            _, seq, what, described, nbytes = command
            memory = _map_memory_file(reduction.recv_handle(ctl), nbytes) if nbytes else None
            tensors = [_view(memory, offset, shape, dtype) if tensor is None else tensor
                       for shape, dtype, tensor, offset in described]
            if what[0] == "batch":
                works = group.send_all([group.header(what[1], what[2]), *tensors])
            else:
                works = group.send_all(tensors)
            in_flight.put((seq, works, (tensors, memory)))
    except (EOFError, OSError):
        pass  # the teacher closed the pipe: the session ended
    except BaseException as e:
        try:
            report(op="failed", message=f"{type(e).__name__}: {e}"[:2000])
        except (OSError, ValueError):
            pass
    finally:
        if group is not None:
            group.abort()
        os._exit(0)  # no interpreter teardown: a group's destructor may wait for its peer


_ALIGN_BYTES = 64


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN_BYTES) * _ALIGN_BYTES


def _memory_file(tensors: list[torch.Tensor], nbytes: int) -> int:
    """A memory file (memfd: no /dev/shm needed, counted as the teacher's memory) holding `tensors`
    at `_aligned` offsets; returns its descriptor."""
    fd = os.memfd_create("teacher-outputs", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes)
        with mmap.mmap(fd, nbytes) as memory:
            flat = torch.frombuffer(memory, dtype=torch.uint8, count=nbytes)
            offset = 0
            for tensor in tensors:
                size = tensor.numel() * tensor.element_size()
                if size:
                    flat[offset:offset + size].copy_(tensor.reshape(-1).view(torch.uint8))
                offset += _aligned(size)
            del flat  # the map closes only once no tensor points into it
    except BaseException:
        os.close(fd)
        raise
    return fd


def _map_memory_file(fd: int, nbytes: int) -> mmap.mmap:
    try:
        return mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)  # the map keeps the memory


def _view(memory: mmap.mmap, offset: int, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    count = math.prod(shape)
    if not count:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(memory, dtype=dtype, count=count, offset=offset).view(shape)


def _wait_in_order(group, in_flight: queue.Queue, report, timeout_s: float) -> None:
    while True:
        seq, works, held = in_flight.get()
        try:
            for work in works:
                group.wait(work, timeout_s, what="a send")
        except BaseException as e:
            report(op="failed", message=f"{e}"[:2000])
            os._exit(1)
        del held  # sent: the memory file's map (or the CUDA IPC mappings) is released
        report(op="sent", seq=seq)

