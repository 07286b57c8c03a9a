"""The FP8 experts' grouped product on a GPU: one Triton kernel over every expert of an MoE layer.

    out[r] = a[gather[r]] . w[e(r)]^T        for each row r of the pairs sorted by expert

with `a` in e4m3 ([rows, K], one scale per row or per 1 x 128 block of a row), each expert's weight
in e4m3 ([E, N, K], one scale per output row or per 128 x 128 tile), products on the FP8 tensor
cores with float32 accumulation, the scales applied in float32, the output in bf16.

    row scales    acc = sum over K of a x w (promoted to float32 at each 128-wide K step, as for
                  block scales and DeepSeek-V3's recipe; with `fast_accum`, the tensor cores' own
                  partial sums over the whole K), then acc x a_scale[row] x w_scale[e, col]
    block scales  per 128-wide K step: acc += (a x w) x a_scale[row, kb] x w_scale[e, col / 128, kb]
                  (the published checkpoints' layout: `weight_scale_inv` [E, N / 128, K / 128])

What it saves over `torch._scaled_grouped_mm` (row scales only, and measured on an H200 at half the
speed of bf16 `torch._grouped_mm` on Qwen3-30B-A3B's 512-row groups: docs/performance.md):

    the gather    the first product reads each pair's token row from the [T, K] activation by index
                  (`gather`): the permutation costs no [T x k, K] copy, and the activation is
                  quantized once per token, not once per pair
    the scatter   the second product writes each sorted row to its pair's place in token order
                  (`scatter`), so the combine is a sum over k contiguous rows, not a gather

Scheduling: the output tiles are the M-tiles of every expert (an expert of n rows has ceil(n /
BLOCK_M)) times the N-tiles; each tile finds its expert from the group offsets on the device (a
cumulative sum over E <= 1024 tile counts, in registers): no host sync, no per-expert launch.
Consecutive tiles share an M-tile (its rows are read once from memory, then from L2), and an
expert's M-tiles follow each other (its weights stay in L2). Two kernels walk them:

    plain        a program a tile; the grid is the upper bound cdiv(M, BLOCK_M) + E M-tiles, and
                 programs past the last tile return at once (the promoted sums and block scales)
    persistent   a few programs an SM loop over the tiles with the tile counts read once, Triton's
                 pipelining flattened over the loop (the next tile's first K steps load during a
                 tile's epilogue), one tile reading the weights through TMA: fast accumulation, where it
                 ran Qwen3-30B-A3B's two products 1.32x bf16 against the plain kernel's 1.24x
                 (bench/investigations/fp8_grouped_tiles.py, an H200; with promoted sums its large
                 tiles spill and it ran 0.4-0.6x bf16, so those stay on the plain kernel)

The gated first product (`grouped_fp8_gated_mm`): a plain SwiGLU expert's weight stored with its
gate and up rows alternating in groups of 64 (`interleave_gate`, at load), so a tile holds gates
and their ups; the epilogue writes silu(gate) x up x the routing weight, [M, I] instead of the
[M, 2I] product (per Qwen3-30B-A3B layer at 8,192 tokens: 100 MB less written, and 100 MB less
read by the quantization that follows, teacher_server/fp8_rows.py's kernel). Row scales only
(block scales keep transformers' layout).

`swiglu_quantize` is the step between the two products for a plain SwiGLU gate whose rows are not
interleaved (block scales): silu(gate) x up x the routing weight of each row, quantized per row or
per 1 x 128 block, one read of the bf16 row; its scales and quotients computed as
teacher_server/fp8_rows.py's kernel computes them (amax x RN(1/448), quotients rounded to nearest
without a division an element), so they are torch's for the same h.

The tile shapes are autotuned per (N, K, scaling, gated, rows per expert rounded to a power of 4)
on first use among a few configurations (`CONFIGS`, `PERSISTENT_CONFIGS`), timed with the L2 cache
as the calls leave it (Triton's default flushes it first; in a forward the activation was just
written). On a CPU there is no kernel: teacher_server/fp8_experts.py dequantizes and multiplies
there, and the tests hold this kernel to that (tests/gpu/test_moe_gpu.py, every configuration of
both kernels, gated and not; on a CPU under Triton's interpreter, tests/test_fp8_grouped_gemm.py).
"""

from __future__ import annotations

import functools

import torch

from teacher_server.fp8_rows import INV_FP8_MAX

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only install: fp8_experts.py's dequantize-and-multiply path serves
    triton = None
else:
    from teacher_server.fp8_rows import _max_nan, _quotient_rn

BLOCK = 128  # the scale blocks of the block layout (1 x 128 activation, 128 x 128 weight)
MAX_EXPERTS = 1024  # the experts one kernel schedules (its tile counts are held in registers)
MAX_BLOCK_K = 256  # the widest K step a configuration may take (row scales; block scales step by BLOCK)
GATE_GROUP = 64  # the gated product's interleaving: every tile width (BLOCK_N) holds whole pairs of groups


def problem(device: torch.device) -> str:
    """Why the kernel does not run on `device`, or "" when it does."""
    if triton is None:
        return "Triton is not installed"
    if device.type != "cuda":
        return f"the Triton kernel runs on CUDA devices, not {device.type}"
    if torch.cuda.get_device_capability(device) < (8, 9):
        return "FP8 tensor cores need compute capability 8.9 or later"
    return ""


def _configs() -> list:
    # BLOCK_K is the scale block (128): one K step per block-scale pair (row scales may step by 64
    # or 256 in a fixed configuration: bench/investigations/fp8_grouped_tiles.py sweeps them). Hopper's FP8 MMA wants
    # K-major operands, which both are (a's rows, w's output rows). The tiles that won somewhere in
    # bench/moe_teacher.py --experts-probe on an H200 (Qwen3-30B-A3B's and gpt-oss-20b's layers,
    # docs/performance.md): 64 x 128 with promoted sums and block scales, 128 x 256 with fast
    # accumulation, 128 x 128 and 64 x 256 close behind; 128 x 128 with 4 warps and 128 x 64 never did.
    shapes = [(64, 128, 4, 4), (128, 256, 8, 3), (128, 128, 8, 3), (64, 256, 8, 3)]
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": BLOCK}, num_warps=w, num_stages=s)
            for m, n, w, s in shapes]


def _persistent_configs() -> list:
    # (BLOCK_M, BLOCK_N, warps, stages, programs an SM, flattened pipelining, weights through TMA): the
    # fastest with fast accumulation on Qwen3-30B-A3B's layers (H200, Triton 3.6,
    # bench/investigations/fp8_grouped_tiles.py: 128 x 256 in 4 stages flattened, 1.32x bf16 over
    # both products where the plain kernel's best gave 1.24x; in 3 stages 1.23x), and 64 x 128 two an
    # SM for small groups. With sums promoted at every K step the large tiles spill (0.4-0.6x bf16): the
    # plain kernel runs those. The first tile with its weights read through TMA was the fastest of the
    # 2026-12-05 sweep on an H200 (both products 1.510 ms where the autotuned set gave 1.573; the FP8
    # forward 1.404x bf16 with it, 1.392x without, docs/performance.md): autotuned where the weights
    # allow TMA (`_tma_fits`), the other three everywhere.
    shapes = [(128, 256, 8, 4, 1, True, False), (128, 256, 8, 3, 1, True, False), (64, 128, 4, 4, 2, True, False),
              (128, 256, 8, 4, 1, True, True)]
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": BLOCK, "PER_SM": p, "FLATTEN": f, "TMA_W": t},
                          num_warps=w, num_stages=s) for m, n, w, s, p, f, t in shapes]


autotune_timings = 0  # how many configurations the autotuner has timed in this process (benches read it)


def _bench_warm(kernel_call, quantiles=None) -> list[float]:
    """The autotuner's timing: median of 20 calls after 3, the L2 cache left as the calls leave it
    (Triton's default flushes it before each call; in a forward the activation was just written)."""
    global autotune_timings
    autotune_timings += 1
    for _ in range(3):
        kernel_call()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(20)]
    for start, end in events:
        start.record()
        kernel_call()
        end.record()
    torch.cuda.synchronize()
    times = sorted(start.elapsed_time(end) for start, end in events)
    return [times[10], times[4], times[16]] if quantiles is not None else times[10]


if triton is not None:
    # Promoted sums: the tensor cores' partial sums added into float32 every 128 products of K, whatever
    # BLOCK_K a tile steps by.
    PROMOTE_K = tl.constexpr(BLOCK)

    @triton.jit
    def _expert_tiles(offsets_ptr, NUM_EXPERTS: tl.constexpr, EXPERTS_POW2: tl.constexpr, BLOCK_M: tl.constexpr):
        """Each expert's rows (starts, ends) and the cumulative count of its M-tiles, in registers."""
        experts = tl.arange(0, EXPERTS_POW2)
        inside = experts < NUM_EXPERTS
        ends = tl.load(offsets_ptr + experts, mask=inside, other=0)
        starts = tl.load(offsets_ptr + experts - 1, mask=inside & (experts > 0), other=0)
        tiles = tl.where(inside, tl.cdiv(ends - starts, BLOCK_M), 0)
        return experts, starts, ends, tiles, tl.cumsum(tiles, 0)

    @triton.jit
    def _product_tile(
            tile_m, tile_n, experts, starts, ends, tiles, tiles_end,
            a_ptr, a_scale_ptr, gather_ptr, w_ptr, w_desc, w_scale_ptr, out_ptr, scatter_ptr, route_ptr,
            N, K, stride_am, stride_asm, stride_we, stride_wn, stride_wse, stride_wsn, stride_om,
            HAS_GATHER: tl.constexpr, HAS_SCATTER: tl.constexpr, BLOCK_SCALED: tl.constexpr, EVEN_K: tl.constexpr,
            FAST_ACCUM: tl.constexpr, TMA_W: tl.constexpr, GATE_GROUP: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """One BLOCK_M x BLOCK_N tile of the output: M-tile `tile_m` of all the experts' (it must be
        one), N-tile `tile_n`. With GATE_GROUP (> 0) the weight's rows alternate GATE_GROUP gate rows
        and the same GATE_GROUP up rows, and the tile writes silu(gate) x up x route[row]: BLOCK_N / 2
        columns of the [M, N / 2] output. EVEN_K: K is a multiple of BLOCK_K (no K step is masked)."""
        # Block scales step one 128-wide scale block a K step (fixed and autotuned configurations alike).
        tl.static_assert(not BLOCK_SCALED or BLOCK_K == 128, "block scales step K by 128")
        # The tile's expert: the first whose cumulative M-tile count passes tile_m.
        expert = tl.sum((tiles_end <= tile_m).to(tl.int32), 0)
        mine = experts == expert
        first_tile = tl.sum(tl.where(mine, tiles_end - tiles, 0), 0)
        row_start = tl.sum(tl.where(mine, starts, 0), 0) + (tile_m - first_tile) * BLOCK_M
        row_end = tl.sum(tl.where(mine, ends, 0), 0)

        rows = row_start + tl.arange(0, BLOCK_M)
        row_ok = rows < row_end
        rows_in = tl.minimum(rows, row_end - 1)  # rows past the group read its last row: loads unmasked
        if HAS_GATHER:
            a_rows = tl.load(gather_ptr + rows_in).to(tl.int64)
        else:
            a_rows = rows_in.to(tl.int64)
        cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        cols_in = tl.minimum(cols, N - 1).to(tl.int64)
        ks = tl.arange(0, BLOCK_K)
        expert64 = expert.to(tl.int64)
        a_ptrs = a_ptr + a_rows[:, None] * stride_am + ks[None, :]
        w_ptrs = w_ptr + expert64 * stride_we + cols_in[None, :] * stride_wn + ks[:, None]
        w_row = expert * N + tile_n * BLOCK_N  # the tile's first row of [E x N, K] (TMA: rows past N masked at the store)
        if BLOCK_SCALED:
            a_scale_ptrs = a_scale_ptr + a_rows * stride_asm
            w_scale_ptrs = w_scale_ptr + expert64 * stride_wse + (cols_in // BLOCK_K) * stride_wsn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb in range(0, tl.cdiv(K, BLOCK_K)):
            if EVEN_K:
                a = tl.load(a_ptrs)
            else:
                a = tl.load(a_ptrs, mask=ks[None, :] < K - kb * BLOCK_K, other=0.0)
            if TMA_W:
                w = w_desc.load([w_row, kb * BLOCK_K]).T  # zeros past K
            elif EVEN_K:
                w = tl.load(w_ptrs)
            else:
                w = tl.load(w_ptrs, mask=ks[:, None] < K - kb * BLOCK_K, other=0.0)
            if BLOCK_SCALED:
                a_s = tl.load(a_scale_ptrs + kb)
                w_s = tl.load(w_scale_ptrs + kb)
                acc += tl.dot(a, w) * a_s[:, None] * w_s[None, :]
            elif FAST_ACCUM:
                acc = tl.dot(a, w, acc)  # the tensor cores' partial sums over the whole K
            else:
                # promoted to float32 every 128 products (every K step where a step is narrower)
                acc = tl.dot(a, w, acc, max_num_imprecise_acc=PROMOTE_K if BLOCK_K > PROMOTE_K else BLOCK_K)
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        if not BLOCK_SCALED:
            a_s = tl.load(a_scale_ptr + a_rows * stride_asm)
            w_s = tl.load(w_scale_ptr + expert64 * stride_wse + cols_in)
            acc = acc * a_s[:, None] * w_s[None, :]
        if HAS_SCATTER:
            out_rows = tl.load(scatter_ptr + rows_in).to(tl.int64)
        else:
            out_rows = rows_in.to(tl.int64)
        if GATE_GROUP > 0:
            # [BLOCK_M, groups, gate | up, GATE_GROUP] -> the gate and up halves, each [BLOCK_M, BLOCK_N / 2]
            halves = tl.permute(tl.reshape(acc, (BLOCK_M, BLOCK_N // (2 * GATE_GROUP), 2, GATE_GROUP)), (0, 1, 3, 2))
            gate, up = tl.split(halves)
            gate = tl.reshape(gate, (BLOCK_M, BLOCK_N // 2))
            up = tl.reshape(up, (BLOCK_M, BLOCK_N // 2))
            route = tl.load(route_ptr + rows_in).to(tl.float32)
            h = gate * tl.sigmoid(gate) * up * route[:, None]
            hcols = tile_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
            out_ptrs = out_ptr + out_rows[:, None] * stride_om + hcols[None, :]
            tl.store(out_ptrs, h.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (hcols < N // 2)[None, :])
        else:
            out_ptrs = out_ptr + out_rows[:, None] * stride_om + cols[None, :]
            tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])

    @triton.jit
    def _grouped_fp8_mm_kernel(
            a_ptr, a_scale_ptr, gather_ptr, w_ptr, w_scale_ptr, out_ptr, scatter_ptr, route_ptr, offsets_ptr,
            M, N, K, ROWS_BUCKET,
            stride_am, stride_asm, stride_we, stride_wn, stride_wse, stride_wsn, stride_om,
            NUM_EXPERTS: tl.constexpr, EXPERTS_POW2: tl.constexpr, HAS_GATHER: tl.constexpr,
            HAS_SCATTER: tl.constexpr, BLOCK_SCALED: tl.constexpr, K_ALIGN: tl.constexpr, FAST_ACCUM: tl.constexpr,
            GATE_GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """A program a tile: the grid is the upper bound of the tiles; programs past the last return."""
        pid = tl.program_id(0)
        tiles_n = tl.cdiv(N, BLOCK_N)
        tile_m = pid // tiles_n
        experts, starts, ends, tiles, tiles_end = _expert_tiles(offsets_ptr, NUM_EXPERTS, EXPERTS_POW2, BLOCK_M)
        if tile_m >= tl.sum(tiles, 0):
            return
        _product_tile(tile_m, pid % tiles_n, experts, starts, ends, tiles, tiles_end,
                      a_ptr, a_scale_ptr, gather_ptr, w_ptr, w_ptr, w_scale_ptr, out_ptr, scatter_ptr, route_ptr,
                      N, K, stride_am, stride_asm, stride_we, stride_wn, stride_wse, stride_wsn, stride_om,
                      HAS_GATHER, HAS_SCATTER, BLOCK_SCALED, K_ALIGN % BLOCK_K == 0, FAST_ACCUM, False, GATE_GROUP,
                      BLOCK_M, BLOCK_N, BLOCK_K)

    @triton.jit
    def _grouped_fp8_mm_persistent_kernel(
            a_ptr, a_scale_ptr, gather_ptr, w_ptr, w_scale_ptr, out_ptr, scatter_ptr, route_ptr, offsets_ptr,
            M, N, K, ROWS_BUCKET, NUM_SMS,
            stride_am, stride_asm, stride_we, stride_wn, stride_wse, stride_wsn, stride_om,
            NUM_EXPERTS: tl.constexpr, EXPERTS_POW2: tl.constexpr, HAS_GATHER: tl.constexpr,
            HAS_SCATTER: tl.constexpr, BLOCK_SCALED: tl.constexpr, K_ALIGN: tl.constexpr, FAST_ACCUM: tl.constexpr,
            GATE_GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
            PER_SM: tl.constexpr, FLATTEN: tl.constexpr, TMA_W: tl.constexpr):
        """NUM_SMS x PER_SM programs walk the tiles: the experts' tile counts are read once,
        no program is launched past the last tile; with FLATTEN Triton's pipeliner loads the next
        tile's first K steps during this tile's epilogue; with TMA_W the weights come through the
        tensor memory accelerator."""
        experts, starts, ends, tiles, tiles_end = _expert_tiles(offsets_ptr, NUM_EXPERTS, EXPERTS_POW2, BLOCK_M)
        tiles_n = tl.cdiv(N, BLOCK_N)
        total = tl.sum(tiles, 0) * tiles_n
        if TMA_W:
            w_desc = tl.make_tensor_descriptor(w_ptr, shape=[NUM_EXPERTS * N, K], strides=[K, 1],
                                               block_shape=[BLOCK_N, BLOCK_K])
        else:
            w_desc = w_ptr
        for tile in tl.range(tl.program_id(0), total, NUM_SMS * PER_SM, flatten=FLATTEN):
            _product_tile(tile // tiles_n, tile % tiles_n, experts, starts, ends, tiles, tiles_end,
                          a_ptr, a_scale_ptr, gather_ptr, w_ptr, w_desc, w_scale_ptr, out_ptr, scatter_ptr,
                          route_ptr, N, K, stride_am, stride_asm, stride_we, stride_wn, stride_wse, stride_wsn,
                          stride_om, HAS_GATHER, HAS_SCATTER, BLOCK_SCALED, K_ALIGN % BLOCK_K == 0, FAST_ACCUM, TMA_W,
                          GATE_GROUP,
                          BLOCK_M, BLOCK_N, BLOCK_K)

    @triton.jit
    def _swiglu_quantize_kernel(x_ptr, weight_ptr, q_ptr, scale_ptr, M, I, stride_x, stride_q, stride_s,
                                INV_MAX: tl.constexpr, BLOCK_SCALED: tl.constexpr, BLOCK_I: tl.constexpr,
                                ROWS: tl.constexpr):
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        row_ok = rows < M
        cols = tl.arange(0, BLOCK_I)
        mask = row_ok[:, None] & (cols < I)[None, :]
        rows64 = rows.to(tl.int64)
        gate = tl.load(x_ptr + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + rows64[:, None] * stride_x + I + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        weight = tl.load(weight_ptr + rows64, mask=row_ok, other=0.0).to(tl.float32)
        h = gate * tl.sigmoid(gate) * up * weight[:, None]
        if BLOCK_SCALED:
            blocks = tl.reshape(h, (ROWS, BLOCK_I // 128, 128))
            # (NaN kept, as torch's reductions keep it: a row with a NaN quantizes to NaNs)
            scale = tl.maximum(tl.reduce(tl.abs(blocks), 2, _max_nan) * INV_MAX, 1e-12,
                               propagate_nan=tl.PropagateNan.ALL)  # [ROWS, BLOCK_I / 128]
            q = tl.reshape(tl.clamp(_quotient_rn(blocks, scale[:, :, None]), -448.0, 448.0,
                                    propagate_nan=tl.PropagateNan.ALL), (ROWS, BLOCK_I))
            nblocks = tl.arange(0, BLOCK_I // 128)
            tl.store(scale_ptr + rows64[:, None] * stride_s + nblocks[None, :], scale,
                     mask=row_ok[:, None] & (nblocks * 128 < I)[None, :])
        else:
            scale = tl.maximum(tl.reduce(tl.abs(h), 1, _max_nan) * INV_MAX, 1e-12,
                               propagate_nan=tl.PropagateNan.ALL)  # [ROWS]
            q = tl.clamp(_quotient_rn(h, scale[:, None]), -448.0, 448.0, propagate_nan=tl.PropagateNan.ALL)
            tl.store(scale_ptr + rows64 * stride_s, scale, mask=row_ok)
        tl.store(q_ptr + rows64[:, None] * stride_q + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=mask)

    _KEY = ["N", "K", "ROWS_BUCKET", "BLOCK_SCALED", "HAS_GATHER", "FAST_ACCUM", "GATE_GROUP"]
    CONFIGS = _configs()
    PERSISTENT_CONFIGS = _persistent_configs()

    def _autotuned(kernel, configs):
        try:
            return triton.autotune(configs=configs, key=_KEY, do_bench=_bench_warm)(kernel)
        except TypeError:  # a Triton without the do_bench argument
            return triton.autotune(configs=configs, key=_KEY)(kernel)

    _tuned_kernel = _autotuned(_grouped_fp8_mm_kernel, CONFIGS)
    # Two autotuners, each with its own cache: weights TMA cannot read never meet a TMA tile.
    _tuned_persistent = _autotuned(_grouped_fp8_mm_persistent_kernel,
                                   [c for c in PERSISTENT_CONFIGS if not c.kwargs["TMA_W"]])
    _tuned_persistent_tma = _autotuned(_grouped_fp8_mm_persistent_kernel, PERSISTENT_CONFIGS)
else:
    CONFIGS = PERSISTENT_CONFIGS = []


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _tma_scratch(size: int, alignment: int, stream) -> torch.Tensor:
    """The global memory Triton asks for the TMA descriptors a kernel makes on the device."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _set_tma_allocator() -> None:
    """Before every persistent launch: Triton keeps its allocator per thread (a context variable),
    and the teacher checks its kernels at load in one thread and runs its forwards in another."""
    triton.set_allocator(_tma_scratch)


def _tma_fits(w: torch.Tensor) -> bool:
    """Whether TMA can read the weights [E, N, K]: one block of memory, rows 16-byte aligned."""
    return w.is_contiguous() and w.shape[-1] % 16 == 0 and w.data_ptr() % 16 == 0


def _tuned(w: torch.Tensor, block_scaled: bool, fast_accum: bool):
    """The autotuner `launch` runs for weights `w`: the persistent kernel's for fast accumulation
    with row scales (the set with its TMA tile where `_tma_fits`), the plain kernel's otherwise
    (bench/investigations/fp8_grouped_tiles.py)."""
    if not fast_accum or block_scaled:
        return _tuned_kernel
    return _tuned_persistent_tma if _tma_fits(w) else _tuned_persistent


def served_configs(w: torch.Tensor, w_scale: torch.Tensor, fast_accum: bool) -> list[dict]:
    """The tiles `launch`'s autotuner may pick for weights `w` and their scales, in `launch_config`'s form."""
    return [launch_config(c) for c in _tuned(w, w_scale.dim() == 3, fast_accum).configs]


def launch_config(config) -> dict:
    """One of `CONFIGS` or `PERSISTENT_CONFIGS` as `launch`'s fixed `config`."""
    fixed = dict(BLOCK_M=config.kwargs["BLOCK_M"], BLOCK_N=config.kwargs["BLOCK_N"],
                 BLOCK_K=config.kwargs.get("BLOCK_K", BLOCK), num_warps=config.num_warps, num_stages=config.num_stages)
    fixed.update({key: config.kwargs[key] for key in ("PER_SM", "FLATTEN", "TMA_W") if key in config.kwargs})
    return fixed


def rows_bucket(rows: int, experts: int) -> int:
    """The mean rows per expert rounded down to a power of 4 (16 .. 4096): the autotuning key, so a
    small warm-up (the self-check's 96 rows) does not pick the tiles of a 512-row-per-expert pack."""
    mean = max(rows // max(experts, 1), 1)
    bucket = 16
    while bucket * 4 <= min(mean, 4096):
        bucket *= 4
    return bucket


def launch(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, offsets: torch.Tensor,
           gather: torch.Tensor | None, scatter: torch.Tensor | None, out: torch.Tensor,
           config: dict | None = None, fast_accum: bool = False, route: torch.Tensor | None = None,
           gate_group: int = 0) -> torch.Tensor:
    """Runs the kernel into `out` [M, N] (M = gather's length, or a's rows). `config`: fixed tile
    shapes ({"BLOCK_M", "BLOCK_N", "num_warps", "num_stages"}) instead of the autotuned ones; with
    "PER_SM" (and "FLATTEN", "TMA_W") the persistent kernel's.
    `fast_accum` (row scales): the FP8 tensor cores' partial sums kept over the whole K, not promoted
    to float32 at each 128-wide step (faster, less exact: what cuBLAS's fast accumulation does).
    `gate_group` (row scales): w's rows alternate `gate_group` gate rows and their up rows
    (`interleave_gate`), `out` is [M, N / 2] and gets silu(gate) x up x `route` [M] of each row."""
    experts, n, k = w.shape
    m = out.shape[0]
    if gate_group:
        if w_scale.dim() == 3 or route is None or n % (2 * gate_group) or out.shape[1] != n // 2:
            raise ValueError("grouped FP8 kernel: the gated product takes row scales, a routing weight per row, "
                             f"N a multiple of {2 * gate_group} and an [M, N / 2] output")
        if config is not None and config["BLOCK_N"] % (2 * gate_group):
            raise ValueError(f"grouped FP8 kernel: BLOCK_N {config['BLOCK_N']} holds no whole gate groups")
    if m == 0:
        return out
    if experts > MAX_EXPERTS:
        raise ValueError(f"the grouped FP8 kernel schedules at most {MAX_EXPERTS} experts, not {experts}")
    block_scaled = w_scale.dim() == 3
    a_scale = a_scale.reshape(a_scale.shape[0], -1)
    w_scale = w_scale if block_scaled else w_scale.reshape(experts, n)
    if w.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError("grouped FP8 kernel: the weights and the output must be contiguous in their last dimension")
    a, a_scale, w_scale = a.contiguous(), a_scale.contiguous(), w_scale.contiguous()
    dummy = offsets  # an unused pointer argument (HAS_GATHER / HAS_SCATTER off)
    args = (a, a_scale, gather if gather is not None else dummy, w, w_scale, out,
            scatter if scatter is not None else dummy, route.contiguous() if gate_group else dummy, offsets,
            m, n, k, rows_bucket(m, experts),
            a.stride(0), a_scale.stride(0), w.stride(0), w.stride(1), w_scale.stride(0),
            w_scale.stride(1) if block_scaled else 0, out.stride(0))
    constants = dict(NUM_EXPERTS=experts, EXPERTS_POW2=max(triton.next_power_of_2(experts), 16),
                     HAS_GATHER=gather is not None, HAS_SCATTER=scatter is not None, BLOCK_SCALED=block_scaled,
                     K_ALIGN=k & -k if k & (MAX_BLOCK_K - 1) else MAX_BLOCK_K,
                     FAST_ACCUM=fast_accum and not block_scaled, GATE_GROUP=gate_group)

    def tiles(meta):  # the upper bound of the output tiles
        return (triton.cdiv(m, meta["BLOCK_M"]) + experts) * triton.cdiv(n, meta["BLOCK_N"])

    # Autotuned: the persistent kernel for row scales with fast accumulation, the plain one otherwise
    # (bench/investigations/fp8_grouped_tiles.py).
    persistent = constants["FAST_ACCUM"] if config is None else "PER_SM" in config
    if persistent:
        sms = _sm_count(a.device.index if a.device.index is not None else torch.cuda.current_device()) \
            if a.is_cuda else 4
        args = args[:13] + (sms,) + args[13:]
        _set_tma_allocator()

        def grid(meta):
            return (min(tiles(meta), sms * meta["PER_SM"]),)
    else:
        def grid(meta):
            return (tiles(meta),)
    if config is None:
        tuned = _tuned(w, block_scaled, fast_accum)
        if gate_group and any(c.kwargs["BLOCK_N"] % (2 * gate_group) for c in tuned.configs):
            raise ValueError(f"grouped FP8 kernel: gate groups of {gate_group} rows do not fit every autotuned "
                             f"tile; interleave by {GATE_GROUP}")
        tuned[grid](*args, **constants)
        return out
    meta = dict(BLOCK_M=config["BLOCK_M"], BLOCK_N=config["BLOCK_N"], BLOCK_K=config.get("BLOCK_K", BLOCK))
    if meta["BLOCK_K"] != BLOCK and block_scaled or meta["BLOCK_K"] not in (64, BLOCK, 2 * BLOCK):
        raise ValueError(f"grouped FP8 kernel: BLOCK_K {meta['BLOCK_K']}; block scales take {BLOCK}, row scales "
                         f"64, {BLOCK} or {2 * BLOCK}")
    if persistent:
        meta.update(PER_SM=config["PER_SM"], FLATTEN=config.get("FLATTEN", False), TMA_W=config.get("TMA_W", False))
        if meta["TMA_W"] and not _tma_fits(w):
            raise ValueError("grouped FP8 kernel: TMA reads contiguous weights with K a multiple of 16")
    kernel = _grouped_fp8_mm_persistent_kernel if persistent else _grouped_fp8_mm_kernel
    kernel[grid(meta)](*args, **constants, **meta, num_warps=config.get("num_warps", 4),
                       num_stages=config.get("num_stages", 3))
    return out


# The product as an operator of its own: a compiled decoder layer calls it as it is (the
# activation's quantization before it still fuses into what produces the activation).
@torch.library.custom_op("distill_fp8::grouped_fp8_mm", mutates_args=())
def grouped_fp8_mm(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                   offsets: torch.Tensor, gather: torch.Tensor | None, scatter: torch.Tensor | None,
                   zero_unwritten: bool, out_dtype: torch.dtype, fast_accum: bool = False) -> torch.Tensor:
    """a [rows, K] e4m3 with scales [rows] or [rows, K / 128]; w [E, N, K] e4m3 with scales [E, N]
    or [E, N / 128, K / 128]; offsets int32 [E] (each expert's rows end); gather [M]: the row of
    `a` of each sorted pair (None: a's rows are the pairs); scatter [M]: each sorted pair's output
    row (None: in sorted order). -> [M, N] in `out_dtype`. `zero_unwritten`: rows no expert of `w`
    holds (past offsets[-1], under expert parallelism) are zeros instead of left unset. `fast_accum`:
    see `launch`."""
    m = gather.shape[0] if gather is not None else a.shape[0]
    make = torch.zeros if zero_unwritten else torch.empty
    out = make(m, w.shape[1], dtype=out_dtype, device=a.device)
    return launch(a, a_scale, w, w_scale, offsets, gather, scatter, out, fast_accum=fast_accum)


@grouped_fp8_mm.register_fake
def _(a, a_scale, w, w_scale, offsets, gather, scatter, zero_unwritten, out_dtype, fast_accum=False):
    m = gather.shape[0] if gather is not None else a.shape[0]
    return a.new_empty((m, w.shape[1]), dtype=out_dtype)


@torch.library.custom_op("distill_fp8::grouped_fp8_gated_mm", mutates_args=())
def grouped_fp8_gated_mm(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                         offsets: torch.Tensor, gather: torch.Tensor | None, route: torch.Tensor, gate_group: int,
                         zero_unwritten: bool, out_dtype: torch.dtype, fast_accum: bool = False) -> torch.Tensor:
    """The first product of a plain SwiGLU expert with its gate in the epilogue: w [E, 2I, K] with rows
    interleaved by `gate_group` (`interleave_gate`), row scales; route [M]: each sorted pair's routing
    weight. -> silu(gate) x up x route, [M, I] in `out_dtype` (the [M, 2I] product is never written)."""
    m = gather.shape[0] if gather is not None else a.shape[0]
    make = torch.zeros if zero_unwritten else torch.empty
    out = make(m, w.shape[1] // 2, dtype=out_dtype, device=a.device)
    return launch(a, a_scale, w, w_scale, offsets, gather, None, out, fast_accum=fast_accum, route=route,
                  gate_group=gate_group)


@grouped_fp8_gated_mm.register_fake
def _(a, a_scale, w, w_scale, offsets, gather, route, gate_group, zero_unwritten, out_dtype, fast_accum=False):
    m = gather.shape[0] if gather is not None else a.shape[0]
    return a.new_empty((m, w.shape[1] // 2), dtype=out_dtype)


def interleave_gate(rows: torch.Tensor, group: int) -> torch.Tensor:
    """[E, 2I, ...] as [gate | up] -> rows alternating `group` gate rows and the same `group` up rows
    (the layout `grouped_fp8_gated_mm` reads: a tile of 2 x group rows holds a gate and its up)."""
    experts, n = rows.shape[:2]
    tail = rows.shape[2:]
    return rows.reshape(experts, 2, n // (2 * group), group, *tail).transpose(1, 2).reshape(experts, n, *tail)


def deinterleave_gate(columns: torch.Tensor, group: int) -> torch.Tensor:
    """The inverse of `interleave_gate` on the last dimension of a product: [..., 2I] back to [gate | up]."""
    n = columns.shape[-1]
    lead = columns.shape[:-1]
    return columns.reshape(*lead, n // (2 * group), 2, group).transpose(-3, -2).reshape(*lead, n)


def swiglu_quantize_reference(x: torch.Tensor, weight: torch.Tensor, block_scaled: bool
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """silu(gate) x up x weight of each row of x [M, 2I] ([gate | up]), quantized to e4m3 per row
    ([M, 1] scales) or per 1 x 128 block ([M, I / 128]), in float32 then rounded: the kernel's
    arithmetic written with torch's operators (the CPU's path, and the tests' reference)."""
    gate, up = x.float().chunk(2, dim=-1)
    h = torch.nn.functional.silu(gate) * up * weight.float().reshape(-1, 1)
    m, i = h.shape
    blocks = h.reshape(m, i // BLOCK if block_scaled else 1, -1)
    scale = (blocks.abs().amax(dim=-1, keepdim=True) / 448.0).clamp(min=1e-12)
    q = (blocks / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q.reshape(m, i), scale.reshape(m, -1)


# SwiGLU, the routing weight and the quantization of the down product's input in one pass: what a
# compiled layer fused into one persistent reduction ran at 1.1 TB/s on Qwen3-30B-A3B's [65536, 1536]
# (0.22 ms a layer, twice the bf16 gate's time; docs/performance.md); this kernel reads the bf16 row
# once and writes e4m3 and its scales.
@torch.library.custom_op("distill_fp8::swiglu_quantize", mutates_args=())
def swiglu_quantize(x: torch.Tensor, weight: torch.Tensor, block_scaled: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, 2I] ([gate | up], transformers' default gated experts), weight [M] or [M, 1]: the routing
    weight of each row -> (e4m3 [M, I], float32 scales [M, 1] or [M, I / 128])."""
    m, width = x.shape
    i = width // 2
    if x.device.type != "cuda" or triton is None:
        return swiglu_quantize_reference(x, weight, block_scaled)
    x = x.contiguous()
    q = torch.empty(m, i, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(m, i // BLOCK if block_scaled else 1, dtype=torch.float32, device=x.device)
    rows = 4
    if m:
        _swiglu_quantize_kernel[(triton.cdiv(m, rows),)](
            x, weight.reshape(-1).contiguous(), q, scale, m, i, x.stride(0), q.stride(0), scale.stride(0),
            INV_MAX=INV_FP8_MAX, BLOCK_SCALED=block_scaled, BLOCK_I=max(triton.next_power_of_2(i), BLOCK),
            ROWS=rows, num_warps=4)
    return q, scale


@swiglu_quantize.register_fake
def _(x, weight, block_scaled):
    m, width = x.shape
    i = width // 2
    return (x.new_empty((m, i), dtype=torch.float8_e4m3fn),
            x.new_empty((m, i // BLOCK if block_scaled else 1), dtype=torch.float32))


@functools.lru_cache(maxsize=None)
def runs_on(device: torch.device) -> bool:
    return not problem(device)
