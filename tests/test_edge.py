"""Attacks on the teacher's gRPC and HTTP ports from callers without the token, on one
teacher whose descriptor limit is the common default soft limit of 1024.

Each test is an attack that worked before the bounds of teacher_server/edge.py: big
requests buffered before the token check, streams and calls without limit, HTTP
connections that never send a request, or that pipeline requests and never read an answer,
a flood of sockets that exhausted descriptors (/healthz dead, a traceback per failed accept),
/metrics and /openapi.json open, and a self-declared job weight without bound.
"""

from __future__ import annotations

import json
import os
import resource
import socket
import threading
import time
from datetime import datetime

import grpc
import pytest
import requests
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from distill_common.proto.teacher.v1 import teacher_pb2 as pb
from student_trainer import TeacherClient
from student_trainer.errors import InvalidRequest
from teacher_server.launcher import ServerProcess, child_env
from tests.attacks import _TCP_ESTABLISHED, CostlyParses, PipelinedUnread, _tcp_state, many_headers
from teacher_server.openai.routes import ANSWER_PIECE_BYTES
from tests.helpers import build_tiny_model, wait_until

TOKEN = "edge-token"
BEARER = (("authorization", f"Bearer {TOKEN}"),)
MAX_SESSIONS = 2
MAX_STREAMS = 2 * MAX_SESSIONS  # the defaults that follow --max-sessions
MAX_RPCS = 4 * MAX_SESSIONS + 16
MAX_BATCH_TOKENS = 16384
# int64 ids and mask of a full batch, int32 ids to score (--max-score-ids 8), plus framing
REQUEST_LIMIT_BYTES = (16 + 4 * 8) * MAX_BATCH_TOKENS + (64 << 10)
HTTP_MAX_CONNECTIONS = 32
HEADER_TIMEOUT_S = 2.0
SEND_TIMEOUT_S = 2.0
MIN_SEND_BYTES_PER_S = 64 << 10
MAX_WEIGHT = 10.0
LEASE_S = 3.0
FD_SOFT_LIMIT = 1024


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = build_tiny_model(tmp_path_factory.mktemp("teacher") / "model")
    server = ServerProcess("--model", str(model_dir), "--max-sessions", str(MAX_SESSIONS), "--max-batch-tokens",
                           str(MAX_BATCH_TOKENS), "--http-max-connections", str(HTTP_MAX_CONNECTIONS),
                           "--http-header-timeout-s", str(HEADER_TIMEOUT_S), "--http-send-timeout-s",
                           str(SEND_TIMEOUT_S), "--http-min-send-bytes-per-s", str(MIN_SEND_BYTES_PER_S),
                           "--max-weight", str(MAX_WEIGHT),
                           "--lease-s", str(LEASE_S), "--heartbeat-interval-s", "0.5",
                           env=child_env(TEACHER_AUTH_TOKEN=TOKEN))
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.prlimit(server.proc.pid, resource.RLIMIT_NOFILE, (min(FD_SOFT_LIMIT, hard), hard))
    yield server
    server.stop()


def _logged(server, start: int, text: str) -> bool:
    """Whether the teacher logged a line with `text` since log line `start`, or would have but for
    its limit of one such line per 10 s (teacher_server.edge.RateLimitedLog): a line with `text`
    came less than 10 s before now, in the test before this one."""
    lines = [line for line in server.log_lines if text in line]
    if any(text in line for line in server.log_lines[start:]):
        return True
    if not lines:
        return False
    logged = datetime.strptime(lines[-1][:23], "%Y-%m-%d %H:%M:%S,%f")
    return (datetime.now() - logged).total_seconds() < 10.0


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) / 1024


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _waiting(release: threading.Event, first: bytes | None = None):
    """A request stream that sends `first` (if any), then nothing until `release`."""
    if first is not None:
        yield first
    release.wait(60)
    return


def _open_sockets(port: int, count: int) -> list[socket.socket]:
    """`count` connections to `port`, every other one with half a request's headers."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < count + 256:
        if hard != resource.RLIM_INFINITY and hard < count + 256:
            pytest.skip(f"needs {count + 256} descriptors, the hard limit is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (count + 256, hard))
    sockets = []
    for i in range(count):
        sock = socket.socket()
        sock.setblocking(False)
        try:
            sock.connect(("127.0.0.1", port))
        except BlockingIOError:
            pass
        if i % 2:
            try:
                sock.send(b"GET /healthz HTTP/1.1\r\nHost: teacher\r\n")
            except OSError:
                pass  # not connected yet: an idle socket then
        sockets.append(sock)
    return sockets


def _closed_within(sock: socket.socket, timeout_s: float) -> bool:
    """Whether the teacher closes `sock` within `timeout_s` (whatever it sends before)."""
    deadline = time.monotonic() + timeout_s
    try:
        while (left := deadline - time.monotonic()) > 0:
            sock.settimeout(left)
            if sock.recv(4096) == b"":
                return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        pass
    return False


# ---- gRPC ---------------------------------------------------------------------------------


def test_requests_without_the_token_are_refused_before_they_are_read(server):
    pid = server.proc.pid
    before_mib = _rss_mib(pid)
    peak_mib = [before_mib]
    sampling = threading.Event()

    def sample():
        while not sampling.is_set():
            peak_mib[0] = max(peak_mib[0], _rss_mib(pid))
            time.sleep(0.02)

    # 8 concurrent 32 MiB requests without the token (each would be buffered whole, then
    # refused, if the token were checked in the handler).
    payload = b"\x0a" + b"\xff" * (32 << 20)
    codes = []

    def send():
        with grpc.insecure_channel(server.address, options=[("grpc.max_send_message_length", -1)]) as channel:
            with pytest.raises(grpc.RpcError) as info:
                channel.unary_unary("/teacher.v1.TeacherService/Submit")(payload, timeout=60)
            codes.append(info.value.code())

    sampler = threading.Thread(target=sample)
    sampler.start()
    senders = [threading.Thread(target=send) for _ in range(8)]
    for thread in senders:
        thread.start()
    for thread in senders:
        thread.join(90)
    sampling.set()
    sampler.join()
    assert len(codes) == 8 and set(codes) <= {grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.RESOURCE_EXHAUSTED}
    assert peak_mib[0] - before_mib < 100, f"teacher RSS grew from {before_mib:.0f} to {peak_mib[0]:.0f} MiB"

    with grpc.insecure_channel(server.address) as channel:
        # A call without the token is refused before its request arrives (here: never).
        release = threading.Event()
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as info:
            channel.stream_unary("/teacher.v1.TeacherService/GetInfo")(_waiting(release), timeout=10)
        release.set()
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED and time.monotonic() - started < 5
        # With the token, the default request limit is what a full batch of --max-batch-tokens needs.
        with pytest.raises(grpc.RpcError) as info:
            channel.unary_unary("/teacher.v1.TeacherService/Submit")(b"\x0a" + b"\xff" * (1 << 20), timeout=30,
                                                                     metadata=BEARER)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f"vs. {REQUEST_LIMIT_BYTES})" in info.value.details(), info.value.details()


def test_streams_and_calls_in_progress_are_bounded(server):
    release = threading.Event()
    nobody = pb.SubmitRequest(session_id="nobody").SerializeToString()
    with grpc.insecure_channel(server.address) as channel:
        submit_stream = channel.stream_stream("/teacher.v1.TeacherService/SubmitStream")
        get_info = channel.unary_unary("/teacher.v1.TeacherService/GetInfo")
        try:
            streams = [submit_stream(_waiting(release, nobody), metadata=BEARER, timeout=60)
                       for _ in range(MAX_STREAMS)]
            for stream in streams:
                next(stream)  # the in-band NOT_FOUND answer: this stream is open on the teacher
            with pytest.raises(grpc.RpcError) as info:
                next(submit_stream(_waiting(release, nobody), metadata=BEARER, timeout=60))
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-streams" in info.value.details()

            # Calls whose request never comes hold the other calls' budget.
            hung = [channel.stream_unary("/teacher.v1.TeacherService/GetInfo").future(
                _waiting(release), metadata=BEARER, timeout=60) for _ in range(MAX_RPCS)]

            def refused() -> str:
                try:
                    get_info(pb.GetInfoRequest().SerializeToString(), metadata=BEARER, timeout=10)
                except grpc.RpcError as e:
                    return e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and e.details()
                return ""

            assert "--max-rpcs" in wait_until(refused, 15, "a call past --max-rpcs to be refused")
        finally:
            release.set()
        for call in hung:
            call.cancel()
        for stream in streams:
            stream.cancel()
        # Ended calls give their budget back.
        wait_until(lambda: not refused(), 15, "calls to be served again")
        next(submit_stream(_waiting(release, nobody), metadata=BEARER, timeout=60))


def test_health_checks_waiting_for_their_request_cannot_lock_probes_out(server):
    release = threading.Event()
    with grpc.insecure_channel(server.address) as channel:
        check = channel.stream_unary("/grpc.health.v1.Health/Check")
        try:
            hung = [check.future(_waiting(release), timeout=60) for _ in range(MAX_RPCS + 8)]
            # Past --max-rpcs, the oldest waiting checks make room; a probe is answered.
            wait_until(lambda: sum(call.done() for call in hung) >= 8, 15, "the oldest waiting checks to be dropped")
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            dropped = [call for call in hung if call.done()]
            assert all(call.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for call in dropped)
        finally:
            release.set()
            for call in hung:
                call.cancel()


def test_a_weight_over_max_weight_is_refused_at_join(server):
    with pytest.raises(InvalidRequest, match=f"--max-weight {MAX_WEIGHT}"):
        TeacherClient(server.address, "cpu", auth_token=TOKEN, weight=1e12, join_timeout_s=30)


# ---- HTTP ---------------------------------------------------------------------------------


def test_half_sent_headers_and_idle_connections_time_out(server):
    address = ("127.0.0.1", server.http_port)
    idle = socket.create_connection(address)
    half = socket.create_connection(address)
    half.sendall(b"GET /healthz HTTP/1.1\r\nHost: teacher\r\n")
    # A complete request, answered; then half of the next one on the same connection.
    kept = socket.create_connection(address)
    kept.sendall(b"GET /healthz HTTP/1.1\r\nHost: teacher\r\n\r\n")
    kept.settimeout(10)
    assert kept.recv(4096).startswith(b"HTTP/1.1 200")
    kept.sendall(b"GET /healthz HTTP/1.1\r\n")
    # Headers trickled a line at a time still have to be complete within the deadline.
    trickle = socket.create_connection(address)
    started = time.monotonic()
    trickle.sendall(b"GET /healthz HTTP/1.1\r\n")
    closed = False
    while not closed and time.monotonic() - started < HEADER_TIMEOUT_S + 5:
        try:
            trickle.sendall(b"X-Slow: 1\r\n")
            closed = _closed_within(trickle, 0.3)
        except OSError:  # reset: the teacher closed it
            closed = True
    assert closed, "headers trickled a line at a time kept the connection open"
    for sock in (idle, half, kept):
        assert _closed_within(sock, HEADER_TIMEOUT_S + 5), "a connection without a complete request stayed open"
    for sock in (idle, half, kept, trickle):
        sock.close()


def test_a_probe_connected_before_its_request_outlasts_stalled_connections(server):
    """The loop may accept many connections between a probe's connect and its request: twice
    the cap of connections that sent half their headers, opened after a probe that has sent
    nothing yet, displace each other, not the probe (the oldest of them all)."""
    address = ("127.0.0.1", server.http_port)
    probe = socket.create_connection(address)
    time.sleep(0.1)
    stalled = []
    try:
        for _ in range(2 * HTTP_MAX_CONNECTIONS):
            sock = socket.create_connection(address)
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: teacher\r\n")
            stalled.append(sock)
            time.sleep(0.01)  # read by the teacher before the next one connects
        time.sleep(0.2)
        probe.sendall(b"GET /healthz HTTP/1.1\r\nHost: teacher\r\nConnection: close\r\n\r\n")
        probe.settimeout(10)
        try:
            answer = probe.recv(4096)
        except ConnectionResetError:
            answer = b"reset"
        assert answer.startswith(b"HTTP/1.1 200"), answer[:100]
    finally:
        for sock in [probe, *stalled]:
            sock.close()


def test_answers_never_read_close_their_connection_at_the_send_deadline(server):
    start = len(server.log_lines)
    # Fewer than the cap, so that nothing displaces them: only the deadline closes them.
    with PipelinedUnread(server.http_port, 4) as attack:
        wait_until(lambda: attack.counts["closed by the teacher"] >= 4, 3 * SEND_TIMEOUT_S + 5,
                   "the teacher to close connections whose answers are never read")
    # The slack: the teacher's own buffers fill after the attacker's stops growing.
    assert max(attack.stalled_s) < SEND_TIMEOUT_S + 3, sorted(attack.stalled_s)
    # Closed for having taken nothing for the timeout, or (when the peer's receive buffer took a
    # little after the wait began) for less than the rate past it: both lines cite the timeout.
    assert (_logged(server, start, "(--http-send-timeout-s)")
            or _logged(server, start, "(--http-min-send-bytes-per-s, --http-send-timeout-s)")), server.log_lines[start:]


def _completion_request(length: int, k: int) -> bytes:
    """A POST /v1/completions of one prompt of `length` ids with `prompt_logprobs` k (about 70 bytes
    of answer per id listed: (k + 1) x length)."""
    body = json.dumps({"prompt": [[(7 * i) % 384 for i in range(length)]], "max_tokens": 1,
                       "prompt_logprobs": k}).encode()
    return (b"POST /v1/completions HTTP/1.1\r\nHost: teacher\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer %s\r\nContent-Length: %d\r\n\r\n%s" % (TOKEN.encode(), len(body), body))


def _read_answer(port: int, request: bytes, bytes_per_s: float, result: dict, stop_after_bytes: int = 0) -> None:
    """Sends `request` and reads its answer at about `bytes_per_s`, through a 4 KiB receive buffer
    (so that what the teacher's TCP sees taken is what is read), with `stop_after_bytes` no more
    reading once that much of the body came: into `result`, the answer's status line, bytes of
    body read, whether it came whole, and how long after its first byte (or after the reading
    stopped) the reading ended or the teacher closed the connection."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(30)
    sock.connect(("127.0.0.1", port))
    sock.sendall(request)
    data, length, started, ended = b"", None, None, None
    try:
        while length is None or len(data) < length:
            chunk = sock.recv(1024)
            if not chunk:
                break
            data += chunk
            if length is None and b"\r\n\r\n" in data:
                head, data = data.split(b"\r\n\r\n", 1)
                result["status"] = head.split(b"\r\n")[0]
                length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                                  if line.lower().startswith(b"content-length")))
                started = time.monotonic()
            if ended is None and _tcp_state(sock) != _TCP_ESTABLISHED:
                ended = time.monotonic()
            if started is not None:  # paced from the answer's first byte on
                time.sleep(max(0.0, started + len(data) / bytes_per_s - time.monotonic()))
            if stop_after_bytes and len(data) >= stop_after_bytes:
                started = time.monotonic()
                while _tcp_state(sock) == _TCP_ESTABLISHED and time.monotonic() < started + 30:
                    time.sleep(0.05)
                ended = time.monotonic()
                break
    except (ConnectionResetError, TimeoutError):
        pass
    finally:
        sock.close()
    ended = ended or time.monotonic()
    result.update(body_bytes=len(data), whole=length is not None and len(data) >= length,
                  seconds=ended - started if started is not None else None, length=length)


def test_a_steady_reader_takes_a_long_answer_and_a_trickling_one_is_cut(server):
    start = len(server.log_lines)
    request = _completion_request(600, 16)  # ~0.7 MB of answer
    steady, trickle, stopped, under = {}, {}, {}, {}
    # Longer than --http-send-timeout-s for the whole answer, but never without progress.
    steady_rate = 200_000
    # Progress every read, but below --http-min-send-bytes-per-s: cut once the timeout's grace is over.
    trickle_rate = MIN_SEND_BYTES_PER_S / 8
    # Fast (its send buffer grown), then nothing: cut once it has taken nothing for the timeout.
    # Just under the rate, through an answer of many pieces (routes.ANSWER_PIECE_BYTES): the wait is
    # one across them, so it is cut once its deficit outgrows the grace, at T * R / (R - r) = 8 s
    # (each piece a wait of its own would give it a new grace a piece, and never cut it).
    under_rate = 0.75 * MIN_SEND_BYTES_PER_S
    threads = [threading.Thread(target=_read_answer, args=(server.http_port, request, rate, out, stop))
               for rate, out, stop in ((steady_rate, steady, 0), (trickle_rate, trickle, 0), (1e9, stopped, 300_000))]
    threads.append(threading.Thread(target=_read_answer, args=(server.http_port, _completion_request(1200, 16),
                                                               under_rate, under)))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert steady["status"] == trickle["status"] == b"HTTP/1.1 200 OK", (steady, trickle)
    assert steady["whole"] and steady["seconds"] > SEND_TIMEOUT_S, steady
    assert not trickle["whole"], trickle
    # Cut when it had taken less than the rate past the grace: at about the grace itself.
    assert trickle["seconds"] < SEND_TIMEOUT_S + 3, trickle
    assert not stopped["whole"] and SEND_TIMEOUT_S - 0.5 < stopped["seconds"] < SEND_TIMEOUT_S + 3, stopped
    cut_s = SEND_TIMEOUT_S * MIN_SEND_BYTES_PER_S / (MIN_SEND_BYTES_PER_S - under_rate)
    assert under["length"] > 4 * ANSWER_PIECE_BYTES and not under["whole"], under
    assert cut_s - 1 < under["seconds"] < cut_s + 3, under
    # (Which bound cut each is in its timing: the trickle took something every read, the stopped
    # one had taken 300 kB, far above the rate, when it was cut; the log says one line in 10 s.)
    assert _logged(server, start, "(--http-min-send-bytes-per-s, --http-send-timeout-s)"), server.log_lines[start:]


def test_the_displacement_order_past_the_cap():
    """HttpConnections.to_displace over GuardedH11Protocol.displace_rank, on connections in the
    states that order them (the served tests above are timing-bound; this is the order itself):
    stalled, then pipelining, then idle for JUDGED_S, then taking an answer at speed, then new
    and silent (a probe whose request is not read yet); the oldest first within each."""
    from types import SimpleNamespace

    from teacher_server import edge

    now, rate = 100.0, float(MIN_SEND_BYTES_PER_S)

    class Connection(SimpleNamespace):
        __hash__ = object.__hash__  # keys of the displaceable dict, by identity

    def connection(name, waiting_for=None, taking=None, heard_at=None, heard=0, idle_since=now, pipelined=False):
        state = Connection(name=name, _waiting_for=waiting_for, _taking=taking, _heard_at=heard_at,
                                _heard_bytes=heard, _idle_since=idle_since, _pipelined=pipelined)
        state.displace_rank = lambda at, min_rate: edge.GuardedH11Protocol.displace_rank(state, at, min_rate)
        return state

    def taking(waited_s, taken, last_taken_ago_s):
        started = edge._Taking(now - waited_s, 0)
        started.acked_bytes, started.last_taken = taken, now - last_taken_ago_s
        return started

    reader = connection("reader", edge._TAKEN, taking(3.0, int(3 * rate * 1.5), 0.1))
    stalled_reader = connection("stalled reader", edge._TAKEN, taking(3.0, int(rate), 2.0))
    trickler = connection("trickler", edge._REQUEST, heard_at=now - 2.0, heard=100, idle_since=now - 2.0)
    pipeliner = connection("pipeliner", edge._TAKEN, taking(3.0, int(3 * rate * 1.5), 0.1), pipelined=True)
    idle = connection("idle", edge._REQUEST, idle_since=now - 1.5)
    probe = connection("probe", edge._REQUEST, idle_since=now - 0.001)
    newcomer = connection("newcomer", edge._REQUEST, idle_since=now)
    newcomer.loop = SimpleNamespace(time=lambda: now)
    guard = edge.HttpConnections(32, 2.0, 2.0, min_send_bytes_per_s=rate)
    order = [probe, reader, idle, pipeliner, stalled_reader, trickler]  # oldest first
    chosen = []
    while order:
        guard.displaceable = dict.fromkeys([*order, newcomer])
        victim = guard.to_displace(newcomer)
        chosen.append(victim.name)
        order.remove(victim)
    assert chosen == ["stalled reader", "trickler", "pipeliner", "idle", "reader", "probe"], chosen
    guard.displaceable = {newcomer: None}
    assert guard.to_displace(newcomer) is newcomer  # nothing else: itself


@pytest.mark.parametrize("upgrade", [b"", b"Upgrade: h2c\r\n"])
def test_a_peer_pipelining_requests_while_reading_answers_is_read_no_further_ahead(server, upgrade):
    """uvicorn resumes reading at every receive() of a request, also behind a whole pipelined
    request h11 holds: a peer that pipelines small completions while reading every answer had
    the teacher read ~60 MB/s ahead of its answers into h11's buffer (with an Upgrade header,
    which h11 holds in a state of its own, too). The teacher now reads no further while it holds
    16 KiB of pipelined requests: what the peer can send ahead is what the sockets' buffers take."""
    payload = json.dumps({"prompt": [[5, 6]], "max_tokens": 1}).encode()
    one = (b"POST /v1/completions HTTP/1.1\r\nHost: teacher\r\nContent-Type: application/json\r\n%s"
           b"Authorization: Bearer %s\r\nContent-Length: %d\r\n\r\n%s" % (upgrade, TOKEN.encode(), len(payload),
                                                                            payload))
    block, sent, answered = one * 200, [0], [0]
    peer = socket.create_connection(("127.0.0.1", server.http_port), timeout=10)
    peer.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 << 10)
    stop = time.monotonic() + 3

    def send():
        while time.monotonic() < stop:
            try:
                peer.sendall(block)
            except OSError:
                return
            sent[0] += 200

    def read():
        while True:
            try:
                data = peer.recv(1 << 20)
            except OSError:
                return
            if not data:
                return
            answered[0] += data.count(b"HTTP/1.1 200")

    threads = [threading.Thread(target=send, daemon=True), threading.Thread(target=read, daemon=True)]
    for thread in threads:
        thread.start()
    threads[0].join(30)
    ahead_bytes = (sent[0] - answered[0]) * len(one)
    peer.close()
    assert answered[0] > 100, answered  # it was served all along
    assert ahead_bytes < 16 << 20, (sent[0], answered[0])  # ~60 MB a second ahead without the bound


def test_pipelined_requests_never_read_starve_no_probes(server):
    pid = server.proc.pid
    start = len(server.log_lines)
    before_mib = _rss_mib(pid)
    answered = []
    # As many as the cap, each with 20,000 requests: the answers to the first two hundred or
    # so fill the socket buffers, then the rest wait on a peer that never reads.
    with PipelinedUnread(server.http_port, HTTP_MAX_CONNECTIONS) as attack:
        deadline = time.monotonic() + 2 * SEND_TIMEOUT_S
        while time.monotonic() < deadline:
            try:  # a connection of its own each time, as kubelet's probes
                ok = requests.get(f"{server.http}/healthz", timeout=2, headers={"Connection": "close"}).status_code
                answered.append(ok == 200)
            except requests.RequestException:
                answered.append(False)
            time.sleep(0.1)
        peak_mib = _rss_mib(pid)
    assert sum(answered) >= 0.95 * len(answered), f"/healthz answered {sum(answered)} of {len(answered)}"
    # Each probe displaced the oldest pipelining connection; none stayed long once stalled.
    assert attack.counts["closed by the teacher"] > 0, attack.counts
    assert _logged(server, start, "--http-max-connections limit")
    assert max(attack.stalled_s) < SEND_TIMEOUT_S + 3, sorted(attack.stalled_s)[-5:]
    # Reading waits while an answer does: each connection buffers at most one read of requests.
    assert peak_mib - before_mib < 50, f"teacher RSS {before_mib:.0f} -> {peak_mib:.0f} MiB"


def test_headers_over_16_kib_are_refused_however_they_arrive(server):
    """h11 counts its 16 KiB only while the headers are incomplete: 97 KB of them read at once were
    parsed (a 200, 14 ms of the loop's time each); now the teacher hands h11 a few KiB at a time."""
    request = many_headers(12_000)
    with socket.create_connection(("127.0.0.1", server.http_port)) as sock:
        sock.sendall(request)
        sock.settimeout(10)
        assert sock.recv(4096).startswith(b"HTTP/1.1 400"), "headers of 97 KB were read"
    assert requests.get(f"{server.http}/healthz", timeout=3).status_code == 200


def test_invalid_requests_are_logged_a_line_at_a_time(server):
    """uvicorn logs a warning per invalid request (or unsupported upgrade): 3,800 lines a second
    from one client without a token, filling the teacher's log. Now a line per 10 s, with a count."""
    start = len(server.log_lines)
    for request in (b"GET / HTTP/1.1\r\nHost: teacher\r\nContent-Length: x\r\n\r\n",
                    b"GET /healthz HTTP/1.1\r\nHost: teacher\r\nConnection: upgrade\r\nUpgrade: x\r\n\r\n"):
        for _ in range(200):
            with socket.create_connection(("127.0.0.1", server.http_port)) as sock:
                sock.sendall(request)
                sock.settimeout(10)
                assert sock.recv(4096)[:12] in (b"HTTP/1.1 400", b"HTTP/1.1 200")
    time.sleep(0.5)
    new = server.log_lines[start:]
    for text in ("Invalid HTTP request received", "Unsupported upgrade request"):
        lines = [line for line in new if text in line]
        assert len(lines) <= 1 and (lines or _logged(server, start, text)), new[:10]


def test_requests_dear_to_parse_starve_no_probes(server):
    """Bodies in one-byte chunks (an h11 event per byte) and header blocks of 97 KB, sent whole by
    as many connections as the cap, each answer read, no token: the loop parsed each whole read
    (256 KiB) in one turn, 40 ms and more a connection, and /healthz (a probe's connection of its
    own each time) timed out; now each turn parses a few KiB of a connection's bytes."""
    answered = []
    with CostlyParses(server.http_port, HTTP_MAX_CONNECTIONS, body_bytes=180 << 10) as attack:
        time.sleep(0.5)
        deadline = time.monotonic() + 4
        while time.monotonic() < deadline:
            try:
                ok = requests.get(f"{server.http}/healthz", timeout=2, headers={"Connection": "close"}).status_code
                answered.append(ok == 200)
            except requests.RequestException:
                answered.append(False)
            time.sleep(0.1)
    assert attack.counts["405"] > 0, attack.counts  # the chunked bodies were read whole
    assert sum(answered) >= 0.95 * len(answered), f"/healthz answered {sum(answered)} of {len(answered)}; " \
                                                  f"attack {dict(attack.counts)}"


def test_thousands_of_open_sockets_starve_neither_probes_nor_sessions(server):
    pid = server.proc.pid
    with TeacherClient(server.address, "cpu", auth_token=TOKEN, weight=MAX_WEIGHT) as client:
        assert client.submit(torch.randint(0, 384, (1, 6))).result(timeout=60).logits.shape == (1, 6, 384)
        before = _fds(pid)
        sockets = _open_sockets(server.http_port, 3000)
        most_fds = 0
        try:
            # Longer than the lease: the session's heartbeats must go on meanwhile.
            deadline = time.monotonic() + 2 * LEASE_S
            while time.monotonic() < deadline:
                assert requests.get(f"{server.http}/healthz", timeout=3).status_code == 200
                with grpc.insecure_channel(server.address) as channel:
                    reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=3)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
                most_fds = max(most_fds, _fds(pid))
                time.sleep(0.3)
            out = client.submit(torch.randint(0, 384, (2, 5))).result(timeout=60)
            assert out.logits.shape == (2, 5, 384)
        finally:
            for sock in sockets:
                sock.close()
    # A connection past the cap closes one, and asyncio accepts at most 2 x the cap at a time.
    assert most_fds - before <= 3 * HTTP_MAX_CONNECTIONS, f"teacher descriptors {before} -> {most_fds}"
    assert "Traceback" not in server.log


def test_accept_errors_are_logged_a_line_at_a_time(server):
    pid = server.proc.pid
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    start = len(server.log_lines)
    # Out of descriptors, however it happened: asyncio's accept loop fails on every attempt.
    resource.prlimit(pid, resource.RLIMIT_NOFILE, (_fds(pid) + 4, hard))
    try:
        sockets = _open_sockets(server.http_port, 200)
        time.sleep(3)
    finally:
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (min(FD_SOFT_LIMIT, hard), hard))
    for sock in sockets:
        sock.close()
    wait_until(lambda: requests.get(f"{server.http}/healthz", timeout=3).status_code == 200, 15, "/healthz")
    new = "".join(server.log_lines[start:])
    assert 1 <= new.count("Too many open files") <= 2 and "Traceback" not in new, new[:3000]
    assert "cannot accept connections" in new


def test_grpc_connections_are_capped_below_the_descriptor_limit():
    from teacher_server.config import ServerConfig
    from teacher_server.edge import DEFAULT_GRPC_MAX_CONNECTIONS, grpc_connections_limit

    config = ServerConfig(max_sessions=64, http_max_connections=64)
    kept = 2 * 64 + 16 * 64 + 256  # HTTP and its backlog, the sessions' data planes, the process
    assert grpc_connections_limit(config, 1 << 20) == DEFAULT_GRPC_MAX_CONNECTIONS
    assert grpc_connections_limit(config, 4096) == 4096 - kept
    assert grpc_connections_limit(ServerConfig(grpc_max_connections=100), 1 << 20) == 100
    # Too few descriptors for everything: a quarter of them, not a teacher that will not start.
    assert grpc_connections_limit(config, 1024) == 256
