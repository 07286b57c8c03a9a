"""How fast the teacher serves mixture-of-experts models, on one GPU, beside a dense one.

    python3 -m bench.moe_teacher --out moe_teacher.md

Models (random bf16 weights built on the GPU: speed does not depend on what the weights learned):
Qwen3-30B-A3B-shaped (48 layers, hidden 2048, 32 query / 4 key-value heads of 128, 128 experts of
768, top-8, vocabulary 151,936), gpt-oss-20b-shaped (24 layers, hidden 2880, 64 / 8 heads of 64
with a sink each, sliding window 128 on every other layer, 32 experts of 2880, top-4, vocabulary
201,088) and the Llama-3-8B-shaped dense forward for scale. Each at 2 x 4096 and 4 x 8192 tokens,
through the server's own ModelRunner (`random:` a config directory: model loading installs
teacher_server/moe.py and sink_attention.py and compiles the decoder layers), host ids in, no cache,
logits out; and, at the --baseline-shapes, transformers' own forward (`grouped_mm` experts, its
default; SDPA attention, or eager for gpt-oss, which refuses SDPA) called the same way.

FLOPs of one forward of T = rows x S tokens (what the share of the peak divides by):

    2 x T x (parameters a token passes through) + attention
    parameters = per layer: q, k, v, o projections + router (hidden x experts) + its top-k experts'
                 three matrices (k x 3 x hidden x expert width) [a dense model: its MLP's three]
                 + the output head (hidden x vocabulary)
    attention  = per layer and token: 2 x 2 x (keys it attends) x heads x head_dim (QK^T and PV);
                 keys = (S + 1) / 2 on average for causal layers, min(position + 1, window) averaged
                 over positions for sliding-window ones

over the H200's 790 TFLOP/s dense bf16 peak (DESIGN.md). Norms, rotary embeddings, biases, sinks,
routing arithmetic, the permutation and combine are not counted: they are the overhead the share
shows. Columns: median ms of --iters forwards (CUDA events), tokens/s, share of the peak, peak
memory allocated (GiB, weights included), and expert imbalance over the timed forwards (tokens of
the busiest expert over the mean per expert, per layer: the mean over layers and the worst layer).

Routing: transformers initialises a router's weights at std 0.02, and on random weights most layers
then send nearly every token to the same few experts (imbalance up to E / k = 16 for Qwen: a few
large groups, the grouped GEMM's easiest case). Each MoE model is therefore timed twice: with the
routers as initialised, then with their weights redrawn from N(0, 1) (--router-std), meant to
spread the tokens over the experts as a trained router does (many groups of T x k / E rows, the
harder case); the same weights otherwise. Measured on an H200: it spreads gpt-oss's (imbalance
1.4-1.8) but not Qwen's (still 10 / 16: the random Qwen's hidden states are nearly the same for
every token, so any router picks the same experts); the imbalance column says which case ran.

--quantize: the MoE models served with --quantize fp8 too (--fp8-scalings: row, block or both; the
decoder's linears and every expert's weights in e4m3, teacher_server/fp8.py and fp8_experts.py; the
layers compiled), a "server FP8" row beside the bf16 one, and the speed-up over it.

--experts-probe: the expert products of one layer of each MoE model alone (8,192 tokens; rows
spread evenly, then all on k experts): bf16 `torch._grouped_mm`, FP8 `torch._scaled_grouped_mm` and
the teacher's Triton kernel (teacher_server/fp8_grouped_gemm.py) in each tile configuration, row and
block scales, each against the float32 dequantize-then-multiply product.

--profile MODEL: a torch.profiler table of the server's forwards of MODEL (bf16, and FP8 under
--quantize) at the first shape (the kernels by CUDA time), printed and written to --profile-dir.
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time

import torch

from bench.cuda_timing import median_call_ms
from bench.models import random_model
from bench.table import emit

BF16_PEAK = 790e12  # H200 dense bf16, as measured here (DESIGN.md)

MODELS = {
    "llama3-8b": ("llama", dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0,
                                max_position_embeddings=8192)),
    "qwen3-30b-a3b": ("qwen3_moe", dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                                        moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
                                        num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                                        norm_topk_prob=True, max_position_embeddings=40960, rms_norm_eps=1e-6,
                                        tie_word_embeddings=False)),
    "gpt-oss-20b": ("gpt_oss", dict(vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=24,
                                    num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=32,
                                    num_experts_per_tok=4, sliding_window=128, attention_bias=True,
                                    layer_types=["sliding_attention", "full_attention"] * 12,
                                    tie_word_embeddings=False)),
}


def config_of(name: str):
    from transformers import AutoConfig

    model_type, shape = MODELS[name]
    return AutoConfig.for_model(model_type, **shape)


def flops(config, rows: int, seq: int) -> float:
    """One forward's FLOPs as the module docstring counts them."""
    h = config.hidden_size
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or h // heads
    kv = config.num_key_value_heads * head_dim
    projections = h * heads * head_dim * 2 + h * kv * 2
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    if experts:
        width = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
        mlp = h * experts + config.num_experts_per_tok * 3 * h * width
    else:
        mlp = 3 * h * config.intermediate_size
    layers = config.num_hidden_layers
    tokens = rows * seq
    linear = 2 * tokens * (layers * (projections + mlp) + h * config.vocab_size)
    kinds = getattr(config, "layer_types", None) or ["full_attention"] * layers
    positions = torch.arange(1, seq + 1, dtype=torch.float64)
    attention = 0.0
    for kind in kinds:
        keys = positions.clamp(max=config.sliding_window) if kind == "sliding_attention" else positions
        attention += 2 * 2 * float(keys.mean()) * heads * head_dim * tokens
    return linear + attention


def is_moe(config) -> bool:
    return bool(getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None))


def transformers_model(config, device: str):
    """transformers' own forward: its default experts (grouped_mm) and attention."""
    return random_model(config, device, torch.bfloat16)


def redraw_routers(model, std: float) -> int:
    """Draws the routers' weights anew from N(0, std); returns how many routers."""
    routers = [m for m in model.modules() if type(m).__name__.lower().endswith("router")
               and getattr(m, "weight", None) is not None]
    generator = torch.Generator(device="cuda").manual_seed(5)
    with torch.no_grad():
        for router in routers:
            router.weight.copy_(torch.randn(router.weight.shape, generator=generator, device="cuda") * std)
    return len(routers)


def server_runner(config, quantize=None, cuda_graphs: int = 0):
    """The server's ModelRunner of a random model of `config` on cuda:0 in bf16 (`quantize`: an Fp8Plan;
    `cuda_graphs`: --cuda-graphs)."""
    from teacher_server.model_runner import ModelRunner

    with tempfile.TemporaryDirectory() as directory:
        config.save_pretrained(directory)
        return ModelRunner(f"random:{directory}", "cuda:0", dtype="bfloat16", quantize=quantize,
                           cuda_graphs=cuda_graphs)


def time_forward(call, rows: int, seq: int, vocab: int, iters: int) -> tuple[float, float]:
    """(median ms, peak GiB) of `call(host_ids, mask)`."""
    ids = torch.randint(vocab, (rows, seq), generator=torch.Generator().manual_seed(rows * seq))
    host_ids, mask = ids.pin_memory(), torch.ones(rows, seq, dtype=torch.long)
    for _ in range(2):  # compiles for the shape, loads kernels
        call(host_ids, mask)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    ms = median_call_ms(lambda: call(host_ids, mask), iters)
    return ms, torch.cuda.max_memory_allocated() / 2**30


def profile(call, rows: int, seq: int, vocab: int, name: str, out_dir: str) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    ids = torch.randint(vocab, (rows, seq))
    mask = torch.ones(rows, seq, dtype=torch.long)
    call(ids, mask)
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        call(ids, mask)
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=22, max_name_column_width=80)
    print(table)
    if out_dir:
        with open(f"{out_dir}/moe_profile_{name.replace('+', '_')}.txt", "w") as f:
            f.write(table)


# The probe's layer shapes: (experts, hidden, expert width, top-k), 8,192 tokens.
PROBE_SHAPES = {"qwen3-30b-a3b": (128, 2048, 768, 8), "gpt-oss-20b": (32, 2880, 2880, 4)}
PROBE_TOKENS = 8192
PROBE_DEVICE = "cuda"


def _probe_reference(x: torch.Tensor, weight: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """float32 products one expert at a time: x [M, K] float32 (sorted), weight [E, N, K] float32."""
    out = torch.empty(x.shape[0], weight.shape[1], device=x.device)
    start = 0
    for expert, size in enumerate(sizes):
        if size:
            torch.mm(x[start:start + size], weight[expert].t(), out=out[start:start + size])
        start += size
    return out


def experts_probe(iters: int, models: list[str]) -> list[str]:
    """One layer's expert products alone (gate_up, then down), 8,192 tokens: bf16 `torch._grouped_mm`,
    FP8 `torch._scaled_grouped_mm` (row scales) and the teacher's Triton kernel (row and block scales,
    each of its tile configurations, then the autotuned one), the inputs quantized already; the first
    product reads its rows by index, the second writes them by index, as the server calls it. Rows
    spread evenly, then all of them on k experts (the random Qwen's routing). Error: relative norm
    against the dequantize-then-multiply product in float32."""
    from teacher_server import fp8, fp8_experts, fp8_grouped_gemm, moe

    tokens = PROBE_TOKENS
    lines = ["| layer | rows | product | kernel | ms | TFLOP/s | share of bf16 peak | error |",
             "|---|---|---|---|---|---|---|---|"]
    for name in models:
        if name not in PROBE_SHAPES:
            continue
        experts, hidden, width, k = PROBE_SHAPES[name]
        generator = torch.Generator(device=PROBE_DEVICE).manual_seed(0)
        weights = {"gate_up": torch.randn(experts, 2 * width, hidden, device=PROBE_DEVICE, generator=generator,
                                          dtype=torch.bfloat16) * 0.02,
                   "down": torch.randn(experts, hidden, width, device=PROBE_DEVICE, generator=generator,
                                       dtype=torch.bfloat16) * 0.02}
        m = tokens * k
        token_rows = torch.randn(tokens, hidden, device=PROBE_DEVICE, generator=generator, dtype=torch.bfloat16)
        hidden_rows = torch.randn(m, width, device=PROBE_DEVICE, generator=generator, dtype=torch.bfloat16)
        scalings = ["row"] + (["block"] if hidden % 128 == 0 and width % 128 == 0 else [])
        quantized = {(product, scaling): fp8_experts.FP8ExpertWeights.quantize(w, scaling)
                     for product, w in weights.items() for scaling in scalings}
        spreads = {"even": [m // experts] * experts, f"all on {k}": [tokens] * k + [0] * (experts - k)}
        for spread, sizes in spreads.items():
            offsets = torch.tensor(sizes, device=PROBE_DEVICE).cumsum(0).int()
            gather = torch.randint(0, tokens, (m,), device=PROBE_DEVICE, generator=generator)
            scatter = torch.randperm(m, device=PROBE_DEVICE, generator=generator)
            for product in ("gate_up", "down"):
                n, kk = weights[product].shape[1:]
                flop = 2 * m * n * kk
                x_bf16 = token_rows.index_select(0, gather) if product == "gate_up" else hidden_rows

                def row(label: str, kernel: str, call, expected=None, out_map=None) -> None:
                    try:
                        got = call()
                        ms = median_call_ms(call, max(iters, 10), warmup=2)
                    except Exception as e:  # a configuration that does not compile or run: say so, go on
                        lines.append(f"| {name} | {spread} | {product} | {kernel} | failed: "
                                     f"{type(e).__name__}: {str(e).splitlines()[0][:100]} | | | |")
                        print(lines[-1], flush=True)
                        return
                    error = ""
                    if expected is not None:
                        got = got.float() if out_map is None else got.float().index_select(0, out_map)
                        error = f"{((got - expected).norm() / expected.norm()).item():.2e}"
                    lines.append(f"| {name} | {spread} | {product} | {kernel} | {ms:.3f} | "
                                 f"{flop / ms / 1e9:.0f} | {flop / (ms / 1e3) / BF16_PEAK:.1%} | {error} |")
                    print(lines[-1], flush=True)

                row(label="bf16", kernel="bf16 torch._grouped_mm",
                    call=lambda: moe.grouped_mm(x_bf16, weights[product].transpose(1, 2), offsets))
                for scaling in scalings:
                    module = quantized[(product, scaling)]
                    source = token_rows if product == "gate_up" else hidden_rows
                    aq, a_s = module.quantize_input(source)
                    a_sorted = fp8.dequantize(*module.quantize_input(x_bf16))
                    expected = _probe_reference(a_sorted, module.dequantized(), sizes)
                    if scaling == "row" and fp8_experts._SCALED_GROUPED_MM is not None:
                        aq_sorted, as_sorted = module.quantize_input(x_bf16)
                        row(label="scaled", kernel="FP8 row torch._scaled_grouped_mm", expected=expected,
                            call=lambda: torch._scaled_grouped_mm(
                                aq_sorted, module.weight.transpose(1, 2), as_sorted.reshape(-1), module.weight_scale,
                                offs=offsets, out_dtype=torch.bfloat16))
                    rows_in = gather if product == "gate_up" else None
                    rows_out = scatter if product == "down" else None
                    configs = [fp8_grouped_gemm.launch_config(c) for c in fp8_grouped_gemm.CONFIGS]
                    runs = [(c, False) for c in configs + [None]] + ([(None, True)] if scaling == "row" else [])
                    for config, fast in runs:
                        label = ("autotuned" if config is None else
                                 "{BLOCK_M}x{BLOCK_N} w{num_warps} s{num_stages}".format(**config))
                        label += ", fast accumulation" if fast else ""
                        out = torch.empty(m, n, device=PROBE_DEVICE, dtype=torch.bfloat16)
                        row(label=label, kernel=f"FP8 {scaling} Triton {label}", expected=expected, out_map=rows_out,
                            call=lambda config=config, out=out, fast=fast: fp8_grouped_gemm.launch(
                                aq, a_s, module.weight, module.weight_scale, offsets, rows_in, rows_out, out,
                                config=config, fast_accum=fast))
                    best = [getattr(getattr(fp8_grouped_gemm, tuned, None), "best_config", None)
                            for tuned in ("_tuned_kernel", "_tuned_persistent", "_tuned_persistent_tma")]
                    print(f"{name} {spread} {product} {scaling}: autotuned plain {best[0]}, persistent {best[1]}, "
                          f"persistent with TMA {best[2]}", flush=True)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="qwen3-30b-a3b,gpt-oss-20b,llama3-8b")
    parser.add_argument("--shapes", default="2x4096,4x8192")
    parser.add_argument("--baseline-shapes", default="2x4096", help="shapes at which transformers' own forward "
                        "is measured too ('' for none)")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--router-std", type=float, default=1.0, help="the std of the redrawn routers' weights "
                        "(0: only the routers as initialised)")
    parser.add_argument("--quantize", action="store_true", help="the MoE models with --quantize fp8 too")
    parser.add_argument("--fp8-scalings", default="row", help="the FP8 scalings served under --quantize (row, "
                        "row+fastacc: with --fp8-fast-accum, block: the published checkpoints' 128 x 128 layout)")
    parser.add_argument("--experts-probe", action="store_true", help="time one layer's expert products alone")
    parser.add_argument("--profile", default="", help="a model whose server forward is profiled at the first shape")
    parser.add_argument("--profile-dir", default="")
    parser.add_argument("--out", default="")
    args = parser.parse_args()

    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",") if s]
    baseline_shapes = [tuple(int(v) for v in s.split("x")) for s in args.baseline_shapes.split(",") if s]
    lines = ["| model | forward | routers | tokens | ms | tokens/s | share of bf16 peak | peak GiB | "
             "imbalance mean / worst |", "|---|---|---|---|---|---|---|---|---|"]
    figures = {}
    probe_lines = experts_probe(args.iters, args.models.split(",")) + [""] if args.experts_probe else []
    print("\n".join(probe_lines), flush=True)
    for name in (n for n in args.models.split(",") if n and shapes):  # --shapes '': the probe alone
        config = config_of(name)
        fp8_variants = [f"server-fp8-{s}" for s in args.fp8_scalings.split(",") if s] if args.quantize else []
        for variant in ["server", *fp8_variants, "transformers"]:
            if variant == "transformers" and not (baseline_shapes and is_moe(config)):
                continue  # transformers' own forward is the baseline of the MoE models
            if variant.startswith("server-fp8") and not is_moe(config):
                continue
            torch._dynamo.reset()
            started = time.perf_counter()
            runner = model = None
            if variant.startswith("server"):
                from teacher_server.fp8 import Fp8Plan

                quantize = None
                if variant.startswith("server-fp8-"):
                    scaling = variant[len("server-fp8-"):]
                    quantize = Fp8Plan(scaling.split("+")[0], fast_accum=scaling.endswith("+fastacc"))
                runner = server_runner(config, quantize)
                call = lambda ids, mask: runner.forward(ids, mask).logits  # noqa: E731
                label = f"server ({runner.info.kernels or 'transformers kernels'})"
                if quantize is not None:
                    label = (f"server FP8 ({runner.quantization}; experts {quantize.scaling}-scaled e4m3"
                             f"{', fast accumulation' if quantize.fast_accum else ''})")
            else:
                model = transformers_model(config, "cuda")
                label = (f"transformers ({model.config._experts_implementation or 'dense'} experts, "
                         f"{model.config._attn_implementation} attention)")

                @torch.inference_mode()
                def call(ids, mask, model=model):
                    return model(input_ids=ids.to("cuda", non_blocking=True), use_cache=False).logits
            print(f"{name} {label}: built in {time.perf_counter() - started:.0f} s", flush=True)
            routings = ["initialised", f"N(0, {args.router_std:g})"] if is_moe(config) and args.router_std else [""]
            for routing in routings:
                if routing.startswith("N("):
                    redraw_routers(runner.model if runner is not None else model, args.router_std)
                for rows, seq in (shapes if variant.startswith("server") else baseline_shapes):
                    row = f"| {name} | {label} | {routing} | {rows} x {seq} |"
                    try:
                        ms, gib = time_forward(call, rows, seq, config.vocab_size, args.iters)
                    except torch.OutOfMemoryError as e:
                        lines.append(f"{row} out of memory | | | | |")
                        print(lines[-1], str(e).splitlines()[0], flush=True)
                        gc.collect()
                        torch.cuda.empty_cache()
                        continue
                    share = flops(config, rows, seq) / (ms / 1e3) / BF16_PEAK
                    tokens_s = rows * seq / ms * 1e3
                    balance = ""
                    if runner is not None and runner.expert_load is not None:
                        from teacher_server.moe import imbalance

                        per_layer = [imbalance(c) for c in runner.expert_load.snapshot().last]
                        balance = f"{sum(per_layer) / len(per_layer):.2f} / {max(per_layer):.2f}"
                    bf16 = figures.get(f"{name}/server/{routing}/{rows}x{seq}")
                    if variant.startswith("server-fp8") and bf16:
                        balance += f" ({bf16['ms'] / ms:.2f}x bf16)"
                    lines.append(f"{row} {ms:.1f} | {tokens_s / 1e3:.1f}k | {share:.1%} | {gib:.1f} | {balance} |")
                    figures[f"{name}/{variant}/{routing}/{rows}x{seq}"] = dict(
                        ms=ms, tokens_s=tokens_s, share=share, gib=gib, imbalance=balance)
                    print(lines[-1], f"({time.perf_counter() - started:.0f} s since built)", flush=True)
            if variant.startswith("server") and name == args.profile:
                profile(call, *shapes[0], config.vocab_size, f"{name}_{variant}", args.profile_dir)
            del call, runner, model
            gc.collect()
            torch.cuda.empty_cache()
    emit(probe_lines + lines, args.out, figures)
    if args.out:
        print(json.dumps(figures))


if __name__ == "__main__":
    main()
