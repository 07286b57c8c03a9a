"""The MoE teacher's kernels on a GPU, as served: tiny qwen3_moe, gpt_oss, mixtral and deepseek_v3
models in bf16 through the server's ModelRunner (torch._grouped_mm experts, FlexAttention with sinks,
the decoder layers compiled), against transformers' eager forward of the same weights in float32
on the same GPU. Sequences of 300 tokens cross FlexAttention's 128-token blocks and gpt-oss's
128-token window.

bf16 alone moves an MoE model's logits far more than a dense one's: a router's top-k over bf16
logits picks another expert for some tokens (measured on a CPU with these shapes: transformers' own
eager forward in bf16 is off from float32 by 17% of the largest logit on the worst token of
gpt_oss, by 0.6% for qwen3_moe). So the served forward is held to what transformers' eager forward
in bf16 gives, both against float32, by the relative norm over all real positions: a wrong
expert, weight or mask moves all of them (~1).
"""

from __future__ import annotations

import pytest
import torch

from bench import moe_checks
from teacher_server import moe, routing, sink_attention
from teacher_server.model_runner import ModelRunner
from tests.test_fp8_experts import published_dir  # noqa: F401  (a fixture: the tiny published FP8 checkpoint)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]

_ATTENTION = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=64)
SMALL = {
    "qwen3_moe": dict(vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                      num_hidden_layers=3, num_experts=16, num_experts_per_tok=4, norm_topk_prob=True,
                      max_position_embeddings=1024, **_ATTENTION),
    "mixtral": dict(vocab_size=512, hidden_size=256, intermediate_size=128, num_hidden_layers=3, num_local_experts=8,
                    num_experts_per_tok=2, max_position_embeddings=1024, **_ATTENTION),
    "gpt_oss": dict(vocab_size=512, hidden_size=256, intermediate_size=128, num_hidden_layers=4, num_local_experts=8,
                    num_experts_per_tok=4, sliding_window=128, attention_bias=True,
                    layer_types=["sliding_attention", "full_attention"] * 2, **_ATTENTION),
    "deepseek_v3": dict(vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                        num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=16, num_experts_per_tok=4,
                        n_group=4, topk_group=2, n_shared_experts=1, q_lora_rank=64, kv_lora_rank=32,
                        qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=64, num_attention_heads=4,
                        num_key_value_heads=4, max_position_embeddings=1024),
}
# How much further from float32 than transformers' own bf16 forward the served one may be, and
# the floor under that (bf16 rounding of the logits themselves).
NO_WORSE = 2.0
FLOOR = 1e-2


def _relative(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return ((ours.float() - reference).norm() / reference.norm()).item()


@pytest.mark.parametrize("model_type", sorted(SMALL))
def test_the_served_moe_forward_equals_transformers_eager_in_float32(tmp_path, model_type):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **SMALL[model_type])
    config.save_pretrained(tmp_path)
    runner = ModelRunner(f"random:{tmp_path}", "cuda:0", dtype="bfloat16")
    assert moe.IMPLEMENTATION in runner.info.kernels and "compiled" in runner.info.kernels
    assert (sink_attention.IMPLEMENTATION in runner.info.kernels) == (model_type == "gpt_oss")
    # Softmax-then-top-k routers through teacher_server/routing.py's kernel (its check at install passed).
    replaced = [r for r in routing.routers(runner.model) if "forward" in r.__dict__]
    assert len(replaced) == (3 if model_type in ("qwen3_moe", "mixtral") else 0)
    assert (routing.IMPLEMENTATION in runner.info.kernels) == bool(replaced)
    generator = torch.Generator(device="cuda").manual_seed(1)
    with torch.no_grad():
        for parameter in runner.model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator, device="cuda") * 0.05)
    reference = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **SMALL[model_type]),
                                                 attn_implementation="eager",
                                                 experts_implementation=moe.EAGER).cuda().eval()
    reference.load_state_dict({k: v.float() for k, v in runner.model.state_dict().items()})
    eager_bf16 = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **SMALL[model_type]),
                                                  attn_implementation="eager", experts_implementation=moe.EAGER)
    eager_bf16 = eager_bf16.to(device="cuda", dtype=torch.bfloat16).eval()
    eager_bf16.load_state_dict(runner.model.state_dict())
    ids = torch.randint(0, 512, (3, 300), generator=torch.Generator().manual_seed(0))
    padded = torch.ones_like(ids)
    padded[1, 200:] = 0
    for mask in (torch.ones_like(ids), padded):
        ours = runner.forward(ids, mask).logits
        with torch.inference_mode():
            theirs = reference(input_ids=ids.cuda(), attention_mask=mask.cuda(), use_cache=False).logits
            theirs_bf16 = eager_bf16(input_ids=ids.cuda(), attention_mask=mask.cuda(), use_cache=False).logits
        real = mask.cuda().bool()
        off, bf16_off = _relative(ours[real], theirs[real]), _relative(theirs_bf16[real], theirs[real])
        print(f"{model_type}: served bf16 {off:.2e}, transformers' eager bf16 {bf16_off:.2e} from float32")
        assert off <= max(NO_WORSE * bf16_off, FLOOR), f"{model_type}: {off:.3g} from float32, eager bf16 {bf16_off:.3g}"
    snapshot = runner.expert_load.snapshot()
    assert all(sum(layer) == 3 * 300 * config.num_experts_per_tok for layer in snapshot.last)


def test_the_router_kernel_chooses_the_stable_sort_of_the_logits():
    """teacher_server/routing.py's kernel: the experts are the first k of a stable descending sort of
    the logits (ties by index: bf16 logits tie often), the weights softmax's probabilities there
    (torch's exp against Triton's: a few float32 ulps)."""
    from tests.test_routing import expected

    generator = torch.Generator(device="cuda").manual_seed(0)
    for rows, experts, k, dtype in ((8192, 128, 8, torch.bfloat16), (1000, 60, 4, torch.float32),
                                    (513, 256, 8, torch.bfloat16), (77, 512, 10, torch.bfloat16)):
        logits = (torch.randn(rows, experts, device="cuda", generator=generator) * 2).to(dtype)
        values, chosen = routing.softmax_topk(logits, k)
        want_values, want_experts = expected(logits, k)
        assert torch.equal(chosen, want_experts), (rows, experts, k, (chosen != want_experts).any(-1).sum())
        torch.testing.assert_close(values, want_values, rtol=1e-5, atol=0)


def _ragged_case(scaling: str, seed: int, device: str = "cuda"):
    """An FP8 expert weight [6, 200, K] (K 320 for row scales: a partial K step; 384 for block), 50
    token rows, groups of 40, 0, 130, 1, 9 and 0 rows and 5 pairs no expert holds, each pair's
    token (gather) and place (scatter): (generator, weights, tokens, held, offsets, gather, scatter)."""
    from teacher_server import fp8_experts

    generator = torch.Generator(device=device).manual_seed(seed)
    k = 320 if scaling == "row" else 384
    weight = torch.randn(6, 200, k, device=device, generator=generator).pow(3)
    module = fp8_experts.FP8ExpertWeights.quantize(weight, scaling)
    tokens = torch.randn(50, k, device=device, generator=generator).pow(3).to(torch.bfloat16)
    sizes = [40, 0, 130, 1, 9, 0]
    held = sum(sizes)
    offsets = torch.tensor(sizes, device=device).cumsum(0).int()
    gather = torch.randint(0, 50, (held + 5,), device=device, generator=generator)
    scatter = torch.randperm(held + 5, device=device, generator=generator)
    return generator, module, tokens, held, offsets, gather, scatter


@pytest.mark.parametrize("scaling", ["row", "block"])
def test_the_triton_fp8_kernel_equals_the_one_expert_at_a_time_reference(scaling):
    """teacher_server/fp8_grouped_gemm.py as FP8ExpertWeights call it: rows gathered from token rows
    by index, products written back by index, groups of 40, 0, 130, 1 and 9 rows (ragged tiles, empty
    experts), 5 pairs no expert holds (zeros), N = 200 (a partial tile), K = 320 for row scales (a
    partial K step) and 384 for block scales; against fp8_experts.reference_product, one row and
    expert at a time, dequantize then multiply in float32."""
    from teacher_server import fp8_experts, fp8_grouped_gemm

    assert not fp8_grouped_gemm.problem(torch.device("cuda")), fp8_grouped_gemm.problem(torch.device("cuda"))
    _, module, tokens, held, offsets, gather, scatter = _ragged_case(scaling, 0)
    assert module.kernel == "triton"
    with torch.inference_mode():
        got = module(tokens, offsets, rows=gather, out_rows=scatter, zero_unwritten=True).float()
        sorted_reference = fp8_experts.reference_product(module, tokens.index_select(0, gather), offsets).float()
        expected = torch.empty_like(sorted_reference).index_copy_(0, scatter, sorted_reference)
        plain = module(tokens.index_select(0, gather)[:held], offsets).float()
    unheld = scatter[held:]
    assert torch.count_nonzero(got.index_select(0, unheld)) == 0
    relative = (got - expected).norm() / expected.norm()
    print(f"{scaling}: Triton kernel against the reference {relative:.2e}")
    assert relative < 1e-2, relative  # bf16 output, float32 sums in another order; a wrong scale gives ~1
    assert (plain - sorted_reference[:held]).norm() / sorted_reference[:held].norm() < 1e-2


@pytest.mark.parametrize("scaling", ["row", "block"])
def test_every_tile_configuration_of_both_fp8_kernels_equals_the_reference(scaling):
    """Each configuration the autotuner may pick, of the plain kernel (a program a tile) and of the
    persistent one (programs walking the tiles, flattened pipelining, weights through TMA), with
    promoted and fast sums: the same ragged and empty groups as above, against the one-expert-at-a-
    time reference. Autotuning picks by speed alone, so a configuration wrong only for some shapes
    would otherwise be served where it wins."""
    from teacher_server import fp8_experts, fp8_grouped_gemm

    generator, module, tokens, held, offsets, gather, scatter = _ragged_case(scaling, 1)
    k = tokens.shape[1]
    sorted_reference = fp8_experts.reference_product(module, tokens.index_select(0, gather), offsets).float()
    expected = torch.zeros_like(sorted_reference)
    expected.index_copy_(0, scatter[:held], sorted_reference[:held])
    aq, a_s = module.quantize_input(tokens)
    configs = [fp8_grouped_gemm.launch_config(c)
               for c in fp8_grouped_gemm.CONFIGS + fp8_grouped_gemm.PERSISTENT_CONFIGS]
    assert any("PER_SM" in c for c in configs) and any("PER_SM" not in c for c in configs)
    if scaling == "row":  # K steps of 256 and 64 (fixed configurations; K 320 is not a multiple of 256)
        configs += [dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=256, num_warps=8, num_stages=2),
                    dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=6, PER_SM=1, FLATTEN=True)]
    for config in configs:
        for fast in ((False, True) if scaling == "row" else (False,)):
            out = torch.zeros(held + 5, 200, device="cuda", dtype=torch.bfloat16)
            fp8_grouped_gemm.launch(aq, a_s, module.weight, module.weight_scale, offsets, gather, scatter, out,
                                    config=config, fast_accum=fast)
            relative = ((out.float() - expected).norm() / expected.norm()).item()
            print(f"{scaling} {config} fast={fast}: {relative:.2e}")
            assert torch.count_nonzero(out.index_select(0, scatter[held:])) == 0, config
            assert relative < 1e-2, (config, fast, relative)
    if scaling == "row":
        # The gate in the epilogue: rows interleaved by 64, silu(gate) x up x the routing weight; N 384
        # (three gate groups: a 256-wide tile half past the end).
        group = 64
        gated = fp8_experts.FP8ExpertWeights.quantize(
            torch.randn(6, 384, k, device="cuda", generator=generator).pow(3), scaling)
        gate, up = fp8_experts.reference_product(gated, tokens.index_select(0, gather), offsets).float().chunk(2, -1)
        w = fp8_grouped_gemm.interleave_gate(gated.weight, group).contiguous()
        w_scale = fp8_grouped_gemm.interleave_gate(gated.weight_scale, group).contiguous()
        route = torch.rand(held + 5, device="cuda", generator=generator)
        want = torch.nn.functional.silu(gate) * up * route.unsqueeze(-1)
        for config in configs:
            for fast in (False, True):
                out = torch.zeros(held + 5, 192, device="cuda", dtype=torch.bfloat16)
                fp8_grouped_gemm.launch(aq, a_s, w, w_scale, offsets, gather, None, out, config=config,
                                        fast_accum=fast, route=route, gate_group=group)
                relative = ((out[:held].float() - want[:held]).norm() / want[:held].norm()).item()
                print(f"gated {config} fast={fast}: {relative:.2e}")
                assert torch.count_nonzero(out[held:]) == 0, config
                assert relative < 1e-2, (config, fast, relative)


def test_the_row_quantization_kernel_gives_quantize_rows_values():
    """fp8_rows.quantize_rows_kernel (the o projection's and the down product's inputs) against
    fp8_rows.quantize_rows, byte for byte: widths of the Qwen3-30B-A3B forward and a ragged one; a
    transposed input and a slice of a wider one (row stride past the width); a row with a NaN (all
    NaN), one with an inf, a -0; and fp8_rows.check, what a layer runs before it takes the kernel."""
    from teacher_server import fp8_rows

    generator = torch.Generator(device="cuda").manual_seed(5)
    for rows, k in ((65536, 768), (8192, 4096), (8192, 2048), (37, 200)):
        wide = (torch.randn(rows, k + 64, device="cuda", generator=generator) ** 3).to(torch.bfloat16)
        x = wide[:, :k].contiguous()
        x[1, 3], x[2, 5], x[3, 7] = float("nan"), float("inf"), -0.0  # (-0 quantizes to byte 0x80)
        wide[:, :k] = x
        for given in (x, x.t().contiguous().t(), wide[:, :k]):
            q, scale = fp8_rows.quantize_rows_kernel(given)
            q_ref, scale_ref = fp8_rows.quantize_rows(x)
            assert q.is_contiguous() and scale.shape == (rows, 1)
            assert torch.equal(scale.nan_to_num(-1.0), scale_ref.nan_to_num(-1.0)), (rows, k)
            nan = q_ref.float().isnan()  # (a NaN's sign bit is not asked of it)
            assert torch.equal(q.float().isnan(), nan), (rows, k)
            assert torch.equal(q.view(torch.uint8)[~nan], q_ref.view(torch.uint8)[~nan]), (rows, k)
            assert scale[1].isnan() and nan[1].all() and nan[2].sum() == 1, (rows, k)
        # Before the e4m3 rounding: the kernel's quotients (computed without a division) are the
        # IEEE quotients torch's division gives, on about 100M of them (a one-ulp miss would show here
        # long before it reached an e4m3 rounding boundary; the inputs have no subnormals).
        quotients = torch.empty(rows, k, device="cuda")
        fp8_rows.launch(x, quotients, torch.empty(rows, 1, device="cuda"))
        _, scale_ref = fp8_rows.quantize_rows(x)
        want = (x.float() / scale_ref).clamp(-fp8_rows.FP8_MAX, fp8_rows.FP8_MAX)
        assert torch.equal(quotients.nan_to_num(-1.0), want.nan_to_num(-1.0)), (rows, k)
    # and the check a layer runs before it takes the kernel passes (else the served forwards below
    # quantize with torch, and their assertions that the kernel serves fail).
    for k in (768, 2048, 4096, 200):
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            assert fp8_rows.check(k, torch.device("cuda"), dtype) == "", (k, dtype)


def test_the_persistent_kernel_reads_weights_through_tma_from_any_thread():
    """The teacher checks its FP8 experts at load in its main thread and runs forwards in its engine
    thread; Triton keeps the allocator for TMA descriptors per thread, so a launch from a thread
    that did not set it fails ("no allocator was set"). Each persistent launch sets it: the same
    product from the main thread and from a new one, with a TMA configuration and autotuned."""
    import threading

    from teacher_server import fp8_experts, fp8_grouped_gemm

    _, module, tokens, held, offsets, gather, scatter = _ragged_case("row", 2)
    aq, a_s = module.quantize_input(tokens)
    config = dict(BLOCK_M=128, BLOCK_N=256, num_warps=8, num_stages=4, PER_SM=1, FLATTEN=True, TMA_W=True)
    sorted_reference = fp8_experts.reference_product(module, tokens.index_select(0, gather), offsets).float()
    expected = torch.zeros_like(sorted_reference).index_copy_(0, scatter[:held], sorted_reference[:held])

    def products() -> list[torch.Tensor]:
        outs = []
        for chosen in (config, None):
            out = torch.zeros(held + 5, 200, device="cuda", dtype=torch.bfloat16)
            fp8_grouped_gemm.launch(aq, a_s, module.weight, module.weight_scale, offsets, gather, scatter, out,
                                    config=chosen, fast_accum=True)
            outs.append(out.float())
        torch.cuda.synchronize()
        return outs

    results: dict[str, object] = {"main": products()}

    def other() -> None:
        try:
            results["thread"] = products()
        except Exception as e:  # noqa: BLE001 - the thread's failure is the test's
            results["thread"] = e

    thread = threading.Thread(target=other)
    thread.start()
    thread.join(timeout=300)
    assert not thread.is_alive(), "the launch from another thread did not return within 300 s"
    assert not isinstance(results["thread"], Exception), results["thread"]
    for got in results["main"] + results["thread"]:
        assert ((got - expected).norm() / expected.norm()).item() < 1e-2


# FP8 experts served on the GPU against the same FP8 weights computed on the CPU (the activations
# quantized at the same points, per row or per 1 x 128 block; products dequantized and multiplied in
# float32: the CPU path of fp8_experts.py and fp8.py), one decoder layer at a time: each reference
# layer is fed the served forward's input to that layer (its hidden states), so the comparison
# measures the layer, not what the layers before it compounded. Whole forwards cannot be held to
# each other at FP8's scale: rounding to e4m3 turns a difference of a bf16 ulp at a quantization
# point into a whole e4m3 step for some elements, a few layers make any two FP8 forwards differ by
# about FP8's own error, and a router's top-k over near-equal logits sends some tokens elsewhere.
# Simulated on a CPU (python -m bench.investigations.fp8_moe_reference: the served forward's
# numerics in bf16 there, against the same reference in float32, on bench/moe_checks.py's
# checkable_moe weights): each layer's update (output - input) off by 0.034-0.069 relative, the
# logits by 0.015-0.029, every token routed alike; with the experts' weight scales read from the
# next expert, row or K block, the activation's from the next token, or the routing weight applied
# twice or not at all, the worst layer is off by 0.32-3.0 and the logits by 0.15-0.56.
LAYER_BOUND = 0.15
LOGITS_BOUND = 0.08


def _served_against_reference_layer_by_layer(served: ModelRunner, reference: ModelRunner, ids: torch.Tensor,
                                             label: str) -> torch.Tensor:
    """The served forward of `ids` (hidden states and logits) held to `reference` layer by layer:
    each layer's update and the logits within the bounds above, every token routed alike (the
    experts' loads equal). Returns the served logits (on the CPU)."""
    out = served.forward(ids, torch.ones_like(ids), hidden=True)
    hidden = [h.float().cpu() for h in out.hidden_states]
    outputs, logits = moe_checks.layer_by_layer(reference, hidden, ids)
    # hidden[i] is layer i's input (the last entry, past the final norm, is not compared).
    updates = [_relative(hidden[i + 1] - hidden[i], outputs[i] - hidden[i]) for i in range(len(outputs) - 1)]
    head = _relative(out.logits.float().cpu(), logits)
    print(f"{label}, served against the reference layer by layer: updates {', '.join(f'{u:.3g}' for u in updates)}; "
          f"logits {head:.3g}")
    assert served.expert_load.snapshot().last == reference.expert_load.snapshot().last, \
        "the served forward routed some tokens to other experts than the reference did on the same inputs"
    assert max(updates) < LAYER_BOUND, f"{label}: layer updates off by {updates} (relative)"
    assert head < LOGITS_BOUND, f"{label}: logits off by {head:.3g} (relative)"
    return out.logits.float().cpu()


@pytest.mark.parametrize("scaling", ["row", "block"])
def test_fp8_experts_on_hopper_match_their_reference_layer_by_layer(tmp_path, scaling):
    """--quantize fp8 on a GPU: the experts' products through the Triton grouped FP8 kernel (checked
    at load against the dequantize-then-multiply reference one expert at a time: fp8_experts.verify
    raises otherwise), the layers compiled with them inside, the e4m3 weights and scales the CPU
    quantizes from the same checkpoint; the served forward against the CPU's (float32 between the
    same quantization points) layer by layer, and its logits within FP8's own error of the float32
    forward of the unquantized weights (0.11-0.18 simulated on a CPU). No calibration: the bias
    correction measured on text bytes misfits a random model's uniformly drawn tokens (simulated:
    0.079 -> 0.145 from bf16 on them, 0.082 -> 0.057 on its own batch)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from teacher_server import fp8, fp8_experts, fp8_rows
    from teacher_server.fp8 import Fp8Plan

    config = AutoConfig.for_model("qwen3_moe", **SMALL["qwen3_moe"])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    moe_checks.checkable_moe(model, torch.Generator().manual_seed(0))
    model.to(torch.bfloat16).save_pretrained(tmp_path)
    plan = Fp8Plan(scaling, calibration_rows=0)
    runner = ModelRunner(str(tmp_path), "cuda:0", dtype="bfloat16", quantize=plan)
    reference = ModelRunner(str(tmp_path), "cpu", dtype="float32", quantize=plan)
    experts = moe.experts_modules(runner.model)
    assert experts and all(isinstance(m.down_proj, fp8_experts.FP8ExpertWeights) for m in experts)
    assert {m.down_proj.kernel for m in experts} == {"triton"}
    # The Triton row kernel quantizes what nothing fuses into (row scales): the o projections' inputs
    # and the down products' after the gated first product; the rest stays with fp8.quantize_rows.
    for name, module in runner.model.named_modules():
        if isinstance(module, fp8.FP8Linear):
            on_kernel = module.quantize is fp8_rows.quantize_rows_kernel
            assert on_kernel == (scaling == "row" and name.endswith("o_proj")), name
        elif isinstance(module, fp8_experts.FP8ExpertWeights):
            on_kernel = module.quantize_rows is fp8_rows.quantize_rows_kernel
            assert on_kernel == (scaling == "row" and name.endswith("down_proj")), name
    assert (fp8_rows.IMPLEMENTATION in runner.info.kernels) == (scaling == "row")
    # The same e4m3 weights on both devices, up to rounding: CUDA divides by a Python number as a
    # multiplication by its reciprocal (ATen's div_true_kernel_cuda), so a scale amax / 448 can be an
    # ulp off the CPU's, and an element at a rounding boundary one e4m3 step off (simulated on the CPU
    # with these weights: 0.05-0.08% of the bytes).
    for ours, theirs in zip(experts, moe.experts_modules(reference.model)):
        for name in ("gate_up_proj", "down_proj"):
            mine, cpu = getattr(ours, name), getattr(theirs, name)
            weight, weight_scale = mine.canonical()  # the GPU's gate_up rows are interleaved for its gated kernel
            torch.testing.assert_close(weight_scale.cpu(), cpu.weight_scale, rtol=1e-6, atol=0)
            codes = weight.cpu().view(torch.uint8).int() - cpu.weight.view(torch.uint8).int()
            assert codes.abs().max() <= 1 and codes.count_nonzero() < 1e-2 * codes.numel(), \
                (name, codes.count_nonzero().item(), codes.abs().max().item())
    ids = torch.randint(0, 512, (2, 300), generator=torch.Generator().manual_seed(3))
    ours = _served_against_reference_layer_by_layer(runner, reference, ids, f"FP8 experts ({scaling})")
    full = ModelRunner(str(tmp_path), "cpu", dtype="float32").forward(ids, torch.ones_like(ids)).logits.float()
    cost = _relative(ours, full)
    print(f"FP8 experts ({scaling}) against the float32 forward of the unquantized weights: {cost:.3g}")
    assert cost < 0.35, cost


def test_a_published_fp8_moe_checkpoint_serves_on_the_gpu_as_on_the_cpu(published_dir):
    """tests/test_fp8_experts.py's tiny Qwen3-30B-A3B-FP8-layout checkpoint on the GPU: its e4m3 bytes
    kept (experts through the Triton kernel with 128 x 128 block scales, linears through cuBLAS's
    block-scaled product, the layers compiled), in bf16 as the checkpoint declares; against the same
    checkpoint on the CPU in float32 (the activations quantized at the same points, 1 x 128 blocks;
    there held to the checkpoint dequantized by hand), layer by layer."""
    from teacher_server import fp8_experts

    path, _ = published_dir
    gpu = ModelRunner(str(path), "cuda:0")
    experts = moe.experts_modules(gpu.model)
    assert experts and {m.down_proj.kernel for m in experts} == {"triton"}
    assert all(isinstance(m.gate_up_proj, fp8_experts.FP8ExpertWeights) for m in experts)
    assert gpu.quantization.source == "checkpoint" and gpu.quantization.scaling == "block"
    cpu = ModelRunner(str(path), "cpu", dtype="float32")
    ids = torch.randint(0, 96, (2, 200), generator=torch.Generator().manual_seed(4))
    _served_against_reference_layer_by_layer(gpu, cpu, ids, "published FP8 MoE checkpoint")
