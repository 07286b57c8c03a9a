"""On a machine with two GPUs: a teacher on GPU 0, students on GPU 1, over NCCL."""

from __future__ import annotations

import pytest
import torch

from student_trainer import TeacherClient
from student_trainer.errors import Incompatible
from teacher_server.launcher import ServerProcess
from tests.helpers import build_tiny_model, finish_student, start_student, wait_for_line

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("teacher") / "model")


@pytest.fixture(scope="module")
def server(model_dir):
    server = ServerProcess("--model", str(model_dir), "--device", "cuda:0", "--max-batch-tokens", "4096",
                           "--max-seq-len", "512")
    yield server
    assert server.stop() == 0, server.log


def test_two_students_on_gpu1_receive_exact_outputs_over_nccl(server, model_dir, tmp_path):
    outs = [tmp_path / "a.json", tmp_path / "b.json"]
    a = start_student(server.address, model_dir, outs[0], "--device", "cuda:1", "--batches", "16",
                      "--inflight", "4", "--max-len", "200", "--pause-s", "0.05", "--job-id", "gpu-a", "--seed", "1")
    wait_for_line(a, "JOINED")
    b = start_student(server.address, model_dir, outs[1], "--device", "cuda:1", "--batches", "8", "--inflight", "3",
                      "--max-len", "300", "--topk", "16", "--hidden-layers", "0,1,2", "--job-id", "gpu-b",
                      "--seed", "2")
    reports = [finish_student(b, outs[1]), finish_student(a, outs[0])]
    assert reports[1]["received"] == list(range(16)) and reports[0]["received"] == list(range(8))
    for report in reports:
        assert report["backend"] == "nccl", report
        for kind, diff in report["worst"].items():
            # Same kernels on both GPUs in float32 (TF32 off): the differences are
            # those of batching different rows together.
            assert diff <= 1e-4, (kind, diff, report)


def test_the_head_at_join_the_final_hidden_state_and_attention_inputs_over_nccl(server, model_dir, tmp_path):
    # The head crosses the group once, right after the handshake, before the first batch.
    out = tmp_path / "head.json"
    report = finish_student(start_student(server.address, model_dir, out, "--device", "cuda:1", "--batches", "8",
                                          "--inflight", "3", "--max-len", "200", "--no-logits", "--topk", "0",
                                          "--hidden-layers", "", "--final-hidden", "--attention-layers", "0,1"), out)
    assert report["backend"] == "nccl" and report["received"] == list(range(8)) and report["checked"] == 8
    assert set(report["worst"]) >= {"final_hidden", "head_weight", "head_logits", "attention"}, report
    for kind, diff in report["worst"].items():
        assert diff <= 1e-4, (kind, diff, report)


def test_student_on_the_teachers_gpu_is_refused(server):
    with pytest.raises(Incompatible, match="CUDA_VISIBLE_DEVICES"):
        TeacherClient(server.address, "cuda:0")


def test_cpu_student_of_a_gpu_teacher_uses_gloo(server, model_dir, tmp_path):
    out = tmp_path / "cpu.json"
    report = finish_student(start_student(server.address, model_dir, out, "--device", "cpu", "--batches", "4"), out)
    assert report["backend"] == "gloo"
    assert all(diff <= 1e-4 for diff in report["worst"].values()), report
