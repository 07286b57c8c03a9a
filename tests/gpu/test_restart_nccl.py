"""On a machine with two GPUs: a teacher on GPU 0 killed with SIGKILL while batches are in
flight to a client on GPU 1 over NCCL, and started again on the same ports. The client aborts
the old communicator, joins again, builds a new one and receives every batch exactly once.

    python -m pytest -q -m gpu tests/gpu/test_restart_nccl.py
"""

from __future__ import annotations

import threading

import pytest
import torch

from student_trainer import Logits, TeacherClient, TopK
from tests.helpers import build_tiny_model
from tests.test_restart import RestartableTeacher, session_status

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")]

VOCAB = 384  # build_tiny_model's


def test_nccl_client_gets_every_batch_once_across_a_teacher_kill_9(tmp_path):
    from transformers import AutoModelForCausalLM

    model_dir = build_tiny_model(tmp_path / "model")
    teacher = RestartableTeacher("--model", str(model_dir), "--device", "cuda:0", "--max-batch-tokens", "4096",
                                 "--max-seq-len", "512")
    errors, previous_hook = [], threading.excepthook
    threading.excepthook = lambda args: errors.append(f"{args.thread.name}: {args.exc_value!r}")
    try:
        server = teacher.running()
        generator = torch.Generator().manual_seed(0)
        batches = [torch.randint(0, VOCAB, (4, 256), generator=generator) for _ in range(12)]
        delivered_first, resolved = 4, []
        with TeacherClient(server.address, "cuda:1", outputs=(Logits(), TopK(8)), max_inflight=8, job_id="nccl-restart",
                           reconnect_timeout_s=180) as client:
            assert client.backend == "nccl"
            futures = [client.submit(ids) for ids in batches[:delivered_first]]
            for future in futures:
                future.result(timeout=120)
            teacher.freeze()
            futures += [client.submit(ids) for ids in batches[delivered_first:]]
            for i, future in enumerate(futures):
                future.add_done_callback(lambda _, i=i: resolved.append(i))
            server = teacher.restart()
            outputs = [future.result(timeout=300) for future in futures]
            status = session_status(server, client.session_id)
            assert client.reconnects == 1
    finally:
        threading.excepthook = previous_hook
        teacher.close()
    assert not errors, errors
    assert resolved == list(range(len(batches)))
    assert [out.batch_id for out in outputs] == list(range(len(batches)))
    assert status is not None and status["batches_submitted"] == len(batches) - delivered_first, status
    model = AutoModelForCausalLM.from_pretrained(model_dir).to("cuda:1").eval()
    for i, (ids, out) in enumerate(zip(batches, outputs)):
        with torch.no_grad():
            logits = model(input_ids=ids.to("cuda:1")).logits
        assert out.logits.device == torch.device("cuda:1")
        assert (out.logits - logits).abs().max().item() <= 1e-4, i
