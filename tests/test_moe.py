"""The teacher's MoE experts and attention-sink kernels against transformers' eager forward.

Tiny qwen3_moe, gpt_oss, mixtral and deepseek_v3 models are built from configs, loaded through the
server's own ModelRunner (`random:` a config directory: model_loading installs teacher_server/moe.py
and sink_attention.py), and every output kind the server derives — logits, top-k log-probabilities,
every hidden state, the decoder's final hidden state — is compared with the same weights run by
transformers with its eager experts (one expert at a time) and eager attention (the sink as a
softmax column).
"""

from __future__ import annotations

import pytest
import torch

from distill_common.outputs import BatchOutputs, ForwardNeeds, TopK
from teacher_server import moe, routing, sink_attention
from teacher_server.metrics import Metrics
from teacher_server.model_runner import ModelRunner

_ATTENTION = dict(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
TINY = {
    "qwen3_moe": dict(vocab_size=96, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                      num_hidden_layers=2, head_dim=8, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                      **_ATTENTION),
    "mixtral": dict(vocab_size=96, hidden_size=32, intermediate_size=16, num_hidden_layers=2, head_dim=8,
                    num_local_experts=4, num_experts_per_tok=2, **_ATTENTION),
    # Sliding-window layers (a window of 5) alternate with full ones; each head has a sink.
    "gpt_oss": dict(vocab_size=96, hidden_size=32, intermediate_size=16, num_hidden_layers=2, head_dim=8,
                    num_local_experts=4, num_experts_per_tok=2, sliding_window=5, num_attention_heads=4,
                    num_key_value_heads=2, layer_types=["sliding_attention", "full_attention"]),
    # The first layer dense, then 8 routed experts in 2 groups (top group then top-2) and a shared one.
    "deepseek_v3": dict(vocab_size=96, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                        num_hidden_layers=2, first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2,
                        n_group=2, topk_group=1, n_shared_experts=1, q_lora_rank=16, kv_lora_rank=8,
                        qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, num_attention_heads=4,
                        num_key_value_heads=4, max_position_embeddings=256),
}
# float32 on both sides: what differs is the order of the sums (grouped products, float32 combine).
RTOL = 2e-5


def _config(model_type: str):
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **TINY[model_type])


def _runner_and_reference(tmp_path, model_type: str):
    """The server's runner over random weights, and transformers' eager model with the same weights."""
    from transformers import AutoModelForCausalLM

    config = _config(model_type)
    config.save_pretrained(tmp_path)
    runner = ModelRunner(f"random:{tmp_path}", "cpu", dtype="float32")
    # Weights drawn anew, larger than transformers' initialisation (std 0.02), so that the routing and
    # every layer's output are far from uniform; DeepSeek-V3's routing correction bias too.
    generator = torch.Generator().manual_seed(1)
    drawn = [*runner.model.parameters(),
             *(b for name, b in runner.model.named_buffers() if name.endswith("e_score_correction_bias"))]
    with torch.no_grad():
        for tensor in drawn:
            tensor.copy_(torch.randn(tensor.shape, generator=generator) * 0.3)
    reference = AutoModelForCausalLM.from_config(_config(model_type), attn_implementation="eager",
                                                 experts_implementation=moe.EAGER).eval()
    reference.load_state_dict(runner.model.state_dict())
    return runner, reference


def _close(ours: torch.Tensor, theirs: torch.Tensor, what: str) -> None:
    scale = theirs.abs().max().item()
    off = (ours.float() - theirs.float()).abs().max().item()
    assert off <= RTOL * max(scale, 1.0), f"{what}: off by {off:.3g} (largest value {scale:.3g})"


@pytest.mark.parametrize("model_type", sorted(TINY))
def test_every_output_kind_equals_transformers_eager_forward(tmp_path, model_type):
    runner, reference = _runner_and_reference(tmp_path, model_type)
    assert moe.IMPLEMENTATION in runner.info.kernels
    assert (sink_attention.IMPLEMENTATION in runner.info.kernels) == (model_type == "gpt_oss")
    # Softmax-then-top-k routers run through teacher_server/routing.py's op (torch's arithmetic on a CPU).
    replaced = [r for r in routing.routers(runner.model) if "forward" in r.__dict__]
    assert len(replaced) == (2 if model_type in ("qwen3_moe", "mixtral") else 0)
    assert routing.IMPLEMENTATION not in runner.info.kernels  # (torch's arithmetic on a CPU: no kernel)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 96, (3, 21), generator=generator)
    # Without padding (the runner passes no mask), then the second row right-padded (the engine's
    # packs) and the third left-padded.
    padded = torch.ones_like(ids)
    padded[1, 13:] = 0
    padded[2, :6] = 0
    masks = [torch.ones_like(ids), padded]
    layers = runner.info.num_layers
    for mask in masks:
        ours = runner.forward(ids, mask, ForwardNeeds(logits=True, hidden_layers=frozenset(range(layers + 1))))
        decoder = runner.forward(ids, mask, ForwardNeeds(final_hidden=True))
        with torch.inference_mode():
            theirs = reference(input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=False)
        real = mask.bool()  # padded positions' outputs are never served
        _close(ours.logits[real], theirs.logits[real], f"{model_type} logits")
        for layer in range(layers + 1):
            _close(ours.hidden_states[layer][real], theirs.hidden_states[layer][real], f"hidden state {layer}")
        _close(decoder.final_hidden[real], theirs.hidden_states[-1][real], "final hidden state")
        topk = TopK(k=5, temperature=1.5)
        our_values, our_ids = topk.derive(BatchOutputs(ours.logits), None, torch.float32)
        their_values, their_ids = topk.derive(BatchOutputs(theirs.logits), None, torch.float32)
        assert torch.equal(our_ids[real], their_ids[real])
        _close(our_values[real], their_values[real], "top-k log-probabilities")


def test_the_expert_load_counts_each_layers_routing_and_reaches_metrics_and_status(tmp_path):
    runner, _ = _runner_and_reference(tmp_path, "qwen3_moe")
    routed = []
    hooks = [m.register_forward_pre_hook(lambda module, args: routed.append(args[1].reshape(-1)))
             for m in moe.experts_modules(runner.model)]
    assert runner.expert_load.snapshot().total == [[0] * 8, [0] * 8]  # the start-up probe is not counted
    ids = torch.randint(0, 96, (3, 10), generator=torch.Generator().manual_seed(2))
    expected = torch.zeros(2, 8, dtype=torch.int64)
    for _ in range(2):
        routed.clear()
        runner.forward(ids, torch.ones_like(ids))
        last = torch.stack([torch.bincount(r, minlength=8) for r in routed])
        expected += last
        snapshot = runner.expert_load.snapshot()
        assert snapshot.last == last.tolist() and snapshot.total == expected.tolist()
    for hook in hooks:
        hook.remove()
    assert expected.sum(1).tolist() == [2 * 3 * 10 * 2] * 2  # two forwards of every token's two experts

    metrics = Metrics()
    metrics.watch_experts(runner.expert_load)
    text = metrics.render().decode()
    for layer in range(2):
        for expert in range(8):
            line = f'teacher_expert_tokens_total{{expert="{expert}",layer="{layer}"}} {float(expected[layer, expert])}'
            assert line in text
        busiest = expected.new_tensor(snapshot.last[layer]).max().item() / (30 * 2 / 8)
        assert f'teacher_expert_imbalance{{layer="{layer}"}} {busiest}' in text
    status = snapshot.status()["layers"]
    assert [entry["tokens_total"] for entry in status] == expected.tolist()
    assert status[0]["imbalance_total"] == round(expected[0].max().item() / (120 / 8), 3)


def test_grouped_products_one_launch_and_one_group_at_a_time_agree():
    generator = torch.Generator().manual_seed(3)
    sizes = torch.tensor([5, 0, 11, 3])  # an expert with no token
    offsets = sizes.cumsum(0).to(torch.int32)
    x = torch.randn(int(sizes.sum()), 32, generator=generator)
    weight = torch.randn(4, 24, 32, generator=generator).transpose(1, 2)  # [E, K, N] as a view, as transformers'
    assert moe._grouped_mm_runs(x, weight)  # torch's kernel on this CPU
    expected = torch.cat([x[a:b] @ weight[e] for e, (a, b) in enumerate(zip([0, *offsets[:-1]], offsets))])
    torch.testing.assert_close(moe.grouped_mm(x, weight, offsets), expected)
    torch.testing.assert_close(moe.grouped_mm_per_group(x, weight, offsets), expected)
    odd = torch.randn(4, 30, 7, generator=generator)  # 7 columns of 4 bytes: not 16-byte strides
    assert not moe._grouped_mm_runs(x[:, :30].contiguous(), odd)
    torch.testing.assert_close(moe.grouped_mm(x[:, :30].contiguous(), odd, offsets),
                               torch.cat([x[a:b, :30] @ odd[e] for e, (a, b) in
                                          enumerate(zip([0, *offsets[:-1]], offsets))]))


@pytest.mark.parametrize("window", [None, 37])
def test_sink_attention_over_several_blocks_equals_the_softmax_with_a_sink_column(window):
    """The block mask from the blocks' bounds (full, straddling and empty blocks, a ragged last
    block, left and right padding) against the dense mask, with sinks, in float64."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    generator = torch.Generator().manual_seed(4)
    batch, heads, kv_heads, length, dim = 2, 4, 2, 300, 16
    q = torch.randn(batch, heads, length, dim, generator=generator, dtype=torch.float32)
    k, v = (torch.randn(batch, kv_heads, length, dim, generator=generator, dtype=torch.float32) for _ in range(2))
    sinks = torch.randn(heads, generator=generator, dtype=torch.float32)
    padding = torch.ones(batch, length, dtype=torch.bool)
    padding[0, 250:] = False
    padding[1, :140] = False
    module = torch.nn.Module().eval()
    module.num_key_value_groups, module.sinks = heads // kv_heads, sinks
    position = torch.arange(length)
    allowed = (position.view(-1, 1) >= position.view(1, -1)) & padding.view(batch, 1, 1, length)
    if window is not None:
        allowed = allowed & (position.view(-1, 1) - position.view(1, -1) < window)
    dense = torch.zeros(allowed.shape, dtype=torch.float32).masked_fill(~allowed, float("-inf"))
    expected, _ = eager_attention_forward(module, q, k, v, dense, scaling=dim ** -0.5)
    mask = sink_attention.block_mask(batch, length, length, attention_mask=padding, local_size=window)
    ours, _ = sink_attention.sink_attention(module, q, k, v, mask, scaling=dim ** -0.5, sliding_window=window,
                                            s_aux=sinks)
    has_key = allowed.any(-1).squeeze(1)  # the eager softmax of a row without keys is all sink: zeros
    torch.testing.assert_close(ours[has_key], expected[has_key], rtol=1e-5, atol=1e-6)
    assert ours[~has_key].abs().max() == 0


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["qwen3_moe", "gpt_oss"])
def test_compiled_moe_layers_share_their_compilations_through_the_probe(tmp_path, model_type):
    """On a GPU the decoder layers are compiled (dynamic shapes) with these kernels inside. Each
    layer's expert-load row is its own tensor: were it guarded on, each layer would compile apart,
    and past dynamo's recompile limit (8) the rest would run uncompiled, silently; here that limit
    is an error, over 10 layers (gpt-oss's alternate: two compilations), the probe and three
    pack shapes. Dynamo's tracing and guards only (backend eager): bf16, which the grouped GEMM's
    shape function requires under tracing."""
    from distill_common.models import load_causal_lm
    from teacher_server import fp8

    config = _config(model_type)
    config.num_hidden_layers = 10
    if model_type == "gpt_oss":
        config.layer_types = ["sliding_attention", "full_attention"] * 5
    config.save_pretrained(tmp_path)
    model = load_causal_lm(f"random:{tmp_path}", device=torch.device("cpu"), dtype=torch.bfloat16)
    moe.install(model)
    sink_attention.install(model)
    shapes = [(2, 16), (3, 9), (1, 30)]
    inputs = [torch.randint(0, 96, shape, generator=torch.Generator().manual_seed(6)) for shape in shapes]
    with torch.inference_mode():
        want = [model(input_ids=ids).logits for ids in inputs]
    for layer in fp8.decoder_layers(model):
        layer.compile(backend="eager", dynamic=True)
    torch._dynamo.reset()
    try:
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
            runner = ModelRunner(str(tmp_path), "cpu", model=model)
            got = [runner.forward(ids, torch.ones_like(ids)).logits for ids in inputs]
    finally:
        torch._dynamo.reset()
    for ours, theirs in zip(got, want):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


@pytest.mark.slow
def test_a_served_moe_teacher_reports_its_kernels_and_expert_load(tmp_path):
    """The HTTP side, on a real server: /v1/status names the kernels and lists each MoE layer's
    tokens per expert (none served yet: the start-up probe is not counted); /metrics has a series
    per layer and expert, and each layer's imbalance. Slow: a server process (12 s on 2 loaded cores)."""
    import requests

    from teacher_server.launcher import ServerProcess

    _config("qwen3_moe").save_pretrained(tmp_path)
    with ServerProcess("--model", f"random:{tmp_path}") as server:
        status = requests.get(f"{server.http}/v1/status", timeout=10).json()
        metrics = requests.get(f"{server.http}/metrics", timeout=10).text
    assert moe.IMPLEMENTATION in status["kernels"]
    assert [layer["tokens_total"] for layer in status["experts"]["layers"]] == [[0] * 8, [0] * 8]
    series = [line for line in metrics.splitlines() if line.startswith("teacher_expert_tokens_total{")]
    assert len(series) == 2 * 8 and all(line.endswith(" 0.0") for line in series)
    assert 'teacher_expert_imbalance{layer="1"} 0.0' in metrics
