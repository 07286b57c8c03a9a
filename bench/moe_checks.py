"""Tiny MoE models whose FP8 products show in their outputs, and the layer-by-layer comparison of a
served forward with a reference: what tests/gpu/test_moe_gpu.py holds the GPU's FP8 experts to,
tests/test_fp8_experts.py's published checkpoint is drawn with, and
bench/investigations/fp8_moe_reference.py simulates on a CPU.
"""

from __future__ import annotations

import torch

from teacher_server import fp8


def checkable_moe(model, generator: torch.Generator, margin: float = 2.0) -> None:
    """Redraws a qwen3_moe model's experts and routers in place (float32), so that the forward of its
    FP8 experts, compared with a reference one decoder layer at a time, shows what each product did:

    magnitudes  each expert weight N(0, 1 / K) (unit gain: a layer's update is mostly its experts'
                output, not the attention's), times 2^U(-1, 1) per expert, per 128 x 128 tile and
                per row: a scale read from another expert, tile or row is off by up to 4 x. With
                equal magnitudes every scale is alike (a 128 x 128 tile of N(0, s) values has nearly
                the largest magnitude of any other), and such a slip would not show
    routing     decided by a code that no layer writes: the residual stream's first E dimensions
                (o_proj's and the experts' down_proj's rows there are zero) hold, in each token's
                embedding, 1 to 1.5 for its k experts and -1 to -0.5 for the others (times twice
                the embedding's std); each layer's router reads that code alone, a permutation of
                it, scaled so that the chosen experts' logits are `margin` to 1.5 x `margin` and the
                others' -`margin` to -margin / 2. RMSNorm rescales a token's code without reordering
                it, so the token picks the same experts on any device, in any dtype, under any
                rounding (the router's top-k over near-equal logits picks another expert for 10 to
                35% of the tokens between an FP8 forward and a bf16 one of random weights, and a
                token routed elsewhere differs by ~1), while its routing weights still differ
    """
    config = model.config
    experts, k = config.num_experts, config.num_experts_per_tok
    layers = model.model.layers
    embedding = model.get_input_embeddings().weight

    def magnitudes(shape: tuple[int, ...]) -> torch.Tensor:  # [E, N, K]: 2^U(-1, 1) per expert, tile, row
        e, n, k_ = shape
        per = [torch.rand(e, 1, 1, generator=generator),
               torch.rand(e, -(-n // 128), k_ // 128, generator=generator).repeat_interleave(128, 1)[:, :n]
               .repeat_interleave(128, 2), torch.rand(e, n, 1, generator=generator)]
        return torch.exp2(sum(2 * p - 1 for p in per)).expand(shape)

    with torch.no_grad():
        sigma = embedding.std().item()
        chosen = torch.rand(embedding.shape[0], experts, generator=generator).argsort(-1)[:, :k]
        code = torch.rand(embedding.shape[0], experts, generator=generator) / 2 - 1
        code.scatter_(1, chosen, 1 + torch.rand(embedding.shape[0], k, generator=generator) / 2)
        embedding[:, :experts] = 2 * sigma * code
        for layer in layers:
            module = layer.mlp.experts
            for weight in (module.gate_up_proj, module.down_proj):  # [E, N, K]
                weight.copy_(torch.randn(weight.shape, generator=generator) * weight.shape[-1] ** -0.5
                             * magnitudes(tuple(weight.shape)))
            module.down_proj[:, :experts] = 0
            layer.self_attn.o_proj.weight[:experts] = 0
            layer.mlp.gate.weight.zero_()
        # Each router's scale from the normed code it reads, layer by layer (a layer's routing moves
        # the next one's input).
        ids = torch.randint(0, embedding.shape[0], (2, 64), generator=generator)
        for layer in layers:
            seen = []
            hook = layer.mlp.gate.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
            model(input_ids=ids)
            hook.remove()
            unit = seen[0][..., :experts].abs().mean().item() / code[ids].abs().mean().item()
            router = torch.zeros_like(layer.mlp.gate.weight)
            router[torch.arange(experts), torch.randperm(experts, generator=generator)] = margin / unit
            layer.mlp.gate.weight.copy_(router)


def layer_by_layer(reference, hidden: list[torch.Tensor], ids: torch.Tensor):
    """`reference`'s forward of `ids` with each decoder layer fed hidden[i] (the served forward's
    input to layer i) in place of its previous layer's output: each layer's output and the logits
    (the last layer's output through the final norm and the head)."""
    layers = fp8.decoder_layers(reference.model)
    outputs: list[torch.Tensor] = []

    def feed(index):
        def pre_hook(module, args, kwargs):
            given = args[0] if args else kwargs["hidden_states"]
            served = hidden[index].to(device=given.device, dtype=given.dtype)
            return ((served, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": served})
        return pre_hook

    hooks = [layer.register_forward_pre_hook(feed(i), with_kwargs=True) for i, layer in enumerate(layers)]
    hooks += [layer.register_forward_hook(lambda module, args, out: outputs.append(
        (out[0] if isinstance(out, tuple) else out).float())) for layer in layers]
    try:
        logits = reference.forward(ids, torch.ones_like(ids)).logits.float()
    finally:
        for hook in hooks:
            hook.remove()
    return outputs, logits
