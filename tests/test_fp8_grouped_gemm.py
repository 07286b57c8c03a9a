"""teacher_server/fp8_grouped_gemm.py's Triton kernels on a CPU, under Triton's interpreter (where
Triton is installed; the GPU image has it, this project's CPU install does not): the grouped FP8
product with gather, scatter, ragged and empty groups, unheld rows and a partial K step, row and
block scales, against the one-expert-at-a-time dequantize-then-multiply product written here; the
SwiGLU-and-quantize kernel against its torch reference; teacher_server/fp8_rows.py's row kernel
against its arithmetic. The interpreter must be chosen before the
kernels are decorated, so the checks run in a child process (`python -m tests.test_fp8_grouped_gemm`).
The quantizations' quotients are exact through fused multiply-adds, which Triton 3.9's interpreter
computes as the GPU does (one rounding) and 3.6's does not (a product, then a sum): the checks
say so first where the interpreter rounds twice.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.slow


def _interpreter_index_fix() -> None:
    """Triton 3.6's interpreter turns a scalar into an index with int() of a 1-element array, which
    NumPy 2.4 refuses ("only 0-dimensional arrays can be converted"): the same, through .reshape."""
    import numpy as np
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched


def _reference(a, a_scale, w, w_scale, offsets, gather, scatter, rows):
    from teacher_server import fp8

    out = torch.zeros(rows, w.shape[1])
    start = 0
    for expert, end in enumerate(offsets.tolist()):
        weight = fp8.dequantize(w[expert], w_scale[expert] if w_scale.dim() == 3 else w_scale[expert].reshape(-1, 1))
        for row in range(start, end):
            source = int(gather[row]) if gather is not None else row
            x = fp8.dequantize(a[source:source + 1], a_scale[source:source + 1].reshape(1, -1))
            out[int(scatter[row]) if scatter is not None else row] = (x @ weight.t())[0]
        start = end
    return out


def _fused_fma() -> bool:
    """Whether this interpreter's tl.math.fma rounds once, as the GPU's fma.rn.f32: (1 + 2^-12)^2 -
    (1 + 2^-11) is 2^-24 so, 0 when the product is rounded first."""
    import triton
    import triton.language as tl

    @triton.jit
    def fma_kernel(a_ptr, out_ptr):
        a = tl.load(a_ptr)
        tl.store(out_ptr, tl.math.fma(a, a, -(a + a - 1.0)))

    a, out = torch.tensor([1 + 2.0 ** -12]), torch.zeros(1)
    fma_kernel[(1,)](a, out)
    return out.item() == 2.0 ** -24


def _checks() -> None:
    _interpreter_index_fix()
    import triton

    from teacher_server import fp8, fp8_grouped_gemm, fp8_rows

    assert _fused_fma(), (f"Triton {triton.__version__}'s interpreter rounds tl.math.fma twice (a product, then a "
                          "sum), so the quantizations' exact quotients cannot be checked under it: run these "
                          "checks with Triton 3.9's interpreter (pip install triton==3.9.0 into a directory of "
                          "its own, on PYTHONPATH)")

    generator = torch.Generator().manual_seed(0)
    sizes = [7, 0, 30, 1, 8]
    held = sum(sizes)
    rows = held + 3  # three pairs no expert holds: left as they were (zeros here)
    offsets = torch.tensor(sizes).cumsum(0).int()
    for block, k in ((False, 384), (False, 320), (False, 512), (False, 336), (True, 384)):
        weight = torch.randn(5, 200, k, generator=generator)
        parts = [fp8.quantize_tiles(e) if block else fp8.quantize_rows(e) for e in weight]
        w = torch.stack([p[0] for p in parts])
        w_scale = torch.stack([p[1] if block else p[1].reshape(-1) for p in parts])
        a, a_scale = (fp8.quantize_row_blocks if block else fp8.quantize_rows)(torch.randn(23, k, generator=generator))
        gather = torch.randint(0, 23, (rows,), generator=generator)
        scatter = torch.randperm(rows, generator=generator)
        for config in ({"BLOCK_M": 16, "BLOCK_N": 64}, {"BLOCK_M": 32, "BLOCK_N": 128},
                       {"BLOCK_M": 16, "BLOCK_N": 64, "PER_SM": 1}, {"BLOCK_M": 32, "BLOCK_N": 128, "PER_SM": 2,
                                                                     "FLATTEN": True},
                       *(() if block else ({"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 256},  # K steps of 256, 64
                                           {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "PER_SM": 1}))):
            out = torch.zeros(rows, 200)
            fp8_grouped_gemm.launch(a, a_scale, w, w_scale, offsets, gather, scatter, out, config=config)
            expected = _reference(a, a_scale, w, w_scale, offsets, gather, scatter, rows)
            torch.testing.assert_close(out, expected, rtol=0, atol=1e-5 * expected.abs().max().item())
    for block in (False, True):
        x = (torch.randn(10, 768, generator=generator) * 3).to(torch.bfloat16)
        weight = torch.rand(10, generator=generator)
        q = torch.empty(10, 384, dtype=torch.float8_e4m3fn)
        scale = torch.empty(10, 3 if block else 1)
        fp8_grouped_gemm._swiglu_quantize_kernel[(3,)](x, weight, q, scale, 10, 384, x.stride(0), q.stride(0),
                                                       scale.stride(0), INV_MAX=fp8_rows.INV_FP8_MAX,
                                                       BLOCK_SCALED=block, BLOCK_I=512, ROWS=4)
        q_ref, scale_ref = fp8_grouped_gemm.swiglu_quantize_reference(x, weight, block)
        torch.testing.assert_close(scale, scale_ref, rtol=1e-6, atol=0)
        # The interpreter's float -> e4m3 conversion drops the carry where rounding reaches the next
        # power of two (127.46 -> 64, where torch and the GPU give 128): 2-3% of these values. The
        # rest are the same e4m3 values.
        same = q.view(torch.uint8) == q_ref.view(torch.uint8)
        assert same.float().mean() > 0.95, same.float().mean()
        # Its quantization exactly: gates where SiLU is the identity in float32 (sigmoid(g) rounds to 1
        # for g >= 17), so h = gate x up x weight in the same order as torch's; the kernel writing its
        # quotients unrounded (float32). Scales amax x RN(1/448) as CUDA torch's `amax / 448`; each
        # quotient torch's division; a zero's sign kept; a NaN row all NaN.
        gate = (20 + 20 * torch.rand(10, 384, generator=generator)).to(torch.bfloat16)
        up = torch.randn(10, 384, generator=generator) ** 3 * torch.exp2(torch.randint(-20, 21, (10, 1),
                                                                                      generator=generator).float())
        up[2, 5], up[3, ::7] = float("nan"), -0.0
        x = torch.cat([gate, up.to(torch.bfloat16)], dim=1)
        quotients = torch.empty(10, 384)
        fp8_grouped_gemm._swiglu_quantize_kernel[(3,)](x, weight, quotients, scale, 10, 384, x.stride(0),
                                                       quotients.stride(0), scale.stride(0),
                                                       INV_MAX=fp8_rows.INV_FP8_MAX, BLOCK_SCALED=block,
                                                       BLOCK_I=512, ROWS=4)
        h = (torch.nn.functional.silu(x[:, :384].float()) * x[:, 384:].float() * weight.reshape(-1, 1))
        blocks = h.reshape(10, 3 if block else 1, -1)
        scale_ref = (blocks.abs().amax(dim=-1, keepdim=True) * fp8_rows.INV_FP8_MAX).clamp(min=1e-12)
        quotients_ref = (blocks / scale_ref).clamp(-448.0, 448.0).reshape(10, 384)
        assert torch.equal(scale.nan_to_num(-1.0), scale_ref.reshape(10, -1).nan_to_num(-1.0)), block
        assert torch.equal(quotients.nan_to_num(-1.0), quotients_ref.nan_to_num(-1.0)), block
        assert torch.equal(quotients.signbit()[~quotients_ref.isnan()], quotients_ref.signbit()[~quotients_ref.isnan()])
        assert quotients[2, :128].isnan().all() and (quotients[3] == 0).any()
    _row_quantization_kernel(generator)
    _served_tiles(generator)
    print("interpreted kernels match")


def _served_tiles(generator) -> None:
    """fp8_experts.check_tiles, which the teacher's start-up check runs on a GPU: each tile the
    autotuner may serve (the plain kernel's, the persistent kernel's with fast accumulation, its TMA
    tile among them), gathered, scattered and gated, within the check's tolerance of the reference;
    and scales read wrongly are far outside it for every tile."""
    from teacher_server import fp8_experts, fp8_grouped_gemm

    sizes = [30, 0, 40, 26]
    offsets = torch.tensor(sizes).cumsum(0).int()
    rows = sum(sizes)
    tokens = (torch.randn(50, 256, generator=generator) ** 3).to(torch.bfloat16)
    gather = torch.randint(0, 50, (rows,), generator=generator)
    scatter = torch.randperm(rows, generator=generator)
    route = torch.rand(rows, generator=generator)
    for scaling, fast in (("row", True), ("row", False), ("block", False)):
        module = fp8_experts.FP8ExpertWeights.quantize(torch.randn(4, 256, 256, generator=generator) ** 3, scaling,
                                                       fast_accum=fast)
        module.kernel = "triton"  # the interpreter runs it on the CPU
        sorted_want = fp8_experts.reference_product(module, tokens.index_select(0, gather), offsets)
        want = torch.empty_like(sorted_want).index_copy_(0, scatter, sorted_want)
        gate, up = sorted_want.float().chunk(2, dim=-1)
        gated = scaling == "row" and module.interleave_gate(64)
        tiles = fp8_experts.check_tiles(module, tokens, offsets, gather, scatter, want,
                                        *((route, torch.nn.functional.silu(gate) * up * route[:, None])
                                          if gated else (None, None)))
        served = fp8_grouped_gemm.served_configs(module.weight, module.weight_scale, module.fast_accum)
        assert len(tiles) == len(served) * (2 if gated else 1), (scaling, tiles)
        assert any(tile.get("TMA_W") for tile, _ in tiles) == fast, tiles
        assert all(error <= fp8_experts._CHECK_RTOL for _, error in tiles), (scaling, fast, tiles)
        module.weight_scale = module.weight_scale.flip(0)  # each expert's scales read as another's
        tiles = fp8_experts.check_tiles(module, tokens, offsets, gather, scatter, want)
        assert all(error > 0.2 for _, error in tiles), (scaling, fast, tiles)


def _row_quantization_kernel(generator) -> None:
    """teacher_server/fp8_rows.py's kernel writing its quotients unrounded (float32, where the
    interpreter's own e4m3 rounding would differ) and its scales: equal to fp8_rows.quantize_rows's
    arithmetic as CUDA torch computes it (amax times the float32 reciprocal of 448; quotients by an
    IEEE division, which the kernel computes without one), zeros' signs kept, a NaN row all NaN, a
    row with an inf zeros of the elements' signs and NaN for the inf, through a row stride past the
    width."""
    from teacher_server import fp8_rows

    for rows, k, width, per_program in ((37, 768, 1024, 4), (5, 4096, 4096, 1), (9, 200, 256, 8)):
        wide = (torch.randn(rows, k + 8, generator=generator) ** 3 * 3).to(torch.bfloat16)
        wide[1, 3], wide[2, 5], wide[3, 7], wide[3, 8] = float("nan"), float("inf"), -0.0, 0.0
        x = wide[:, :k]
        quotients = torch.empty(rows, k)
        scale = torch.empty(rows, 1)
        fp8_rows._quantize_rows_kernel[(-(-rows // per_program),)](
            x, quotients, scale, rows, k, x.stride(0), INV_MAX=fp8_rows.INV_FP8_MAX, BLOCK_K=width, ROWS=per_program)
        scale_ref = (x.abs().amax(dim=-1, keepdim=True).float() * fp8_rows.INV_FP8_MAX).clamp(min=fp8_rows.MIN_SCALE)
        quotients_ref = (x.float() / scale_ref).clamp(-fp8_rows.FP8_MAX, fp8_rows.FP8_MAX)
        assert torch.equal(scale.nan_to_num(-1.0), scale_ref.nan_to_num(-1.0)), (rows, k)
        assert torch.equal(quotients.nan_to_num(-1.0), quotients_ref.nan_to_num(-1.0)), (rows, k)
        number = ~quotients_ref.isnan()  # (equal above as numbers; here the zeros' signs too)
        assert torch.equal(quotients.signbit()[number], quotients_ref.signbit()[number]), (rows, k)
        assert scale[1].isnan() and quotients[1].isnan().all()
        finite = x[2].isfinite()
        assert torch.equal(quotients[2][finite].signbit(), x[2][finite].signbit()), (rows, k)
        assert quotients[2][finite].eq(0).all() and quotients[2][~finite].isnan().all(), (rows, k)


def test_the_kernels_under_tritons_interpreter_equal_their_references():
    pytest.importorskip("triton")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(
        [root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    done = subprocess.run([sys.executable, "-m", "tests.test_fp8_grouped_gemm"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "interpreted kernels match" in done.stdout, done.stdout + done.stderr


if __name__ == "__main__":
    _checks()
