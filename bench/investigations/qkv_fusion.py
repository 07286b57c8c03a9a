"""Whether the FP8 forward gains by one product for q, k and v instead of three: FP8 e4m3 row-scaled
products (torch._scaled_mm, fast accumulation, bf16 out) of one quantized input against the q, k and
v weights one at a time, against the same three weights stacked into one [Nq + 2 Nkv, K] matrix,
at 2 x 4096 tokens, on the Qwen3-30B-A3B and Llama-3-8B attention shapes; bf16 beside it.

    python3 -m bench.investigations.qkv_fusion --out /tmp/qkv.md   (one Hopper GPU, a minute)

The FP8 forward's profile (docs/performance.md) gives q/k/v/o 10.1 ms; k's and v's products are
[8192 x 512] each on Qwen's shape, too few tiles to fill 132 SMs. Times are medians of 50 calls
(CUDA events); the stacked product's columns are compared with the three's.
"""

from __future__ import annotations

import argparse

import torch

from bench.investigations.quantize_rows_speed import median_ms
from bench.table import emit

SHAPES = {"Qwen3-30B-A3B": (2048, 4096, 512), "Llama-3-8B": (4096, 4096, 1024)}  # hidden, q out, k/v out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    from teacher_server import fp8

    lines = ["| shape | dtype | q, k, v apart ms | stacked ms | apart / stacked | TFLOP/s apart | TFLOP/s stacked | "
             "stacked against apart, largest relative difference |", "|---|---|---|---|---|---|---|---|"]
    generator = torch.Generator(device="cuda").manual_seed(0)
    for name, (hidden, nq, nkv) in SHAPES.items():
        x = torch.randn(args.tokens, hidden, device="cuda", generator=generator).to(torch.bfloat16)
        weights = [torch.randn(n, hidden, device="cuda", generator=generator).to(torch.bfloat16) * hidden ** -0.5
                   for n in (nq, nkv, nkv)]
        flop = 2 * args.tokens * hidden * (nq + 2 * nkv)
        quantized = [fp8.quantize_rows(w) for w in weights]
        stacked_q = torch.cat([q for q, _ in quantized]).contiguous()
        stacked_s = torch.cat([s for _, s in quantized]).reshape(1, -1).contiguous()
        scales = [s.reshape(1, -1).contiguous() for _, s in quantized]
        xq, xs = fp8.quantize_rows(x)

        def fp8_apart():
            return [torch._scaled_mm(xq, q.t(), scale_a=xs, scale_b=s, out_dtype=torch.bfloat16,
                                     use_fast_accum=True) for (q, _), s in zip(quantized, scales)]

        def fp8_stacked():
            return torch._scaled_mm(xq, stacked_q.t(), scale_a=xs, scale_b=stacked_s, out_dtype=torch.bfloat16,
                                    use_fast_accum=True)
        stacked_w = torch.cat(weights)
        cases = {"FP8 row, fast accumulation": (fp8_apart, fp8_stacked),
                 "bf16": (lambda: [x @ w.t() for w in weights], lambda: x @ stacked_w.t())}
        for dtype, (apart, stacked) in cases.items():
            # (cuBLAS may choose another algorithm for the wider product: the same sums, other orders)
            reference = torch.cat(apart(), dim=1).float()
            same = ((stacked().float() - reference).abs().max() / reference.abs().max()).item()
            ms_apart, ms_stacked = median_ms(apart), median_ms(stacked)
            lines.append(f"| {name} ({hidden} -> {nq} + 2 x {nkv}) | {dtype} | {ms_apart:.4f} | {ms_stacked:.4f} | "
                         f"{ms_apart / ms_stacked:.3f} | {flop / ms_apart / 1e9:.0f} | {flop / ms_stacked / 1e9:.0f} | "
                         f"{same:.1e} |")
            print(lines[-1], flush=True)
    emit(lines, args.out)


if __name__ == "__main__":
    main()
