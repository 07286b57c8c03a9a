"""Which causal kernel the unroll's fused attention should merge with (student_trainer/eagle3/attention.py).

    python -m bench.investigations.ttt_attention_kernels      # one GPU, about a minute

For S tokens, a Llama-3-8B-shaped draft's attention (32 heads of 128, 8 key heads): one whole
unroll of 7 steps, forward and backward, through `merged_ttt_attention` with each of PyTorch's
CUDA causal kernels ("flash", "cudnn"), and the causal part alone through flex_attention
(compiled, returning the log-sum-exp), timed with CUDA events (median of 5 after 2 warm-ups).
TFLOP/s counts 3 x 2 x S^2 x 4096 per step (the causal half; docs/eagle3.md).
"""

from __future__ import annotations

import argparse

import torch

from bench.cuda_timing import median_call_ms
from bench.table import emit
from student_trainer.eagle3.attention import merged_ttt_attention

HEADS, KV_HEADS, DIM, STEPS = 32, 8, 128, 7


def unroll(kernel: str, length: int):
    torch.manual_seed(length)
    leaf = lambda h: torch.randn(1, h, length, DIM, device="cuda", dtype=torch.bfloat16).requires_grad_()  # noqa: E731
    q, k0, v0 = [leaf(HEADS) for _ in range(STEPS)], leaf(HEADS), leaf(HEADS)
    kd, vd = [leaf(KV_HEADS) for _ in range(STEPS - 1)], [leaf(KV_HEADS) for _ in range(STEPS - 1)]
    if kernel != "flash":  # the same inputs through the flash kernel: how far this kernel's output is
        with torch.no_grad():
            a = merged_ttt_attention(q[-1], k0, v0, kd, vd, kernel).double()
            b = merged_ttt_attention(q[-1], k0, v0, kd, vd, "flash").double()
        print(f"{kernel} at S={length}: ||out - flash|| / ||flash|| = {((a - b).norm() / b.norm()).item():.2e}")

    def run():
        total = sum(merged_ttt_attention(q[k], k0, v0, kd[:k], vd[:k], kernel).float().sum() for k in range(STEPS))
        total.backward()
    return run


def flex_causal(length: int):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    compiled = torch.compile(flex_attention)
    mask = create_block_mask(lambda b, h, q, k: q >= k, None, None, length, length)
    leaf = lambda h: torch.randn(1, h, length, DIM, device="cuda", dtype=torch.bfloat16).requires_grad_()  # noqa: E731
    q, k, v = leaf(HEADS), leaf(KV_HEADS), leaf(KV_HEADS)

    def run():
        total = 0
        for _ in range(STEPS):
            out, lse = compiled(q, k, v, block_mask=mask, enable_gqa=True, return_lse=True)
            total = total + out.float().sum() + lse.sum()
        total.backward()
    return run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-lens", default="2048,8192,16384,32768")
    parser.add_argument("--flex-lens", default="16384", help="lengths at which to time flex_attention (compiles)")
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    lines = ["| tokens | kernel | unroll attention fwd+bwd ms | TFLOP/s |", "|---:|---|---:|---:|"]
    for length in [int(x) for x in args.seq_lens.split(",")]:
        flops = 3 * 2.0 * length ** 2 * HEADS * DIM * STEPS
        candidates = [("flash", lambda: unroll("flash", length)), ("cudnn", lambda: unroll("cudnn", length))]
        if str(length) in args.flex_lens.split(","):
            candidates.append(("flex (causal part only)", lambda: flex_causal(length)))
        for name, build in candidates:
            try:
                ms = median_call_ms(build(), repeats=5, warmup=2)
                lines.append(f"| {length} | {name} | {ms:.1f} | {flops / ms / 1e9:.0f} |")
            except Exception as e:  # noqa: BLE001 - a kernel this build lacks is a row, not the end of the run
                lines.append(f"| {length} | {name} | failed: {type(e).__name__}: {str(e)[:120]} | |")
            print(lines[-1], flush=True)
            torch.cuda.empty_cache()
    emit(lines, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
