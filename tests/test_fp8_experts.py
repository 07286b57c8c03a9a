"""FP8 experts (teacher_server/fp8_experts.py) on CPU against a fake quantization written here the
straightforward way: each weight row (or 128 x 128 tile) and each activation row (or 1 x 128
block) scaled by its largest magnitude over 448, rounded to e4m3, scaled back, multiplied in
float32 one token and one expert at a time.
"""

from __future__ import annotations

import pytest
import torch

from teacher_server import fp8_experts, fp8_rows, moe
from teacher_server.fp8 import Fp8Plan
from teacher_server.model_runner import ModelRunner
from bench.moe_checks import checkable_moe
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


@pytest.mark.parametrize("experts", [1, 2, 3, 8])
def test_the_load_check_holds_every_count_of_experts(experts):
    """fp8_experts.verify, which every FP8 teacher runs at load, on weights of 1 to 8 experts (an
    expert-parallel rank holds E / N of them: 2 for Mixtral's 8 over 4 ranks): each expert's product
    is checked and the check passes (with 2 it once sent more rows than it had)."""
    holder = torch.nn.Module()
    holder.weight = fp8_experts.FP8ExpertWeights.quantize(torch.randn(experts, 48, 128), "block")
    assert fp8_experts.verify(holder, torch.float32) == 1


def test_gate_rows_interleaved_for_the_gpu_give_the_same_products_and_gate_off_it():
    """An expert weight whose gate and up rows were interleaved for the Triton kernel's gated
    epilogue (fp8_experts.interleave_gate), then run where that kernel does not (moved to a CPU):
    its product, its dequantized weight and its gate equal those of the same weight never
    interleaved, and the interleaving moved rows and their scales together."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(3, 256, 96, generator=generator)
    plain = fp8_experts.FP8ExpertWeights.quantize(weight, "row")
    interleaved = fp8_experts.FP8ExpertWeights.quantize(weight, "row")
    interleaved.kernel = "triton"  # what a CUDA device would have chosen
    assert interleaved.interleave_gate(64) and interleaved.gate_group == 64
    assert torch.equal(interleaved.weight[0, 64:128], plain.weight[0, 128:192])  # up rows after their gate rows
    assert torch.equal(interleaved.weight_scale[1, 64:128], plain.weight_scale[1, 128:192])
    interleaved.kernel = "dequantize"
    x = torch.randn(20, 96, generator=generator)
    offsets = torch.tensor([7, 7, 20], dtype=torch.int32)
    route = torch.rand(20, generator=generator)
    torch.testing.assert_close(interleaved.dequantized(), plain.dequantized(), rtol=0, atol=0)
    torch.testing.assert_close(interleaved(x, offsets), plain(x, offsets), rtol=0, atol=0)
    torch.testing.assert_close(fp8_experts.reference_product(interleaved, x, offsets),
                               fp8_experts.reference_product(plain, x, offsets), rtol=0, atol=0)
    gate, up = plain(x, offsets).chunk(2, dim=-1)
    torch.testing.assert_close(interleaved.gated(x, offsets, route), torch.nn.functional.silu(gate) * up
                               * route.unsqueeze(-1), rtol=1e-6, atol=1e-6)
    assert not plain.interleave_gate(64)  # not on the Triton kernel: left as it is


def test_experts_stored_in_fp8_without_block_scales_are_refused_with_what_to_do():
    """3-D e4m3 expert weights without the 128 x 128 scales fp8_experts.adopt_published reads are
    not served: the error says to dequantize the checkpoint and quantize at load instead."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3_moe", **TINY["qwen3_moe"]))
    for experts in moe.experts_modules(model):
        experts.down_proj = torch.nn.Parameter(experts.down_proj.detach().to(E4M3), requires_grad=False)
    with pytest.raises(moe.MoeUnsupported, match=r"dequantize the checkpoint .*with --quantize fp8 for FP8 experts"):
        moe.install(model)


# ---- a published FP8 MoE checkpoint ------------------------------------------------------------

# Qwen3-30B-A3B-FP8's layout in small: every linear of the decoder and every expert's gate, up and
# down projection stored in e4m3 with a float32 `weight_scale_inv` per 128 x 128 tile (one expert's
# matrices under their own names, as the release stores them); embeddings, norms, routers and the
# head in bf16. 128-wide matrices: whole tiles, and a partial one (vocabulary 96 is not quantized).
PUBLISHED = dict(vocab_size=96, hidden_size=256, intermediate_size=256, moe_intermediate_size=128,
                 num_hidden_layers=2, head_dim=64, num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                 num_experts_per_tok=2, norm_topk_prob=True, tie_word_embeddings=False)


def _quantize_tiles_by_hand(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> e4m3 values and one scale per 128 x 128 tile (largest magnitude / 448)."""
    rows, cols = -(-w.shape[0] // 128), w.shape[1] // 128
    scale = torch.empty(rows, cols)
    q = torch.empty(w.shape, dtype=E4M3)
    for r in range(rows):
        for c in range(cols):
            tile = w[r * 128:(r + 1) * 128, c * 128:(c + 1) * 128].float()
            scale[r, c] = max(tile.abs().max().item() / E4M3_MAX, 1e-12)
            q[r * 128:(r + 1) * 128, c * 128:(c + 1) * 128] = (tile / scale[r, c]).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return q, scale


def _dequantized_by_hand(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale.repeat_interleave(128, 0)[:q.shape[0]].repeat_interleave(128, 1)


def write_published(path, shape: dict, model_type: str = "qwen3_moe", experts_3d: bool = False) -> dict:
    """A tiny model of `shape` written to `path` as a published FP8 checkpoint: safetensors with
    per-expert e4m3 matrices and their tile scales, every other linear of the decoder (attention,
    dense MLPs, shared experts) so too, config.json with transformers' fine-grained FP8 declaration.
    A qwen3_moe's experts and routers are drawn as bench/moe_checks.py's `checkable_moe` draws them;
    others' as initialised (std 0.3). `experts_3d`: the experts stored as transformers keeps them
    instead ([E, N, K] e4m3 and [E, N / 128, K / 128] scales under the parameters' names), a layout
    no rank reads a slice of. Returns the stored tensors."""
    import json

    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **({} if model_type == "qwen3_moe" else {"initializer_range": 0.3}),
                                  **shape)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    if model_type == "qwen3_moe":
        checkable_moe(model, torch.Generator().manual_seed(0))
    stored = {}
    for name, value in model.state_dict().items():
        value = value.detach()
        if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            prefix = name.rsplit(".", 1)[0]
            if experts_3d:
                tiles = [_quantize_tiles_by_hand(matrix) for matrix in value]
                stored[name] = torch.stack([q for q, _ in tiles])
                stored[name + "_scale_inv"] = torch.stack([scale for _, scale in tiles])
                continue
            for expert, matrix in enumerate(value):  # [2I, H] (gate rows, then up rows) or [H, I]
                parts = ({"gate_proj": matrix.chunk(2)[0], "up_proj": matrix.chunk(2)[1]}
                         if name.endswith("gate_up_proj") else {"down_proj": matrix})
                for projection, part in parts.items():
                    q, scale = _quantize_tiles_by_hand(part)
                    stored[f"{prefix}.{expert}.{projection}.weight"] = q
                    stored[f"{prefix}.{expert}.{projection}.weight_scale_inv"] = scale
        elif ".layers." in name and name.endswith(".weight") and value.dim() == 2 and not name.endswith(".gate.weight"):
            # (every linear of the decoder but the routers, which published checkpoints keep as they are)
            stored[name], stored[name + "_scale_inv"] = _quantize_tiles_by_hand(value)
        else:
            stored[name] = value.to(torch.bfloat16)
    path.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in stored.items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})
    config.torch_dtype = torch.bfloat16
    config.save_pretrained(path)
    raw = json.loads((path / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                  "weight_block_size": [128, 128]}
    (path / "config.json").write_text(json.dumps(raw))
    return stored


@pytest.fixture(scope="module")
def published_dir(tmp_path_factory):
    """The published FP8 checkpoint of `write_published` in PUBLISHED's shape: its directory and
    its stored tensors."""
    path = tmp_path_factory.mktemp("published") / "qwen3-moe-fp8"
    return path, write_published(path, PUBLISHED)


def _published_experts_reference(stored: dict, layer: int, hidden: torch.Tensor, index: torch.Tensor,
                                 weights: torch.Tensor) -> torch.Tensor:
    """One MoE layer's output from the checkpoint's tensors dequantized by hand, one token and expert
    at a time: each product's input fake-quantized per 1 x 128 block, silu(gate) x up x the routing
    weight, float32 throughout."""
    def weight(expert: int, projection: str) -> torch.Tensor:
        key = f"model.layers.{layer}.mlp.experts.{expert}.{projection}.weight"
        return _dequantized_by_hand(stored[key], stored[key + "_scale_inv"])

    out = torch.zeros(hidden.shape, dtype=torch.float32)
    for token in range(hidden.shape[0]):
        for slot in range(index.shape[1]):
            e = int(index[token, slot])
            a = fake_quantize(hidden[token:token + 1].float(), 1, 128)
            gate, up = a @ weight(e, "gate_proj").t(), a @ weight(e, "up_proj").t()
            h = torch.nn.functional.silu(gate) * up * weights[token, slot].float()
            out[token] += (fake_quantize(h, 1, 128) @ weight(e, "down_proj").t())[0]
    return out


def test_a_published_fp8_moe_checkpoint_is_served_as_stored(published_dir):
    """The server's model loading keeps the checkpoint's e4m3 bytes in memory (experts and linears,
    nothing dequantized at load), runs the experts through the teacher's forward, and each MoE
    layer's output in the served forward equals the checkpoint dequantized by hand, one token and
    expert at a time (on a CPU every FP8 product dequantizes then multiplies in float32)."""
    path, stored = published_dir
    runner = ModelRunner(str(path), "cpu", dtype="float32")
    assert runner.quantization.source == "checkpoint" and runner.quantization.scaling == "block"
    experts = moe.experts_modules(runner.model)
    assert len(experts) == 2 and moe.IMPLEMENTATION in runner.info.kernels
    assert fp8_rows.IMPLEMENTATION not in runner.info.kernels  # (no row kernel on a CPU)
    for layer, module in enumerate(experts):
        assert isinstance(module.down_proj, fp8_experts.FP8ExpertWeights) and module.down_proj.scaling == "block"
        for e in range(PUBLISHED["num_experts"]):
            key = f"model.layers.{layer}.mlp.experts.{e}"
            gate_up = torch.cat([stored[f"{key}.gate_proj.weight"], stored[f"{key}.up_proj.weight"]])
            assert torch.equal(module.gate_up_proj.weight[e].view(torch.uint8), gate_up.view(torch.uint8))
            assert torch.equal(module.down_proj.weight[e].view(torch.uint8),
                               stored[f"{key}.down_proj.weight"].view(torch.uint8))
            assert torch.equal(module.down_proj.weight_scale[e], stored[f"{key}.down_proj.weight_scale_inv"])
    from teacher_server import fp8

    linears = [m for m in runner.model.modules() if isinstance(m, fp8.FP8Linear)]
    assert len(linears) == 2 * 4 and all(m.weight.dtype == E4M3 for m in linears)
    captured = []
    hooks = [m.register_forward_hook(lambda module, args, out: captured.append((args, out))) for m in experts]
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(1))
    result = runner.forward(ids, torch.ones_like(ids))
    for hook in hooks:
        hook.remove()
    assert len(captured) == 2 and torch.isfinite(result.logits).all()
    for layer, ((hidden, index, weights), out) in enumerate(captured):
        expected = _published_experts_reference(stored, layer, hidden, index, weights)
        torch.testing.assert_close(out.float(), expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())
