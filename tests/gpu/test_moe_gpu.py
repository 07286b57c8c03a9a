"""The MoE teacher's kernels on a GPU, as served: tiny qwen3_moe, gpt_oss, mixtral and deepseek_v3
models in bf16 through the server's ModelRunner (torch._grouped_mm experts, FlexAttention with sinks,
the decoder layers compiled), against transformers' eager forward of the same weights in float32
on the same GPU. Sequences of 300 tokens cross FlexAttention's 128-token blocks and gpt-oss's
128-token window.
"""

from __future__ import annotations

import pytest
import torch

from teacher_server import moe, sink_attention
from teacher_server.model_runner import ModelRunner

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
# bf16 against float32, relative to the largest logit: bf16 roundings of the activations compounded
# over a few layers; a wrong expert, weight or mask gives ~1.
RTOL = 3e-2


@pytest.mark.parametrize("model_type", sorted(SMALL))
def test_the_served_moe_forward_equals_transformers_eager_in_float32(tmp_path, model_type):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **SMALL[model_type])
    config.save_pretrained(tmp_path)
    runner = ModelRunner(f"random:{tmp_path}", "cuda:0", dtype="bfloat16")
    assert moe.IMPLEMENTATION in runner.info.kernels and "compiled" in runner.info.kernels
    assert (sink_attention.IMPLEMENTATION in runner.info.kernels) == (model_type == "gpt_oss")
    generator = torch.Generator(device="cuda").manual_seed(1)
    with torch.no_grad():
        for parameter in runner.model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator, device="cuda") * 0.05)
    reference = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **SMALL[model_type]),
                                                 attn_implementation="eager",
                                                 experts_implementation=moe.EAGER).cuda().eval()
    reference.load_state_dict({k: v.float() for k, v in runner.model.state_dict().items()})
    ids = torch.randint(0, 512, (3, 300), generator=torch.Generator().manual_seed(0))
    padded = torch.ones_like(ids)
    padded[1, 200:] = 0
    for mask in (torch.ones_like(ids), padded):
        ours = runner.forward(ids, mask).logits.float()
        with torch.inference_mode():
            theirs = reference(input_ids=ids.cuda(), attention_mask=mask.cuda(), use_cache=False).logits
        real = mask.cuda().bool()
        off = (ours[real] - theirs[real]).abs().max().item()
        assert off <= RTOL * theirs.abs().max().item(), f"{model_type}: logits off by {off:.3g}"
    snapshot = runner.expert_load.snapshot()
    assert all(sum(layer) == 3 * 300 * config.num_experts_per_tok for layer in snapshot.last)
