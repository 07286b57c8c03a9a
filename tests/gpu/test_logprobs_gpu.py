"""On two GPUs: log-probabilities at given tokens from a teacher on GPU 0 to a student on GPU 1
over NCCL, against log_softmax of the same model run on GPU 1 (NextTokenLogprobs, ScoredLogprobs).

The large vocabulary (builtin:wide, 128,256) takes the derive through several row chunks on the
device; the tiny model's batches are padded."""

from __future__ import annotations

import pytest
import torch

from distill_common.models import load_causal_lm
from student_trainer import NextTokenLogprobs, ScoredLogprobs, TeacherClient
from teacher_server.launcher import ServerProcess
from tests.helpers import build_tiny_model

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")]

# Same float32 kernels on both GPUs (TF32 off); what differs is which rows share a forward.
TOLERANCE = 1e-4


@pytest.fixture(autouse=True)
def no_tf32():
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = previous


def _check(teacher: TeacherClient, local, batches, temperature: float) -> None:
    futures = [teacher.submit(ids, mask, score_ids=score) for ids, mask, score in batches]
    for (ids, mask, score), future in zip(batches, futures):
        out = future.result(timeout=300)
        assert out.next_token_logprobs.device == out.scored_logprobs.device == torch.device("cuda", 1)
        ids, mask, score = ids.to("cuda:1"), mask.to("cuda:1"), score.to("cuda:1")
        with torch.no_grad():
            log_p = torch.log_softmax(local(input_ids=ids, attention_mask=mask).logits.float() / temperature, -1)
        real = mask.bool()
        keep = real[:, :-1] & real[:, 1:]
        nxt = log_p[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
        assert (out.next_token_logprobs[:, :-1] - nxt)[keep].abs().max() <= TOLERANCE
        assert (out.scored_logprobs - log_p.gather(-1, score))[real].abs().max() <= TOLERANCE
        assert (out.next_token_logprobs[:, :-1][~keep] == 0).all() and (out.scored_logprobs[~real] == 0).all()


def test_a_wide_vocabulary_in_chunks_on_the_device():
    server = ServerProcess("--model", "builtin:wide", "--device", "cuda:0", "--max-batch-tokens", "8192",
                           "--max-seq-len", "4096", "--max-score-ids", "32")
    try:
        local = load_causal_lm("builtin:wide", device=torch.device("cuda:1")).eval()
        generator = torch.Generator().manual_seed(0)
        batches = [(torch.randint(0, 128256, (2, 2048), generator=generator), torch.ones(2, 2048, dtype=torch.int64),
                    torch.randint(0, 128256, (2, 2048, 32), generator=generator)) for _ in range(3)]
        with TeacherClient(server.address, "cuda:1", outputs=(NextTokenLogprobs(), ScoredLogprobs(32)),
                           max_inflight=3) as teacher:
            assert teacher.backend == "nccl"
            _check(teacher, local, batches, 1.0)
    finally:
        assert server.stop() == 0, server.log


def test_padded_batches_at_a_temperature(tmp_path):
    model_dir = build_tiny_model(tmp_path / "model")
    server = ServerProcess("--model", str(model_dir), "--device", "cuda:0", "--max-batch-tokens", "4096",
                           "--max-seq-len", "512", "--max-score-ids", "8")
    try:
        from transformers import AutoModelForCausalLM

        local = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to("cuda:1").eval()
        generator = torch.Generator().manual_seed(1)
        batches = []
        for rows, seq in ((3, 100), (1, 7), (4, 300)):
            mask = torch.ones(rows, seq, dtype=torch.int64)
            mask[0, seq // 2:] = 0  # right padding
            if rows > 1:
                mask[1, :3] = 0  # left padding
            batches.append((torch.randint(0, 384, (rows, seq), generator=generator), mask,
                            torch.randint(0, 384, (rows, seq, 8), generator=generator)))
        with TeacherClient(server.address, "cuda:1", outputs=(NextTokenLogprobs(0.7), ScoredLogprobs(8, 0.7)),
                           max_inflight=3) as teacher:
            _check(teacher, local, batches, 0.7)
    finally:
        assert server.stop() == 0, server.log
