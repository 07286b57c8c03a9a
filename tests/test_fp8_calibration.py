"""The FP8 teacher's measurement of itself (teacher_server/fp8_calibration.py), on tiny built
models: the KL it reports against the KL computed the straightforward way from the two models'
logits, the linears it keeps for a bound, bias correction against its formula, and the flags.
The same on SmolLM2-135M-Instruct: tests/test_fp8_smollm2.py (slow)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distill_common.quantization import Quantization
from distill_common.settings import ConfigError
from teacher_server import fp8
from teacher_server import fp8_calibration as calibration
from teacher_server.config import ServerConfig
from tests.helpers import build_tiny_model

HIDDEN = 64  # _scaled_mm wants widths that are multiples of 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("fp8cal") / "model", hidden_size=HIDDEN, layers=3,
                            dtype=torch.bfloat16)


def _model(model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    with torch.no_grad():  # a random model's next-token distributions are near uniform: sharpen them, as training does
        model.lm_head.weight.mul_(30)
    return model


def _ids(model) -> torch.Tensor:
    return calibration.calibration_batch(None, calibration.calibration_texts(""), 4, 64,
                                         model.config.vocab_size)


def _straightforward_kl(reference_model, model, ids) -> torch.Tensor:
    """Per-token KL(reference || model) with torch's own kl_div, in float64."""
    with torch.no_grad():
        p = reference_model(input_ids=ids).logits.double().log_softmax(-1)
        q = model(input_ids=ids).logits.double().log_softmax(-1)
    return F.kl_div(q, p, log_target=True, reduction="none").sum(-1).flatten()


def test_the_measured_kl_is_the_kl_between_the_two_models(model_dir):
    model = _model(model_dir)
    reference = copy.deepcopy(model)
    ids = _ids(model)
    done = calibration.quantize_and_measure(model, fp8.Fp8Plan(bias_correction=False), ids)
    kl = _straightforward_kl(reference, model, ids)
    assert done.cost.tokens == ids.numel() == 256
    assert done.cost.kl_mean == pytest.approx(kl.mean().item(), rel=1e-3, abs=1e-6)  # float32 against float64 sums
    assert done.cost.kl_max == pytest.approx(kl.max().item(), rel=1e-3, abs=1e-6)
    assert done.cost.kl_p99 == pytest.approx(kl.quantile(0.99).item(), rel=1e-3, abs=1e-6)
    assert done.cost.kl_mean > 0 and done.fp8_flop_share == 1.0 and done.rounds == 0
    assert all(isinstance(e[3], fp8.FP8Linear) for e in fp8.decoder_linears(model).values())


def test_a_bound_keeps_the_costliest_linears_until_the_measured_kl_holds(model_dir):
    model = _model(model_dir)
    reference = copy.deepcopy(model)
    ids = _ids(model)
    all_fp8 = calibration.quantize_and_measure(copy.deepcopy(model), fp8.Fp8Plan(), ids).cost.kl_mean
    bound = all_fp8 / 3
    done = calibration.quantize_and_measure(model, fp8.Fp8Plan(max_kl=bound), ids)
    kl = _straightforward_kl(reference, model, ids).mean().item()
    assert kl <= bound * (1 + 1e-3) and done.cost.kl_mean == pytest.approx(kl, rel=1e-3, abs=1e-6)
    assert done.rounds >= 1 and done.plan.keep_linears and done.plan.max_kl == bound
    originals = {name: e[3] for name, e in fp8.decoder_linears(reference).items()}
    linears = fp8.decoder_linears(model)
    for name, (_, _, _, module) in linears.items():
        if name in done.plan.keep_linears:  # back in the model's dtype, its weights as loaded
            assert type(module) is nn.Linear and torch.equal(module.weight, originals[name].weight)
        else:
            assert isinstance(module, fp8.FP8Linear)
    kept_flops = sum(m.in_features * m.out_features for n, m in originals.items() if n in done.plan.keep_linears)
    total = sum(m.in_features * m.out_features for m in originals.values())
    assert done.fp8_flop_share == pytest.approx(1 - kept_flops / total)
    assert 0 < done.fp8_flop_share < 1


def test_the_gradient_shares_add_up_to_the_kl(model_dir):
    """Near d = 0 the KL is quadratic in the linears' output errors: the shares (g_i . d_i / 2)
    add up to the measured KL, to second order."""
    model = _model(model_dir)
    ids = _ids(model)
    with torch.inference_mode():
        reference = calibration.log_probs(model, ids)
    linears = fp8.decoder_linears(model)
    originals = {n: e[3] for n, e in linears.items()}
    fp8.quantize_model(model, fp8.Fp8Plan())
    quantized = {n: e[3] for n, e in fp8.decoder_linears(model).items()}
    with torch.inference_mode():
        measured = calibration.kl_cost(reference, calibration.log_probs(model, ids))[0].kl_mean
    shares = calibration.kl_shares(model, ids, reference, linears, originals, quantized)
    assert set(shares) == set(quantized)
    assert sum(shares.values()) == pytest.approx(measured, rel=0.25)
    assert all(isinstance(e[3], fp8.FP8Linear) for e in fp8.decoder_linears(model).values())  # put back


def test_bias_correction_adds_the_weight_error_on_the_mean_input():
    g = torch.Generator().manual_seed(3)
    linear = nn.Linear(128, 32, bias=True)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(32, 128, generator=g))
        linear.bias.copy_(torch.randn(32, generator=g))
    mean = torch.randn(128, generator=g) * 4 + 1
    layer = fp8.FP8Linear.from_linear(linear, "row", input_mean=mean)
    plain = fp8.FP8Linear.from_linear(linear, "row")
    w_q, w_s = fp8.quantize_rows(linear.weight.detach())
    error = linear.weight.detach().double() - fp8.dequantize(w_q, w_s).double()
    expected = linear.bias.detach().double() + mean.double() @ error.t()
    assert torch.allclose(layer.bias.double(), expected, rtol=1e-5, atol=1e-5)
    # On inputs around the mean, the corrected product is closer to the exact one.
    x = mean + 0.1 * torch.randn(64, 128, generator=g)
    exact = x.double() @ linear.weight.detach().double().t() + linear.bias.detach().double()
    x_bf16 = x.to(torch.bfloat16)
    corrected_error = (layer.reference(x_bf16).double() - exact).norm()
    plain_error = (plain.reference(x_bf16).double() - exact).norm()
    assert corrected_error < plain_error


def test_the_calibration_batch_alternates_the_texts_and_says_when_they_are_short(tmp_path):
    ids = calibration.calibration_batch(None, ("a" * 300, "b" * 200), 3, 100, 512)
    assert ids.tolist() == [[ord("a")] * 100, [ord("b")] * 100, [ord("a")] * 100]
    with pytest.raises(calibration.CalibrationError, match="gives 5 windows of 100 tokens.*asks for 6"):
        calibration.calibration_batch(None, ("a" * 300, "b" * 200), 6, 100, 512)
    bad = tmp_path / "calibration.bin"
    bad.write_bytes(b"\xff\xfe text")
    with pytest.raises(calibration.CalibrationError, match="not UTF-8 text"):
        calibration.calibration_texts(str(bad))
    good = tmp_path / "calibration.txt"
    good.write_text("prose")
    assert calibration.calibration_texts(str(good)) == ("prose",)


def test_calibration_flags(tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("some text")
    plan = ServerConfig(quantize="fp8", fp8_calibration=str(text), fp8_calibration_rows=2, fp8_calibration_seq=64,
                        fp8_max_kl=0.01, fp8_bias_correction="off").fp8_plan()
    assert (plan.calibration, plan.calibration_rows, plan.calibration_seq, plan.max_kl, plan.bias_correction) == (
        str(text), 2, 64, 0.01, False)
    assert ServerConfig(quantize="fp8").fp8_plan().bias_correction
    with pytest.raises(ConfigError, match="add --quantize fp8"):
        ServerConfig(fp8_max_kl=0.01)
    with pytest.raises(ConfigError, match="--fp8-max-kl bounds the KL measured.*--fp8-calibration-rows above 0"):
        ServerConfig(quantize="fp8", fp8_max_kl=0.01, fp8_calibration_rows=0)
    with pytest.raises(ConfigError, match="--fp8-max-kl -1.0 must be a finite number >= 0"):
        ServerConfig(quantize="fp8", fp8_max_kl=-1.0)
    with pytest.raises(ConfigError, match="--fp8-calibration .*missing.txt: no such file"):
        ServerConfig(quantize="fp8", fp8_calibration=str(tmp_path / "missing.txt"))


def test_a_runner_without_calibration_says_it_measured_nothing(model_dir):
    from teacher_server.model_runner import ModelRunner

    runner = ModelRunner(str(model_dir), "cpu", quantize=fp8.Fp8Plan(compile="off", calibration_rows=0))
    q = runner.info.quantization
    assert q.format == "fp8_e4m3" and not q.measured and not q.bias_correction and q.fp8_flop_share == 1.0
    assert "not measured" in str(q)
    assert "did not measure" in q.above(1.0)
    assert Quantization().above(1e-9) == ""  # a teacher in its dtype passes any bound


def test_the_bench_maps_a_calibrated_plan_onto_another_depth(tmp_path):
    """bench/fp8_teacher.py's '+plan' variants time a plan chosen on SmolLM2 (30 layers) on the
    8B shape (32): the same kinds kept at the same relative depth."""
    import json

    from bench.fp8_teacher import plan_for
    from distill_common.models import builtin_model

    model = builtin_model("tiny")  # 2 decoder layers
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"num_layers": 30, "keep_linears": [
        "model.layers.0.self_attn.k_proj", "model.layers.29.mlp.down_proj", "model.layers.14.mlp.up_proj"]}))
    kept = plan_for(model, str(plan))
    assert kept == ("model.layers.0.mlp.up_proj", "model.layers.0.self_attn.k_proj", "model.layers.1.mlp.down_proj")
    fp8.quantize_model(model, fp8.Fp8Plan(keep_linears=kept))
    linears = fp8.decoder_linears(model)
    assert {n for n, e in linears.items() if not isinstance(e[3], fp8.FP8Linear)} == set(kept)
    with pytest.raises(ValueError, match="no decoder linear of that name"):
        fp8.quantize_model(builtin_model("tiny"), fp8.Fp8Plan(keep_linears=("model.layers.5.mlp.up_proj",)))


def test_the_bench_students_learn_from_the_quantized_teachers_own_distribution(monkeypatch):
    """bench/fp8_teacher.py's SmolLM2 students read each teacher's distribution from its cached last
    hidden states through its head: the same log-probabilities as the FP8 teacher's own forward;
    each seed draws its own batches from the pool and starts from its own weights."""
    from bench import fp8_teacher as bench
    from distill_common.models import builtin_model

    monkeypatch.setattr(bench, "DEVICE", "cpu")
    teacher = builtin_model("tiny", torch.bfloat16).eval()
    fp8.quantize_model(teacher, fp8.Fp8Plan())
    windows = torch.randint(0, teacher.config.vocab_size, (6, 17), generator=torch.Generator().manual_seed(0))
    hidden = bench.final_hidden(teacher, windows[:, :-1], rows=4)
    draws = {}
    for seed in (100, 101):
        data = bench.distilled_batches(windows, hidden, teacher.get_output_embeddings(), 3,
                                       torch.Generator().manual_seed(seed))
        draws[seed] = [next(data) for _ in range(2)]
    for ids, target in draws[100] + draws[101]:
        with torch.inference_mode():
            want = teacher(input_ids=ids[:, :-1]).logits.float().log_softmax(-1)
        torch.testing.assert_close(target, want, rtol=0, atol=0)
    assert not all(torch.equal(a[0], b[0]) for a, b in zip(draws[100], draws[101]))
    shape = dict(vocab_size=512, max_position_embeddings=16, **bench.llama_shape(1, 64))
    first, second = (bench.llama(shape, torch.float32, "cpu", seed=s) for s in (100, 101))
    assert not torch.equal(first.lm_head.weight, second.lm_head.weight)
    # A step on cached targets is the step on the teacher run in the loop (not one on the labels).
    ids, target = draws[100][0]
    students = {}
    for how, data, kwargs in (("cached", [(ids, target)], {}), ("teacher", [ids], {"teacher": teacher}),
                              ("labels", [ids], {})):
        students[how] = bench.llama(shape, torch.float32, "cpu", seed=100)
        bench.train(students[how], iter(data), 0, lr=1e-2, steps=1, warmup_steps=1, **kwargs)
    assert torch.equal(students["cached"].lm_head.weight, students["teacher"].lm_head.weight)
    assert not torch.equal(students["cached"].lm_head.weight, students["labels"].lm_head.weight)
