"""The FP8 teacher on CPU: the quantization arithmetic against straightforward references, the
flag and the fields that say what the teacher runs in, and the refusals. torch's CPU
`_scaled_mm` runs row-wise scales (CI's torch 2.13; 2.11's does not, and FP8Linear dequantizes
then), so `--quantize fp8` really serves here; block-wise scales (and
published FP8 checkpoints, tests/test_fp8_experts.py) are dequantized and multiplied in float32 on a
CPU, and tests/gpu/test_fp8_gpu.py covers their cuBLAS products.
"""

from __future__ import annotations

import json
import logging

import pytest
import requests
import torch
from torch import nn

from distill_common.quantization import Quantization
from student_trainer import Logits, TeacherClient
from student_trainer.errors import Incompatible
from teacher_server import fp8
from teacher_server.admin import AdminConfig, query
from teacher_server.config import ServerConfig
from teacher_server.launcher import ServerProcess
from teacher_server.model_runner import ModelRunner
from tests.helpers import build_tiny_model

E4M3_STEP = 2.0 ** -3  # e4m3 keeps 3 mantissa bits: a rounding moves a normal value by at most half of 2^-3 of it


def _heavy_tailed(*shape: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).pow(3)  # outliers, as activations have


# ---- the arithmetic ------------------------------------------------------------------------

def _e4m3_round(values: torch.Tensor) -> torch.Tensor:
    """Round to nearest even on e4m3's grid, computed by hand: 3 mantissa bits, exponents down to
    -6, subnormals in steps of 2^-9, saturated at 448."""
    v = values.double().clamp(-448, 448)
    exponent = torch.floor(torch.log2(v.abs().clamp(min=2.0 ** -6)))
    step = torch.pow(2.0, exponent - 3)
    return torch.round(v / step) * step  # torch.round rounds half to even


def test_quantize_rows_is_amax_over_448_and_round_to_nearest():
    x = _heavy_tailed(7, 96, seed=0).to(torch.bfloat16)
    q, scale = fp8.quantize_rows(x)
    amax = x.float().abs().amax(dim=1, keepdim=True)
    assert q.dtype == fp8.FP8 and scale.shape == (7, 1)
    torch.testing.assert_close(scale, amax / 448, rtol=0, atol=0)
    assert torch.equal(q.double(), _e4m3_round((x.float() / scale).double()))  # the quotient in float32
    assert (q.float().abs().amax(dim=1) == 448).all()  # each row's largest value lands on the top of the range


def test_block_scales_cover_1x128_and_128x128_blocks():
    x = _heavy_tailed(5, 256, seed=1)
    q, scale = fp8.quantize_row_blocks(x)
    assert scale.shape == (5, 2)
    for row in range(5):
        for block in range(2):
            part = x[row, block * 128:(block + 1) * 128]
            assert scale[row, block] == part.abs().max() / 448
    w = _heavy_tailed(200, 256, seed=2)  # 200 rows: a partial last tile
    wq, wscale = fp8.quantize_tiles(w)
    assert wscale.shape == (2, 2) and wq.shape == (200, 256)
    for i in range(2):
        for j in range(2):
            assert wscale[i, j] == w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128].abs().max() / 448
    # Dequantized, each value is within one e4m3 rounding of where it was.
    for values, got in ((x, fp8.dequantize(q, scale)), (w, fp8.dequantize(wq, wscale))):
        bound = values.abs() * E4M3_STEP / 2 + 2.0 ** -10 * got.abs().max()
        assert ((got - values).abs() <= bound).all()


def test_zero_rows_quantize_to_zeros():
    q, scale = fp8.quantize_rows(torch.zeros(3, 32))
    assert torch.equal(q.float(), torch.zeros(3, 32)) and (scale > 0).all()


def _emulated_scaled_mm(xq, x_scale, wq, w_scale) -> torch.Tensor:
    """What _scaled_mm computes, from its definition: (xq * sx) @ (wq * sw)^T, in float64."""
    return (xq.double() * x_scale.double()) @ (wq.double() * w_scale.double()).t()


def test_the_row_kernel_operator_is_quantize_rows_where_no_kernel_runs():
    """fp8_rows.quantize_rows_kernel, the operator a layer's o projection and down product call on a
    GPU: on a CPU it is fp8.quantize_rows, also for a column-major input (contiguous output, as its
    fake kernel says), and torch's operator checks (schema, fake kernel, compiled) pass."""
    from teacher_server import fp8_rows

    x = (torch.randn(40, 6) * 5).to(torch.bfloat16).t()  # [6, 40], column-major
    q, scale = fp8_rows.quantize_rows_kernel(x)
    q_ref, scale_ref = fp8.quantize_rows(x)
    assert q.is_contiguous() and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(scale, scale_ref)
    torch.library.opcheck(fp8_rows.quantize_rows_kernel, (x,))


def _torch_kernel(x, out, scale):
    """What the row kernel computes (torch's arithmetic): e4m3 values, or float32 quotients for a
    float32 `out`."""
    from teacher_server import fp8_rows

    q, s = fp8_rows.quantize_rows(x)
    scale.copy_(s)
    out.copy_(q if out.dtype == fp8_rows.FP8 else (x.float() / s).clamp(-fp8_rows.FP8_MAX, fp8_rows.FP8_MAX))


def _one_ulp_off(x, out, scale):
    _torch_kernel(x, out, scale)
    if out.dtype == torch.float32:
        out.view(torch.int32)[40, 3] += 1


def _minus_zero_made_plus(x, out, scale):
    _torch_kernel(x, out, scale)
    out.copy_(torch.where(out.float() == 0, torch.zeros_like(out), out))


def _nan_skipped(x, out, scale):
    _torch_kernel(torch.where(x.isnan(), torch.zeros_like(x), x), out, scale)


def _row_stride_ignored(x, out, scale):
    _torch_kernel(x.as_strided(x.shape, (x.shape[1], 1)), out, scale)


def _truncated_to_e4m3(x, out, scale):
    """The quotients right, their e4m3 rounding toward zero instead of to nearest."""
    from teacher_server import fp8_rows

    _torch_kernel(x, out, scale)
    if out.dtype == fp8_rows.FP8:
        quotients = (x.float() / scale).clamp(-fp8_rows.FP8_MAX, fp8_rows.FP8_MAX)
        over = out.float().abs() > quotients.abs()
        out.view(torch.uint8)[over] -= 1  # one step toward zero (e4m3's magnitude bits are ordered)


def _ties_away_from_zero(x, out, scale):
    """e4m3 rounding right but at ties, which it takes away from zero instead of to even."""
    from teacher_server import fp8_rows

    _torch_kernel(x, out, scale)
    if out.dtype == fp8_rows.FP8:
        quotients = (x.float() / scale).clamp(-fp8_rows.FP8_MAX, fp8_rows.FP8_MAX)
        below = out.float().abs() < quotients.abs()
        up = out.view(torch.uint8).clone()
        up[below] += 1  # the next e4m3 value away from zero
        tie = below & ((up.view(fp8_rows.FP8).float() - quotients).abs() == (out.float() - quotients).abs())
        out.view(torch.uint8)[tie] = up[tie]


def _wrong_for_one_row(x, out, scale):
    _torch_kernel(x, out, scale)
    if x.shape[0] == 1:
        scale.mul_(2)


def _fails(x, out, scale):
    raise RuntimeError("PTX compilation failed")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_row_kernels_check_passes_its_arithmetic_and_catches_each_difference(dtype):
    """fp8_rows.check, run before a layer takes the row kernel on its device: a kernel computing
    quantize_rows's values passes (widths of a partial block and of a whole one); one ulp off in one
    float32 quotient, -0 made +0, a NaN that does not make its row NaN, the row stride ignored,
    e4m3 rounding toward zero, ties rounded away from zero, a kernel wrong for a single row (Triton
    compiles it apart), and a kernel that throws are each found and named."""
    from teacher_server import fp8_rows

    cpu = torch.device("cpu")
    for width in (200, 768):
        assert fp8_rows.check(width, cpu, dtype, _torch_kernel) == ""
    cases = ((_one_ulp_off, "other float32 quotients in 1 of 64 rows, 64 contiguous rows"),
             (_minus_zero_made_plus, "quotients"), (_nan_skipped, "other scales in 1 of 64 rows"),
             (_row_stride_ignored, "of 67 rows, 67 rows through a row stride"),
             (_truncated_to_e4m3, "other e4m3 bytes"), (_ties_away_from_zero, "other e4m3 bytes in"),
             (_wrong_for_one_row, "other scales in 1 of 1 rows, 1 row"),
             (_fails, "the kernel failed: RuntimeError: PTX"))
    for run, said in cases:
        assert said in fp8_rows.check(768, cpu, dtype, run), run.__name__


def test_a_layer_takes_the_row_kernel_only_where_its_check_passed(monkeypatch, caplog):
    """fp8.quantize_model's o projections (as on a GPU, the kernel's predicate forced here): with a
    kernel that computes quantize_rows's values they take it; with one that differs they keep
    torch's quantization and a warning says what differed, once per width (the verdict kept)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from teacher_server import fp8_rows

    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    monkeypatch.setattr(fp8_rows, "kernel_serves", lambda width, device: True)
    monkeypatch.setattr(fp8_rows, "_verdicts", {})
    monkeypatch.setattr(fp8_rows, "launch", _torch_kernel)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    fp8.quantize_model(model, fp8.Fp8Plan("row"))
    takes = [layer.self_attn.o_proj.quantize is fp8_rows.quantize_rows_kernel for layer in model.model.layers]
    assert takes == [True, True] and fp8_rows.served(model) == 2
    assert model.model.layers[0].mlp.down_proj.quantize is not fp8_rows.quantize_rows_kernel

    calls = []
    monkeypatch.setattr(fp8_rows, "_verdicts", {})
    monkeypatch.setattr(fp8_rows, "launch", lambda x, out, scale: (calls.append(1), _one_ulp_off(x, out, scale)))
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    with caplog.at_level("WARNING", logger="teacher_server.fp8_rows"):
        fp8.quantize_model(model, fp8.Fp8Plan("row"))
    assert fp8_rows.served(model) == 0 and len(calls) == 2  # one check (two launches) for both layers
    assert "rows of 64 in torch.bfloat16" in caplog.text and "other float32 quotients" in caplog.text


@pytest.mark.parametrize("bias", [False, True])
def test_fp8_linear_equals_dequantize_then_matmul(bias):
    torch.manual_seed(3)
    linear = nn.Linear(96, 80, bias=bias).to(torch.bfloat16)
    layer = fp8.FP8Linear.from_linear(linear, "row")
    x = _heavy_tailed(2, 9, 96, seed=4).to(torch.bfloat16)
    out = layer(x)
    xq, xs = fp8.quantize_rows(x.reshape(-1, 96))
    expected = _emulated_scaled_mm(xq, xs, layer.weight, layer.weight_scale)
    if bias:
        expected = expected + linear.bias.double()
    assert out.shape == (2, 9, 80) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.reshape(-1, 80).double(), expected.to(torch.bfloat16).double(), rtol=0, atol=0)
    torch.testing.assert_close(fp8.reference_linear(x, layer.weight, layer.weight_scale, "row", layer.bias), out,
                               rtol=0, atol=0)
    # And near the bf16 layer it replaces: FP8's error, not a wrong product.
    exact = linear(x).double()
    assert (out.double() - exact).norm() / exact.norm() < 0.08



def test_row_scales_where_the_cpu_scaled_mm_takes_per_tensor_scales_only(monkeypatch):
    """torch 2.11's CPU _scaled_mm refuses row-wise scales (an internal assert, the GPU machine's
    torch): FP8Linear then computes the same product by dequantizing (reference_linear), and the
    self-check passes, instead of the load failing on the assert."""
    def per_tensor_only(a, b, scale_a, scale_b, **kwargs):
        if scale_a.numel() != 1 or scale_b.numel() != 1:
            raise RuntimeError("(scale_a.numel() == 1 && scale_b.numel() == 1) INTERNAL ASSERT FAILED: Now "
                               "_scaled_mm only supports per-tensor scaling for CPU backend.")
        raise AssertionError("not reached here")

    torch.manual_seed(3)
    layer = fp8.FP8Linear.from_linear(nn.Linear(96, 80).to(torch.bfloat16), "row")
    x = _heavy_tailed(2, 9, 96, seed=4).to(torch.bfloat16)
    monkeypatch.setattr(torch, "_scaled_mm", per_tensor_only)
    fp8.rowwise_scaled_mm_on_cpu.cache_clear()
    try:
        assert not fp8.rowwise_scaled_mm_on_cpu()
        torch.testing.assert_close(layer(x), fp8.reference_linear(x, layer.weight, layer.weight_scale, "row",
                                                                  layer.bias), rtol=0, atol=0)
        assert fp8.verify(nn.ModuleList([layer]), torch.bfloat16) == 1
    finally:
        fp8.rowwise_scaled_mm_on_cpu.cache_clear()

def test_fast_accumulation_is_a_row_option_that_quantize_model_passes_on():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    linear = nn.Linear(128, 64, bias=False).to(torch.bfloat16)
    with pytest.raises(ValueError, match="fast accumulation is for row scales"):
        fp8.FP8Linear.from_linear(linear, "block", fast_accum=True)
    layer = fp8.FP8Linear.from_linear(linear, "row", fast_accum=True)
    assert layer.fast_accum and "fast_accum=True" in repr(layer)
    x = _heavy_tailed(7, 128, seed=4).to(torch.bfloat16)  # the CPU's product has one accumulation: same bits
    torch.testing.assert_close(layer(x), fp8.FP8Linear.from_linear(linear, "row")(x), rtol=0, atol=0)
    config = LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    fp8.quantize_model(model, fp8.Fp8Plan("row", fast_accum=True))
    layers = [m for m in model.modules() if isinstance(m, fp8.FP8Linear)]
    assert len(layers) == 14 and all(m.fast_accum for m in layers)


def test_block_reference_linear_is_the_blockwise_product():
    x = _heavy_tailed(6, 256, seed=5)
    w = _heavy_tailed(128, 256, seed=6)
    wq, ws = fp8.quantize_tiles(w)
    xq, xs = fp8.quantize_row_blocks(x)
    # Summed block by block, each block's product scaled by its two scales.
    expected = torch.zeros(6, 128, dtype=torch.float64)
    for k in range(2):
        cols = slice(k * 128, (k + 1) * 128)
        expected += (xq[:, cols].double() @ wq[:, cols].double().t()) * xs[:, k:k + 1].double() * ws[0, k].double()
    got = fp8.reference_linear(x, wq, ws, "block")  # float32 sums: rounding relative to the largest output
    torch.testing.assert_close(got.double(), expected, rtol=0, atol=1e-6 * expected.abs().max().item())


def test_block_layers_pad_k_to_four_blocks_without_changing_the_product():
    """cuBLAS reads 128 x 128 scales in rows of a multiple of 4 K-blocks: 6 blocks become 8, the
    weight's new columns zero, and the product over the padded operands (computed here from
    _scaled_mm's definition, block by block) is the unpadded one."""
    w = _heavy_tailed(200, 768, seed=10)
    layer = fp8.FP8Linear(*fp8.quantize_tiles(w), "block")
    assert layer.weight.shape == (200, 1024) and layer.weight_scale.shape == (2, 8)
    assert layer._scale_b.shape == (8, 2) and layer._scale_b.stride() == (1, 8)  # K-major
    assert torch.equal(layer.weight[:, 768:].float(), torch.zeros(200, 256))
    q, scale = fp8.quantize_tiles(w)
    stored_q, stored_scale = layer.stored()
    assert torch.equal(stored_q.view(torch.uint8), q.view(torch.uint8)) and torch.equal(stored_scale, scale)
    x = _heavy_tailed(5, 768, seed=11)
    xq, xs = fp8.quantize_row_blocks(torch.nn.functional.pad(x, (0, 256)))
    padded = torch.zeros(5, 200, dtype=torch.float64)
    for k in range(8):
        cols = slice(k * 128, (k + 1) * 128)
        tile = layer.weight_scale[:, k].repeat_interleave(128)[:200].double()
        padded += (xq[:, cols].double() @ layer.weight[:, cols].double().t()) * xs[:, k:k + 1].double() * tile
    unpadded = fp8.reference_linear(x, q, scale, "block").double()
    torch.testing.assert_close(padded, unpadded, rtol=0, atol=1e-6 * unpadded.abs().max().item())


def test_the_block_product_is_an_operator_whose_output_a_compiler_knows_without_running_it():
    """The block-scaled product is an operator of its own (torch.compile calls it as it is, its
    lowering refusing block scales of symbolic shapes): what it returns, traced without data (the
    operator's fake implementation, which a compiled layer is built from), is the product's shape."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    layer = fp8.FP8Linear(*fp8.quantize_tiles(_heavy_tailed(200, 768, seed=10)), "block")
    with FakeTensorMode(allow_non_fake_inputs=True):
        xq, xs = fp8.quantize_row_blocks(torch.zeros(40, 1024, dtype=torch.bfloat16))
        out = fp8.block_scaled_mm(xq, xs, layer.weight, layer._scale_b, None, torch.bfloat16)
        assert out.shape == (40, 200) and out.dtype == torch.bfloat16


def test_the_self_check_catches_a_wrong_product():
    torch.manual_seed(12)
    model = nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 64)).to(torch.bfloat16)
    model[0] = fp8.FP8Linear.from_linear(model[0], "row")
    model[1] = fp8.FP8Linear.from_linear(model[1], "row")
    assert fp8.verify(model, torch.bfloat16) == 2
    model[1]._scale_b = model[1]._scale_b.flip(1)  # scales read in the wrong order
    with pytest.raises(fp8.FP8Unsupported, match=r"FP8 self-check failed: 1 \(32 -> 64, row scales\)"):
        fp8.verify(model, torch.bfloat16)


def test_quantize_model_keeps_layers_and_carries_hooks():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    called = []
    model.model.layers[1].mlp.down_proj.register_forward_hook(lambda m, a, out: called.append(out.shape))
    # and hooks registered with kwargs or to be called always keep those flags
    model.model.layers[0].mlp.up_proj.register_forward_pre_hook(
        lambda m, args, kwargs: called.append("pre with kwargs") or None, with_kwargs=True)
    model.model.layers[0].mlp.up_proj.register_forward_hook(
        lambda m, args, kwargs, out: called.append("with kwargs") or None, with_kwargs=True, always_call=True)
    assert fp8.quantize_model(model, fp8.Fp8Plan("row", keep_layers=(-1,))) == 14  # 7 linears x 2 layers
    kinds = [[type(getattr(layer.self_attn, n, None) or getattr(layer.mlp, n)).__name__ for n in fp8.LINEAR_NAMES]
             for layer in model.model.layers]
    assert kinds[0] == kinds[1] == ["FP8Linear"] * 7 and kinds[2] == ["Linear"] * 7
    assert model.lm_head.weight.dtype == model.model.embed_tokens.weight.dtype == torch.bfloat16
    model(input_ids=torch.randint(64, (1, 5)))
    # the hooks a tensor-parallel plan puts there still run, each called as it was registered
    assert called == ["pre with kwargs", "with kwargs", torch.Size([1, 5, 64])]
    assert model.model.layers[0].mlp.up_proj._forward_hooks_always_called
    with pytest.raises(ValueError, match="the model has 3 decoder layers"):
        fp8.quantize_model(LlamaForCausalLM(config), fp8.Fp8Plan("row", keep_layers=(3,)))


def test_a_head_stored_in_fp8_is_sent_dequantized():
    """A published checkpoint's FP8 Linear (transformers keeps e4m3 weights and a weight_scale_inv per
    128 x 128 tile): the head a student is sent is its value in the output dtype."""
    w = _heavy_tailed(130, 256, seed=9)
    q, scale = fp8.quantize_tiles(w)
    stored = nn.Linear(256, 130, bias=False)
    stored.weight = nn.Parameter(q, requires_grad=False)
    stored.weight_scale_inv = nn.Parameter(scale, requires_grad=False)
    expected = q.float() * scale.repeat_interleave(128, 0)[:130].repeat_interleave(128, 1)
    got = fp8.dense_weight(stored, torch.bfloat16)
    assert got.dtype == torch.bfloat16 and torch.equal(got, expected.to(torch.bfloat16))
    assert fp8.dense_weight(nn.Linear(4, 4), torch.bfloat16).dtype == torch.float32  # not FP8: as it is


def test_device_problems_name_what_to_do():
    assert fp8.fp8_device_problem(torch.device("cpu"), "row") == ""
    assert fp8.fp8_device_problem(torch.device("cpu"), "block") == ""  # dequantized and multiplied there
    assert "compute capability 8.9" in fp8.fp8_device_problem(torch.device("meta"), "block")


def test_flags():
    assert ServerConfig().fp8_plan() is None
    plan = ServerConfig(quantize="fp8", fp8_scaling="block", fp8_keep_layers="0,-1", fp8_compile="off").fp8_plan()
    assert plan == fp8.Fp8Plan("block", (0, -1), "off")
    assert ServerConfig(quantize="fp8", fp8_fast_accum=True).fp8_plan() == fp8.Fp8Plan("row", fast_accum=True)
    from distill_common.settings import ConfigError

    with pytest.raises(ConfigError, match="add --quantize fp8"):
        ServerConfig(fp8_keep_layers="1")
    with pytest.raises(ConfigError, match="--fp8-keep-layers 'x'"):
        ServerConfig(quantize="fp8", fp8_keep_layers="x")
    with pytest.raises(ConfigError, match="add --quantize fp8"):
        ServerConfig(fp8_fast_accum=True)
    with pytest.raises(ConfigError, match="--fp8-fast-accum is for --fp8-scaling row"):
        ServerConfig(quantize="fp8", fp8_scaling="block", fp8_fast_accum=True)


# ---- a teacher that runs in FP8 -----------------------------------------------------------

HIDDEN = 64  # _scaled_mm wants widths that are multiples of 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("fp8") / "model", hidden_size=HIDDEN, dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def fp8_server(model_dir):
    # Fast accumulation: the CPU's product has one accumulation (the same bits), but it is said everywhere.
    # No bias correction: the served logits are held to the plain FP8 product below. The calibration
    # batch is small (the tiny model has no tokenizer: the built-in sample's bytes stand for ids).
    server = ServerProcess("--model", str(model_dir), "--quantize", "fp8", "--fp8-keep-layers", "-1",
                           "--fp8-fast-accum", "--fp8-bias-correction", "off", "--fp8-calibration-rows", "2",
                           "--fp8-calibration-seq", "64", "--max-batch-tokens", "256", "--max-seq-len", "64")
    yield server
    server.stop()


def _reference_logits(model_dir, ids: torch.Tensor) -> torch.Tensor:
    """The saved model with its first layer's linears replaced by the straightforward FP8 product."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)

    class Reference(nn.Module):
        def __init__(self, linear: nn.Linear):
            super().__init__()
            self.weight_q, self.weight_scale = fp8.quantize_rows(linear.weight.detach())

        def forward(self, x):
            return fp8.reference_linear(x, self.weight_q, self.weight_scale, "row")

    layer = model.model.layers[0]
    for parent in (layer.self_attn, layer.mlp):
        for name in fp8.LINEAR_NAMES:
            if hasattr(parent, name):
                setattr(parent, name, Reference(getattr(parent, name)))
    with torch.inference_mode():
        return model(input_ids=ids).logits.float()


def test_fp8_teacher_serves_and_says_so(fp8_server, model_dir):
    ids = torch.randint(0, 384, (2, 11), generator=torch.Generator().manual_seed(7))
    with TeacherClient(fp8_server.address, "cpu", outputs=(Logits(),)) as client:
        assert client.info.quantization == Quantization("fp8_e4m3", "row", "quantized at load", (1,), True)
        assert client.info.dtype == "bfloat16"
        logits = client.submit(ids).result(timeout=60).logits.float()
    reference = _reference_logits(model_dir, ids)
    # bf16 rounding of the activations between layers: a few bf16 steps of the logits, no more.
    assert (logits - reference).abs().max() <= 0.02 * reference.abs().max()
    assert "decoder linears in FP8: fp8_e4m3" in fp8_server.log
    status = requests.get(f"{fp8_server.http}/v1/status", timeout=10).json()["quantization"]
    measured = {key: status.pop(key) for key in ("kl_mean", "kl_p99", "top1_agreement")}
    assert status == {"format": "fp8_e4m3", "scaling": "row", "source": "quantized at load",
                      "full_precision_layers": [1], "fast_accumulation": True, "full_precision_linears": [],
                      "bias_correction": False, "fp8_flop_share": 0.5, "calibration_tokens": 128, "max_kl": 0.0}
    # What the join answer says is what the teacher measured (the status reads the same record).
    joined = client.info.quantization
    assert (joined.kl_mean, joined.kl_p99, joined.top1_agreement) == tuple(measured.values())
    assert 0 < measured["kl_mean"] <= measured["kl_p99"] and 0 < measured["top1_agreement"] <= 1
    info = query("info", fp8_server.address, AdminConfig())
    assert ("fp8_e4m3 linears (per-row activation, per-channel weight scales; quantized at load; fast accumulation), "
            "decoder layers 1 in the model's dtype; 50% of the linear FLOPs in FP8; KL ") in info, info
    assert "FP8 cost measured in" in fp8_server.log


def test_a_student_can_refuse_an_fp8_teacher(fp8_server, caplog):
    with pytest.raises(Incompatible, match="refuses a quantized teacher"):
        TeacherClient(fp8_server.address, "cpu", refuse_quantized=True)
    with caplog.at_level("INFO", logger="student_trainer.client"):
        with TeacherClient(fp8_server.address, "cpu"):
            pass
    assert "decoder linears: fp8_e4m3 linears" in caplog.text
    with TeacherClient(fp8_server.address, "cpu") as client:
        measured = client.info.quantization.kl_mean
    with pytest.raises(Incompatible, match=r"costs it a KL of .* --max-teacher-kl is .*--fp8-max-kl"):
        TeacherClient(fp8_server.address, "cpu", max_teacher_kl=measured / 2)
    with TeacherClient(fp8_server.address, "cpu", max_teacher_kl=measured * 2):
        pass


def test_the_runner_reports_fp8_and_sends_the_head_in_the_model_dtype(model_dir):
    runner = ModelRunner(str(model_dir), "cpu", quantize=fp8.Fp8Plan("row", compile="off"))
    assert runner.info.quantization.format == "fp8_e4m3" and runner.info.dtype == torch.bfloat16
    assert runner.join_data.head.weight.dtype == torch.bfloat16 and not runner.info.head.unavailable


# ---- published FP8 checkpoints --------------------------------------------------------------

def _fp8_checkpoint_config(path, block=(128, 128)):
    """A model directory whose config.json declares transformers' fine-grained FP8: the teacher
    decides from the config alone, before loading any weight."""
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=384, hidden_size=256, intermediate_size=512, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2)
    config.save_pretrained(path)
    raw = json.loads((path / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                  "weight_block_size": list(block)}
    (path / "config.json").write_text(json.dumps(raw))
    return path


@pytest.fixture
def restored_logging():
    """teacher_server's main sets up the root logger: put it back for the tests after."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def test_fp8_checkpoints_the_teacher_cannot_serve_are_refused_at_start_up(tmp_path, capsys, restored_logging):
    from teacher_server.__main__ import main

    other = _fp8_checkpoint_config(tmp_path / "fp8-64", block=(64, 64))
    with pytest.raises(SystemExit) as exited:  # the command line's own exit, before any weight loads
        main(["--model", str(other), "--port", "0", "--http-port", "0"])
    stderr = capsys.readouterr().err
    assert exited.value.code == 2
    assert "FP8 weights with blocks [64, 64]; the teacher serves 128 x 128 blocks" in stderr
    path = _fp8_checkpoint_config(tmp_path / "fp8")
    with pytest.raises(ValueError, match="an FP8 checkpoint already"):
        ModelRunner(str(path), "cpu", quantize=fp8.Fp8Plan())


# ---- with tensor parallelism ----------------------------------------------------------------

@pytest.mark.slow
def test_fp8_under_tensor_parallelism(model_dir):
    """Two ranks (gloo), each quantizing its shards: the row-parallel layers' all-reduce (a hook on
    the Linear) moves to the FP8 layer. Each rank scales its own slice of an activation, so the
    logits are FP8's, not bit-equal to one process's."""
    ids = torch.randint(0, 384, (2, 9), generator=torch.Generator().manual_seed(8))
    one = ModelRunner(str(model_dir), "cpu", quantize=fp8.Fp8Plan("row", compile="off"))
    plain = ModelRunner(str(model_dir), "cpu")
    one_logits = one.forward(ids, torch.ones_like(ids)).logits.float()
    exact = plain.forward(ids, torch.ones_like(ids)).logits.float()
    with ServerProcess("--model", str(model_dir), "--quantize", "fp8", "--max-batch-tokens", "256",
                       "--max-seq-len", "64", nproc_per_node=2) as server:
        assert "lm_head colwise gathered" in server.log, server.log  # the teacher's own plan, plain shards
        with TeacherClient(server.address, "cpu") as client:
            assert client.info.quantization.format == "fp8_e4m3"
            tp = client.submit(ids).result(timeout=60).logits.float()
    fp8_error = (one_logits - exact).norm() / exact.norm()
    assert 0 < fp8_error < 0.05
    assert (tp - exact).norm() / exact.norm() < 2 * fp8_error
    assert (tp - one_logits).norm() / one_logits.norm() < 2 * fp8_error
