"""The Qwen3-30B-A3B-shaped forward in bf16 and in FP8 with fast accumulation, both models built in
one process and timed in turns (bf16, FP8, bf16, FP8, ...), each turn with the median of
bench/moe_teacher.py's timing, the wall time of one synced call, and the kernels' device time from
a profile. Asks why bench/moe_teacher.py, which builds, times and frees the variants one after
another, gave the FP8 forward 120-142 ms timed while its kernels add up to 91-95 ms (an H200,
2026-12-04), and what the ratio is when nothing else differs.

    python3 -m bench.investigations.fp8_forward_gap --out /tmp/gap.md   (one Hopper GPU, minutes)

With `--cuda-graphs N` both forwards run as the server runs them under --cuda-graphs N (the decoder
captured once per shape, then replayed: no host gaps between its kernels); the table says whether
each was captured or why not. `--inductor KEY=VALUE` sets an inductor config for both forwards'
compiled layers (e.g. `triton.decompose_sort_ops=True`: the routers' top-k through inductor's sort,
with `--router torch`: the routers as the model writes them, not teacher_server/routing.py's kernel).

`--variants` picks the forwards from: bf16; fp8 (`--quantize fp8 --fp8-fast-accum` as served);
fp8-inductor (the same with the o projection's input and the down product's input quantized by
fp8.quantize_rows as compiled into the layer, not by the Triton kernel written for them). Eager,
the two FP8 variants are one model, switched before each turn (the compiled layers guard on it).
"""

from __future__ import annotations

import argparse
import ast
import time

import torch

from bench.moe_teacher import config_of, server_runner, time_forward
from bench.table import emit


def _config_value(text: str):
    """An --inductor value: true / false (any case), a Python literal, or else the string itself."""
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--cuda-graphs", type=int, default=0, help="the server's --cuda-graphs (0: eager)")
    parser.add_argument("--variants", default="bf16,fp8", help="bf16, fp8, fp8-inductor (the first is the baseline)")
    parser.add_argument("--kernels", type=int, default=0,
                        help="also list each forward's N longest kernels (device ms, calls) from the last "
                             "turn's profile")
    parser.add_argument("--inductor", action="append", default=[], metavar="KEY=VALUE",
                        help="an inductor config for every compiled layer of both forwards (repeatable), "
                             "e.g. triton.decompose_sort_ops=True: the routers' top-k through inductor's sort")
    parser.add_argument("--router", choices=("kernel", "torch"), default="kernel",
                        help="the routers' softmax and top-k: teacher_server/routing.py's kernel (as served) or the "
                             "model's own (inductor's softmax, torch's top-k: as served before 2026-12-05)")
    parser.add_argument("--no-tma", action="store_true",
                        help="leave the persistent tile that reads its weights through TMA out of the grouped FP8 "
                             "kernel's autotuned set (as served before 2026-12-06)")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    import torch._inductor.config as inductor

    for setting in args.inductor:
        key, _, value = setting.partition("=")
        section, _, leaf = key.rpartition(".")
        where = inductor
        for part in filter(None, section.split(".")):
            where = getattr(where, part, None)
        if not value or where is None or not hasattr(where, leaf):
            parser.error(f"--inductor {setting}: this torch ({torch.__version__}) has no inductor config {key}")
        setattr(where, leaf, _config_value(value))
    from torch.profiler import ProfilerActivity, profile

    from teacher_server import fp8, fp8_grouped_gemm, fp8_rows, routing
    from teacher_server.fp8 import Fp8Plan
    from teacher_server.fp8_experts import FP8ExpertWeights

    names = {"bf16": "bf16", "fp8": "FP8, fast accumulation",
             "fp8-inductor": "FP8, fast accumulation, o's and down's inputs quantized by inductor"}
    chosen = args.variants.split(",")
    if len(chosen) < 2 or any(v not in names for v in chosen):
        parser.error(f"--variants: a baseline and at least one more, comma-separated, of {', '.join(names)}")
    if args.cuda_graphs and {"bf16", "fp8", "fp8-inductor"} <= set(chosen):
        parser.error("--cuda-graphs with bf16, fp8 and fp8-inductor builds three models, which do not fit one "
                     "141 GB GPU (captured graphs replay one quantizer: the FP8 variants cannot share a model)")
    if args.no_tma:
        fp8_grouped_gemm._tuned_persistent_tma = fp8_grouped_gemm._tuned_persistent
        print("the persistent kernel's autotuned set without its TMA tile", flush=True)
    config = config_of("qwen3-30b-a3b")
    runners, kernel = {}, {}
    for variant in chosen:
        kernel[names[variant]] = variant == "fp8"
        shared = {"fp8": "fp8-inductor", "fp8-inductor": "fp8"}.get(variant)
        if shared in chosen[:chosen.index(variant)] and not args.cuda_graphs:
            runners[names[variant]] = runners[names[shared]]  # (a third model would not fit beside the others)
            continue
        started = time.perf_counter()
        runners[names[variant]] = server_runner(
            config, None if variant == "bf16" else Fp8Plan("row", fast_accum=True), args.cuda_graphs)
        if args.router == "torch":  # (before the first forward of the timed shape: compiled and captured after)
            routing.uninstall(runners[names[variant]].model)
        kernels = sum("forward" in r.__dict__ for r in routing.routers(runners[names[variant]].model))
        print(f"{names[variant]}: {kernels} routers through teacher_server/routing.py's kernel", flush=True)
        print(f"{names[variant]}: built in {time.perf_counter() - started:.0f} s", flush=True)

    def choose(name: str) -> None:  # before a forward of `name` (its first: before it is compiled, captured)
        quantizer = fp8_rows.quantize_rows_kernel if kernel[name] else fp8.quantize_rows
        for module_name, module in runners[name].model.named_modules():
            if isinstance(module, FP8ExpertWeights) and module_name.endswith("down_proj"):
                module.quantize_rows = quantizer
            elif isinstance(module, fp8.FP8Linear) and module_name.endswith("o_proj"):
                module.quantize = quantizer
    ids = torch.randint(config.vocab_size, (args.rows, args.seq), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    lines = ["| turn | forward | timed ms (median) | wall ms of one synced call | kernels ms (profile) | "
             "autotuner timings in the timed calls |", "|---|---|---|---|---|---|"]
    timed: dict[str, list[float]] = {name: [] for name in runners}
    device: dict[str, list[float]] = {name: [] for name in runners}
    longest: dict[str, list] = {}
    for turn in range(args.turns):
        for name, runner in runners.items():
            choose(name)
            call = lambda ids, mask, runner=runner: runner.forward(ids, mask).logits  # noqa: E731
            before = fp8_grouped_gemm.autotune_timings
            ms, _ = time_forward(call, args.rows, args.seq, config.vocab_size, args.iters)
            tuned = fp8_grouped_gemm.autotune_timings - before
            torch.cuda.synchronize()
            started = time.perf_counter()
            call(ids, mask)
            torch.cuda.synchronize()
            wall = (time.perf_counter() - started) * 1e3
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                call(ids, mask)
                torch.cuda.synchronize()
            kernels = sum(e.self_device_time_total for e in prof.key_averages()) / 1e3
            longest[name] = sorted(prof.key_averages(), key=lambda e: -e.self_device_time_total)[:args.kernels]
            timed[name].append(ms)
            device[name].append(kernels)
            lines.append(f"| {turn + 1} | {name} | {ms:.1f} | {wall:.1f} | {kernels:.1f} | {tuned} |")
            print(lines[-1], flush=True)
    base, *others = runners
    lines += ["", "| | " + " | ".join(f"{base} / {o}, timed | kernels" for o in others) + " |",
              "|---|" + "---|---|" * len(others)]
    for turn in range(args.turns):
        lines.append(f"| turn {turn + 1} | " + " | ".join(
            f"{timed[base][turn] / timed[o][turn]:.3f} | {device[base][turn] / device[o][turn]:.3f}" for o in others)
            + " |")
    if args.inductor:
        lines += ["", f"inductor: {', '.join(args.inductor)}"]
    if args.cuda_graphs:
        lines += ["", f"--cuda-graphs {args.cuda_graphs}: " + "; ".join(
            f"{name}: {runner.graphs.shapes} shape(s) captured" + (f", off: {runner.graphs.off}" if runner.graphs.off
                                                                    else "") for name, runner in runners.items())]
    for name, events in longest.items():
        if events:
            lines += ["", f"{name}, the last turn's longest kernels:", "", "| kernel | ms | calls |", "|---|---|---|"]
            lines += [f"| `{e.key[:110]}` | {e.self_device_time_total / 1e3:.2f} | {e.count} |" for e in events]
    print("\n".join(lines), flush=True)
    emit(lines, args.out)


if __name__ == "__main__":
    main()
