"""One e4m3 scale per row: the arithmetic (`quantize_rows`) and a Triton kernel that computes it in
one pass on a GPU (`quantize_rows_kernel`, a custom op).

    scale = max(amax(|x_row|) / 448, 1e-12)        q = clamp(x / scale, -448, 448) as e4m3

A compiled decoder layer fuses `quantize_rows` into the kernel that produces its input (the norm
before q/k/v, before the experts). What a kernel of our own or attention produces cannot be fused
into: there inductor compiled the quantization into a reduction kernel of its own that ran at a
fifth to a third of the copy bandwidth on an H200, and this kernel at most of it (0.040 against
0.186 ms on Qwen3-30B-A3B's [65,536 x 768] rows between the experts' products;
bench/investigations/quantize_rows_speed.py, docs/performance.md). teacher_server/fp8.py uses it
for the o projection's input, fp8_experts.py for the down product's after the gated first product.

The kernel gives `quantize_rows`'s values on a GPU: the same scales (amax times the float32
reciprocal of 448, as CUDA torch divides by a number), the same float32 quotients (rounded to
nearest, as torch's divisions) where |x| is above about 1e-33 (nearer float32's smallest normal
numbers a correction's residual underflows and a quotient may be an ulp off: such quotients round
to 0 in e4m3 either way), the same e4m3 rounding, zeros' signs kept; a NaN in a row makes its scale
and every element NaN, as torch's reductions do (tests/gpu/test_moe_gpu.py holds it to
`quantize_rows` byte for byte).

Before a layer takes the kernel (`serves`), `check` holds it to `quantize_rows` on that device, for
that width and dtype, on rows that random ones rarely give (magnitudes spread over 2^-60..2^60, a
zero row, -0s, a NaN, infs, e4m3's rounding ties), contiguous as the layers pass them (many rows,
one row: Triton compiles each apart) and through a row stride: a kernel that differs there (a GPU
or Triton it was not tested on) leaves the layer on torch's quantization, with a warning, instead
of serving other values.
"""

from __future__ import annotations

import logging

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only install: `quantize_rows_kernel` computes `quantize_rows`
    triton = None

log = logging.getLogger(__name__)

IMPLEMENTATION = "quantize_rows"  # what /v1/status's kernels name

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
# The smallest scale: an all-zero row quantizes to zeros instead of dividing by zero.
MIN_SCALE = 1e-12
# The widest row the kernel holds in registers (a program's row); wider ones are quantized by torch.
KERNEL_MAX_WIDTH = 16384


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] -> (e4m3 [M, K], float32 scale [M, 1]): one scale per row."""
    amax = x.abs().amax(dim=-1, keepdim=True).float()
    scale = (amax / FP8_MAX).clamp(min=MIN_SCALE)
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def kernel_serves(width: int, device: torch.device) -> bool:
    """Whether `quantize_rows_kernel` runs the Triton kernel for rows of `width` on `device`."""
    return triton is not None and device.type == "cuda" and width <= KERNEL_MAX_WIDTH


# What CUDA torch multiplies by for `amax / 448` (a tensor divided by a Python number is computed
# as a product with the number's float32 reciprocal there): quantize_rows's scales on a GPU.
INV_FP8_MAX = (torch.tensor(1.0) / torch.tensor(FP8_MAX)).item()

if triton is not None:
    @triton.jit
    def _max_nan(a, b):
        return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)

    @triton.jit
    def _quotient_rn(x, scale):
        """x / scale rounded to nearest (as torch's division), float32, `scale` broadcast over x,
        without a division an element (with an IEEE division an element the row kernel ran about 3x
        slower in the forward): the reciprocal rounded to nearest, the product, and corrections by
        the exact residual (one FMA each). A correction of a quotient within one ulp gives the
        quotient rounded to nearest (Markstein's theorem); the product is not always within one ulp,
        so the first correction brings it there and the second rounds it (for bf16 x one suffices;
        fp16 and float32 x need both). A zero residual (the quotient exact, or x a zero whose sign a
        correction would lose) or a NaN one (an inf scale: a row with an inf) keeps the quotient:
        x * 0 there, a zero of x's sign, NaN for the inf. A NaN scale gives NaN."""
        inv = tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)
        quotient = x * inv
        for _ in tl.static_range(2):
            residual = tl.math.fma(-quotient, scale, x)
            quotient = tl.where(tl.abs(residual) > 0, tl.math.fma(residual, inv, quotient), quotient)
        return quotient

    @triton.jit
    def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, M, K, stride_x, INV_MAX: tl.constexpr, BLOCK_K: tl.constexpr,
                              ROWS: tl.constexpr):
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK_K)
        mask = (rows < M)[:, None] & (cols < K)[None, :]
        rows64 = rows.to(tl.int64)
        x = tl.load(x_ptr + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        amax = tl.reduce(tl.abs(x), 1, _max_nan)
        scale = tl.maximum(amax * INV_MAX, 1e-12, propagate_nan=tl.PropagateNan.ALL)
        quotient = _quotient_rn(x, scale[:, None])
        q = tl.clamp(quotient, -448.0, 448.0, propagate_nan=tl.PropagateNan.ALL)
        tl.store(q_ptr + rows64[:, None] * K + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(scale_ptr + rows64, scale, mask=rows < M)


def launch(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> None:
    """The kernel on x [M, K] (unit column stride, any row stride) into q [M, K] (contiguous; e4m3,
    or float32 for the unrounded quotients) and scale [M, 1]."""
    m, k = x.shape
    width = max(triton.next_power_of_2(k), 16)
    # 4,096 elements a program, and the warps that were fastest on an H200 at widths 1,024 (rows of
    # 768), 2,048 and 4,096 (bench/investigations/quantize_rows_speed.py).
    rows = max(1, min(16, 4096 // width))
    warps = {1024: 2, 2048: 4, 4096: 16}.get(width, 4 if width < 4096 else 16)
    if m:
        _quantize_rows_kernel[(triton.cdiv(m, rows),)](x, q, scale, m, k, x.stride(0), INV_MAX=INV_FP8_MAX,
                                                       BLOCK_K=width, ROWS=rows, num_warps=warps)


@torch.no_grad()
def check(width: int, device: torch.device, dtype: torch.dtype, run=None) -> str:
    """What differs between the kernel (`run(x, q, scale)`, by default `launch`) and `quantize_rows`
    on `device` for rows of `width` in `dtype` ("" when nothing does): the scales, the float32
    quotients before the e4m3 rounding (exact: a one-ulp error shows here long before it reaches a
    rounding boundary), the e4m3 bytes, and NaNs where torch has them. Three inputs, since Triton
    compiles a kernel anew for a row stride or a row count divisible by 16 or equal to 1: 64
    contiguous rows (as the layers call it), one row, and 67 rows (a partial last program) read
    through a row stride past the width."""
    run = launch if run is None else run
    wide = _check_rows(67, width, device, dtype)
    cases = (("64 contiguous rows", wide[:64, :width].contiguous()), ("1 row", wide[5:6, :width].contiguous()),
             ("67 rows through a row stride", wide[:, :width]))
    for what, x in cases:
        why = _differences(x, run)
        if why:
            return f"{why}, {what}"
    return ""


def _check_rows(rows: int, width: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """[rows, width + 8] of what random rows rarely give: magnitudes 2^e a row, e spread over the
    dtype's range (bf16: 2^-60..2^60; fp16: 2^-8..2^8); a zero row; -0s; a NaN; infs; and (row 5)
    448 and the midpoints between neighbouring e4m3 values, both signs: its scale is 1, so its
    quotients are those midpoints and their e4m3 rounding is a tie each (to even)."""
    generator = torch.Generator(device=device).manual_seed(0)
    wide = torch.randn(rows, width + 8, device=device, generator=generator) ** 3
    reach = min(60, int(torch.finfo(dtype).max).bit_length() // 2)
    exponents = torch.randint(-reach, reach + 1, (rows, 1), device=device, generator=generator)
    wide = (wide * torch.exp2(exponents.float())).to(dtype)
    wide[0] = 0.0
    wide[1, :: 3] = -0.0
    wide[2, width // 2] = float("nan")
    wide[3, width - 1] = float("inf")
    wide[4, 0] = float("-inf")
    grid = torch.arange(0, 127, dtype=torch.uint8).view(FP8).float()  # e4m3's values from 0 to 448
    midpoints = (grid[:-1] + grid[1:]) / 2
    ties = torch.cat([midpoints, -midpoints]).to(device)
    wide[5] = ties.repeat(-(-(width + 8) // ties.numel()))[: width + 8].to(dtype)
    wide[5, 0] = FP8_MAX
    return wide


def _differences(x: torch.Tensor, run) -> str:
    rows, width = x.shape
    q_ref, scale_ref = quantize_rows(x)
    quotients_ref = (x.float() / scale_ref).clamp(-FP8_MAX, FP8_MAX)
    q, scale = torch.empty(rows, width, dtype=FP8, device=x.device), torch.empty(rows, 1, device=x.device)
    quotients = torch.empty(rows, width, device=x.device)
    try:
        run(x, q, scale)
        run(x, quotients, torch.empty(rows, 1, device=x.device))
    except Exception as e:  # noqa: BLE001 - any failure of the kernel (a compile error, a launch error) is the verdict
        return f"the kernel failed: {type(e).__name__}: {e}"
    if not torch.equal(scale.nan_to_num(-1.0), scale_ref.nan_to_num(-1.0)):
        return f"other scales in {_rows(scale.nan_to_num(-1.0) != scale_ref.nan_to_num(-1.0))} of {rows} rows"
    same = (quotients == quotients_ref) & (quotients.signbit() == quotients_ref.signbit())
    same |= quotients.isnan() & quotients_ref.isnan()
    if not bool(same.all()):
        return f"other float32 quotients in {_rows(~same)} of {rows} rows"
    nan = q_ref.float().isnan()  # (a NaN's sign bit is not asked of it)
    if not torch.equal(q.float().isnan(), nan):
        return f"NaNs elsewhere than torch's in {_rows(q.float().isnan() != nan)} of {rows} rows"
    differs = (q.view(torch.uint8) != q_ref.view(torch.uint8)) & ~nan
    if bool(differs.any()):
        return f"other e4m3 bytes in {_rows(differs)} of {rows} rows"
    return ""


def _rows(mismatch: torch.Tensor) -> int:
    return int(mismatch.any(dim=-1).sum())


_verdicts: dict[tuple, bool] = {}


def serves(width: int, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a layer whose input rows are `width` wide in `dtype` on `device` takes
    `quantize_rows_kernel`: the kernel runs there (`kernel_serves`) and `check` passed (once per
    width, device and dtype; where it did not, a warning says what differed)."""
    if not kernel_serves(width, device):
        return False
    key = (width, str(device), dtype)
    if key not in _verdicts:
        why = check(width, device, dtype)
        if why:
            log.warning("FP8 row quantization kernel, rows of %d in %s on %s: %s; those layers quantize with "
                        "torch instead (the same values, slower)", width, dtype, device, why)
        _verdicts[key] = not why
    return _verdicts[key]


def served(model: torch.nn.Module) -> int:
    """How many of the model's layers quantize their input rows with the kernel."""
    return sum(1 for m in model.modules()
               if quantize_rows_kernel in (getattr(m, "quantize", None), getattr(m, "quantize_rows", None)))


@torch.library.custom_op("distill_fp8::quantize_rows", mutates_args=())
def _quantize_rows_op(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if not kernel_serves(x.shape[1], x.device):
        q, scale = quantize_rows(x.contiguous())  # (the layout the fake promises)
        return q, scale
    if x.stride(-1) != 1:
        x = x.contiguous()
    q = torch.empty(x.shape, dtype=FP8, device=x.device)
    scale = torch.empty(x.shape[0], 1, dtype=torch.float32, device=x.device)
    launch(x, q, scale)
    return q, scale


@_quantize_rows_op.register_fake
def _(x):
    return x.new_empty(x.shape, dtype=FP8), x.new_empty((x.shape[0], 1), dtype=torch.float32)


# The operator itself (an OpOverload: a module attribute holding it deep-copies, a CustomOpDef does
# not): x [M, K] -> (e4m3 [M, K], float32 [M, 1]), `quantize_rows`'s values; on a CPU, or rows wider
# than KERNEL_MAX_WIDTH, `quantize_rows` itself.
quantize_rows_kernel = torch.ops.distill_fp8.quantize_rows.default
