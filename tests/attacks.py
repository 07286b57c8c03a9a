"""Attacks on a running teacher, and what honest parties see while one runs.

Each attack is a context manager: entering starts it (threads of the test process, an
asyncio loop for the gRPC ones), leaving stops it and closes what it opened; `counts` says
what it did and what the teacher answered. `Observer.watch()` is the honest side's view:
the liveness probe, the operator's GetInfo, a grpc health check on a new connection each
second, and the teacher's memory.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import multiprocessing
import queue
import resource
import socket
import struct
import termios
import threading
import time
from collections import Counter
from pathlib import Path

import grpc
import requests
from grpc_health.v1 import health_pb2, health_pb2_grpc

from distill_common.channel import SESSION_SECRET_KEY
from distill_common.proto.teacher.v1 import teacher_pb2 as pb

# What a HTTP/2 client sends first: the preface and an empty SETTINGS frame.
H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
SERVICE = "/teacher.v1.TeacherService/"


def rss_mib(pid: int) -> float:
    text = Path(f"/proc/{pid}/status").read_text()
    return next(int(line.split()[1]) for line in text.splitlines() if line.startswith("VmRSS:")) / 1024


def descriptors(pid: int) -> int:
    return len(list(Path(f"/proc/{pid}/fd").iterdir()))


def transport_processes(teacher_pid: int) -> int:
    """How many session transport processes (teacher_server/session_process.py) the teacher has:
    the children of its fork server."""
    def children(pid: int) -> list[int]:
        path = Path(f"/proc/{pid}/task/{pid}/children")
        return [int(child) for child in path.read_text().split()] if path.exists() else []

    servers = [child for child in children(teacher_pid)
               if b"forkserver" in Path(f"/proc/{child}/cmdline").read_bytes()]
    return sum(len(children(server)) for server in servers)


def allow_descriptors(count: int) -> None:
    """Raises this process's soft descriptor limit to hold `count` more sockets."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = count + 512
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(want, hard), hard))


def bearer(token: str) -> tuple:
    return (("authorization", f"Bearer {token}"),)


class Attack:
    """Runs `run(stop)` in a thread until the context exits."""

    def __init__(self):
        self.counts: Counter = Counter()
        self.details: dict[str, str] = {}  # by status code: the first message the teacher sent with it
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def run(self, stop: threading.Event) -> None:
        raise NotImplementedError

    def __enter__(self):
        self._thread = threading.Thread(target=self._run, name=type(self).__name__, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            self.run(self._stop)
        except Exception as e:  # the attack's own failure: reported, not hidden
            self.counts[f"attack failed: {e!r}"] += 1

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(30)


class _Sockets(Attack):
    """Keeps `connections` sockets open to a port, each opened with `opening()` bytes, and
    opens a new one for each the teacher closes (at most `per_pass` a pass)."""

    def __init__(self, port: int, connections: int, per_pass: int = 200):
        super().__init__()
        self.port, self.connections, self.per_pass = port, connections, per_pass
        allow_descriptors(connections)

    def opening(self, index: int) -> bytes:
        return b""

    def every_second(self, sock: socket.socket, index: int) -> None:
        """Called once a second for each open socket."""

    def run(self, stop: threading.Event) -> None:
        sockets: dict[int, socket.socket] = {}
        unsent: set[int] = set()  # connecting: the opening bytes not sent yet
        index = 0
        next_tick = time.monotonic() + 1
        try:
            while not stop.is_set():
                opened = 0
                while len(sockets) < self.connections and opened < self.per_pass:
                    sock = socket.socket()
                    sock.setblocking(False)
                    sock.connect_ex(("127.0.0.1", self.port))
                    sockets[index] = sock
                    unsent.add(index)
                    index += 1
                    opened += 1
                    self.counts["opened"] += 1
                tick = time.monotonic() >= next_tick
                if tick:
                    next_tick += 1
                for i, sock in list(sockets.items()):
                    closed = False
                    try:
                        if i in unsent:
                            sock.send(self.opening(i))  # ENOTCONN/EAGAIN while connecting
                            unsent.discard(i)
                            continue
                        data = sock.recv(65536)
                        self.counts["413"] += data.startswith(b"HTTP/1.1 413")
                        closed = data == b""
                    except (BlockingIOError, InterruptedError):
                        if tick and i not in unsent:
                            try:
                                self.every_second(sock, i)
                            except BlockingIOError:
                                pass
                            except OSError:
                                closed = True
                    except OSError as e:
                        closed = not (i in unsent and e.errno in (errno.ENOTCONN, errno.EINPROGRESS, errno.EALREADY))
                    if closed:
                        self.counts["closed by the teacher"] += 1
                        sock.close()
                        del sockets[i]
                        unsent.discard(i)
                stop.wait(0.1)
        finally:
            for sock in sockets.values():
                sock.close()


class SlowBodies(_Sockets):
    """HTTP requests whose body comes a byte a second: half declare a gigabyte, half 1000 bytes
    (under the body cap, so only the request deadline and the connection cap end them)."""

    def opening(self, index: int) -> bytes:
        length = 1_000_000_000 if index % 2 else 1000
        return (b"POST /healthz HTTP/1.1\r\nHost: teacher\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n" % length)

    def every_second(self, sock: socket.socket, index: int) -> None:
        sock.send(b"x")


class IdleConnections(_Sockets):
    """gRPC connections that send the HTTP/2 preface and SETTINGS, then nothing."""

    def opening(self, index: int) -> bytes:
        return H2_PREFACE


def many_headers(count: int) -> bytes:
    """A GET /healthz with `count` empty header lines (12,000: 97 KB, past h11's 16 KiB)."""
    return b"GET /healthz HTTP/1.1\r\nHost: teacher\r\n" + b"".join(b"x%d:\r\n" % i for i in range(count)) + b"\r\n"


class CostlyParses(Attack):
    """`connections` HTTP connections, each sending requests one after another (every answer read)
    that are cheap to send and dear to parse, no token needed: a body of `body_bytes` in chunks of
    one byte (`Transfer-Encoding: chunked`: an event of h11's and of uvicorn's per byte), or
    `headers` empty header lines sent at once (h11's 16 KiB limit counted only the headers of a
    request still incomplete). A new connection for each the teacher closes."""

    def __init__(self, port: int, connections: int, body_bytes: int, headers: int = 12_000):
        super().__init__()
        self.port, self.connections = port, connections
        self.requests = [
            b"POST /healthz HTTP/1.1\r\nHost: teacher\r\nTransfer-Encoding: chunked\r\n\r\n"
            + b"1\r\nx\r\n" * (body_bytes // 6) + b"0\r\n\r\n",
            many_headers(headers)]
        allow_descriptors(connections)

    def run(self, stop: threading.Event) -> None:
        workers = [threading.Thread(target=self._connection, args=(stop, self.requests[i % 2]), daemon=True)
                   for i in range(self.connections)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()

    def _connection(self, stop: threading.Event, request: bytes) -> None:
        while not stop.is_set():
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=5) as sock:
                    while not stop.is_set():
                        sock.sendall(request)
                        answer = sock.recv(4096)
                        if not answer:
                            self.counts["closed by the teacher"] += 1
                            break
                        self.counts[answer[9:12].decode(errors="replace")] += 1
            except OSError:
                self.counts["closed by the teacher"] += 1


class PipelinedUnread(Attack):
    """`connections` HTTP connections that each pipeline `requests` GET /healthz and never read
    an answer, with a small receive buffer so that the teacher's sends block soon; a new one
    for each the teacher closes. `stalled_s`, per connection: how long it stayed open once the
    teacher's answers stopped arriving (its receive queue stopped growing), or once it opened
    if none came; those still open when the attack stops included."""

    REQUEST = b"GET /healthz HTTP/1.1\r\nHost: teacher\r\n\r\n"

    def __init__(self, port: int, connections: int, requests: int = 20_000, receive_buffer_bytes: int = 4096):
        super().__init__()
        self.port, self.connections, self.receive_buffer_bytes = port, connections, receive_buffer_bytes
        self.pipeline = memoryview(self.REQUEST * requests)
        self.stalled_s: list[float] = []
        allow_descriptors(connections)

    def run(self, stop: threading.Event) -> None:
        sockets: dict[socket.socket, _Pipelining] = {}
        try:
            while not stop.is_set():
                while len(sockets) < self.connections:
                    sock = socket.socket()
                    # Set before connecting, so that the window the teacher sees is small from the start.
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self.receive_buffer_bytes)
                    sock.setblocking(False)
                    sock.connect_ex(("127.0.0.1", self.port))
                    sockets[sock] = _Pipelining(time.monotonic())
                    self.counts["opened"] += 1
                for sock, state in list(sockets.items()):
                    tcp_state = _tcp_state(sock)
                    closed = tcp_state not in (_TCP_ESTABLISHED, _TCP_SYN_SENT)
                    if tcp_state == _TCP_ESTABLISHED:
                        state.received(_unread_bytes(sock))
                        if state.sent_bytes < len(self.pipeline):
                            try:
                                sent = sock.send(self.pipeline[state.sent_bytes:])
                                self.counts["requests sent"] += ((state.sent_bytes + sent) // len(self.REQUEST)
                                                                 - state.sent_bytes // len(self.REQUEST))
                                state.sent_bytes += sent
                            except (BlockingIOError, InterruptedError):
                                pass  # the teacher reads no further: its answers wait for us
                            except OSError:
                                closed = True
                    if closed:
                        self.counts["closed by the teacher"] += 1
                        self.stalled_s.append(time.monotonic() - state.last_arrival)
                        sock.close()
                        del sockets[sock]
                stop.wait(0.05)
        finally:
            now = time.monotonic()
            for sock, state in sockets.items():
                self.stalled_s.append(now - state.last_arrival)
                sock.close()


class _Pipelining:
    """One connection of PipelinedUnread: what it sent, and when answers last arrived."""

    def __init__(self, opened: float):
        self.sent_bytes = 0
        self.unread_bytes = 0
        self.last_arrival = opened

    def received(self, unread_bytes: int) -> None:
        if unread_bytes != self.unread_bytes:
            self.unread_bytes, self.last_arrival = unread_bytes, time.monotonic()


# Linux's TCP states (include/net/tcp_states.h), the first byte of TCP_INFO: a connection the
# teacher closed is seen without reading what it sent.
_TCP_ESTABLISHED, _TCP_SYN_SENT = 1, 2


def _tcp_state(sock: socket.socket) -> int:
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0]


def _unread_bytes(sock: socket.socket) -> int:
    return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0" * 4))[0]


class _AsyncAttack(Attack):
    """Runs `attack(stop)` on an asyncio loop of its own."""

    def __init__(self, address: str, token: str):
        super().__init__()
        self.address, self.token = address, token

    async def attack(self, stop: threading.Event) -> None:
        raise NotImplementedError

    def run(self, stop: threading.Event) -> None:
        asyncio.run(self.attack(stop))

    def channel(self, index: int = 0) -> grpc.aio.Channel:
        # A connection of its own (no subchannel shared with the other channels).
        return grpc.aio.insecure_channel(self.address, options=[("grpc.use_local_subchannel_pool", 1),
                                                                ("grpc.attacker_channel", index),
                                                                ("grpc.max_send_message_length", 64 << 20)])

    def note(self, call_or_error) -> None:
        code = call_or_error.code() if isinstance(call_or_error, grpc.RpcError) else call_or_error
        name = getattr(code, "name", str(code))
        self.counts[name] += 1
        if isinstance(call_or_error, grpc.RpcError):
            self.details.setdefault(name, (call_or_error.details() or "")[:200])


class HalfOpenCalls(_AsyncAttack):
    """Heartbeats and submit streams whose request never comes, over `channels` connections, with
    a job token: replaced as soon as the teacher ends one."""

    def __init__(self, address: str, token: str, heartbeats: int = 280, streams: int = 130, channels: int = 9):
        super().__init__(address, token)
        self.heartbeats, self.streams, self.channels = heartbeats, streams, channels

    async def attack(self, stop: threading.Event) -> None:
        channels = [self.channel(i) for i in range(self.channels)]
        calls: list = []

        async def hold(index: int, stream: bool) -> None:
            channel = channels[index % len(channels)]
            while not stop.is_set():
                if stream:
                    call = channel.stream_stream(SERVICE + "SubmitStream")(metadata=bearer(self.token))
                else:
                    call = channel.stream_unary(SERVICE + "Heartbeat")(metadata=bearer(self.token))
                calls.append(call)
                try:
                    code = await call.code()
                    self.note(code)
                    self.details.setdefault(code.name, (await call.details() or "")[:200])
                finally:
                    calls.remove(call)
                await asyncio.sleep(0.05)

        tasks = [asyncio.create_task(hold(i, False)) for i in range(self.heartbeats)]
        tasks += [asyncio.create_task(hold(i, True)) for i in range(self.streams)]
        while not stop.is_set():
            await asyncio.sleep(0.1)
        for call in list(calls):
            call.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for channel in channels:
            await channel.close()


class UnreadRefusals(Attack):
    """Submit streams (a connection each) that write small requests as fast as the teacher takes
    them, each refused (a session id and secret that name nothing), and never read an answer.
    `written` holds how many requests the teacher had taken, sampled every 0.5 s (the teacher once
    took them all and held every refusal it could not send: 700 MB a minute)."""

    def __init__(self, address: str, token: str, streams: int = 4):
        super().__init__()
        self.address, self.token, self.streams = address, token, streams
        self.written: list[int] = []

    def run(self, stop: threading.Event) -> None:
        metadata = bearer(self.token) + ((SESSION_SECRET_KEY, "not-a-secret"),)
        request = pb.SubmitRequest(session_id="no-such-session", batch_id=1).SerializeToString()

        def requests_():
            while not stop.is_set():
                self.counts["requests written"] += 1
                yield request

        # A small receive window that does not grow: the client's gRPC stops taking answers soon, as a
        # client that never reads would on a slow link.
        options = [("grpc.use_local_subchannel_pool", 1), ("grpc.http2.bdp_probe", 0),
                   ("grpc.http2.lookahead_bytes", 16384)]
        channels = [grpc.insecure_channel(self.address, options=options) for _ in range(self.streams)]
        calls = [channel.stream_stream(SERVICE + "SubmitStream")(requests_(), metadata=metadata)
                 for channel in channels]  # their answers never read
        while not stop.is_set():
            time.sleep(0.5)
            self.written.append(self.counts["requests written"])
        for call in calls:
            call.cancel()
        for channel in channels:
            channel.close()


class RendezvousWaits(_AsyncAttack):
    """The attacker's own session (a job token's Join, no group formed): `calls` WAITs at once,
    each naming `keys` keys none of which is set, and as many naming a handful."""

    def __init__(self, address: str, token: str, job_id: str, calls: int = 128, keys: int = 50_000):
        super().__init__(address, token)
        self.job_id, self.calls, self.keys = job_id, calls, keys

    async def attack(self, stop: threading.Event) -> None:
        import torch

        channel = self.channel()
        join = channel.unary_unary(SERVICE + "Join", request_serializer=pb.JoinRequest.SerializeToString,
                                   response_deserializer=pb.JoinResponse.FromString)
        rendezvous = channel.unary_unary(SERVICE + "Rendezvous", request_serializer=None,
                                         response_deserializer=pb.RendezvousResponse.FromString)
        # The keys serialized once (short: as many as a request holds); a message's bytes followed by
        # another's parse as one message with the fields of both.
        many = pb.RendezvousRequest(keys=[f"{k:x}" for k in range(self.keys)]).SerializeToString()
        few = pb.RendezvousRequest(keys=[f"never-set-{k}" for k in range(4)]).SerializeToString()
        joined: list[pb.JoinResponse | None] = [None]
        joining = asyncio.Lock()

        async def session() -> pb.JoinResponse | None:
            async with joining:
                while joined[0] is None and not stop.is_set():
                    peer = pb.PeerInfo(device_type="cpu", torch_version=torch.__version__)
                    try:
                        joined[0] = await join(pb.JoinRequest(job_id=self.job_id, outputs=pb.OutputSpec(logits=True),
                                                              peer=peer), metadata=bearer(self.token), timeout=10)
                        self.counts["joined"] += 1
                    except grpc.RpcError as e:
                        self.note(e)
                        await asyncio.sleep(0.5)
                return joined[0]

        async def wait(index: int) -> None:
            while not stop.is_set():
                current = await session()
                if current is None:
                    return
                keys = many if index % 2 else few
                started = time.monotonic()
                try:
                    await rendezvous(pb.RendezvousRequest(session_id=current.session_id, op=pb.RendezvousRequest.WAIT,
                                                          wait_s=5.0).SerializeToString() + keys,
                                     metadata=bearer(self.token) + ((SESSION_SECRET_KEY, current.session_secret),),
                                     timeout=15)
                    self.note("OK")
                except grpc.RpcError as e:
                    self.note(e)
                    if e.code() == grpc.StatusCode.NOT_FOUND and joined[0] is current:
                        joined[0] = None  # it ended (its group never formed): join again
                if time.monotonic() - started < 0.05:
                    await asyncio.sleep(0.05)

        tasks = [asyncio.create_task(wait(i)) for i in range(self.calls)]
        while not stop.is_set():
            await asyncio.sleep(0.1)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await leave(channel, self.token, [joined[0]] if joined[0] is not None else [])
        await channel.close()


def unmatched_vocabulary(entries: int) -> bytes:
    """A JoinRequest.student_vocabulary of `entries` 4-byte pieces no byte-level teacher spells
    (0xff starts no UTF-8 and no merge), serialized."""
    from distill_common.alignment import StudentVocabulary

    message = pb.StudentVocabulary()
    StudentVocabulary(tuple(b"\xff" + i.to_bytes(3, "big") for i in range(entries))).to_proto(message)
    return message.SerializeToString()


class VocabularyJoins(_AsyncAttack):
    """`calls` cross-tokenizer Joins at once, each with a student vocabulary of `entries` pieces
    that match none of the teacher's, sent again as soon as answered. With `hold_cap`, the job
    keeps its session cap full with plain Joins (never connected; joined again as they expire),
    so that the cross-tokenizer ones are refused for the cap; without, for the empty match."""

    def __init__(self, address: str, token: str, job_id: str, entries: int = 32_000, calls: int = 24,
                 hold_cap: bool = True):
        super().__init__(address, token)
        self.job_id, self.entries, self.calls, self.hold_cap = job_id, entries, calls, hold_cap

    async def attack(self, stop: threading.Event) -> None:
        import torch

        channel = self.channel()
        join = channel.unary_unary(SERVICE + "Join", request_serializer=None, response_deserializer=None)
        peer = pb.PeerInfo(device_type="cpu", torch_version=torch.__version__)
        plain = pb.JoinRequest(job_id=self.job_id, outputs=pb.OutputSpec(logits=True), peer=peer).SerializeToString()
        cross = pb.JoinRequest(job_id=self.job_id, peer=peer, outputs=pb.OutputSpec(
            cross_tokenizer=pb.CrossTokenizerOutputs(span_logprobs=True)))
        # Serialized once: the attacker spends nothing per call but the sending.
        cross = cross.SerializeToString() + _field(pb.JoinRequest, "student_vocabulary",
                                                   unmatched_vocabulary(self.entries))

        held: list[pb.JoinResponse] = []

        async def fill() -> None:
            while not stop.is_set():
                try:
                    held.append(pb.JoinResponse.FromString(await join(plain, metadata=bearer(self.token), timeout=10)))
                    self.counts["held"] += 1
                    continue  # another, until the cap refuses
                except grpc.RpcError as e:
                    if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                        self.note(e)
                await asyncio.sleep(0.2)

        async def send() -> None:
            while not stop.is_set():
                try:
                    await join(cross, metadata=bearer(self.token), timeout=30)
                    self.note("OK")
                except grpc.RpcError as e:
                    self.note(e)

        tasks = [asyncio.create_task(fill())] if self.hold_cap else []
        if self.hold_cap:
            await asyncio.sleep(0.5)  # the cap full before the first cross-tokenizer Join
        tasks += [asyncio.create_task(send()) for _ in range(self.calls)]
        while not stop.is_set():
            await asyncio.sleep(0.1)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await leave(channel, self.token, held)
        await channel.close()


async def leave(channel: grpc.aio.Channel, token: str, sessions: list[pb.JoinResponse]) -> None:
    """Ends the sessions an attack joined (or finds them ended), so that the next attack finds its job's cap free."""
    call = channel.unary_unary(SERVICE + "Leave", request_serializer=pb.LeaveRequest.SerializeToString,
                               response_deserializer=pb.LeaveResponse.FromString)
    for joined in sessions:
        try:
            await call(pb.LeaveRequest(session_id=joined.session_id),
                       metadata=bearer(token) + ((SESSION_SECRET_KEY, joined.session_secret),), timeout=10)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.NOT_FOUND:  # expired already
                raise


def _field(message_class, name: str, serialized: bytes) -> bytes:
    """The wire bytes of one length-delimited field of `message_class` holding `serialized`."""
    number = message_class.DESCRIPTOR.fields_by_name[name].number
    return _varint(number << 3 | 2) + _varint(len(serialized)) + serialized


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


class RefusedCrossBatches(_AsyncAttack):
    """`sessions` cross-tokenizer sessions of the job (joined, never connected: joined again as
    they expire), each streaming batches that the teacher refuses only once it re-tokenized them:
    `rows` rows of one student token spelling `row_bytes` bytes that the teacher's tokenizer
    makes as many tokens, together more than its --max-batch-tokens (each row within
    --max-seq-len, and the rows' bytes alone do not show it: a row must be encoded first)."""

    def __init__(self, address: str, token: str, job_id: str, sessions: int = 3, rows: int = 20,
                 row_bytes: int = 500, byte: bytes = b"z"):
        super().__init__(address, token)
        self.job_id, self.sessions, self.rows, self.row_bytes, self.byte = job_id, sessions, rows, row_bytes, byte

    async def attack(self, stop: threading.Event) -> None:
        import torch

        from distill_common.alignment import StudentVocabulary
        from distill_common.wire import encode

        channel = self.channel()
        join = channel.unary_unary(SERVICE + "Join", request_serializer=pb.JoinRequest.SerializeToString,
                                   response_deserializer=pb.JoinResponse.FromString)
        long_piece = self.byte * self.row_bytes
        request = pb.JoinRequest(job_id=self.job_id, peer=pb.PeerInfo(device_type="cpu",
                                                                      torch_version=torch.__version__),
                                 outputs=pb.OutputSpec(cross_tokenizer=pb.CrossTokenizerOutputs(span_logprobs=True)))
        StudentVocabulary(tuple(bytes([b]) for b in range(256)) + (long_piece,)).to_proto(request.student_vocabulary)
        ids = torch.full((self.rows, 1), 256, dtype=torch.int64)

        def batch(session_id: str, batch_id: int) -> pb.SubmitRequest:
            return pb.SubmitRequest(session_id=session_id, batch_id=batch_id, input_ids=encode(ids),
                                    student_text=pb.RowTexts(rows=[long_piece] * self.rows))

        async def one_session() -> None:
            while not stop.is_set():
                try:
                    joined = await join(request, metadata=bearer(self.token), timeout=30)
                    held.append(joined)
                    self.counts["joined"] += 1
                except grpc.RpcError as e:
                    self.note(e)
                    await asyncio.sleep(0.5)
                    continue
                metadata = bearer(self.token) + ((SESSION_SECRET_KEY, joined.session_secret),)
                answered = asyncio.Queue()

                async def requests():
                    batch_id = 0
                    while not stop.is_set():
                        yield batch(joined.session_id, batch_id).SerializeToString()
                        batch_id += 1
                        await answered.get()  # one batch at a time: the next once this one is answered

                call = channel.stream_stream(SERVICE + "SubmitStream", request_serializer=None,
                                             response_deserializer=pb.SubmitResponse.FromString)(
                    requests(), metadata=metadata)
                try:
                    async for response in call:
                        if response.HasField("events"):
                            continue
                        if response.error_code:
                            code = next((c.name for c in grpc.StatusCode if c.value[0] == response.error_code),
                                        str(response.error_code))
                            self.counts[code] += 1
                            self.details.setdefault(code, response.error_message[:300])
                            if code == "NOT_FOUND":
                                break  # expired: join again
                        else:
                            self.counts["accepted"] += 1
                        answered.put_nowait(None)
                except grpc.RpcError as e:
                    self.note(e)
                finally:
                    call.cancel()

        held: list[pb.JoinResponse] = []
        tasks = [asyncio.create_task(one_session()) for _ in range(self.sessions)]
        while not stop.is_set():
            await asyncio.sleep(0.1)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await leave(channel, self.token, held)
        await channel.close()


class SlowConsumers(Attack):
    """`sessions` real clients (the job token's) that join at `weight`, submit their max_inflight
    batches of `shape` and never post a receive."""

    def __init__(self, address: str, token: str, job_id: str, sessions: int = 2, shape: tuple = (4, 256),
                 weight: float = 1.0):
        super().__init__()
        self.address, self.token, self.job_id, self.sessions, self.shape = address, token, job_id, sessions, shape
        self.weight = weight

    def run(self, stop: threading.Event) -> None:
        import torch

        from student_trainer import TeacherClient
        from student_trainer.session import Session

        def never_receive(session: Session) -> None:  # posts no receive, ever
            while True:
                pending = session._to_receive.get()
                if pending is None or session._stopped:
                    break
            session._posted.put(None)

        original = Session._post_announced
        Session._post_announced = never_receive  # this process's clients from now on
        clients = []
        try:
            for _ in range(self.sessions):
                client = TeacherClient(self.address, "cpu", auth_token=self.token, job_id=self.job_id,
                                       max_inflight=8, join_timeout_s=30, weight=self.weight)
                clients.append(client)
                self.counts["joined"] += 1
                for _ in range(8):
                    client.submit(torch.randint(0, client.info.vocab_size, self.shape))
                    self.counts["submitted"] += 1
            stop.wait()
        finally:
            closing = [threading.Thread(target=client.close, kwargs={"timeout_s": 0.5}, daemon=True)
                       for client in clients]
            for thread in closing:
                thread.start()
            for thread in closing:
                thread.join(20)
            Session._post_announced = original


class HostilePeers(Attack):
    """Students of the attacker's job that send, over their own session's rendezvous and data
    plane, what an honest student never would (tests/hostile_peer.py's modes, in turn, each in
    a session of its own), in a process of their own. `results` holds each mode's outcome."""

    def __init__(self, address: str, token: str, job_id: str, modes: tuple[str, ...] | None = None,
                 repeat: bool = True):
        super().__init__()
        from tests.hostile_peer import MODES

        self.address, self.token, self.job_id = address, token, job_id
        self.modes, self.repeat = tuple(modes or MODES), repeat
        self.results: list[dict] = []

    def run(self, stop: threading.Event) -> None:
        import json
        import subprocess
        import sys

        while not stop.is_set():
            proc = subprocess.Popen([sys.executable, "-m", "tests.hostile_peer", self.address, self.token, self.job_id,
                                     *self.modes], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            try:
                for line in proc.stdout:
                    if line.startswith("RESULT "):
                        result = json.loads(line[len("RESULT "):])
                        self.results.append(result)
                        self.counts[result["mode"]] += 1
                    if stop.is_set():
                        break
            finally:
                if proc.poll() is None:
                    proc.kill()
                proc.wait(10)
            if not self.repeat:
                return


class Observer:
    """The honest side's tools, in a process of their own (as an operator's would be: in the
    test's process they would wait for the interpreter lock behind the attacks' threads),
    started once; `watch()` is one window of watching."""

    def __init__(self, server, operator_token: str, interval_s: float = 0.25):
        context = multiprocessing.get_context("spawn")
        self.commands, self.results = context.Queue(), context.Queue()
        self._process = context.Process(target=_observe, daemon=True, args=(
            server.address, server.http, server.proc.pid, operator_token, interval_s, self.commands, self.results))
        self._process.start()
        assert self.results.get(timeout=60) == "ready"

    def watch(self) -> Watch:
        return Watch(self)

    def close(self) -> None:
        self.commands.put(None)
        self._process.join(30)


class _Window:
    """A window of what a process of the honest side sees: entering tells it to start
    watching, leaving to stop and say what it saw (`seen`)."""

    stop_timeout_s = 60.0

    def __init__(self, source):
        self._source = source  # has `commands` and `results` queues to that process

    def __enter__(self):
        self._source.commands.put("start")
        assert self._source.results.get(timeout=30) == "watching"
        return self

    def __exit__(self, *exc) -> None:
        self._source.commands.put("stop")
        self.seen(self._source.results.get(timeout=self.stop_timeout_s))

    def seen(self, seen: dict) -> None:
        raise NotImplementedError


class Watch(_Window):
    """What honest parties saw in one window: every `interval_s` a liveness probe (GET
    /healthz) and the operator's GetInfo (on the operator's connection), each second a grpc
    health check on a new connection; the teacher's RSS and descriptors at their highest."""

    def __init__(self, observer: Observer):
        super().__init__(observer)
        self.probes = Counter()
        self.get_info_s: list[float] = []
        self.peak_rss_mib = 0.0
        self.peak_descriptors = 0

    def seen(self, seen: dict) -> None:
        self.probes = Counter(seen["probes"])
        self.get_info_s = seen["get_info_s"]
        self.peak_rss_mib, self.peak_descriptors = seen["peak_rss_mib"], seen["peak_descriptors"]

    @property
    def healthz_fraction(self) -> float:
        total = self.probes["healthz ok"] + self.probes["healthz failed"]
        return self.probes["healthz ok"] / max(1, total)

    @property
    def get_info_p99_s(self) -> float:
        times = sorted(self.get_info_s)
        return times[min(len(times) - 1, int(0.99 * len(times)))] if times else float("inf")

    def summary(self) -> str:
        return (f"/healthz {self.healthz_fraction:.1%} of {sum(v for k, v in self.probes.items() if 'healthz' in k)}, "
                f"GetInfo p99 {self.get_info_p99_s * 1000:.0f} ms of {len(self.get_info_s)}, "
                f"probes {dict(self.probes)}, peak RSS {self.peak_rss_mib:.0f} MiB, "
                f"peak descriptors {self.peak_descriptors}")


def _observe(address: str, http: str, pid: int, token: str, interval_s: float, commands, results) -> None:
    """Observer's process: a window of probes from each "start" to its "stop", put on `results`."""
    with grpc.insecure_channel(address) as channel:
        get_info = channel.unary_unary(SERVICE + "GetInfo")
        results.put("ready")
        while commands.get() == "start":
            probes: Counter = Counter()
            get_info_s: list[float] = []
            peak_rss, peak_descriptors = 0.0, 0
            last_health = 0.0
            results.put("watching")
            while True:
                started = time.monotonic()
                try:  # a connection of its own each time, as kubelet's probes
                    ok = requests.get(f"{http}/healthz", timeout=2, headers={"Connection": "close"}).status_code == 200
                except requests.RequestException:
                    ok = False
                probes["healthz ok" if ok else "healthz failed"] += 1
                started_info = time.monotonic()
                try:
                    get_info(pb.GetInfoRequest().SerializeToString(), metadata=bearer(token), timeout=5)
                    get_info_s.append(time.monotonic() - started_info)
                except grpc.RpcError as e:
                    probes[f"GetInfo {e.code().name}"] += 1
                    get_info_s.append(float("inf"))
                if started - last_health >= 1.0:
                    last_health = started
                    try:
                        with grpc.insecure_channel(address) as fresh:
                            reply = health_pb2_grpc.HealthStub(fresh).Check(health_pb2.HealthCheckRequest(), timeout=3)
                        probes["grpc health ok" if reply.status == health_pb2.HealthCheckResponse.SERVING
                               else "grpc health not serving"] += 1
                    except grpc.RpcError as e:
                        probes[f"grpc health {e.code().name}"] += 1
                peak_rss = max(peak_rss, rss_mib(pid))
                peak_descriptors = max(peak_descriptors, descriptors(pid))
                try:
                    if commands.get(timeout=max(0.001, interval_s - (time.monotonic() - started))) == "stop":
                        break
                except queue.Empty:
                    pass
            results.put({"probes": dict(probes), "get_info_s": get_info_s, "peak_rss_mib": peak_rss,
                         "peak_descriptors": peak_descriptors})


class CrossStudent:
    """An honest student with a tokenizer of its own (cross-tokenizer outputs: SpanLogprobs), in a
    process of its own, started once; `window()` is one window of its batches.

    It sends one batch again and again, one at a time: the first answer, before any window, is
    the reference every later one must equal; a window records each batch's latency (submit to
    outputs received) and the largest difference from the reference."""

    def __init__(self, address: str, token: str, job_id: str, tokenizer_json: str, texts: list[str]):
        context = multiprocessing.get_context("spawn")
        self.commands, self.results = context.Queue(), context.Queue()
        self._process = context.Process(target=_cross_student, daemon=True, args=(
            address, token, job_id, tokenizer_json, texts, self.commands, self.results))
        self._process.start()
        ready = self.results.get(timeout=120)
        assert ready == "ready", ready

    def window(self) -> "CrossWindow":
        return CrossWindow(self)

    def close(self) -> None:
        self.commands.put(None)
        self._process.join(30)
        if self._process.is_alive():
            self._process.kill()


class CrossWindow(_Window):
    """What the cross-tokenizer student saw in one window: its batches' latencies, the largest
    difference from its first answers, its errors."""

    stop_timeout_s = 120.0

    def __init__(self, student: CrossStudent):
        super().__init__(student)
        self.latencies_s: list[float] = []
        self.worst = float("inf")
        self.errors: list[str] = []

    def seen(self, seen: dict) -> None:
        self.latencies_s, self.worst, self.errors = seen["latencies_s"], seen["worst"], seen["errors"]

    def percentile_s(self, q: float) -> float:
        times = sorted(self.latencies_s)
        return times[min(len(times) - 1, int(q * len(times)))] if times else float("inf")

    def summary(self) -> str:
        return (f"cross-tokenizer student: {len(self.latencies_s)} batches, "
                f"p50 {self.percentile_s(0.5) * 1000:.0f} ms, "
                f"p99 {self.percentile_s(0.99) * 1000:.0f} ms, worst difference {self.worst:.2g}, errors {self.errors}")


def _cross_student(address: str, token: str, job_id: str, tokenizer_json: str, texts: list[str], commands,
                   results) -> None:
    """CrossStudent's process."""
    import torch
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    from student_trainer import SpanLogprobs, TeacherClient

    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(tokenizer_json))
    rows = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    width = max(map(len, rows))
    ids = torch.zeros(len(rows), width, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for r, row in enumerate(rows):
        ids[r, :len(row)], mask[r, :len(row)] = torch.tensor(row), 1
    valid = mask.bool()
    with TeacherClient(address, "cpu", outputs=[SpanLogprobs()], tokenizer=tokenizer, auth_token=token,
                       job_id=job_id, join_timeout_s=60) as client:
        reference = client.submit(ids, mask).result(timeout=60).span_logprobs[valid]
        results.put("ready")
        while commands.get() == "start":
            latencies_s, worst, errors = [], 0.0, []
            results.put("watching")
            while True:
                started = time.monotonic()
                try:
                    out = client.submit(ids, mask).result(timeout=60)
                    latencies_s.append(time.monotonic() - started)
                    worst = max(worst, (out.span_logprobs[valid] - reference).abs().max().item())
                except Exception as e:  # reported to the test, which fails on it
                    errors.append(repr(e)[:300])
                try:
                    if commands.get_nowait() == "stop":
                        break
                except queue.Empty:
                    pass
            results.put({"latencies_s": latencies_s, "worst": worst, "errors": errors})
