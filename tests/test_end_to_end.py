"""A real teacher server process and real student processes over gloo on CPU."""

from __future__ import annotations

import time

import grpc
import pytest
import requests
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from student_trainer import HiddenStates, Logits, TeacherClient, TopK
from teacher_server.launcher import ServerProcess, metrics_samples
from tests.helpers import build_tiny_model, finish_student, start_student, status_sessions, wait_for_line

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("teacher") / "model")


@pytest.fixture(scope="module")
def server(model_dir):
    server = ServerProcess("--model", str(model_dir), "--max-batch-tokens", "256", "--max-seq-len", "64")
    yield server
    assert server.stop() == 0, server.log


def test_two_students_joining_at_different_times_get_exact_outputs(server, model_dir, tmp_path):
    a_out, b_out = tmp_path / "a.json", tmp_path / "b.json"
    # A runs longer; B joins while A is mid-run and leaves first: A must not notice.
    a = start_student(server.address, model_dir, a_out, "--batches", "14", "--inflight", "3", "--pause-s", "0.15",
                      "--job-id", "job-a", "--seed", "1")
    wait_for_line(a, "JOINED")
    time.sleep(0.5)
    b = start_student(server.address, model_dir, b_out, "--batches", "5", "--inflight", "2", "--topk", "7",
                      "--hidden-layers", "1", "--job-id", "job-b", "--seed", "2")
    b_report = finish_student(b, b_out)
    a_report = finish_student(a, a_out)
    assert a_report["received"] == list(range(14))
    assert b_report["received"] == list(range(5))
    for report in (a_report, b_report):
        for kind, diff in report["worst"].items():
            assert diff <= TOLERANCE, (kind, diff, report)
    assert "session" in server.log and "ended: left" in server.log


def test_final_hidden_head_and_attention_inputs_equal_the_local_teachers(server, model_dir, tmp_path):
    out = tmp_path / "c.json"
    report = finish_student(start_student(server.address, model_dir, out, "--batches", "5", "--inflight", "2",
                                          "--no-logits", "--topk", "0", "--hidden-layers", "", "--final-hidden",
                                          "--attention-layers", "1,0"), out)
    assert report["received"] == list(range(5)) and report["checked"] == 5
    assert set(report["worst"]) >= {"final_hidden", "head_weight", "head_logits", "attention"}
    for kind, diff in report["worst"].items():
        assert diff <= TOLERANCE, (kind, diff, report)
    status = requests.get(f"{server.http}/v1/status", timeout=10).json()
    assert status["attention_inputs"] == {"query_width": 48, "key_width": 24, "value_width": 24, "unavailable": ""}
    assert status["output_head"] == {"bias": False, "final_logit_softcapping": 0.0, "logit_scale": 1.0,
                                     "unavailable": ""}


def test_status_metrics_and_health_match_what_was_sent(server):
    batches = [(torch.randint(0, 384, (2, 9)), None), (torch.randint(0, 384, (3, 5)), None)]
    with TeacherClient(server.address, "cpu", outputs=(Logits(), TopK(3)), job_id="metrics-job") as teacher:
        for ids, mask in batches:
            teacher.submit(ids, mask).result(timeout=60)
        # batches_sent is counted by the teacher's sender once its send completes, a
        # moment after the student has the data.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            mine = status_sessions(server.http).get(teacher.session_id)
            if mine and mine["batches_sent"] == 2:
                break
            time.sleep(0.05)
        assert mine and mine["job_id"] == "metrics-job" and mine["state"] == "ready"
        assert mine["tokens_served"] == 2 * 9 + 3 * 5
        status = requests.get(f"{server.http}/v1/status", timeout=10).json()
        assert status["vocab_size"] == 384 and status["num_layers"] == 2 and status["dtype"] == "float32"

        samples = metrics_samples(server.http)
        labels = (("job", "metrics-job"), ("session", teacher.session_id))
        assert samples[("teacher_batches_total", labels)] == 2
        assert samples[("teacher_tokens_total", labels)] == 2 * 9 + 3 * 5
        per_token = (384 + 3) * 4 + 3 * 4  # logits + top-k values (float32) + top-k indices (int32)
        assert samples[("teacher_bytes_sent_total", labels)] == (2 * 9 + 3 * 5) * per_token
        assert samples[("teacher_sessions_connected", ())] >= 1
        assert samples[("teacher_forward_seconds_count", ())] >= 2
        assert ("teacher_queue_depth", ()) in samples

    assert requests.get(f"{server.http}/healthz", timeout=10).status_code == 200
    assert requests.get(f"{server.http}/readyz", timeout=10).status_code == 200
    with grpc.insecure_channel(server.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "teacher.v1.TeacherService"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_session_leaves_status_after_close(server):
    with TeacherClient(server.address, "cpu", outputs=(HiddenStates((2,)),), job_id="short") as teacher:
        session_id = teacher.session_id
        teacher.submit(torch.randint(0, 384, (1, 4))).result(timeout=60)

    def gone():
        return session_id not in status_sessions(server.http)

    deadline = time.monotonic() + 10
    while not gone():
        assert time.monotonic() < deadline, "session still listed 10 s after close"
        time.sleep(0.05)
