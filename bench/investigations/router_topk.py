"""The MoE router's softmax and top-k as a compiled decoder layer runs them: torch's top-k kernel
(inductor calls it as it is) against inductor's own lowering of top-k through a stable sort that it
generates and fuses with the softmax (`torch._inductor.config.triton.decompose_sort_ops`, where the
installed torch has it), and against teacher_server/routing.py's kernel (softmax and top-k in one,
what the teacher serves since 2026-12-05), on Qwen3-30B-A3B's router at 2 x 4096 tokens ([8192 x 128]
logits, k = 8).

    python3 -m bench.investigations.router_topk --out /tmp/topk.md   (one GPU, a minute)

The FP8 forward's profile under CUDA graphs gave torch's top-k (`gatherTopK`) 3.0 ms of 100 in
bf16 and FP8 alike (0.062 ms a layer for 4 MB of logits). Times are medians of 50 calls (CUDA
events). Against eager torch: the largest difference of the routing weights (tokens routed to the
same experts), the tokens routed to other experts, and of those the ones where a tie at the k-th
place (which bf16 logits make likely) was broken the other way: the same probabilities chosen.
"""

from __future__ import annotations

import argparse

import torch

from bench.investigations.quantize_rows_speed import median_ms
from bench.table import emit


def route(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-MoE's router after its linear (transformers' Qwen3MoeTopKRouter)."""
    probs = torch.nn.functional.softmax(logits, dtype=torch.float, dim=-1)
    values, indices = torch.topk(probs, k, dim=-1)
    values = values / values.sum(dim=-1, keepdim=True)
    return values.to(logits.dtype), indices


def route_kernel(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same router through teacher_server/routing.py's softmax-and-top-k kernel (as served)."""
    from teacher_server import routing

    values, indices = routing.softmax_topk(logits, k)
    values = values / values.sum(dim=-1, keepdim=True)
    return values.to(logits.dtype), indices


def by_expert(weights: torch.Tensor, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's chosen experts in index order, and their weights in the same order."""
    order = indices.argsort(dim=-1)
    return indices.gather(1, order), weights.float().gather(1, order)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    import torch._inductor.config as inductor

    logits = torch.randn(args.tokens, args.experts, device="cuda").to(torch.bfloat16)
    probs = torch.nn.functional.softmax(logits, dtype=torch.float, dim=-1)
    want_experts, want_weights = by_expert(*route(logits, args.k))
    variants = {"eager": lambda x: route(x, args.k),
                "compiled, torch's top-k": torch.compile(lambda x: route(x, args.k), dynamic=True)}
    variants["compiled, teacher_server/routing.py's kernel (served)"] = torch.compile(
        lambda x: route_kernel(x, args.k), dynamic=True)
    has_option = hasattr(inductor.triton, "decompose_sort_ops")
    if has_option:
        variants["compiled, top-k through inductor's sort"] = torch.compile(
            lambda x: route(x, args.k), dynamic=True, options={"triton.decompose_sort_ops": True})
    lines = [f"torch {torch.__version__}: inductor's decompose_sort_ops {'present' if has_option else 'absent'}", "",
             "| router (softmax, top-k, normalised) | ms | largest weight difference | tokens routed elsewhere | "
             "of them by a tie |", "|---|---|---|---|---|"]
    for name, call in variants.items():
        experts, weights = by_expert(*call(logits))
        other = (experts != want_experts).any(dim=-1)
        tie = other & (probs.gather(1, experts).sort(dim=-1).values
                       == probs.gather(1, want_experts).sort(dim=-1).values).all(dim=-1)
        same = ~other
        difference = (weights - want_weights).abs()[same].max().item() if same.any() else 0.0
        lines.append(f"| {name} | {median_ms(lambda: call(logits)):.4f} | {difference:.2e} | "
                     f"{int(other.sum())} | {int(tie.sum())} |")
        print(lines[-1], flush=True)
    emit(lines, args.out)


if __name__ == "__main__":
    main()
