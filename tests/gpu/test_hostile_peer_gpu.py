"""On one GPU: a student that sends over its own session's data plane what an honest one never
would ends that session only, also when the teacher runs on a GPU (its transport processes
then take the outputs over CUDA IPC) and when the peer speaks NCCL.

- Every mode of tests/hostile_peer.py over gloo (the hostile student on the CPU), as on CPU.
- Two NCCL peers on the teacher's own GPU (one GPU is all this test has): one that says its GPU
  is another (so the teacher's UUID check lets it in) and forms its end on the same GPU, and
  one that reads the NCCL unique id from its rendezvous and sends forged lengths and bytes
  to the teacher's bootstrap root.

Meanwhile an honest student of another job (CPU, gloo) is served throughout, every batch
checked against the local model, without a reconnect. Prints each mode's ending and the GPU
memory each transport process holds.

    bash bench/run_gpu.sh hostile   # or: python3 -m pytest -q -s -m gpu tests/gpu/test_hostile_peer_gpu.py
"""

from __future__ import annotations

import json
import subprocess

import pytest
import torch

from teacher_server.launcher import ServerProcess, child_env
from tests.attacks import HostilePeers, transport_processes
from tests.helpers import build_tiny_model, finish_student, free_port, start_student, wait_for_line, wait_until
from tests.hostile_peer import MODES, NCCL_MODES

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

OPERATOR = "hostile-gpu-operator-token"
ATTACKER = "attacker-job-token-0123456789"
HONEST = "honest-job-token-0123456789ab"
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = build_tiny_model(tmp_path_factory.mktemp("teacher") / "model")
    tokens = tmp_path_factory.mktemp("tokens") / "tokens.json"
    tokens.write_text(json.dumps({"attacker": {"token": ATTACKER, "max_sessions": 3},
                                  "honest": {"token": HONEST, "max_sessions": 2}}))
    grpc_port, http_port = free_port(), free_port()
    work = tmp_path_factory.mktemp("honest")
    stop, out = work / "stop", work / "report.json"
    student = start_student(f"127.0.0.1:{grpc_port}", model_dir, out, "--batches", "0", "--stop-file", str(stop),
                            "--topk", "5", "--max-len", "24", "--job-id", "honest", "--pause-s", "0.02",
                            env=child_env(TEACHER_AUTH_TOKEN=HONEST))
    server = ServerProcess("--model", str(model_dir), "--device", "cuda:0", "--port", str(grpc_port),
                           "--http-port", str(http_port), "--max-sessions", "8", "--join-timeout-s", "10",
                           "--transfer-timeout-s", "20", "--heartbeat-interval-s", "0.5", "--job-tokens", str(tokens),
                           env=child_env(TEACHER_AUTH_TOKEN=OPERATOR))
    session_id = wait_for_line(student, "JOINED").split()[1]
    yield server
    stop.touch()
    report = finish_student(student, out)
    assert report["reconnects"] == 0 and report["session_id"] == session_id, report
    assert report["checked"] == len(report["received"]) > 0
    assert all(value < TOLERANCE for value in report["worst"].values()), report["worst"]
    assert server.stop() == 0, server.log[-3000:]


def gpu_memory_mib_by_pid() -> dict[int, int]:
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=30).stdout
    return {int(pid): int(mib) for pid, mib in (line.split(", ") for line in out.strip().splitlines() if line)}


def run_modes(server, modes) -> list[dict]:
    attack = HostilePeers(server.address, ATTACKER, "attacker", modes=modes, repeat=False)
    with attack:
        wait_until(lambda: len(attack.results) == len(modes), 300, "every hostile mode to finish")
    for result in attack.results:
        print(f"{result['mode']:>20}: {result['ended']}")
    assert server.proc.poll() is None, "the teacher died"
    assert all(result["ended"] for result in attack.results), attack.results
    wait_until(lambda: transport_processes(server.proc.pid) == 1, 20, "the hostile sessions' processes to go")
    return attack.results


def test_hostile_gloo_peers_of_a_cuda_teacher(server):
    by_pid = gpu_memory_mib_by_pid()
    print(f"GPU memory: teacher {by_pid.get(server.proc.pid)} MiB; all processes {by_pid}")
    results = {r["mode"]: r["ended"] for r in run_modes(server, MODES)}
    assert "transport process was ended by SIG" in results["address_length"], results
    assert "transport process was ended by SIGABRT" in results["proof_long"], results


def test_hostile_nccl_peers_end_their_session_only(server):
    run_modes(server, NCCL_MODES)


def _sum_in_transport_process(conn) -> None:
    """A transport process's side of the hand-over (as session_process._worker takes a batch)."""
    from multiprocessing.reduction import ForkingPickler

    tensor = ForkingPickler.loads(conn.recv_bytes())  # its stream waits for the producer's event
    conn.send_bytes(repr(float(tensor.double().sum())).encode())


def test_outputs_cross_to_a_transport_process_by_cuda_ipc():
    """An NCCL session's outputs reach its transport process as CUDA IPC handles: the process
    reads what the producing stream wrote, also when that stream is still busy at hand-over
    (one GPU cannot form an NCCL session with a second process, so the send itself is not run
    here)."""
    from multiprocessing.reduction import ForkingPickler

    from teacher_server import session_process

    session_process.start()
    parent, child = session_process._context.Pipe()
    proc = session_process._context.Process(target=_sum_in_transport_process, args=(child,), daemon=True)
    proc.start()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        big = torch.randn(8192, 8192, device="cuda")
        for _ in range(20):  # keeps the stream busy past the hand-over
            big = big @ big.T / 8192
        out = big[:4096].contiguous()
        expected = float(out.double().sum().cpu())
        parent.send_bytes(bytes(ForkingPickler.dumps(out)))
    assert parent.poll(60), "the transport process did not answer"
    got = float(parent.recv_bytes())
    proc.join(10)
    assert got == pytest.approx(expected, rel=1e-9), (got, expected)
