"""The teacher's decoder in FP8 (e4m3): a bf16 checkpoint quantized at load (`--quantize fp8`),
or a published FP8 checkpoint (transformers' fine-grained FP8, 128 x 128 weight blocks) served
as it is stored.

What is quantized: the decoder's linear layers (q/k/v/o, gate/up/down); an MoE layer's experts,
3-D weights, in teacher_server/fp8_experts.py. The embedding, the
norms, the attention itself and the output head stay in the model's dtype: the head decides the
distribution a student learns from, and it is a small share of the FLOPs.

Two scalings, both through `torch._scaled_mm` (FP8 products accumulated in float32, the
output in the model's dtype):

    row     weights per output channel (one scale per row of W), activations per row (one
            scale per token), computed from the activation at each forward
    block   weights per 128 x 128 tile, activations per 1 x 128 block of each row (the format
            of DeepSeek-V3 and the Qwen3 FP8 releases): finer, so an outlier costs the
            precision of 128 values instead of a whole row

On a CPU there is no block-scaled kernel: FP8Linear dequantizes and multiplies in float32 there
(`reference_linear`), so a published checkpoint serves there too (slowly: for tests); so it does
for row scales where torch's CPU `_scaled_mm` takes per-tensor scales only (torch 2.11).

A scale here is the dequantization multiplier: x ≈ q * scale, with q = x / scale in e4m3
(|q| <= 448). The slow, obvious version of every product is `reference_linear` (dequantize
to float32, multiply): the tests hold the fast one to it.

Speed: the matmul alone runs 1.7-1.9x bf16 on an H200, but each activation's quantization is
a read of the bf16 activation, a row reduction and a write of FP8; as separate kernels they
cost more than the matmul saves. `compile_layers` compiles each decoder layer, so that the
quantization fuses into the kernel that produces its input (the RMSNorm before q/k/v and
gate/up, the SwiGLU product before down). The o projection's input comes out of attention,
which nothing fuses into: with row scales on a GPU it is quantized by a Triton kernel of its
own (teacher_server/fp8_rows.py; inductor's ran at a fifth to a third of the copy bandwidth).
bench/fp8_teacher.py measures each variant.

What a quantization costs the distribution depends on the teacher (a toy Llama 7.7e-4 nats
per token, SmolLM2-135M 3.1e-2): teacher_server/fp8_calibration.py measures it at load on a
calibration batch, adds each linear's weight rounding error on the batch's mean input to its
bias (`FP8Linear.from_linear(input_mean=)`), and keeps single linears in the model's dtype for
a bound (`Fp8Plan.keep_linears`).

Before a model quantized here serves, `verify` runs one layer of each shape against the
reference on its own device: a scale layout that this torch's `_scaled_mm` reads otherwise
would give wrong outputs without an error. Measured on an H200 (torch 2.11, CUDA 13;
`python -m bench.investigations.fp8_block_layout`): cuBLAS reads each row of 128 x 128 weight
scales as a multiple of 4 K-blocks (an unpadded count of 2 or 6 gave errors of 1e2-1e3, hence
the K padding below), and refuses 1 x 128 activation scales for a row count that is not a
multiple of 4 (hence the row padding, in `block_scaled_mm`).
"""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass

import torch
from torch import nn

from distill_common.quantization import FP8_E4M3, Quantization  # noqa: F401  (what the runner reports)
from teacher_server import fp8_rows
from teacher_server.fp8_rows import FP8, FP8_MAX, quantize_rows  # noqa: F401  (this module's arithmetic)

BLOCK = 128
SCALINGS = ("row", "block")
_MIN_SCALE = fp8_rows.MIN_SCALE
# The linear layers of a Llama-family decoder layer that are quantized.
LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class FP8Unsupported(ValueError):
    """This device cannot run the FP8 teacher asked for; the message says what to do instead."""


def fp8_device_problem(device: torch.device, scaling: str = "row") -> str:
    """Why `device` cannot run FP8 matmuls of `scaling`, or "" when it can."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            return (f"{torch.cuda.get_device_name(device)} (compute capability {major}.{minor}) has no FP8 matrix "
                    "units: FP8 needs compute capability 8.9 or later (Ada, Hopper, Blackwell)")
        if scaling == "block" and major != 9:
            return (f"block-wise FP8 scales run through cuBLAS on compute capability 9.0 (Hopper) only, not "
                    f"{major}.{minor}")
        return ""
    if device.type == "cpu":
        # torch's CPU _scaled_mm runs row-wise scales (from some version on: `rowwise_scaled_mm_on_cpu`);
        # block-wise ones, and row-wise ones where it does not, are dequantized and multiplied in float32
        # (FP8Linear.forward). Slowly: for tests and published checkpoints on a laptop, not for speed.
        return ""
    return f"FP8 with {scaling}-wise scales does not run on {device.type}: it needs a GPU of compute capability 8.9+"


@functools.lru_cache(maxsize=None)
def rowwise_scaled_mm_on_cpu() -> bool:
    """Whether this torch's CPU `_scaled_mm` takes row-wise scales: torch 2.13's does, 2.11's takes
    per-tensor scales only (an internal assert otherwise: "_scaled_mm only supports per-tensor
    scaling for CPU backend")."""
    a = torch.zeros(16, 16, dtype=FP8)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.float32)
    except (RuntimeError, NotImplementedError):
        return False
    return True


# ---- quantization: the arithmetic ---------------------------------------------------------

# quantize_rows (one scale per row) is teacher_server/fp8_rows.py's, beside its GPU kernel.


def quantize_row_blocks(x: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] -> (e4m3 [M, K], float32 scale [M, K / block]): one scale per 1 x block of a row."""
    m, k = x.shape
    blocks = x.float().reshape(m, k // block, block)
    scale = (blocks.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=_MIN_SCALE)
    q = (blocks / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.reshape(m, k), scale.reshape(m, k // block)


def quantize_tiles(w: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> (e4m3 [N, K], float32 scale [N / block, K / block]): one scale per block x block tile
    (a partial last tile where N is not a multiple of the block)."""
    n, k = w.shape
    rows = math.ceil(n / block) * block
    padded = torch.zeros(rows, k, dtype=torch.float32, device=w.device)
    padded[:n] = w.float()
    tiles = padded.reshape(rows // block, block, k // block, block)
    scale = (tiles.abs().amax(dim=(1, 3), keepdim=True) / FP8_MAX).clamp(min=_MIN_SCALE)
    q = (tiles / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).reshape(rows, k)[:n]
    return q.contiguous(), scale.reshape(rows // block, k // block)


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 values of `q` [R, C] under `scale`: [R, 1] (rows), [R, C / b] (1 x b blocks) or
    [ceil(R / b), C / b] (b x b tiles)."""
    r, c = q.shape
    values = q.float()
    if scale.shape[0] == r:
        return (values.reshape(r, scale.shape[1], -1) * scale.unsqueeze(-1)).reshape(r, c)
    block = c // scale.shape[1]
    full = scale.repeat_interleave(block, dim=0)[:r].repeat_interleave(block, dim=1)[:, :c]
    return values * full


def reference_linear(x: torch.Tensor, weight_q: torch.Tensor, weight_scale: torch.Tensor, scaling: str,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """The straightforward FP8 linear, the tests' reference: the activation quantized as the fast
    path does, both operands dequantized to float32, multiplied in float32."""
    x2 = x.reshape(-1, x.shape[-1])
    xq, xs = quantize_rows(x2) if scaling == "row" else quantize_row_blocks(x2)
    out = dequantize(xq, xs) @ dequantize(weight_q, weight_scale).t()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*x.shape[:-1], weight_q.shape[0])


# cuBLAS reads each row of 128 x 128 weight scales as a multiple of 4 K-blocks: a layer with
# another count is padded with zero columns (and its input with zeros) to the next multiple.
_K_BLOCK_MULTIPLE = 4
_M_ROW_MULTIPLE = 4
# The self-check's bound on |FP8Linear - reference| / |reference|: the bf16 rounding of the
# output and the float32 sums' order, far under any layout or scale error (which gives ~1).
_CHECK_RTOL = 1e-2


# The block-scaled product as an operator of its own, which torch.compile calls as it is: the
# compiler's lowering of `_scaled_mm` refuses 1 x 128 / 128 x 128 scales whose shapes are
# symbolic (a compiled layer's, with dynamic shapes: "Inductor Triton does not support
# scale_a.shape = ..."). The activation's quantization before it still fuses into what produces it.
@torch.library.custom_op("distill_fp8::block_scaled_mm", mutates_args=())
def block_scaled_mm(xq: torch.Tensor, xs: torch.Tensor, weight: torch.Tensor, scale_b: torch.Tensor,
                    bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """xq [M, K] e4m3 with 1 x 128 scales xs [M, K / 128], times weight [N, K] e4m3 with 128 x 128
    scales (K-major, [K / 128, N / 128]): [M, N] in `out_dtype`."""
    rows = xq.shape[0]
    pad = (-rows) % _M_ROW_MULTIPLE
    if pad:
        # cuBLAS refuses 1 x 128 scales whose M-major leading dimension is not a multiple of 4
        # (CUBLAS_STATUS_NOT_SUPPORTED): rows of zeros added (byte 0 is +0.0 in e4m3), scale 1.
        # Here, where the row count is a number: in a compiled layer it is a symbol, and padding
        # by its remainder broke the compiler's tiling analysis.
        xq = torch.cat([xq.view(torch.uint8), xq.new_zeros((pad, xq.shape[1]), dtype=torch.uint8)]).view(FP8)
        xs = torch.cat([xs, xs.new_ones((pad, xs.shape[1]))])
    xs = xs.t().contiguous().t()  # cuBLAS reads 1 x 128 scales M-major
    out = torch._scaled_mm(xq, weight.t(), scale_a=xs, scale_b=scale_b, bias=bias, out_dtype=out_dtype)
    return out[:rows] if pad else out


@block_scaled_mm.register_fake
def _(xq, xs, weight, scale_b, bias, out_dtype):
    return xq.new_empty((xq.shape[0], weight.shape[0]), dtype=out_dtype)


# ---- the layer ------------------------------------------------------------------------------

class FP8Linear(nn.Module):
    """A Linear whose weight is e4m3 with `scaling` scales; its input is quantized at each call."""

    def __init__(self, weight_q: torch.Tensor, weight_scale: torch.Tensor, scaling: str,
                 bias: torch.Tensor | None = None, fast_accum: bool = False):
        super().__init__()
        if scaling not in SCALINGS:
            raise ValueError(f"FP8 scaling {scaling!r}: choose one of {', '.join(SCALINGS)}")
        if fast_accum and scaling != "row":
            raise ValueError("FP8 fast accumulation is for row scales: block-scaled products accumulate in float32")
        self.scaling = scaling
        # cuBLAS's fast accumulation: the tensor cores' partial sums are not promoted to float32 as
        # the product goes along K (what torchao's row-wise float8 does by default).
        self.fast_accum = fast_accum
        self.out_features, self.in_features = weight_q.shape
        weight_scale = weight_scale.float()
        self._k_pad = 0
        if scaling == "block" and weight_scale.shape[1] % _K_BLOCK_MULTIPLE:
            blocks = weight_scale.shape[1] + (-weight_scale.shape[1]) % _K_BLOCK_MULTIPLE
            self._k_pad = blocks * BLOCK - self.in_features
            padded = torch.zeros(self.out_features, blocks * BLOCK, dtype=torch.uint8, device=weight_q.device)
            padded[:, :self.in_features] = weight_q.view(torch.uint8)  # byte 0 is +0.0 in e4m3
            weight_q = padded.view(FP8)
            weight_scale = torch.cat([weight_scale, weight_scale.new_ones(weight_scale.shape[0], blocks -
                                                                          weight_scale.shape[1])], dim=1)
        self.register_buffer("weight", weight_q.contiguous())  # [N, K (+ padding)]
        self.register_buffer("weight_scale", weight_scale.contiguous())  # [N, 1] or [N / 128, K / 128 (+ padding)]
        # _scaled_mm takes row scales as one row [1, N], and 128 x 128 scales K-major [K / 128, N / 128].
        self.register_buffer("_scale_b", self.weight_scale.reshape(1, -1) if scaling == "row"
                             else self.weight_scale.t(), persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.quantize = quantize_rows if scaling == "row" else quantize_row_blocks

    @classmethod
    def from_linear(cls, linear: nn.Linear, scaling: str, fast_accum: bool = False,
                    input_mean: torch.Tensor | None = None) -> "FP8Linear":
        """`input_mean` [in_features]: the mean input on a calibration batch; given, the weight's
        rounding error on it is added to the bias (bias correction: the systematic part of the
        error, which the same weights make on every token, costs nothing at run time)."""
        weight = linear.weight.detach()
        if hasattr(weight, "full_tensor"):
            raise ValueError("FP8 quantization at load needs plain weight tensors, not DTensors (transformers' "
                             "tensor-parallel plan): the teacher shards with its own plan when --quantize fp8 is set")
        if weight.shape[1] % BLOCK and scaling == "block":
            raise ValueError(f"block-wise FP8 needs in_features divisible by {BLOCK}, not {weight.shape[1]}")
        q, scale = quantize_rows(weight) if scaling == "row" else quantize_tiles(weight)
        bias = linear.bias
        if input_mean is not None:
            correction = input_mean.float().to(weight.device) @ (weight.float() - dequantize(q, scale)).t()
            bias = correction.to(weight.dtype) if bias is None else (bias.detach().float() + correction).to(bias.dtype)
        layer = cls(q, scale, scaling, bias, fast_accum)
        carry_hooks(linear, layer)  # the TP plan's collectives on the Linear move with it
        return layer

    def stored(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The e4m3 weight [N, K] and its scales, without the padding."""
        if not self._k_pad:
            return self.weight, self.weight_scale
        return self.weight[:, :self.in_features], self.weight_scale[:, :math.ceil(self.in_features / BLOCK)]

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize(*self.stored()).to(dtype)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The same product, computed the straightforward way (`reference_linear`)."""
        return reference_linear(x, *self.stored(), self.scaling, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cuda" and (self.scaling == "block" or not rowwise_scaled_mm_on_cpu()):
            return self.reference(x)  # no FP8 kernel for these scales off a GPU: the same product, in float32
        x2 = x.reshape(-1, self.in_features)
        if self._k_pad:  # the in-features padded with zeros as the weight is (the rows: in block_scaled_mm)
            x2 = torch.nn.functional.pad(x2, (0, self._k_pad))
        xq, xs = self.quantize(x2)
        if self.scaling == "block":
            out = block_scaled_mm(xq, xs, self.weight, self._scale_b, self.bias, x.dtype)
        else:
            out = torch._scaled_mm(xq, self.weight.t(), scale_a=xs, scale_b=self._scale_b, bias=self.bias,
                                   out_dtype=x.dtype, use_fast_accum=self.fast_accum)
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, scaling={self.scaling}"
                + (", fast_accum=True" if self.fast_accum else ""))


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """|got - want| / |want| in float32: what the self-checks (`verify`, fp8_experts.verify) bound."""
    return ((got.float() - want.float()).norm() / want.float().norm().clamp(min=1e-30)).item()


def verify(model, dtype: torch.dtype, rows: int = 64) -> int:
    """Checks one FP8Linear of each shape and input quantization against `FP8Linear.reference` on
    random heavy-tailed inputs, on the layers' own device, before the teacher serves anything: a
    torch whose `_scaled_mm` reads a scale layout otherwise than it is written here would give wrong
    outputs without an error. Returns how many were checked; raises FP8Unsupported."""
    checked: set[tuple] = set()
    for name, module in model.named_modules():
        if not isinstance(module, FP8Linear):
            continue
        key = (module.scaling, module.in_features, module.out_features, module.quantize)
        if key in checked:
            continue
        checked.add(key)
        generator = torch.Generator(device=module.weight.device).manual_seed(len(checked))
        x = torch.randn(rows, module.in_features, generator=generator, device=module.weight.device).pow(3).to(dtype)
        with torch.inference_mode():
            got = module.forward(x).float()  # forward, not __call__: no tensor-parallel hook runs
            want = module.reference(x).float()
        error = relative_error(got, want)
        if not error < _CHECK_RTOL:
            raise FP8Unsupported(
                f"FP8 self-check failed: {name} ({module.in_features} -> {module.out_features}, {module.scaling} "
                f"scales) differs from the dequantize-then-multiply reference by {error:.3g} (relative), more than "
                f"{_CHECK_RTOL:g}: this torch ({torch.__version__}) computes its scaled matmul otherwise than "
                "teacher_server/fp8.py lays it out. Serve with --fp8-scaling row, or without FP8")
    return len(checked)


# ---- a model quantized at load ------------------------------------------------------------

COMPILE_MODES = ("auto", "layers", "quantize", "off")


@dataclass(frozen=True)
class Fp8Plan:
    """How a bf16 checkpoint is quantized at load (--quantize fp8), and how FP8 layers are compiled."""

    scaling: str = "row"
    keep_layers: tuple[int, ...] = ()  # decoder layers left in the model's dtype (negative: from the end)
    compile: str = "auto"  # COMPILE_MODES: auto is layers on one process, quantize under tensor parallelism
    fast_accum: bool = False  # row scales only: cuBLAS's fast accumulation (docs/performance.md weighs it)
    # Single linears left in the model's dtype, by module name (model.named_modules(), e.g.
    # "model.layers.29.mlp.down_proj"): what the start-up calibration keeps under --fp8-max-kl.
    keep_linears: tuple[str, ...] = ()
    # The start-up calibration (teacher_server/fp8_calibration.py): its text (a file, "" the
    # built-in sample), its batch (0 rows: not measured), the bound on the measured KL per token
    # (0: measured, nothing kept for it), and the bias correction computed on it.
    calibration: str = ""
    calibration_rows: int = 4
    calibration_seq: int = 256
    max_kl: float = 0.0
    bias_correction: bool = True


def decoder_layers(model) -> nn.ModuleList:
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"{type(model).__name__} has no decoder.layers list: FP8 quantization at load knows "
                         "Llama-family decoders (q/k/v/o_proj, gate/up/down_proj)")
    return layers


def decoder_linears(model) -> dict[str, tuple[int, nn.Module, str, nn.Module]]:
    """The decoder layers' linears FP8 applies to (plain or already FP8), by module name:
    name -> (decoder layer index, parent module, attribute name, the linear)."""
    layers = decoder_layers(model)
    names = {id(module): name for name, module in model.named_modules()}
    found = {}
    for index, layer in enumerate(layers):
        for parent in layer.modules():
            for name, child in parent.named_children():
                if name in LINEAR_NAMES and isinstance(child, (nn.Linear, FP8Linear)):
                    found[f"{names[id(parent)]}.{name}"] = (index, parent, name, child)
    return found


def carry_hooks(source: nn.Module, target: nn.Module) -> None:
    """`source`'s forward hooks and pre-hooks onto `target` (which replaces it), with the flags torch
    keeps beside them (hooks that take kwargs, hooks called always)."""
    target._forward_hooks.update(source._forward_hooks)
    target._forward_pre_hooks.update(source._forward_pre_hooks)
    target._forward_hooks_with_kwargs.update(source._forward_hooks_with_kwargs)
    target._forward_pre_hooks_with_kwargs.update(source._forward_pre_hooks_with_kwargs)
    target._forward_hooks_always_called.update(source._forward_hooks_always_called)


def quantize_model(model, plan: Fp8Plan, input_means: dict[str, torch.Tensor] | None = None) -> int:
    """Replaces the decoder layers' linears by FP8Linear in place (but those of `plan.keep_layers`
    and `plan.keep_linears`); returns how many were replaced. `input_means`: each linear's mean
    input on a calibration batch, by module name, for bias correction (FP8Linear.from_linear)."""
    layers = decoder_layers(model)
    outside = [i for i in plan.keep_layers if not -len(layers) <= i < len(layers)]
    if outside:
        raise ValueError(f"--fp8-keep-layers {','.join(map(str, outside))}: the model has {len(layers)} decoder "
                         f"layers (0..{len(layers) - 1}, or -1 for the last)")
    keep = {i % len(layers) for i in plan.keep_layers}
    linears = decoder_linears(model)
    unknown = sorted(set(plan.keep_linears) - set(linears))
    if unknown:
        raise ValueError(f"FP8 plan keeps {unknown[0]} in the model's dtype, but the model has no decoder linear of "
                         f"that name (they are named like {next(iter(linears), '?')})")
    replaced = 0
    for full_name, (index, parent, name, child) in linears.items():
        if index in keep or full_name in plan.keep_linears or not isinstance(child, nn.Linear):
            continue
        mean = None if input_means is None else input_means.get(full_name)
        layer = FP8Linear.from_linear(child, plan.scaling, plan.fast_accum, mean)
        if name == "o_proj" and plan.scaling == "row" and fp8_rows.serves(layer.in_features, layer.weight.device,
                                                                           child.weight.dtype):
            # Its input is attention's output, which a compiled layer cannot fuse a quantization into.
            layer.quantize = fp8_rows.quantize_rows_kernel
        setattr(parent, name, layer)
        replaced += 1
    if not replaced:
        raise ValueError(f"{type(model).__name__}: no decoder linear ({', '.join(LINEAR_NAMES)}) to quantize")
    return replaced


def linear_flops(module: nn.Module) -> int:
    """Multiply-adds per token of a linear (plain or FP8): in_features x out_features."""
    return module.in_features * module.out_features


def compile_layers(model, block: bool | None = None) -> None:
    """Compiles each decoder layer (dynamic shapes: one graph serves every pack shape), so that an
    activation's quantization fuses into the kernel that produces it. `block`: whether the layers
    hold block-scaled products (None: whether any FP8Linear of the model is block-scaled)."""
    # Block scales: without the compiler's coalescing analysis for tiling, whose check of a fused
    # node's sizes failed on the block quantization's symbolic shapes (an AssertionError in
    # tiling_utils.get_pw_red_splits, torch 2.11, on an H200); it does not apply to dynamic shapes.
    import torch._inductor.config as inductor

    if block is None:
        block = any(isinstance(m, FP8Linear) and m.scaling == "block" for m in model.modules())
    options = ({"triton.coalesce_tiling_analysis": False}
               if block and hasattr(inductor.triton, "coalesce_tiling_analysis") else None)
    layers = decoder_layers(model)
    # The layers share one code object, so one compilation serves every layer of the same make-up;
    # a plan that keeps single linears in bf16 (--fp8-max-kl) gives layers of several make-ups, one
    # compilation each, and past dynamo's recompile limit (8) the remaining layers would run
    # uncompiled without an error: the limit is raised to their number (and the layer kinds' eight).
    makeups = {tuple(type(m).__name__ for m in layer.modules()) for layer in layers}
    import torch._dynamo.config as dynamo

    if len(makeups) + 8 > dynamo.recompile_limit:
        dynamo.recompile_limit = len(makeups) + 8
    for layer in layers:
        layer.compile(dynamic=True, options=options)


def compile_quantization(model) -> None:
    """Compiles each FP8 layer's activation quantization alone (one fused kernel per activation
    instead of five), for a forward that cannot be compiled whole: under tensor parallelism the
    layers' collectives run in hooks between the linears."""
    compiled = {"row": torch.compile(quantize_rows, dynamic=True),
                "block": torch.compile(quantize_row_blocks, dynamic=True)}
    for module in model.modules():
        if isinstance(module, FP8Linear) and module.quantize is not fp8_rows.quantize_rows_kernel:
            module.quantize = compiled[module.scaling]


# ---- published FP8 checkpoints ----------------------------------------------------------------

def checkpoint_quantization(config) -> dict | None:
    """The FP8 quantization_config a model's config.json declares, or None (not FP8)."""
    qc = getattr(config, "quantization_config", None)
    if qc is None:
        return None
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    return qc if qc.get("quant_method") == "fp8" else None


@contextlib.contextmanager
def loaded_as_stored():
    """Within it, transformers loads an FP8 checkpoint's weights as they are stored on a machine
    without a GPU too (its FP8 quantizer dequantizes them to bf16 there): the teacher adopts them
    as they are (`adopt_published`, fp8_experts.adopt_published) and computes their products on
    the CPU by dequantizing at each product."""
    from transformers.quantizers import auto
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    class AsStored(FineGrainedFP8HfQuantizer):
        def validate_environment(self, *args, **kwargs):
            if torch.cuda.is_available() or not self.pre_quantized:
                return super().validate_environment(*args, **kwargs)

    previous = auto.AUTO_QUANTIZER_MAPPING["fp8"]
    auto.AUTO_QUANTIZER_MAPPING["fp8"] = AsStored
    try:
        yield
    finally:
        auto.AUTO_QUANTIZER_MAPPING["fp8"] = previous


def adopt_published(model) -> int:
    """Replaces the FP8 linears transformers' loader built (a weight in e4m3 and its `weight_scale_inv`
    per 128 x 128 tile) by FP8Linear over the same tensors; returns how many. transformers' own
    forward for them runs a kernel fetched from the hub at first use, which a teacher without
    internet access cannot; `_scaled_mm` computes the same block-scaled product."""
    replaced = 0
    for parent in model.modules():
        for name, child in list(parent.named_children()):
            scale = getattr(child, "weight_scale_inv", None)
            weight = getattr(child, "weight", None)
            if scale is None or weight is None or weight.dtype != FP8:
                continue
            block = getattr(child, "block_size", None)
            if scale.dim() != 2 or tuple(block or ()) != (BLOCK, BLOCK):
                raise ValueError(f"{name}: FP8 weight scales of block {block}; the teacher serves 128 x 128 blocks "
                                 "(transformers' FineGrainedFP8Config with weight_block_size [128, 128])")
            layer = FP8Linear(weight.detach(), scale.detach(), "block", getattr(child, "bias", None))
            carry_hooks(child, layer)  # the tensor-parallel plan's collectives on the linear move with it
            setattr(parent, name, layer)
            replaced += 1
    return replaced


def dense_weight(module: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """A linear's weight in `dtype`, dequantized when it is stored in FP8."""
    if isinstance(module, FP8Linear):
        return module.dense_weight(dtype)
    weight = module.weight
    scale = getattr(module, "weight_scale_inv", None)
    if weight.dtype == FP8 and scale is not None:
        if scale.numel() == 1:
            return (weight.float() * scale.float()).to(dtype)
        return dequantize(weight, scale).to(dtype)
    return weight
