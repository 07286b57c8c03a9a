"""On a machine with two GPUs: a student dies while a 1 GiB payload is in flight to it.

The teacher runs on GPU 0 with a Llama-3-sized vocabulary (128256) on a tiny body, so one
3 x 700 batch of float32 logits is 1.0 GiB. Two students on GPU 1 receive such batches over
NCCL. The victim is frozen (SIGSTOP) until the teacher shows a batch of it submitted and not
yet sent: its sends are posted and cannot complete, since a stopped student posts no
receive. Then it is killed (-9). The teacher must abort that session's group only, stay up
(/healthz, a GetStatus call) and keep serving the survivor exact outputs.

Printed: detection (kill -> the session gone from /v1/status) and recovery (kill -> the
survivor's next batch complete, and the survivor's longest wait between two batches).

    bash bench/run_gpu.sh faults      # or: python -m pytest -q -s -m gpu tests/gpu/test_gpu_faults.py
"""

from __future__ import annotations

import os
import signal
import time

import grpc
import pytest
import requests
import torch

from distill_common.proto.teacher.v1 import teacher_pb2 as pb
from distill_common.proto.teacher.v1 import teacher_pb2_grpc as pb_grpc
from teacher_server.launcher import ServerProcess
from tests.helpers import build_tiny_model, finish_student, start_student, status_sessions, wait_for_line, wait_until

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")]

VOCAB = 128256
SHAPE = (3, 700)  # 2100 tokens x 128256 x 4 bytes = 1.003 GiB of float32 logits per batch
LEASE_S = 5.0
TRANSFER_TIMEOUT_S = 5.0
FREEZE_TRIES = 40


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("teacher") / "model", vocab_size=VOCAB, layers=1)


@pytest.fixture(scope="module")
def server(model_dir):
    server = ServerProcess("--model", str(model_dir), "--device", "cuda:0", "--max-batch-tokens", "8192",
                           "--max-seq-len", "1024", "--lease-s", str(LEASE_S), "--heartbeat-interval-s", "0.5",
                           "--transfer-timeout-s", str(TRANSFER_TIMEOUT_S))
    yield server
    assert server.stop() == 0, server.log[-3000:]


def test_killed_student_with_a_gib_in_flight_leaves_the_teacher_serving(server, model_dir, tmp_path):
    payload_bytes = SHAPE[0] * SHAPE[1] * VOCAB * 4
    assert payload_bytes >= 1 << 30
    stop_file = tmp_path / "stop"
    shape = f"{SHAPE[0]}x{SHAPE[1]}"
    common = ("--device", "cuda:1", "--batches", "0", "--stop-file", str(stop_file), "--shape", shape,
              "--topk", "0", "--hidden-layers", "", "--max-len", str(SHAPE[1]))
    survivor = start_student(server.address, model_dir, tmp_path / "survivor.json", *common, "--inflight", "2",
                             "--job-id", "gpu-survivor", "--seed", "1")
    victim = start_student(server.address, model_dir, tmp_path / "victim.json", *common, "--inflight", "4",
                           "--check-every", "1000000", "--job-id", "gpu-victim", "--seed", "2")
    try:
        survivor_id = wait_for_line(survivor, "JOINED").split()[1]
        victim_id = wait_for_line(victim, "JOINED").split()[1]
        wait_until(lambda: all(status_sessions(server.http).get(i, {}).get("batches_sent", 0) >= 2
                               for i in (survivor_id, victim_id)), 120, "both students to receive two batches")

        # Freeze the victim until a batch of it is stuck at the teacher (sent by the engine,
        # not received: the student posts no receive while stopped); then kill it.
        for _ in range(FREEZE_TRIES):
            os.kill(victim.pid, signal.SIGSTOP)
            time.sleep(0.5)  # the engine computes what was queued and posts its sends
            if status_sessions(server.http)[victim_id]["inflight"] >= 1:
                break
            os.kill(victim.pid, signal.SIGCONT)
            time.sleep(0.2)
        else:
            pytest.fail(f"the victim never had a batch in flight while frozen ({FREEZE_TRIES} tries)")
        stuck = status_sessions(server.http)[victim_id]
        os.kill(victim.pid, signal.SIGKILL)
        killed_at, killed_wall = time.monotonic(), time.time()

        wait_until(lambda: victim_id not in status_sessions(server.http), LEASE_S + TRANSFER_TIMEOUT_S + 10,
                   "the killed student's session to end", 0.02)
        detection_s = time.monotonic() - killed_at
        assert requests.get(f"{server.http}/healthz", timeout=10).status_code == 200
        with grpc.insecure_channel(server.address) as channel:
            status = pb_grpc.TeacherServiceStub(channel).GetStatus(pb.GetStatusRequest(), timeout=10)
        assert [s.session_id for s in status.sessions] == [survivor_id]

        served = status_sessions(server.http)[survivor_id]["batches_sent"]
        wait_until(lambda: status_sessions(server.http)[survivor_id]["batches_sent"] >= served + 3, 60,
                   "the survivor to receive three more batches after the detection")
        stop_file.touch()
        report = finish_student(survivor, tmp_path / "survivor.json", timeout_s=300)
        assert report["backend"] == "nccl"
        assert report["received"] == list(range(len(report["received"])))
        # Same kernels on both GPUs in float32 (TF32 off): the differences are those of
        # batching different rows together.
        assert all(diff <= 1e-4 for diff in report["worst"].values()), report["worst"]
        times = report["received_at"]
        recovery_s = min(t for t in times if t > killed_wall) - killed_wall
        longest_gap_s = max(b - a for a, b in zip(times, times[1:]))
        print(f"\nvictim at the kill: {stuck['inflight']} batch(es) of {payload_bytes / (1 << 30):.2f} GiB in flight, "
              f"{stuck['batches_sent']} sent before")
        print(f"detection (kill -> session gone from /v1/status): {detection_s:.2f} s "
              f"(lease {LEASE_S:.0f} s, transfer timeout {TRANSFER_TIMEOUT_S:.0f} s)")
        print(f"recovery (kill -> survivor's next batch complete): {recovery_s:.3f} s; survivor's longest wait "
              f"between two batches: {longest_gap_s:.3f} s; survivor batches: {len(times)}, "
              f"{sum(t > killed_wall for t in times)} after the kill")
        assert server.proc.poll() is None
    finally:
        stop_file.touch()
        for proc in (survivor, victim):
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
                proc.kill()
            proc.communicate(timeout=60)
