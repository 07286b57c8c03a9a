"""What a GPU test of FP8 experts can hold the served forward to, simulated on a CPU.

    python -m bench.investigations.fp8_moe_reference            # 2 CPU cores: about 10 minutes
    python -m bench.investigations.fp8_moe_reference --quick    # one seed, no injected faults

The served forward on a GPU runs bf16 activations between FP8 products (e4m3 weights, the
activation quantized per row or per 1 x 128 block before each product, float32 sums). On a CPU,
teacher_server's FP8 path quantizes at the same points and multiplies in float32, so a CPU runner
in bf16 computes what the GPU does (up to the order of float32 sums and which bf16 roundings the
GPU's compiled layers fuse away), and one in float32 is the reference. Three questions:

1. Whole forwards (what tests/gpu/test_moe_gpu.py compared before): how far the FP8 forward of
   tests' tiny random qwen3_moe is from bf16 and float32, how many tokens the routers send to
   other experts, how much of it the routing explains (the routing forced to the reference's),
   what the start-up bias correction does on random token ids and on its own batch, and how far
   a wrong expert scale moves the logits there.
2. The same FP8 weights in bf16 against float32 (the same quantization points), whole forwards:
   rounding to e4m3 turns a bf16 ulp at a quantization point into a whole e4m3 step for some
   elements, so the two drift apart layer after layer.
3. Layer by layer (what the test does now: each reference layer fed the served input, on
   bench/moe_checks.py's checkable_moe weights): each layer's update and the logits, the routing,
   and the same with faults injected into the served side (another expert's, row's or K block's
   weight scales, the next token's activation scales, the routing weight applied twice or not
   at all).
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile

import torch

from bench.moe_checks import checkable_moe, layer_by_layer
from bench.table import emit
from teacher_server import fp8_calibration, fp8_experts, fp8_grouped_gemm, moe
from teacher_server.fp8 import Fp8Plan
from teacher_server.model_runner import ModelRunner

_ATTENTION = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=64)
# tests/gpu/test_moe_gpu.py's SMALL["qwen3_moe"] and tests/test_fp8_experts.py's PUBLISHED.
MODELS = {
    "small": dict(vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                  num_hidden_layers=3, num_experts=16, num_experts_per_tok=4, norm_topk_prob=True,
                  max_position_embeddings=1024, **_ATTENTION),
    "published": dict(vocab_size=96, hidden_size=256, intermediate_size=256, moe_intermediate_size=128,
                      num_hidden_layers=2, head_dim=64, num_attention_heads=4, num_key_value_heads=2,
                      num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, tie_word_embeddings=False),
}
TOKENS = {"small": (2, 300), "published": (2, 200)}


def rel(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return ((ours.float() - reference.float()).norm() / reference.float().norm()).item()


def run(runner: ModelRunner, ids: torch.Tensor, force=None):
    """Logits and each MoE layer's routing (top-k ids and weights); `force`: routing put in their place."""
    seen = []

    def pre_hook(module, args):
        seen.append((args[1].clone(), args[2].clone()))
        if force is not None:
            index, weights = force[len(seen) - 1]
            return args[0], index, weights.to(args[2].dtype)

    hooks = [m.register_forward_pre_hook(pre_hook) for m in moe.experts_modules(runner.model)]
    try:
        return runner.forward(ids, torch.ones_like(ids)).logits.float(), seen
    finally:
        for hook in hooks:
            hook.remove()


def flips(ours, reference) -> str:
    """Per MoE layer, the share of tokens whose chosen experts differ."""
    return " ".join(f"{(a[0].sort(-1).values != b[0].sort(-1).values).any(-1).float().mean().item():.0%}"
                    for a, b in zip(ours, reference))


def checkpoint(model_name: str, seed: int, checkable: bool, **overrides) -> str:
    """A bf16 checkpoint of a tiny qwen3_moe drawn with `seed` (checkable_moe's weights or transformers')."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("qwen3_moe", **{**MODELS[model_name], **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    if checkable:
        checkable_moe(model, torch.Generator().manual_seed(seed))
    path = tempfile.mkdtemp(prefix="fp8_moe_reference_")
    model.to(torch.bfloat16).save_pretrained(path)
    return path


# ---- faults injected into the served side -----------------------------------------------------

@contextlib.contextmanager
def _rolled_scales(runner, dim: int):
    weights = [m for m in runner.model.modules() if isinstance(m, fp8_experts.FP8ExpertWeights)]
    saved = [m.weight_scale.clone() for m in weights]
    for m in weights:
        m.weight_scale.copy_(m.weight_scale.roll(1, dim))
    try:
        yield
    finally:
        for m, scale in zip(weights, saved):
            m.weight_scale.copy_(scale)


@contextlib.contextmanager
def _routing_weight(runner, fn):
    original = fp8_grouped_gemm.swiglu_quantize
    fp8_grouped_gemm.swiglu_quantize = lambda x, weight, block: original(x, fn(weight.float()), block)
    try:
        yield
    finally:
        fp8_grouped_gemm.swiglu_quantize = original


@contextlib.contextmanager
def _next_tokens_activation_scales(runner):
    original = fp8_experts.FP8ExpertWeights.quantize_input

    def quantize_input(self, x):
        q, scale = original(self, x)
        return q, scale.roll(1, 0)

    fp8_experts.FP8ExpertWeights.quantize_input = quantize_input
    try:
        yield
    finally:
        fp8_experts.FP8ExpertWeights.quantize_input = original


FAULTS = {
    "the next expert's weight scales": lambda r: _rolled_scales(r, 0),
    "the next row's / K block's weight scales": lambda r: _rolled_scales(r, -1),
    "the next token's activation scales": _next_tokens_activation_scales,
    "the routing weight twice": lambda r: _routing_weight(r, lambda w: w * w),
    "no routing weight": lambda r: _routing_weight(r, torch.ones_like),
}


def layer_figures(served: ModelRunner, reference: ModelRunner, ids: torch.Tensor, fault=None):
    """Each layer's update (but the last's) and the logits, served against reference layer by
    layer, and whether every token was routed alike."""
    with fault(served) if fault is not None else contextlib.nullcontext():
        out = served.forward(ids, torch.ones_like(ids), hidden=True)
    hidden = [h.float() for h in out.hidden_states]
    outputs, logits = layer_by_layer(reference, hidden, ids)
    updates = [rel(hidden[i + 1] - hidden[i], outputs[i] - hidden[i]) for i in range(len(outputs) - 1)]
    return updates, rel(out.logits, logits), served.expert_load.snapshot().last == reference.expert_load.snapshot().last


# ---- the three questions ----------------------------------------------------------------------

def whole_forwards(lines: list[str]) -> None:
    path = checkpoint("small", 0, checkable=False)
    ids = torch.randint(0, 512, TOKENS["small"], generator=torch.Generator().manual_seed(3))
    calibration_ids = fp8_calibration.calibration_batch(None, fp8_calibration.calibration_texts(""), 4, 256, 512)
    bf16 = ModelRunner(path, "cpu", dtype="bfloat16")
    f32 = ModelRunner(path, "cpu", dtype="float32")
    reference, routing = run(bf16, ids)
    full, full_routing = run(f32, ids)
    lines.append(f"| small, transformers' init | bf16 | float32 | {rel(reference, full):.3f} | "
                 f"{flips(routing, full_routing)} | |")
    for scaling in ("row", "block"):
        for name, plan in (("calibrated (default)", Fp8Plan(scaling)),
                           ("no calibration", Fp8Plan(scaling, calibration_rows=0))):
            runner = ModelRunner(path, "cpu", dtype="bfloat16", quantize=plan)
            ours, our_routing = run(runner, ids)
            forced, _ = run(runner, ids, force=routing)
            on_own, _ = run(runner, calibration_ids)
            own_reference, _ = run(bf16, calibration_ids)
            lines.append(f"| small, transformers' init | FP8 {scaling}, {name} | bf16 | {rel(ours, reference):.3f} | "
                         f"{flips(our_routing, routing)} | routing forced {rel(forced, reference):.3f}; on the "
                         f"calibration batch {rel(on_own, own_reference):.3f} |")
            if name == "no calibration":
                reference32 = ModelRunner(path, "cpu", dtype="float32", quantize=plan)
                theirs, their_routing = run(reference32, ids)
                with _rolled_scales(runner, 0):
                    wrong, _ = run(runner, ids)
                lines.append(f"| small, transformers' init | FP8 {scaling} in bf16 | the same in float32 | "
                             f"{rel(ours, theirs):.3f} | {flips(our_routing, their_routing)} | the next expert's "
                             f"scales: {rel(wrong, theirs):.3f} |")


def published_whole(lines: list[str]) -> None:
    """tests/test_fp8_experts.py's published checkpoint as it was drawn before checkable_moe
    (transformers' init with range 0.1), block-scaled, bf16 (the GPU) against float32 (the CPU)."""
    path = checkpoint("published", 0, checkable=False, initializer_range=0.1)
    ids = torch.randint(0, 96, TOKENS["published"], generator=torch.Generator().manual_seed(4))
    plan = Fp8Plan("block", calibration_rows=0)
    ours, routing = run(ModelRunner(path, "cpu", dtype="bfloat16", quantize=plan), ids)
    theirs, their_routing = run(ModelRunner(path, "cpu", dtype="float32", quantize=plan), ids)
    plain16, _ = run(ModelRunner(path, "cpu", dtype="bfloat16"), ids)
    plain32, _ = run(ModelRunner(path, "cpu", dtype="float32"), ids)
    lines.append(f"| published, init 0.1 | FP8 block in bf16 | the same in float32 | {rel(ours, theirs):.3f} | "
                 f"{flips(routing, their_routing)} | unquantized, bf16 against float32: {rel(plain16, plain32):.3f} |")


def layer_by_layer_figures(lines: list[str], seeds: int, faults: bool) -> None:
    for model_name, scalings in (("small", ("row", "block")), ("published", ("block",))):
        for scaling in scalings:
            for seed in range(seeds):
                path = checkpoint(model_name, seed, checkable=True)
                ids = torch.randint(0, MODELS[model_name]["vocab_size"], TOKENS[model_name],
                                    generator=torch.Generator().manual_seed(3))
                plan = Fp8Plan(scaling, calibration_rows=0)
                served = ModelRunner(path, "cpu", dtype="bfloat16", quantize=plan)
                reference = ModelRunner(path, "cpu", dtype="float32", quantize=plan)
                updates, logits, same = layer_figures(served, reference, ids)
                full, _ = run(ModelRunner(path, "cpu", dtype="float32"), ids)
                ours, _ = run(served, ids)
                lines.append(f"| {model_name} | {scaling} | {seed} | none | {' '.join(f'{u:.3f}' for u in updates)} | "
                             f"{logits:.3f} | {same} | {rel(ours, full):.3f} |")
                if faults and seed == 0:
                    for name, fault in FAULTS.items():
                        updates, logits, same = layer_figures(served, reference, ids, fault)
                        lines.append(f"| {model_name} | {scaling} | {seed} | {name} | "
                                     f"{' '.join(f'{u:.3f}' for u in updates)} | {logits:.3f} | {same} | |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="one seed, no injected faults, no whole forwards")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--out", default="", help="also write the tables here")
    args = parser.parse_args()
    torch.set_num_threads(max(torch.get_num_threads(), 1))
    lines = []
    if not args.quick:
        lines += ["Whole forwards (relative norm of the logits' difference; flips: tokens routed elsewhere, per MoE "
                  "layer)", "", "| model | ours | against | relative | flips | also |", "|---|---|---|---|---|---|"]
        whole_forwards(lines)
        published_whole(lines)
        lines.append("")
    lines += ["Layer by layer, served (bf16) against the reference (float32, fed the served input to each layer), "
              "checkable_moe's weights", "",
              "| model | scaling | seed | fault | updates | logits | routed alike | FP8 vs float32 unquantized, "
              "whole |", "|---|---|---|---|---|---|---|---|"]
    layer_by_layer_figures(lines, 1 if args.quick else args.seeds, faults=not args.quick)
    emit(lines, args.out)


if __name__ == "__main__":
    main()
