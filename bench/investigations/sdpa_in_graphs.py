"""Does each attention kernel run as fast inside a CUDA graph as outside it?

    python -m bench.investigations.sdpa_in_graphs [--shape 7,12,2,1046,128] [--decoder]

bench/forward_launch.py found the 1.5B model's decoder 8% slower on the device when
replayed from a graph, all of it in cuDNN's attention kernel (188 us per call against 75
eagerly). This times scaled_dot_product_attention (causal, bf16, grouped key/value heads
as the model has them) with each backend, eagerly and replayed from a graph, and the
largest difference of each from the eager default. Prints a table.

--decoder also times the 1.5B model's decoder on 7 x 1046 tokens: eagerly, captured the
way teacher_server/cuda_graphs.py captures it (capture_begin on a side stream, thread-local
errors, a shared pool), and captured with torch.cuda.graph's defaults; per forward, and
per call of the attention kernel (torch.profiler).
"""

from __future__ import annotations

import argparse
import itertools
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from bench.table import emit

BACKENDS = {"default": None, "cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def attention(q, k, v, backend, gqa: bool):
    """As transformers calls it without a mask: grouped heads passed as they are (enable_gqa),
    or repeated to the query heads first (gqa False, as it does with a mask)."""
    if not gqa:
        repeat = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1)
    if backend is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    with sdpa_kernel([backend]):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)


def attention_kernel_us(fn, calls: int) -> float:
    """Mean device time of the attention kernels launched by `calls` runs of fn."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    kernels = [a for a in prof.key_averages() if not a.key.startswith("aten::") and
               any(word in a.key for word in ("sdpa", "flash", "fmha"))]
    return sum(a.self_device_time_total for a in kernels) / max(1, sum(a.count for a in kernels))


def decoder_rows(rows: int = 7, seq: int = 1046, iters: int = 10) -> list[str]:
    from bench.distill_pipeline import small_teacher_spec
    from distill_common.models import load_causal_lm

    model = load_causal_lm(small_teacher_spec(), device=torch.device("cuda"), dtype=torch.bfloat16).eval()
    decoder = model.get_decoder()
    ids = torch.randint(0, model.config.vocab_size, (rows, seq), device="cuda")

    @torch.inference_mode()
    def run():
        return decoder(input_ids=ids, use_cache=False, return_dict=True).last_hidden_state

    @torch.no_grad()
    def run_no_grad():
        return decoder(input_ids=ids, use_cache=False, return_dict=True).last_hidden_state

    reference = run()
    lines = [f"the 1.5B decoder on {rows} x {seq} tokens", "| how | ms per forward | attention us per call | "
             "max diff from eager |", "|---|---:|---:|---:|"]
    lines.append(f"| eager | {timed_us(run, iters) / 1e3:.2f} | {attention_kernel_us(run, 2):.1f} | 0 |")
    side = torch.cuda.Stream()
    for how in ("as cuda_graphs.py", "torch.cuda.graph", "torch.cuda.graph, no_grad"):
        if how.endswith("no_grad"):
            run = run_no_grad
        side.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(side):
            run()
            if how == "as cuda_graphs.py":
                graph.capture_begin(pool=torch.cuda.graph_pool_handle(), capture_error_mode="thread_local")
                out = run()
                graph.capture_end()
        torch.cuda.current_stream().wait_stream(side)
        if how.startswith("torch.cuda.graph"):
            with torch.cuda.graph(graph):
                out = run()
        graph.replay()
        diff = (out.float() - reference.float()).abs().max().item()
        lines.append(f"| {how} | {timed_us(graph.replay, iters) / 1e3:.2f} | "
                     f"{attention_kernel_us(graph.replay, 2):.1f} | {diff:.3g} |")
    return lines


def timed_us(fn, iters: int) -> float:
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    torch.cuda.synchronize()
    begin.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) * 1e3 / iters


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="7,12,2,1046,128", help="batch, heads, key/value heads, length, head size")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--decoder", action="store_true", help="also time the 1.5B model's decoder, eager and captured")
    p.add_argument("--out", default="")
    args = p.parse_args()
    b, h, kv, s, d = (int(x) for x in args.shape.split(","))
    torch.manual_seed(0)
    # Laid out as a Llama attention makes them: projected [B, S, heads, D], then transposed.
    q, k, v = (torch.randn(b, s, n, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for n in (h, kv, kv))
    reference = attention(q, k, v, None, False)
    lines = [f"scaled_dot_product_attention, causal, bf16, [{b}, {h} (kv {kv}), {s}, {d}], "
             f"{torch.cuda.get_device_name()}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}",
             "| backend | key/value heads | eager us | graph us | graph / eager | max diff from eager default |",
             "|---|---|---:|---:|---:|---:|"]
    for (name, backend), gqa in itertools.product(BACKENDS.items(), (True, False)):
        heads = "grouped (enable_gqa)" if gqa else "repeated"
        try:
            eager_us = timed_us(lambda: attention(q, k, v, backend, gqa), args.iters)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                attention(q, k, v, backend, gqa)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = attention(q, k, v, backend, gqa)
            graph_us = timed_us(graph.replay, args.iters)
            diff = (out.float() - reference.float()).abs().max().item()
            lines.append(f"| {name} | {heads} | {eager_us:.1f} | {graph_us:.1f} | {graph_us / eager_us:.2f} | {diff:.3g} |")
        except RuntimeError as e:
            lines.append(f"| {name} | {heads} | not available: {str(e).splitlines()[0][:80]} | | | |")
    lines += ["", "cudnn, grouped heads, called as the model calls it:",
              "| inference_mode | scale given | eager us | graph us | graph / eager |", "|---|---|---:|---:|---:|"]
    for inference, scaled in itertools.product((False, True), (False, True)):
        kwargs = {"scale": d ** -0.5} if scaled else {}

        def call():
            with torch.inference_mode(inference), sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, **kwargs)

        eager_us = timed_us(call, args.iters)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            call()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            call()
        graph_us = timed_us(graph.replay, args.iters)
        lines.append(f"| {inference} | {scaled} | {eager_us:.1f} | {graph_us:.1f} | {graph_us / eager_us:.2f} |")
    if args.decoder:
        lines += ["", *decoder_rows()]
    emit(lines, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
