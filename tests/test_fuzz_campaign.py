"""The fuzz campaign (slow): at least 10,000 hostile cases at every RPC, the rendezvous that
replaced the store, and the HTTP endpoints, while an honest student trains beside them.

What must hold at the end: every call was answered with a status code (no crash, no
INTERNAL or UNKNOWN, no 5xx), the honest student received every batch and each equals the
same model run locally, and the teacher is healthy with its memory and descriptors within
bounds. Run with `pytest -m slow tests/test_fuzz_campaign.py -s` (it prints the case counts;
docs/security.md quotes them).
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import time
from collections import Counter
from pathlib import Path

import grpc
import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import PreTrainedTokenizerFast

from distill_common.channel import SESSION_SECRET_KEY
from distill_common.proto.teacher.v1 import teacher_pb2 as pb
from student_trainer import TeacherClient
from teacher_server.launcher import ServerProcess, child_env
from tests.helpers import build_tiny_model, finish_student, start_student, wait_for_line
from tests.test_alignment import TEACHER_MERGES, byte_level_tokenizer
from tests.test_fuzz import messages

pytestmark = pytest.mark.slow

TOKEN = "campaign-token"
BEARER = (("authorization", f"Bearer {TOKEN}"),)
UNARY = ("GetInfo", "Join", "Submit", "Heartbeat", "Leave", "GetStatus", "Rendezvous")
CASES: Counter = Counter()
CODES: Counter = Counter()
BEFORE: dict = {}
CRASH_CODES = (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DEADLINE_EXCEEDED)


def campaign(examples: int):
    return settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), database=None)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    model_dir = build_tiny_model(tmp_path_factory.mktemp("teacher") / "model")
    # A tokenizer too, so that hostile cross-tokenizer Joins reach the alignment at join.
    PreTrainedTokenizerFast(tokenizer_object=byte_level_tokenizer(TEACHER_MERGES)).save_pretrained(model_dir)
    return model_dir


@pytest.fixture(scope="module")
def server(model_dir):
    server = ServerProcess("--model", str(model_dir), "--max-batch-tokens", "512", "--max-seq-len", "128",
                           "--join-timeout-s", "2", "--max-sessions", "64", env=child_env(TEACHER_AUTH_TOKEN=TOKEN))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def channel(server):
    with grpc.insecure_channel(server.address, options=[("grpc.max_send_message_length", 64 << 20)]) as channel:
        yield channel


@pytest.fixture(scope="module")
def honest(server, model_dir, tmp_path_factory):
    """A student that submits until told to stop and compares every batch with the local model."""
    work = tmp_path_factory.mktemp("honest")
    stop, out = work / "stop", work / "report.json"
    proc = start_student(server.address, model_dir, out, "--batches", "0", "--stop-file", str(stop),
                         "--topk", "5", "--hidden-layers", "0,2", "--max-len", "24", "--job-id", "honest",
                         env=child_env(TEACHER_AUTH_TOKEN=TOKEN))
    session_id = wait_for_line(proc, "JOINED").split()[1]
    return proc, out, stop, session_id


@pytest.fixture(scope="module")
def rogue(server):
    """The attacker's own session, its group formed: it holds a token and knows the session's
    id and secret (a student of its own gone rogue)."""
    with TeacherClient(server.address, "cpu", auth_token=TOKEN, job_id="rogue") as client:
        yield client._connection.session.joined


def _process(server) -> dict:
    pid = server.proc.pid
    rss_kb = next(int(line.split()[1]) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                  if line.startswith("VmRSS:"))
    return {"rss_mb": rss_kb / 1024, "fds": len(os.listdir(f"/proc/{pid}/fd"))}


def _answer(call, payload, metadata=(), what: str = "") -> None:
    """One case: the call must end with a status code that is not a crash."""
    CASES[what] += 1
    try:
        call(payload, timeout=20, metadata=metadata)
        CODES["OK"] += 1
    except grpc.RpcError as e:
        assert e.code() not in CRASH_CODES, f"{what}: {e.code()} {e.details()}"
        CODES[e.code().name] += 1


def _unary(channel, method: str):
    return channel.unary_unary(f"/teacher.v1.TeacherService/{method}")


def _stream(channel):
    stream = channel.stream_stream("/teacher.v1.TeacherService/SubmitStream")
    return lambda payloads, **kw: list(stream(iter(payloads), **kw))


credentials = st.sampled_from(["none", "token", "wrong token"])


def _metadata(kind: str, extra=()) -> tuple:
    base = {"none": (), "token": BEARER, "wrong token": (("authorization", "Bearer nope"),)}[kind]
    return base + tuple(extra)


def test_the_honest_student_is_served_before_the_campaign(honest, server):
    assert server.proc.poll() is None and honest[0].poll() is None
    BEFORE.update(_process(server))


@campaign(3000)
@given(method=st.sampled_from(UNARY + ("SubmitStream",)), payloads=st.lists(st.binary(max_size=2048), min_size=1,
                                                                              max_size=3), who=credentials)
def test_raw_bytes_at_every_rpc(channel, honest, method, payloads, who):
    if method == "SubmitStream":
        _answer(_stream(channel), payloads, _metadata(who), "raw bytes")
    else:
        _answer(_unary(channel, method), payloads[0], _metadata(who), "raw bytes")


@campaign(3200)
@given(data=st.data())
def test_hostile_fields_at_every_rpc(channel, honest, data):
    method = data.draw(st.sampled_from(["Submit", "SubmitStream", "Join", "Heartbeat", "Leave", "Rendezvous"]))
    message = data.draw(messages["Submit" if method == "SubmitStream" else method])
    if method == "Rendezvous" and message.wait_s == message.wait_s:  # not NaN: a bounded wait
        message.wait_s = min(message.wait_s, 0.05)
    who = data.draw(credentials)
    if method == "SubmitStream":
        _answer(_stream(channel), [message.SerializeToString()], _metadata(who), "hostile fields")
    else:
        _answer(_unary(channel, method), message.SerializeToString(), _metadata(who), "hostile fields")


@campaign(1800)
@given(data=st.data())
def test_the_rogue_session_acts_on_itself_and_on_the_honest_one(channel, honest, rogue, data):
    """A token holder with a session of its own: its id and secret, the honest session's id
    (which GetStatus shows a token holder) with its own secret or a guessed one, any request."""
    target = data.draw(st.sampled_from(["own", "honest"]))
    session_id = rogue.session_id if target == "own" else honest[3]
    secret = data.draw(st.sampled_from([rogue.session_secret, "", "0" * 43]))
    method = data.draw(st.sampled_from(["Submit", "SubmitStream", "Heartbeat", "Rendezvous"]))
    message = data.draw(messages["Submit" if method == "SubmitStream" else method])
    message.session_id = session_id
    if method == "Rendezvous":
        message.wait_s = min(message.wait_s, 0.05) if message.wait_s == message.wait_s else message.wait_s
    metadata = BEARER + (((SESSION_SECRET_KEY, secret),) if secret else ())
    if method == "SubmitStream":
        _answer(_stream(channel), [message.SerializeToString()], metadata, "rogue session")
    else:
        _answer(_unary(channel, method), message.SerializeToString(), metadata, "rogue session")


HTTP_PATHS = ["/healthz", "/readyz", "/metrics", "/v1/status", "/openapi.json", "/docs", "/", "/v1/status/../metrics"]
header_names = st.sampled_from(["Authorization", "Content-Length", "Transfer-Encoding", "Host", "Content-Type",
                                "X-Forwarded-For", "Connection", "Expect"])
header_values = st.sampled_from([f"Bearer {TOKEN}", "Bearer wrong", "chunked", "-1", "99999999999", "close",
                                 "100-continue", ""]) | st.text(alphabet=st.characters(min_codepoint=32,
                                                                                          max_codepoint=126),
                                                                max_size=200)


@campaign(1500)
@given(method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "HEAD", "OPTIONS", "PATCH", "TRACE", "BREW"]),
       path=st.sampled_from(HTTP_PATHS) | st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126),
                                                   max_size=300).map(lambda s: "/" + s),
       headers=st.dictionaries(header_names, header_values, max_size=4), body=st.binary(max_size=1024))
def test_hostile_http_requests(server, honest, method, path, headers, body):
    CASES["http requests"] += 1
    host, port = server.http.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=20)
    try:
        connection.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
        for name, value in headers.items():
            connection.putheader(name, value)
        connection.endheaders(body or None)
        status = connection.getresponse().status
    except (http.client.HTTPException, ConnectionError, ValueError) as e:
        CODES[f"http {type(e).__name__}"] += 1  # the server closed a request it would not parse: an answer
        return
    finally:
        connection.close()
    CODES[f"http {status}"] += 1
    assert status < 500, f"{method} {path!r} {headers}: {status}"


@campaign(1500)
@given(payload=st.binary(min_size=1, max_size=4096) | st.sampled_from([
    b"GET /metrics HTTP/1.1\r\nHost: x\r\n", b"GET / HTTP/1.1\r\n" + b"X: y\r\n" * 500,
    b"POST /v1/status HTTP/1.1\r\nContent-Length: 99999999\r\n\r\nabc", b"\r\n" * 100,
    b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"]))
def test_raw_bytes_at_the_http_port(server, honest, payload):
    CASES["http raw bytes"] += 1
    host, port = server.http.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(payload)
        sock.shutdown(socket.SHUT_WR)
        try:
            while sock.recv(65536):
                pass
        except (TimeoutError, ConnectionError):
            pass  # a half-sent request: closed by the header timeout, or reset


def test_after_the_campaign(server, honest, channel):
    """No crash, the honest student's batches all right, the teacher healthy and within bounds."""
    total = sum(CASES.values())
    print(f"\nfuzz campaign: {total} cases {dict(CASES)}\nanswers: {dict(CODES)}")
    assert total >= 10_000, CASES
    proc, out, stop, _ = honest
    stop.write_text("")
    report = finish_student(proc, out, timeout_s=180)
    print(f"honest student: {len(report['received'])} batches, {report['checked']} checked, worst {report['worst']}")
    assert report["checked"] == len(report["received"]) > 100
    assert report["received"] == sorted(report["received"])
    assert max(report["worst"].values()) < 1e-4, report["worst"]
    assert server.proc.poll() is None, server.log[-3000:]
    assert requests.get(f"{server.http}/healthz", timeout=10).status_code == 200
    assert "Traceback" not in server.log, server.log[-5000:]
    # Within bounds once the campaign's connections close: the connection cap's descriptors and the
    # request-size bound's memory, not one more per case.
    time.sleep(3)
    used = _process(server)
    print(f"teacher before: {json.dumps(BEFORE)}, after: {json.dumps(used)}")
    assert used["fds"] < BEFORE["fds"] + 32, (BEFORE, used)
    assert used["rss_mb"] < BEFORE["rss_mb"] + 512, (BEFORE, used)
