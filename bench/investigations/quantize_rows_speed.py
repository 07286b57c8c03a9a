"""How fast the FP8 forward's activation quantizations can run: fp8.quantize_rows (one e4m3 scale
per row) compiled by inductor, as a compiled decoder layer runs it, against a Triton kernel written
for it (teacher_server/fp8_rows.py: a few rows a program, one read of the bf16 row, one write of
e4m3; swept here over rows a program and warps, and as its operator chooses them; beside it the
same kernel with an IEEE division an element, as it was at c69342a),
on the Qwen3-30B-A3B-shaped forward's activations at 2 x 4096 tokens: the [65,536 x 768] rows
between the experts' products, the [8,192 x 4096] input of the o projection (contiguous, and as
attention leaves it: [B, H, T, D] read through a transpose), the [8,192 x 2048] input of q/k/v.

    python3 -m bench.investigations.quantize_rows_speed --out /tmp/quantize.md   (one GPU, a minute)

Asks whether a hand kernel would take the 8.9 ms of quantizations in the FP8 forward's profile
(docs/performance.md, "Where the time goes now") nearer the copy bandwidth. Times are medians of
50 calls (CUDA events); TB/s counts the bf16 read and the e4m3 and scale writes.
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from bench.table import emit
from teacher_server.fp8_rows import _max_nan


def quantize_triton(x: torch.Tensor, rows: int, warps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8_rows's kernel with `rows` rows a program and `warps` warps."""
    from teacher_server import fp8_rows

    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    fp8_rows._quantize_rows_kernel[(triton.cdiv(m, rows),)](
        x, q, s, m, k, x.stride(0), INV_MAX=fp8_rows.INV_FP8_MAX, BLOCK_K=triton.next_power_of_2(k), ROWS=rows,
        num_warps=warps)
    return q, s


@triton.jit
def _divide_kernel(x_ptr, q_ptr, scale_ptr, M, K, stride_x, BLOCK_K: tl.constexpr, ROWS: tl.constexpr):
    """The kernel as it was at c69342a: IEEE divisions (tl.math.div_rn) for the scale and every element."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_K)
    mask = (rows < M)[:, None] & (cols < K)[None, :]
    rows64 = rows.to(tl.int64)
    x = tl.load(x_ptr + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    amax = tl.reduce(tl.abs(x), 1, _max_nan)
    scale = tl.maximum(tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32)), 1e-12,
                       propagate_nan=tl.PropagateNan.ALL)
    q = tl.clamp(tl.math.div_rn(x, scale[:, None]), -448.0, 448.0, propagate_nan=tl.PropagateNan.ALL)
    tl.store(q_ptr + rows64[:, None] * K + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + rows64, scale, mask=rows < M)


def quantize_dividing(x: torch.Tensor) -> None:
    """_divide_kernel with the served kernel's rows a program and warps."""
    m, k = x.shape
    width = triton.next_power_of_2(k)
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    rows = max(1, min(16, 4096 // width))
    warps = {1024: 2, 2048: 4, 4096: 16}[width]
    _divide_kernel[(triton.cdiv(m, rows),)](x, q, s, m, k, x.stride(0), BLOCK_K=width, ROWS=rows, num_warps=warps)


def median_ms(call, iters: int = 50) -> float:
    for _ in range(5):
        call()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for start, end in events:
        start.record()
        call()
        end.record()
    torch.cuda.synchronize()
    return sorted(s.elapsed_time(e) for s, e in events)[iters // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    from teacher_server import fp8, fp8_rows

    compiled = torch.compile(fp8.quantize_rows, dynamic=True)
    cases = {
        "[65536 x 768] between the experts' products": torch.randn(65536, 768, device="cuda").to(torch.bfloat16),
        "[8192 x 4096] o's input, contiguous": torch.randn(8192, 4096, device="cuda").to(torch.bfloat16),
        "[8192 x 2048] q/k/v's input": torch.randn(8192, 2048, device="cuda").to(torch.bfloat16),
    }
    attention = torch.randn(2, 32, 4096, 128, device="cuda").to(torch.bfloat16)  # [B, H, T, D]
    lines = ["| activation | inductor ms | inductor TB/s | Triton best ms (rows a program, warps) | Triton TB/s | "
             "the op's choice ms | an IEEE division an element, same rows and warps, ms | "
             "e4m3 bytes and scales equal to quantize_rows's |", "|---|---|---|---|---|---|---|---|"]
    for name, x in cases.items():
        m, k = x.shape
        moved = m * k * 3 + m * 4
        inductor = median_ms(lambda: compiled(x))
        best = None
        for rows in (1, 2, 4, 8, 16):
            for warps in (2, 4, 8, 16):
                if rows * triton.next_power_of_2(k) > 32768:
                    continue
                ms = median_ms(lambda: quantize_triton(x, rows, warps))
                if best is None or ms < best[0]:
                    best = (ms, rows, warps)
        chosen = median_ms(lambda: fp8_rows.quantize_rows_kernel(x))
        dividing = median_ms(lambda: quantize_dividing(x))
        q_ref, s_ref = fp8.quantize_rows(x)  # eager: torch's own kernels
        q, s = fp8_rows.quantize_rows_kernel(x)
        same = torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)
        lines.append(f"| {name} | {inductor:.4f} | {moved / inductor / 1e9:.2f} | "
                     f"{best[0]:.4f} ({best[1]}, {best[2]}) | "
                     f"{moved / best[0] / 1e9:.2f} | {chosen:.4f} | {dividing:.4f} | {same} |")
        print(lines[-1], flush=True)

    # The layer's own order: attention's [B, H, T, D] output, transposed into rows of H x D, in one graph.
    transposed = torch.compile(lambda a: fp8.quantize_rows(a.transpose(1, 2).reshape(-1, a.shape[1] * a.shape[3])),
                               dynamic=True)
    ms = median_ms(lambda: transposed(attention))
    moved = 8192 * 4096 * 3 + 8192 * 4
    lines.append(f"| [8192 x 4096] o's input through the transpose | {ms:.4f} | {moved / ms / 1e9:.2f} | | | | | |")
    print(lines[-1], flush=True)
    copy = median_ms(lambda: cases["[65536 x 768] between the experts' products"].clone())
    lines += ["", f"A bf16 copy of [65536 x 768]: {copy:.4f} ms, {65536 * 768 * 4 / copy / 1e9:.2f} TB/s."]
    print(lines[-1])
    emit(lines, args.out)


if __name__ == "__main__":
    main()
