"""Which grouped FP8 kernel and tiles run Qwen3-30B-A3B's expert products fastest on a Hopper GPU:
teacher_server/fp8_grouped_gemm.py's plain kernel (a program a tile, the grid an upper bound of the
tiles) against its persistent kernel (a few programs an SM walking the tiles; with Triton's
flattened pipelining, which loads the next tile's first K steps during a tile's epilogue; with the
weights read through the tensor memory accelerator), each in several tile shapes, with K steps of
128 (the scale block) and, for row scales, of 256 or 64 (the label's k256, k64).

One layer, 8,192 tokens, top-8 of 128 experts: the first product (gate_up, N 1536, K 2048) reads
each sorted pair's token row by index, also as served ("gate_up gated": gate and up rows
interleaved, silu(gate) x up x the routing weight in the epilogue, [M, 768] written), the second
(down, N 2048, K 768) writes each row to its pair's place, as served; rows spread evenly (512 an
expert) and all on 8 experts (the random model's routing). Fast accumulation first (every
variant), then promoted sums for the three fastest. Each output is held to the float32
dequantize-then-multiply product (relative norm: a variant off by more than 1e-2 is wrong, and the
table says so). Beside: bf16 `torch._grouped_mm`.
The summary adds the served products (gated first, down) of both spreads against bf16's two.

    python3 -m bench.investigations.fp8_grouped_tiles --out /tmp/tiles.md   (one Hopper GPU, minutes)
    python3 -m bench.investigations.fp8_grouped_tiles --variants ' k256 , k64 ,128x256 w8 s4 x1 flat'
        (the K steps of 256 and 64 beside the autotuned set's fastest tile, run_gpu.sh fp8tileswidek)
"""

from __future__ import annotations

import argparse
import time

import torch

from bench.cuda_timing import median_call_ms
from bench.moe_teacher import PROBE_SHAPES, PROBE_TOKENS, _probe_reference
from bench.table import emit

# (BLOCK_M, BLOCK_N, warps, stages): the plain kernel's; the persistent kernel's add programs an SM.
PLAIN = [(64, 128, 4, 4), (128, 256, 8, 3), (128, 128, 8, 3), (64, 256, 8, 3), (128, 256, 8, 4), (128, 128, 8, 4),
         (256, 128, 8, 3)]
PERSISTENT = [(128, 256, 8, 3, 1), (128, 256, 8, 4, 1), (128, 128, 8, 3, 2), (128, 128, 8, 3, 1), (128, 128, 8, 4, 1),
              (64, 128, 4, 4, 2), (64, 128, 4, 4, 1), (256, 128, 8, 3, 1)]
# K steps other than 128 (row scales only; never measured before 2026-12-05): (BLOCK_M, BLOCK_N, BLOCK_K,
# warps, stages, programs an SM; 0: the plain kernel), flattened where persistent. Fewer, wider steps
# for the down product's K of 768 (six steps of 128), or narrower ones in more stages.
WIDE_K = [(128, 256, 256, 8, 2, 0), (128, 128, 256, 8, 3, 0), (64, 256, 256, 8, 2, 0),
          (128, 256, 256, 8, 2, 1), (128, 128, 256, 8, 3, 1), (128, 128, 256, 8, 3, 2),
          (128, 256, 64, 8, 6, 1), (128, 256, 64, 8, 8, 1)]


# What the summary adds up: the products as served (FP8: the gated first product and the down one;
# bf16: its two grouped GEMMs, the gate a kernel of its own).
SERVED = ("gate_up gated", "down")
BF16_SERVED = ("gate_up", "down")


def variants() -> list[tuple[str, dict]]:
    out = [(f"plain {m}x{n} w{w} s{s}", dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=s))
           for m, n, w, s in PLAIN]
    for m, n, w, s, p in PERSISTENT:
        for flatten in (False, True):
            for tma in (False, True):
                label = f"persistent {m}x{n} w{w} s{s} x{p}" + (" flat" if flatten else "") + (" tma" if tma else "")
                out.append((label, dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=s, PER_SM=p, FLATTEN=flatten,
                                        TMA_W=tma)))
    for m, n, bk, w, s, p in WIDE_K:
        config = dict(BLOCK_M=m, BLOCK_N=n, BLOCK_K=bk, num_warps=w, num_stages=s)
        if p:
            config.update(PER_SM=p, FLATTEN=True, TMA_W=False)
        out.append((f"{'persistent' if p else 'plain'} {m}x{n} k{bk} w{w} s{s}" + (f" x{p} flat" if p else ""), config))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--precise-top", type=int, default=3, help="the fastest variants timed with promoted sums too")
    parser.add_argument("--variants", default="",
                        help="comma-separated parts of labels: only the variants whose label holds one (default all)")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    chosen = [(label, config) for label, config in variants()
              if not args.variants or any(part in label for part in args.variants.split(","))]
    if not chosen:
        parser.error(f"--variants {args.variants!r} matches none of: " + "; ".join(label for label, _ in variants()))
    from teacher_server import fp8, fp8_experts, fp8_grouped_gemm

    device = "cuda"
    experts, hidden, width, k = PROBE_SHAPES["qwen3-30b-a3b"]
    tokens, m = PROBE_TOKENS, PROBE_TOKENS * PROBE_SHAPES["qwen3-30b-a3b"][3]
    generator = torch.Generator(device=device).manual_seed(0)
    weights = {"gate_up": torch.randn(experts, 2 * width, hidden, device=device, generator=generator,
                                      dtype=torch.bfloat16) * 0.02,
               "down": torch.randn(experts, hidden, width, device=device, generator=generator,
                                   dtype=torch.bfloat16) * 0.02}
    token_rows = torch.randn(tokens, hidden, device=device, generator=generator, dtype=torch.bfloat16)
    hidden_rows = torch.randn(m, width, device=device, generator=generator, dtype=torch.bfloat16)
    modules = {p: fp8_experts.FP8ExpertWeights.quantize(w, "row") for p, w in weights.items()}
    # The first product as served: gate and up rows interleaved, silu(gate) x up x the routing weight
    # in the epilogue ([M, I] written instead of [M, 2I]).
    modules["gate_up gated"] = fp8_experts.FP8ExpertWeights.quantize(weights["gate_up"], "row")
    assert modules["gate_up gated"].interleave_gate()
    route = torch.rand(m, device=device, generator=generator)
    spreads = {"even": [m // experts] * experts, f"all on {k}": [tokens] * k + [0] * (experts - k)}
    cases = []  # (spread, product, call arguments, reference, out_map, flop)
    for spread, sizes in spreads.items():
        offsets = torch.tensor(sizes, device=device).cumsum(0).int()
        gather = torch.randint(0, tokens, (m,), device=device, generator=generator)
        scatter = torch.randperm(m, device=device, generator=generator)
        for product, module in modules.items():
            n, kk = module.weight.shape[1:]
            first = product.startswith("gate_up")
            x_bf16 = token_rows.index_select(0, gather) if first else hidden_rows
            source = token_rows if first else hidden_rows
            aq, a_s = module.quantize_input(source)
            expected = _probe_reference(fp8.dequantize(*module.quantize_input(x_bf16)), module.dequantized(), sizes)
            gated = {}
            if module.gate_group:  # (dequantized: [gate | up], transformers' order)
                gate, up = expected.chunk(2, dim=-1)
                expected = torch.nn.functional.silu(gate) * up * route[:, None]
                gated = dict(route=route, gate_group=module.gate_group)
            rows_in = gather if first else None
            rows_out = scatter if product == "down" else None
            bf16 = (x_bf16, weights[product.split()[0]].transpose(1, 2), offsets)
            cases.append((spread, product, (aq, a_s, module.weight, module.weight_scale, offsets, rows_in, rows_out),
                          expected, rows_out, 2 * m * n * kk, bf16, gated))

    lines = ["| spread | product | kernel | accumulation | ms | TFLOP/s | × bf16 | error |",
             "|---|---|---|---|---|---|---|---|"]
    times: dict[tuple[str, bool], float] = {}  # (variant, fast) -> ms summed over the cases

    def run(label: str, config: dict | None, fast: bool) -> None:
        total = 0.0
        for spread, product, call_args, expected, rows_out, flop, bf16, gated in cases:
            out = torch.empty(expected.shape[0], expected.shape[1], device=device, dtype=torch.bfloat16)

            def call(out=out, call_args=call_args, gated=gated):
                return fp8_grouped_gemm.launch(*call_args, out, config=config, fast_accum=fast, **gated)
            try:
                start = time.perf_counter()
                got = call().float()
                compile_s = time.perf_counter() - start
                ms = median_call_ms(call, args.iters, warmup=2)
            except Exception as e:  # a variant that does not compile or run: say so, go on
                lines.append(f"| {spread} | {product} | {label} | {'fast' if fast else 'promoted'} | failed: "
                             f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''} | | | |")
                print(lines[-1], flush=True)
                total = float("inf")
                continue
            if rows_out is not None:
                got = got.index_select(0, rows_out)
            error = ((got - expected).norm() / expected.norm()).item()
            lines.append(f"| {spread} | {product} | {label} | {'fast' if fast else 'promoted'} | {ms:.3f} | "
                         f"{flop / ms / 1e9:.0f} | {bf16_ms[(spread, product)] / ms:.2f} | {error:.2e}"
                         f"{' WRONG' if error > 1e-2 else ''} | ")
            print(lines[-1], f"(first call {compile_s:.1f} s)", flush=True)
            if product in SERVED:
                total += ms if error <= 1e-2 else float("inf")
        times[(label, fast)] = total

    bf16_ms = {}  # bf16 torch._grouped_mm per case
    for spread, product, call_args, expected, rows_out, flop, bf16, gated in cases:
        ms = median_call_ms(lambda bf16=bf16: torch._grouped_mm(bf16[0], bf16[1], offs=bf16[2],
                                                                out_dtype=torch.bfloat16), args.iters, 2)
        bf16_ms[(spread, product)] = ms
        lines.append(f"| {spread} | {product} | bf16 torch._grouped_mm | | {ms:.3f} | {flop / ms / 1e9:.0f} | 1 | |")
        print(lines[-1], flush=True)
        if product in BF16_SERVED:
            times[("bf16", False)] = times.get(("bf16", False), 0.0) + ms
    for label, config in chosen:
        run(label, config, fast=True)
    fast_order = sorted((ms, label) for (label, fast), ms in times.items() if fast and ms < float("inf"))
    configs = dict(chosen)
    for _, label in fast_order[:args.precise_top]:
        run(label, configs[label], fast=False)
    run("autotuned", None, fast=True)
    run("autotuned", None, fast=False)

    bf16_total = times[("bf16", False)]
    summary = ["", "| kernel | accumulation | ms, the served products of both spreads summed | × bf16 |",
               "|---|---|---|---|"]
    for (label, fast), ms in sorted(times.items(), key=lambda item: item[1]):
        summary.append(f"| {label} | {'fast' if fast else ('promoted' if label != 'bf16' else '')} | {ms:.3f} | "
                       f"{bf16_total / ms:.2f} |")
    print("\n".join(summary), flush=True)
    print(f"gpu: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    emit(lines + summary, args.out)


if __name__ == "__main__":
    main()
