"""FP8 experts (teacher_server/fp8_experts.py) on CPU against a fake quantization written here the
straightforward way: each weight row (or 128 x 128 tile) and each activation row (or 1 x 128
block) scaled by its largest magnitude over 448, rounded to e4m3, scaled back, multiplied in
float32 one token and one expert at a time.
"""

from __future__ import annotations

import pytest
import torch

from teacher_server import fp8_experts, moe
from teacher_server.fp8 import Fp8Plan
from teacher_server.model_runner import ModelRunner
from tests.test_moe import TINY

E4M3, E4M3_MAX = torch.float8_e4m3fn, 448.0


def fake_quantize(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """x [R, C] in float32, each rows x cols tile scaled to e4m3's range, rounded, scaled back."""
    out = torch.empty_like(x, dtype=torch.float32)
    for r in range(0, x.shape[0], rows):
        for c in range(0, x.shape[1], cols):
            tile = x[r:r + rows, c:c + cols].float()
            scale = max(tile.abs().max().item() / E4M3_MAX, 1e-12)
            out[r:r + rows, c:c + cols] = (tile / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3).float() * scale
    return out


@pytest.mark.parametrize("scaling", ["row", "block"])
def test_grouped_fp8_product_equals_fake_quantization(scaling):
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(4, 200, 256, generator=generator).pow(3)  # heavy tails; 200 rows: a partial tile
    x = torch.randn(30, 256, generator=generator).pow(3)
    sizes = [7, 0, 15, 8]  # an expert without rows
    offsets = torch.tensor(sizes).cumsum(0).to(torch.int32)
    weights = fp8_experts.FP8ExpertWeights.quantize(weight, scaling)
    tile = (1, 256) if scaling == "row" else (128, 128)
    expected = torch.empty(30, 200)
    start = 0
    for expert, size in enumerate(sizes):
        w = fake_quantize(weight[expert], *tile)
        for row in range(start, start + size):
            expected[row] = w @ fake_quantize(x[row:row + 1], 1, 256 if scaling == "row" else 128)[0]
        start += size
    torch.testing.assert_close(weights.dequantized(), torch.stack([fake_quantize(w, *tile) for w in weight]),
                               rtol=0, atol=0)
    # float32 sums in another order, over heavy-tailed values: within 1e-5 of the largest output.
    atol = 1e-5 * expected.abs().max().item()
    torch.testing.assert_close(weights(x, offsets), expected, rtol=0, atol=atol)
    torch.testing.assert_close(fp8_experts.reference_product(weights, x, offsets), expected, rtol=0, atol=atol)
    assert fp8_experts.verify(torch.nn.ModuleList([weights]), torch.float32) == 1


def _reference_experts(experts, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The FP8 experts' forward, one token and expert at a time, from the unquantized experts module
    (transformers' weights, gate and biases): the weight rows and each product's input rows
    fake-quantized; the routing weight applied to the down product's input (what is quantized there)."""
    out = torch.zeros_like(hidden)
    gate_up = experts.gate_up_proj if experts.is_transposed else experts.gate_up_proj.transpose(1, 2)
    down = experts.down_proj if experts.is_transposed else experts.down_proj.transpose(1, 2)  # [E, K, N]
    for token in range(hidden.shape[0]):
        for slot in range(index.shape[1]):
            e = int(index[token, slot])
            a = fake_quantize(hidden[token:token + 1], 1, hidden.shape[1])
            projected = a @ fake_quantize(gate_up[e].t(), 1, gate_up.shape[1]).t()
            if experts.has_bias:
                projected = projected + experts.gate_up_proj_bias[e]
            h = experts._apply_gate(projected) * weights[token, slot]
            y = fake_quantize(h, 1, h.shape[1]) @ fake_quantize(down[e].t(), 1, down.shape[1]).t()
            if experts.has_bias:
                y = y + experts.down_proj_bias[e] * weights[token, slot]
            out[token] += y[0]
    return out


@pytest.mark.parametrize("model_type", ["qwen3_moe", pytest.param("gpt_oss", marks=pytest.mark.slow)])
def test_quantize_fp8_puts_every_experts_layer_in_fp8_equal_to_fake_quantization(tmp_path, model_type):
    """--quantize fp8 (row scales) on a tiny model: every MoE layer's experts hold e4m3 weights, and
    each layer's output, captured in the served forward, equals the fake-quantized experts of the
    same seeded weights on the same inputs. gpt_oss: transposed weights, biases, a clamped gate."""
    from transformers import AutoConfig

    AutoConfig.for_model(model_type, initializer_range=0.3, **TINY[model_type]).save_pretrained(tmp_path)
    runner = ModelRunner(f"random:{tmp_path}", "cpu", dtype="float32", quantize=Fp8Plan("row"))
    whole = ModelRunner(f"random:{tmp_path}", "cpu", dtype="float32")  # the same seeded weights, unquantized
    quantized, originals = moe.experts_modules(runner.model), moe.experts_modules(whole.model)
    assert len(quantized) == 2 and all(isinstance(m.down_proj, fp8_experts.FP8ExpertWeights) for m in quantized)
    assert all(m.down_proj.weight.dtype == E4M3 for m in quantized)
    captured = []
    hooks = [m.register_forward_hook(lambda module, args, out: captured.append((args, out))) for m in quantized]
    ids = torch.randint(0, 96, (2, 11), generator=torch.Generator().manual_seed(1))
    runner.forward(ids, torch.ones_like(ids))
    for hook in hooks:
        hook.remove()
    assert len(captured) == 2
    for ((hidden, index, weights), out), original in zip(captured, originals):
        expected = _reference_experts(original, hidden, index, weights)
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())


def test_experts_stored_in_fp8_by_a_checkpoint_are_refused_with_what_to_do():
    """transformers' FP8 experts (a published checkpoint's e4m3 3-D weights, on a GPU) are not served:
    the error says to dequantize and quantize at load instead."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3_moe", **TINY["qwen3_moe"]))
    for experts in moe.experts_modules(model):
        experts.down_proj = torch.nn.Parameter(experts.down_proj.detach().to(E4M3), requires_grad=False)
    with pytest.raises(moe.MoeUnsupported, match=r"dequantize it .*with --quantize fp8 for FP8 experts"):
        moe.install(model)
