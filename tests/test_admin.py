"""`teacher-server status` / `info` against a running server with two sessions, and JSON logs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from student_trainer import Logits, TeacherClient, TopK
from teacher_server.launcher import ServerProcess, child_env
from tests.helpers import ROOT, build_tiny_model


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = build_tiny_model(tmp_path_factory.mktemp("teacher") / "model")
    server = ServerProcess("--model", str(model_dir), "--max-sessions", "7", "--log-format", "json")
    yield server
    server.stop()


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "teacher_server", *args], capture_output=True, text=True,
                          timeout=60, env=child_env(), cwd=ROOT)


def test_status_lists_both_sessions_and_info_the_limits(server):
    with TeacherClient(server.address, "cpu", job_id="job-a", job_rank=0) as a, \
            TeacherClient(server.address, "cpu", outputs=(Logits(), TopK(4)), job_id="job-b", job_rank=1) as b:
        a.submit(torch.randint(0, 384, (2, 5))).result(timeout=60)
        b.submit(torch.randint(0, 384, (1, 7))).result(timeout=60)
        b.submit(torch.randint(0, 384, (1, 3))).result(timeout=60)
        status = _run("status", server.address)
        assert status.returncode == 0, status.stderr
        lines = status.stdout.splitlines()
        assert "2 session(s)" in lines[0]
        row_a = next(line.split() for line in lines if line.startswith(a.session_id))
        row_b = next(line.split() for line in lines if line.startswith(b.session_id))
        assert row_a[1:5] == ["job-a", "0", "gloo", "ready"] and row_a[5] == "10"
        assert row_b[1:5] == ["job-b", "1", "gloo", "ready"] and row_b[5] == "10"
        assert row_b[6] == "2/2" or row_b[6] == "1/2"  # the last send may still be settling

    info = _run("info", server.address)
    assert info.returncode == 0, info.stderr
    rows = {line[:20].strip(): line[20:].strip() for line in info.stdout.splitlines()[2:]}
    assert rows["vocab size"] == "384" and rows["layers"] == "2" and rows["dtype"] == "float32"
    assert rows["--max-sessions"] == "7" and rows["architecture"] == "LlamaForCausalLM"
    assert rows["quantization"] == "none"


def test_status_of_an_unreachable_teacher_says_so():
    result = _run("status", "127.0.0.1:1", "--timeout-s", "2")
    assert result.returncode == 1 and "UNAVAILABLE" in result.stderr


def test_json_logs_carry_session_ids(server):
    with TeacherClient(server.address, "cpu", job_id="json-job") as client:
        session_id = client.session_id
    records = [json.loads(line) for line in server.log_lines if line.startswith("{")]
    assert records, server.log
    mine = [r for r in records if r.get("session_id") == session_id]
    assert any("joined" in r["message"] for r in mine) and all(r["job_id"] == "json-job" for r in mine)
