"""Transport access: TLS (and mutual TLS) on gRPC and HTTP from real servers and real
clients with right and wrong credentials, and the request-size limit (--max-request-bytes).

Certificates are made here with the openssl CLI, in a temporary directory: a CA that signs
the server's certificate, a CA that signs a client certificate (mutual TLS) and an
unrelated CA (the wrong one). No key is committed.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
import requests
import torch

from student_trainer import Logits, TeacherClient, TopK
from student_trainer.config import TrainConfig
from student_trainer.errors import AuthenticationFailed, LimitExceeded, TeacherUnavailable
from teacher_server.config import ServerConfig
from teacher_server.launcher import ServerProcess, child_env
from tests.attacks import H2_PREFACE
from tests.helpers import ROOT, build_tiny_model

TOKEN = "tls-and-token"
MAX_REQUEST_BYTES = 1 << 20
# A TLS mismatch is reported at once; a plaintext connection the server keeps closing
# after ~2 s. Far below the 30 s join timeout the clients below are given.
FAST_FAILURE_S = 15.0

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None,
                                reason="the openssl CLI is needed to make the test certificates")


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _make_ca(directory: Path, name: str) -> None:
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.pem",
             "-days", "1", "-subj", f"/CN={name}", cwd=directory)


def _make_cert(directory: Path, name: str, ca: str, san: str) -> None:
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
             "-subj", f"/CN={name}", cwd=directory)
    (directory / f"{name}.ext").write_text(f"subjectAltName={san}\n")
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key", "-CAcreateserial",
             "-out", f"{name}.pem", "-days", "1", "-extfile", f"{name}.ext", cwd=directory)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("pki")
    for ca in ("ca", "client-ca", "wrong-ca"):
        _make_ca(d, ca)
    _make_cert(d, "server", "ca", "DNS:localhost,IP:127.0.0.1")
    _make_cert(d, "client", "client-ca", "DNS:student")
    _make_cert(d, "stranger", "wrong-ca", "DNS:student")
    return d


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("teacher") / "model")


@pytest.fixture(scope="module")
def servers(pki, model_dir):
    """Four teachers, started side by side: plaintext (with a 1 MiB request limit), TLS with
    an auth token, mutual TLS, and plaintext with room for one gRPC connection."""
    tls = ("--tls-cert", str(pki / "server.pem"), "--tls-key", str(pki / "server.key"))
    specs = {
        "plain": (("--max-request-bytes", str(MAX_REQUEST_BYTES), "--max-batch-tokens", "4096",
                   "--max-seq-len", "1024"), None),
        "tls": (tls, child_env(TEACHER_AUTH_TOKEN=TOKEN)),
        "mtls": ((*tls, "--tls-client-ca", str(pki / "client-ca.pem")), None),
        "capped": (("--grpc-max-connections", "1"), None),
    }
    started, errors = {}, []

    def start(name):
        args, env = specs[name]
        try:
            started[name] = ServerProcess("--model", str(model_dir), *args, env=env)
        except Exception as e:  # reported below, after the others are up or failed
            errors.append(e)

    threads = [threading.Thread(target=start, args=(name,)) for name in specs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(200)
    try:
        if errors:
            raise errors[0]
        yield started
    finally:
        for server in started.values():
            server.stop()


def _reference_logits(model_dir: Path, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


def _fails_fast(make_client, error, match):
    start = time.monotonic()
    with pytest.raises(error, match=match) as info:
        make_client()
    assert time.monotonic() - start < FAST_FAILURE_S, f"took {time.monotonic() - start:.1f}s to say: {info.value}"
    return str(info.value)


# ---- TLS ---------------------------------------------------------------------------------


def test_right_ca_and_token_are_served_with_exact_outputs(servers, pki, model_dir):
    ids = torch.randint(0, 384, (2, 9), generator=torch.Generator().manual_seed(3))
    with TeacherClient(servers["tls"].address, "cpu", tls_ca=str(pki / "ca.pem"),
                       auth_token=TOKEN) as client:
        out = client.submit(ids).result(timeout=60)
    assert (out.logits - _reference_logits(model_dir, ids)).abs().max().item() <= 1e-4


def test_right_ca_with_a_wrong_token_is_unauthenticated(servers, pki):
    with pytest.raises(AuthenticationFailed, match="auth token"):
        TeacherClient(servers["tls"].address, "cpu", tls_ca=str(pki / "ca.pem"), auth_token="wrong")


def test_a_wrong_ca_is_refused_at_once_and_names_the_argument(servers, pki):
    message = _fails_fast(lambda: TeacherClient(servers["tls"].address, "cpu", tls_ca=str(pki / "wrong-ca.pem"),
                                                auth_token=TOKEN, join_timeout_s=30),
                          TeacherUnavailable, "not signed by the CA")
    assert "--teacher-tls-ca" in message and "CERTIFICATE_VERIFY_FAILED" in message


def test_a_plaintext_client_of_a_tls_teacher_is_told_to_pass_the_ca(servers):
    message = _fails_fast(lambda: TeacherClient(servers["tls"].address, "cpu", auth_token=TOKEN, join_timeout_s=30),
                          TeacherUnavailable, "may serve TLS")
    assert "--teacher-tls-ca" in message


def test_a_tls_client_of_a_plaintext_teacher_is_told_to_drop_the_ca(servers, pki):
    _fails_fast(lambda: TeacherClient(servers["plain"].address, "cpu", tls_ca=str(pki / "ca.pem"), join_timeout_s=30),
                TeacherUnavailable, "does not speak TLS")


def test_a_client_of_a_teacher_at_its_connection_cap_is_told_so_and_not_to_configure_tls(servers):
    """The teacher closes each new connection at once while its one allowed connection is held: the
    client says so (after waiting its join timeout: the cap heals as connections close), as does the
    CLI; once the connection is gone the same client is served."""
    server = servers["capped"]
    with socket.create_connection(("127.0.0.1", server.grpc_port)) as held:
        held.sendall(H2_PREFACE)
        time.sleep(0.5)
        start = time.monotonic()
        with pytest.raises(TeacherUnavailable, match="--grpc-max-connections cap") as info:
            TeacherClient(server.address, "cpu", join_timeout_s=4)
        assert time.monotonic() - start >= 3.5, f"gave up before its join timeout: {info.value}"
        assert "tls_ca" not in str(info.value) and "--tls-cert" not in str(info.value), info.value
        cli = _cli("status", server.address, "--timeout-s", "3")
        assert cli.returncode == 1 and "--grpc-max-connections cap" in cli.stderr, cli.stderr
        assert "--tls-ca" not in cli.stderr, cli.stderr
    with TeacherClient(server.address, "cpu", join_timeout_s=30) as client:
        assert client.submit(torch.randint(0, 384, (1, 5))).result(timeout=60).logits.shape == (1, 5, 384)


def test_https_with_the_ca_works_and_plain_http_does_not(servers, pki):
    server = servers["tls"]
    https = f"https://127.0.0.1:{server.http_port}"
    assert requests.get(f"{https}/healthz", verify=str(pki / "ca.pem"), timeout=10).json() == {"status": "ok"}
    assert requests.get(f"{https}/v1/status", verify=str(pki / "ca.pem"), timeout=10).status_code == 401
    status = requests.get(f"{https}/v1/status", verify=str(pki / "ca.pem"), timeout=10,
                          headers={"Authorization": f"Bearer {TOKEN}"})
    assert status.status_code == 200 and status.json()["vocab_size"] == 384
    with pytest.raises(requests.exceptions.SSLError):
        requests.get(f"{https}/healthz", verify=str(pki / "wrong-ca.pem"), timeout=10)
    with pytest.raises(requests.exceptions.ConnectionError):
        requests.get(f"{server.http}/healthz", timeout=10)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "teacher_server", *args], capture_output=True, text=True,
                          timeout=60, env=child_env(), cwd=ROOT)


def test_admin_commands_over_tls(servers, pki):
    address = servers["tls"].address
    ok = _cli("info", address, "--tls-ca", str(pki / "ca.pem"), "--auth-token", TOKEN)
    assert ok.returncode == 0 and "vocab size" in ok.stdout, ok.stderr
    plain = _cli("status", address, "--auth-token", TOKEN, "--timeout-s", "5")
    assert plain.returncode == 1 and "UNAVAILABLE" in plain.stderr and "--tls-ca" in plain.stderr, plain.stderr
    missing = _cli("status", address, "--tls-ca", str(pki / "nope.pem"))
    assert missing.returncode == 2 and "--tls-ca" in missing.stderr and "cannot read" in missing.stderr


# ---- mutual TLS ----------------------------------------------------------------------------


def test_mutual_tls_needs_a_client_certificate_its_ca_signed(servers, pki):
    address, ca = servers["mtls"].address, str(pki / "ca.pem")
    with TeacherClient(address, "cpu", outputs=(Logits(), TopK(3)), tls_ca=ca, tls_cert=str(pki / "client.pem"),
                       tls_key=str(pki / "client.key")) as client:
        out = client.submit(torch.randint(0, 384, (1, 5))).result(timeout=60)
    assert out.topk_indices.shape == (1, 5, 3)
    message = _fails_fast(lambda: TeacherClient(address, "cpu", tls_ca=ca, join_timeout_s=30),
                          TeacherUnavailable, "client certificate")
    assert "--teacher-tls-cert" in message
    _fails_fast(lambda: TeacherClient(address, "cpu", tls_ca=ca, tls_cert=str(pki / "stranger.pem"),
                                      tls_key=str(pki / "stranger.key"), join_timeout_s=30),
                TeacherUnavailable, "client certificate")


# ---- settings that are wrong before anything connects ----------------------------------------


def test_tls_settings_are_checked_by_flag_name(pki, tmp_path):
    cert, key = str(pki / "server.pem"), str(pki / "server.key")
    with pytest.raises(ValueError, match="--tls-cert and --tls-key go together"):
        ServerConfig(tls_cert=cert)
    with pytest.raises(ValueError, match="--tls-key .*nope.key: cannot read it"):
        ServerConfig(tls_cert=cert, tls_key=str(tmp_path / "nope.key"))
    with pytest.raises(ValueError, match="do not form a usable certificate and key pair"):
        ServerConfig(tls_cert=cert, tls_key=str(pki / "ca.key"))
    with pytest.raises(ValueError, match="--tls-client-ca needs --tls-cert"):
        ServerConfig(tls_client_ca=str(pki / "client-ca.pem"))
    with pytest.raises(ValueError, match="--max-request-bytes 1000 is too small"):
        ServerConfig(max_request_bytes=1000)
    with pytest.raises(ValueError, match="tls_ca / --teacher-tls-ca .*nope.pem: cannot read it"):
        TeacherClient("127.0.0.1:1", "cpu", tls_ca=str(tmp_path / "nope.pem"))
    with pytest.raises(ValueError, match="tls_cert / --teacher-tls-cert and tls_key"):
        TeacherClient("127.0.0.1:1", "cpu", tls_ca=str(pki / "ca.pem"), tls_cert=str(pki / "client.pem"))
    base = dict(teacher="127.0.0.1:1", model="m", data="d")
    with pytest.raises(ValueError, match="--teacher-tls-ca .*nope.pem: cannot read it"):
        TrainConfig(**base, teacher_tls_ca=str(tmp_path / "nope.pem"))
    assert TrainConfig(**base, teacher_tls_ca="system").teacher_tls is True
    assert TrainConfig(**base).teacher_tls is None


def test_the_server_refuses_to_start_with_a_cert_and_no_key(pki):
    result = _cli("--tls-cert", str(pki / "server.pem"))
    assert result.returncode == 2 and "--tls-cert and --tls-key go together" in result.stderr, result.stderr


# ---- --max-request-bytes ------------------------------------------------------------------------


def test_requests_over_max_request_bytes_are_resource_exhausted(servers):
    # grpc enforces the limit before the teacher's handlers see the bytes, so the message is
    # grpc's own ("Received message larger than max (N vs. LIMIT)"); docs/security.md names
    # the flag. Just under the limit, the bytes reach the teacher (and are malformed).
    server = servers["plain"]
    with grpc.insecure_channel(server.address, options=[("grpc.max_send_message_length", 64 << 20)]) as channel:
        submit = channel.unary_unary("/teacher.v1.TeacherService/Submit")
        with pytest.raises(grpc.RpcError) as over:
            submit(b"\x0a" + b"\xff" * (MAX_REQUEST_BYTES + 1024), timeout=30)
        assert over.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f"vs. {MAX_REQUEST_BYTES})" in over.value.details(), over.value.details()
        with pytest.raises(grpc.RpcError) as under:
            submit(b"\x0a" + b"\xff" * (MAX_REQUEST_BYTES - 4096), timeout=30)
        assert under.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "malformed" in under.value.details()
    with TeacherClient(server.address, "cpu") as client:
        # 80k int64 ids = 640 KiB, under the limit: refused by the teacher's own --max-batch-tokens.
        with pytest.raises(LimitExceeded, match="--max-batch-tokens"):
            client.submit(torch.zeros(80, 1000, dtype=torch.int64)).result(timeout=60)
        assert client.submit(torch.randint(0, 384, (1, 4))).result(timeout=60).logits.shape == (1, 4, 384)
    with TeacherClient(server.address, "cpu") as client:
        # 160k int64 ids = 1.25 MiB: grpc ends the submit stream; the client says so.
        with pytest.raises(LimitExceeded, match="larger than max"):
            client.submit(torch.zeros(160, 1000, dtype=torch.int64)).result(timeout=60)
    with TeacherClient(server.address, "cpu") as client:  # the teacher serves on
        assert client.submit(torch.randint(0, 384, (2, 4))).result(timeout=60).logits.shape == (2, 4, 384)
    assert server.proc.poll() is None
