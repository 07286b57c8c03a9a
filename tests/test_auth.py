"""--auth-token: every RPC but health needs it; right and wrong credentials from real clients."""

from __future__ import annotations

import grpc
import pytest
import requests
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from distill_common.proto.teacher.v1 import teacher_pb2 as pb
from distill_common.proto.teacher.v1 import teacher_pb2_grpc as pb_grpc
from student_trainer import TeacherClient
from student_trainer.errors import AuthenticationFailed
from teacher_server.launcher import ServerProcess, child_env
from tests.helpers import build_tiny_model

TOKEN = "s3cret-token"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = build_tiny_model(tmp_path_factory.mktemp("teacher") / "model")
    # The token comes from the environment, as deploy/ passes it (never on a command line).
    server = ServerProcess("--model", str(model_dir), env=child_env(TEACHER_AUTH_TOKEN=TOKEN))
    yield server
    server.stop()


def test_right_token_is_served(server):
    with TeacherClient(server.address, "cpu", auth_token=TOKEN) as client:
        out = client.submit(torch.randint(0, 384, (1, 6))).result(timeout=60)
    assert out.logits.shape == (1, 6, 384)


@pytest.mark.parametrize("token", ["", "wrong"])
def test_missing_or_wrong_token_is_unauthenticated(server, token):
    with pytest.raises(AuthenticationFailed, match="auth token"):
        TeacherClient(server.address, "cpu", auth_token=token)
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.TeacherServiceStub(channel)
        metadata = (("authorization", f"Bearer {token}"),) if token else ()
        for call, request in ((stub.GetInfo, pb.GetInfoRequest()), (stub.GetStatus, pb.GetStatusRequest()),
                              (stub.Heartbeat, pb.HeartbeatRequest(session_id="x"))):
            with pytest.raises(grpc.RpcError) as info:
                call(request, timeout=10, metadata=metadata)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as info:
            list(stub.SubmitStream(iter([pb.SubmitRequest(session_id="x")]), timeout=10, metadata=metadata))
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_probes_stay_open_metrics_status_and_openapi_do_not(server):
    with grpc.insecure_channel(server.address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    assert requests.get(f"{server.http}/healthz", timeout=10).status_code == 200
    assert requests.get(f"{server.http}/readyz", timeout=10).status_code == 200
    # /metrics and /v1/status name jobs and sessions; /openapi.json describes the endpoints.
    for path in ("/metrics", "/v1/status", "/openapi.json"):
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            refused = requests.get(f"{server.http}{path}", headers=headers, timeout=10)
            assert refused.status_code == 401 and "auth token" in refused.text, (path, refused.text)
    token = {"Authorization": f"Bearer {TOKEN}"}
    ok = requests.get(f"{server.http}/v1/status", headers=token, timeout=10)
    assert ok.status_code == 200 and ok.json()["vocab_size"] == 384
    metrics = requests.get(f"{server.http}/metrics", headers=token, timeout=10)
    assert metrics.status_code == 200 and "teacher_rpc_errors_total" in metrics.text
    openapi = requests.get(f"{server.http}/openapi.json", headers=token, timeout=10)
    assert openapi.status_code == 200 and "/v1/status" in openapi.json()["paths"]
