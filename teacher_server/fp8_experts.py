"""The experts of MoE layers in FP8 (e4m3): quantized at load under --quantize fp8, or a published
FP8 MoE checkpoint's experts (128 x 128 block scales, the Qwen3-30B-A3B-FP8 / DeepSeek-V3 layout)
served as they are stored.

transformers keeps an MoE layer's experts as 3-D parameters (teacher_server/moe.py). Here each of
them (gate_up_proj or up_proj, down_proj) becomes an `FP8ExpertWeights`: the e4m3 weights of every
expert as [E, N, K] (N output rows, K inputs, whatever transformers' layout was) and their scales,

    row     one per expert and output row, [E, N], with one scale per activation row computed at
            each forward (what --quantize fp8 gives by default)
    block   one per expert and 128 x 128 tile, [E, N / 128, K / 128] (a published checkpoint's
            `weight_scale_inv`; --fp8-scaling block), activations per 1 x 128 block of each row

A scale is the dequantization multiplier, as in teacher_server/fp8.py: w ≈ q * scale.
moe.experts_forward calls the weights with the activation, the group offsets and, for the first
product, each sorted pair's token row (`rows`: the permutation) and, for the second, each sorted
row's place in token order (`out_rows`: the combine's order). The activation is quantized before
the permutation (one scale per token row, or per 1 x 128 block of it: the same values as after it,
once per token instead of once per pair; in a compiled layer the quantization fuses into what
produces the activation: the norm before the experts, the gate before the down product; the
output of the gated first product below, which nothing fuses into, is quantized by
teacher_server/fp8_rows.py's kernel). The product is

    GPU      teacher_server/fp8_grouped_gemm.py: one Triton kernel over every expert, FP8 tensor
             cores, float32 accumulation (with --fp8-fast-accum and row scales, the tensor cores'
             partial sums kept over the whole K), the scales in its epilogue (row) or per K block
             (block), the permutation read by index and the combine's order written by index. A
             plain SwiGLU gate with row scales: the first weight's gate and up rows interleaved at
             load (`interleave_gate`), the gate and the routing weight in the first product's
             epilogue (`gated`); with block scales, the gate, the routing weight and the down
             product's input quantization in one kernel between the products (`swiglu_product`)
    CPU      the operands quantized the same way, dequantized to float32 and multiplied by the
             grouped GEMM in float32 (moe.grouped_mm): numerically the product above, up to the
             order of the float32 sums. Also the path of a GPU without Triton (in bf16 there).

A published checkpoint's experts come from transformers' FP8 loader (its `FP8Experts`: e4m3
[E, N, K] and `<name>_scale_inv`); `adopt_published` wraps the same tensors, before moe.install.
Measured on an H200: docs/performance.md, "MoE teachers on one GPU".

`reference_product` is the slow, obvious version (one expert at a time, the quantization written
out): what `verify` holds the device's product to at load (each tile the Triton kernel's
autotuner may pick: `check_tiles`), and what the tests hold both to.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from teacher_server import fp8, fp8_grouped_gemm, fp8_rows, moe

log = logging.getLogger(__name__)

FP8 = fp8.FP8
BLOCK = fp8.BLOCK
GATE_GROUP = fp8_grouped_gemm.GATE_GROUP  # gate rows interleaved with their up rows by this many (interleave_gate)
# The experts' 3-D weights that are quantized, by transformers' names.
WEIGHT_NAMES = ("gate_up_proj", "up_proj", "down_proj")
_SCALED_GROUPED_MM = getattr(torch, "_scaled_grouped_mm", None)
# |product - reference| / |reference| that `verify` accepts: bf16 output rounding and float32 sums'
# order, far under a wrong scale layout (~1).
_CHECK_RTOL = 2e-2


def choose_kernel(device: torch.device, scaling: str) -> str:
    """Which product runs on `device`: "triton" (fp8_grouped_gemm.py), "scaled_grouped_mm" (torch's
    grouped FP8 GEMM, row scales: a GPU without Triton) or "dequantize" (a CPU's)."""
    if fp8_grouped_gemm.runs_on(device):
        return "triton"
    if scaling == "row" and device.type == "cuda" and _SCALED_GROUPED_MM is not None:
        return "scaled_grouped_mm"
    return "dequantize"


class FP8ExpertWeights(nn.Module):
    """One 3-D expert weight in e4m3 ([E, N, K]) with row or block scales; called with rows sorted by
    expert and the group offsets, it returns their products [M, N]."""

    is_expert_weights = True  # what moe.experts_modules recognises besides a 3-D tensor

    def __init__(self, weight_q: torch.Tensor, weight_scale: torch.Tensor, scaling: str, fast_accum: bool = False):
        super().__init__()
        if scaling not in fp8.SCALINGS:
            raise ValueError(f"FP8 scaling {scaling!r}: choose one of {', '.join(fp8.SCALINGS)}")
        experts, n, k = weight_q.shape
        want = (experts, n) if scaling == "row" else (experts, -(-n // BLOCK), k // BLOCK)
        if scaling == "block" and k % BLOCK:
            raise ValueError(f"block-wise FP8 experts need inputs divisible by {BLOCK}, not {k}: use --fp8-scaling "
                             "row")
        if tuple(weight_scale.shape) != want:
            raise ValueError(f"FP8 expert scales {tuple(weight_scale.shape)} for weights {tuple(weight_q.shape)} "
                             f"with {scaling} scaling: expected {want}")
        self.scaling = scaling
        # Row scales on a GPU: the FP8 tensor cores' partial sums kept over the whole K instead of
        # promoted to float32 at each 128-wide step (--fp8-fast-accum; fp8_grouped_gemm.launch).
        self.fast_accum = fast_accum and scaling == "row"
        self.register_buffer("weight", weight_q.contiguous())
        self.register_buffer("weight_scale", weight_scale.float().contiguous())
        self.kernel = choose_kernel(self.weight.device, scaling)
        # > 0: the rows alternate this many gate rows and their up rows (`interleave_gate`), so that the
        # Triton kernel computes silu(gate) x up in its epilogue (`gated`). Products and `dequantized`
        # still give [gate | up].
        self.gate_group = 0
        # How a row-scaled input is quantized: fp8.quantize_rows (which a compiled layer fuses into what
        # makes the input), or fp8_rows.quantize_rows_kernel for an input a kernel of ours makes.
        self.quantize_rows = fp8.quantize_rows

    def interleave_gate(self, group: int = GATE_GROUP) -> bool:
        """A plain SwiGLU expert's first weight ([gate | up], row scales, on the Triton kernel) stored
        with its gate and up rows alternating in groups of `group`, for `gated`. Returns whether it was."""
        n = self.weight.shape[1]
        if self.gate_group or self.kernel != "triton" or self.scaling != "row" or n % (2 * group):
            return False
        self.weight = fp8_grouped_gemm.interleave_gate(self.weight, group).contiguous()
        self.weight_scale = fp8_grouped_gemm.interleave_gate(self.weight_scale, group).contiguous()
        self.gate_group = group
        return True

    def _apply(self, fn, recurse=True):
        # Moved to another device (.to, .cuda): the product that runs there. Decided here, not in
        # forward, so that a compiled layer reads a plain attribute.
        result = super()._apply(fn, recurse)
        self.kernel = choose_kernel(self.weight.device, self.scaling)
        return result

    @classmethod
    def quantize(cls, weight: torch.Tensor, scaling: str, fast_accum: bool = False) -> "FP8ExpertWeights":
        """From transformers' [E, N, K] weights (transpose an [E, K, N] layout first)."""
        quantize = fp8.quantize_rows if scaling == "row" else fp8.quantize_tiles
        parts = [quantize(expert) for expert in weight.detach()]  # one expert at a time: bounded memory
        q = torch.stack([p[0] for p in parts])
        scale = torch.stack([p[1].reshape(p[1].shape[0]) if scaling == "row" else p[1] for p in parts])
        return cls(q, scale, scaling, fast_accum)

    @property
    def dtype(self) -> torch.dtype:
        return FP8

    @property
    def device(self) -> torch.device:
        return self.weight.device

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[E, N, K] in `dtype` (the product in float32, then rounded)."""
        weight, weight_scale = self.canonical()  # [gate | up]
        experts, n, k = weight.shape
        if self.scaling == "row":
            scale = weight_scale.unsqueeze(-1)
        else:
            scale = weight_scale.repeat_interleave(BLOCK, 1)[:, :n].repeat_interleave(BLOCK, 2)
        return (weight.float() * scale).to(dtype)

    def quantize_input(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.quantize_rows(x) if self.scaling == "row" else fp8.quantize_row_blocks(x)

    def forward(self, x: torch.Tensor, offsets: torch.Tensor, rows: torch.Tensor | None = None,
                out_rows: torch.Tensor | None = None, zero_unwritten: bool = False,
                out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """The products of the M sorted (token, expert) pairs: [M, N] in `out_dtype` (x's by default).
        `x`: the activation, [M, K] in sorted order, or [T, K] by token with `rows` [M] the token of each
        sorted pair; `offsets` int32 [E]: where each expert's pairs end; `out_rows` [M]: where each
        sorted pair's product goes (None: in sorted order). `zero_unwritten`: the pairs past
        offsets[-1] (other ranks' experts) give zeros."""
        return self.product(*self.quantize_input(x), offsets, rows, out_rows, zero_unwritten, out_dtype or x.dtype)

    def product(self, xq: torch.Tensor, xs: torch.Tensor, offsets: torch.Tensor, rows: torch.Tensor | None = None,
                out_rows: torch.Tensor | None = None, zero_unwritten: bool = False,
                out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """`forward` on an activation quantized already (e4m3 `xq` and its scales `xs`, as
        `quantize_input` or fp8_grouped_gemm.swiglu_quantize give them)."""
        if self.kernel == "triton":
            out = fp8_grouped_gemm.grouped_fp8_mm(xq, xs, self.weight, self.weight_scale, offsets, rows, out_rows,
                                                  zero_unwritten, out_dtype, self.fast_accum)
            return fp8_grouped_gemm.deinterleave_gate(out, self.gate_group) if self.gate_group else out
        if rows is not None:
            xq, xs = xq.index_select(0, rows), xs.index_select(0, rows)
        if self.kernel == "scaled_grouped_mm":
            out = _SCALED_GROUPED_MM(xq, self.weight.transpose(1, 2), xs.reshape(-1), self.weight_scale,
                                     offs=offsets, out_dtype=out_dtype, use_fast_accum=self.fast_accum)
        else:
            # float32 on a CPU (the tests' exactness); on a GPU the operands rounded to the output's
            # dtype, where the grouped GEMM runs (bf16: the values of e4m3 x a float32 scale, to 8 bits).
            dtype = torch.float32 if xq.device.type == "cpu" else out_dtype
            activation = fp8.dequantize(xq, xs).to(dtype)
            out = moe.grouped_mm(activation, self.dequantized(dtype).transpose(1, 2), offsets).to(out_dtype)
        if self.kernel == "scaled_grouped_mm" and self.gate_group:
            out = fp8_grouped_gemm.deinterleave_gate(out, self.gate_group)
        if zero_unwritten:
            held = torch.arange(out.shape[0], device=out.device) < offsets[-1]
            out = torch.where(held.unsqueeze(-1), out, 0)
        if out_rows is not None:
            out = torch.empty_like(out).index_copy_(0, out_rows, out)
        return out

    def swiglu_product(self, projected: torch.Tensor, pair_weights: torch.Tensor, offsets: torch.Tensor,
                       **placed) -> torch.Tensor:
        """The down product of silu(gate) x up x the routing weight of each row of `projected` [M, 2I]
        ([gate | up], sorted by expert): the gate, the weight and the quantization in one kernel
        (fp8_grouped_gemm.swiglu_quantize), then `product` (`placed`: its out_rows, zero_unwritten,
        out_dtype)."""
        xq, xs = fp8_grouped_gemm.swiglu_quantize(projected, pair_weights, self.scaling == "block")
        return self.product(xq, xs, offsets, **placed)

    def canonical(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The e4m3 weight and its scales with the rows as transformers keeps them ([gate | up])."""
        if not self.gate_group:  # (interleaved only with row scales: weight_scale [E, N])
            return self.weight, self.weight_scale
        weight = fp8_grouped_gemm.deinterleave_gate(self.weight.transpose(1, 2), self.gate_group).transpose(1, 2)
        return weight.contiguous(), fp8_grouped_gemm.deinterleave_gate(self.weight_scale, self.gate_group)

    def gated(self, x: torch.Tensor, offsets: torch.Tensor, pair_weights: torch.Tensor,
              rows: torch.Tensor | None = None, zero_unwritten: bool = False) -> torch.Tensor:
        """A plain SwiGLU expert's first product and gate: silu(gate) x up x the routing weight of each
        sorted pair, [M, I] in x's dtype (`x`, `offsets`, `rows`, `zero_unwritten` as in `forward`).
        With the gate rows interleaved on the Triton kernel, in the product's epilogue: the [M, 2I]
        product is never written; otherwise the product, then the gate in float32."""
        if self.kernel == "triton" and self.gate_group:
            xq, xs = self.quantize_input(x)
            return fp8_grouped_gemm.grouped_fp8_gated_mm(xq, xs, self.weight, self.weight_scale, offsets, rows,
                                                         pair_weights.reshape(-1), self.gate_group, zero_unwritten,
                                                         x.dtype, self.fast_accum)
        gate, up = self(x, offsets, rows=rows, zero_unwritten=zero_unwritten).float().chunk(2, dim=-1)
        return (torch.nn.functional.silu(gate) * up * pair_weights.float().reshape(-1, 1)).to(x.dtype)

    def extra_repr(self) -> str:
        experts, n, k = self.weight.shape
        return (f"experts={experts}, out_features={n}, in_features={k}, scaling={self.scaling}, kernel={self.kernel}"
                + (", fast_accum=True" if self.fast_accum else "")
                + (f", gate rows interleaved by {self.gate_group}" if self.gate_group else ""))


def reference_product(weights: FP8ExpertWeights, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The straightforward product: for each expert, its rows quantized as the fast path does (the
    activation's scales computed row by row, or block by block), both operands dequantized to
    float32, multiplied."""
    weight_q, weight_scale = weights.canonical()  # [gate | up]
    out = torch.zeros(x.shape[0], weight_q.shape[1], dtype=torch.float32, device=x.device)
    start = 0
    for expert, end in enumerate(offsets.tolist()):
        for row in range(start, end):
            values = x[row].float()
            blocks = values.reshape(-1, values.shape[0] if weights.scaling == "row" else BLOCK)
            scale = (blocks.abs().amax(dim=1, keepdim=True) / fp8.FP8_MAX).clamp(min=1e-12)
            activation = ((blocks / scale).clamp(-fp8.FP8_MAX, fp8.FP8_MAX).to(FP8).float() * scale).reshape(-1)
            q = weight_q[expert].float()
            scale_w = weight_scale[expert]
            if weights.scaling == "row":
                w = q * scale_w.unsqueeze(1)
            else:
                w = q * scale_w.repeat_interleave(BLOCK, 0)[:q.shape[0]].repeat_interleave(BLOCK, 1)
            out[row] = w @ activation
        start = end
    return out.to(x.dtype)


def quantize_experts(model: nn.Module, scaling: str, keep_layers: tuple[int, ...] = (), fast_accum: bool = False
                     ) -> int:
    """Replaces the 3-D expert weights of every MoE layer (but those of decoder layers `keep_layers`)
    by FP8ExpertWeights in place; returns how many weights were replaced."""
    layers = fp8.decoder_layers(model)
    keep = {i % len(layers) for i in keep_layers}
    replaced = 0
    for index, layer in enumerate(layers):
        if index in keep:
            continue
        for module in moe.experts_modules(layer):
            for name in WEIGHT_NAMES:
                weight = module._parameters.get(name)
                if weight is None:
                    continue
                if weight.shape[-1] % 16 or weight.shape[-2] % 16:
                    raise ValueError(f"{type(module).__name__}.{name} {tuple(weight.shape)}: FP8 experts need both "
                                     "matrix dimensions divisible by 16; serve the model without --quantize fp8")
                canonical = weight.transpose(1, 2) if module.is_transposed else weight  # [E, N, K]
                del module._parameters[name]
                quantized = FP8ExpertWeights.quantize(canonical, scaling, fast_accum)
                if name == "gate_up_proj" and getattr(module, "plain_swiglu", False):
                    quantized.interleave_gate()  # the gate in the first product's epilogue (moe.experts_forward)
                if name == "down_proj" and getattr(getattr(module, "gate_up_proj", None), "gate_group", 0) \
                        and fp8_rows.serves(quantized.shape[2], quantized.device, canonical.dtype):
                    # Its input comes out of the gated product's kernel, which nothing fuses into.
                    quantized.quantize_rows = fp8_rows.quantize_rows_kernel
                setattr(module, name, quantized)
                replaced += 1
    return replaced


def verify(model: nn.Module, dtype: torch.dtype, rows: int = 96) -> int:
    """Checks one FP8ExpertWeights of each shape against `reference_product` on its own device,
    before the teacher serves (a scale layout the device's kernel reads otherwise gives wrong
    outputs without an error): the rows sorted already, and the rows gathered from token rows and
    written back in token order, as moe.experts_forward calls it. Rows spread over the first
    experts, one expert left empty. Returns how many shapes were checked; raises fp8.FP8Unsupported."""
    checked: set[tuple] = set()
    for name, module in model.named_modules():
        if not isinstance(module, FP8ExpertWeights):
            continue
        key = (module.scaling, *module.weight.shape)
        if key in checked:
            continue
        checked.add(key)
        experts, _, k = module.weight.shape
        device = module.weight.device
        generator = torch.Generator(device=device).manual_seed(len(checked))
        x = torch.randn(rows, k, generator=generator, device=device).pow(3).to(dtype)
        sizes = torch.zeros(experts, dtype=torch.int64)
        used = min(experts, 4)
        sizes[:used] = rows // used
        sizes[used - 1] += rows - int(sizes.sum())
        if used > 2:  # an expert without rows (with two, both take rows: each expert's scales are checked)
            sizes[used - 1] += sizes[1]
            sizes[1] = 0
        offsets = sizes.cumsum(0).to(torch.int32).to(device)
        tokens = x[: rows // 2 + 1]
        gather = torch.randint(0, tokens.shape[0], (rows,), generator=generator, device=device)
        scatter = torch.randperm(rows, generator=generator, device=device)
        with torch.inference_mode():
            sorted_want = reference_product(module, tokens.index_select(0, gather), offsets)
            cases = [(module(x, offsets), reference_product(module, x, offsets)),
                     (module(tokens, offsets, rows=gather, out_rows=scatter),
                      torch.empty_like(sorted_want).index_copy_(0, scatter, sorted_want))]
            if module.gate_group:  # the gate in the product's epilogue, against the reference product's gate
                route = torch.rand(rows, generator=generator, device=device)
                gate, up = sorted_want.float().chunk(2, dim=-1)
                cases.append((module.gated(tokens, offsets, route, rows=gather),
                              torch.nn.functional.silu(gate) * up * route.unsqueeze(-1)))
            errors = [fp8.relative_error(got, want) for got, want in cases]
            # The product above ran the tile the autotuner picked for these few rows; a forward's
            # many rows may pick another: each one it may pick, gathered and scattered (and gated).
            tiles = [] if module.kernel != "triton" else check_tiles(
                module, tokens, offsets, gather, scatter, cases[1][1],
                *((route, cases[2][1]) if module.gate_group else (None, None)))
        if not max(errors) <= _CHECK_RTOL:
            raise fp8.FP8Unsupported(f"FP8 experts {name} ({module.extra_repr()}) on {device}: the grouped product "
                                     f"is off the dequantize-then-multiply reference by {max(errors):.3g} (relative; "
                                     f"sorted rows {errors[0]:.3g}, gathered and scattered {errors[1]:.3g}"
                                     + (f", gated {errors[2]:.3g}" if module.gate_group else "") + "): the "
                                     f"{module.kernel} product reads its operands otherwise. Serve the model without "
                                     "--quantize fp8")
        for tile, error in tiles:
            if not error <= _CHECK_RTOL:
                raise fp8.FP8Unsupported(f"FP8 experts {name} ({module.extra_repr()}) on {device}: the grouped "
                                         f"product with the tile {tile} is off the dequantize-then-multiply reference "
                                         f"by {error:.3g} (relative), and the kernel's autotuner may pick that tile. "
                                         "Serve the model without --quantize fp8, or report this with the GPU and "
                                         "the Triton version")
    return len(checked)


def check_tiles(module: FP8ExpertWeights, tokens: torch.Tensor, offsets: torch.Tensor, gather: torch.Tensor,
                scatter: torch.Tensor, want: torch.Tensor, route: torch.Tensor | None = None,
                gated_want: torch.Tensor | None = None) -> list[tuple[dict, float]]:
    """The Triton product of each tile fp8_grouped_gemm's autotuner may pick for `module`, against
    `want` (the rows of `tokens` gathered, multiplied and scattered, [gather's length, N], all rows
    held by an expert): [(tile, relative error)]; with `route` and `gated_want` also the gated
    product of each (sorted order, [M, N / 2]), its tile marked "gated"."""
    xq, xs = module.quantize_input(tokens)
    m, n = gather.shape[0], module.weight.shape[1]
    results = []
    for tile in fp8_grouped_gemm.served_configs(module.weight, module.weight_scale, module.fast_accum):
        out = torch.empty(m, n, dtype=tokens.dtype, device=tokens.device)
        fp8_grouped_gemm.launch(xq, xs, module.weight, module.weight_scale, offsets, gather, scatter, out,
                                config=tile, fast_accum=module.fast_accum)
        if module.gate_group:
            out = fp8_grouped_gemm.deinterleave_gate(out, module.gate_group)
        results.append((tile, fp8.relative_error(out, want)))
        if gated_want is not None:
            gated = torch.empty(m, n // 2, dtype=tokens.dtype, device=tokens.device)
            fp8_grouped_gemm.launch(xq, xs, module.weight, module.weight_scale, offsets, gather, None, gated,
                                    config=tile, fast_accum=module.fast_accum, route=route,
                                    gate_group=module.gate_group)
            results.append(({**tile, "gated": True}, fp8.relative_error(gated, gated_want)))
    return results


def adopt_published(model: nn.Module) -> int:
    """Replaces the FP8 experts transformers' loader built for a published FP8 checkpoint (its
    `FP8Experts`: e4m3 3-D weights [E, N, K] and a `<name>_scale_inv` [E, N / 128, K / 128] per
    128 x 128 tile) by FP8ExpertWeights over the same tensors (nothing dequantized, nothing copied
    but the scales' dtype); returns how many weights. moe.install then runs them through the
    teacher's experts forward (transformers' own runs a kernel fetched from the hub at first use)."""
    replaced = 0
    for module in model.modules():
        for name in WEIGHT_NAMES:
            weight = module._parameters.get(name)
            scale = module._parameters.get(f"{name}_scale_inv")
            if weight is None or scale is None or weight.dtype != FP8:
                continue
            block = tuple(getattr(module, "block_size", None) or ())
            if block != (BLOCK, BLOCK) or scale.dim() != 3 or getattr(module, "is_transposed", False):
                raise ValueError(f"{type(module).__name__}.{name}: FP8 experts with scales {tuple(scale.shape)} of "
                                 f"block {block or None}; the teacher serves 128 x 128 blocks over [experts, out, in] "
                                 "weights (transformers' FineGrainedFP8Config with weight_block_size [128, 128])")
            experts, n, k = weight.shape
            # transformers allocates at least two scale rows for gate_up (its halves); the weight's own rows count.
            scale = scale.detach()[:, :-(-n // BLOCK)]
            del module._parameters[name], module._parameters[f"{name}_scale_inv"]
            setattr(module, name, FP8ExpertWeights(weight.detach(), scale, "block"))
            replaced += 1
    return replaced
