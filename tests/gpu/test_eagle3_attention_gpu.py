"""On one GPU: the unroll's fused attention (merged_ttt_attention over PyTorch's CUDA causal
kernels, bfloat16) against the chunked reference (ttt_attention, float32 inside) on the same
bfloat16 inputs, values and gradients, at every unroll step; and a bfloat16 draft's unroll
with the fused attention against the same draft's with the reference."""

from __future__ import annotations

import pytest
import torch

from student_trainer.eagle3.attention import merged_ttt_attention, ttt_attention

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# bfloat16 operands, float32 accumulation: ||got - want|| / ||want|| lands between 1e-3 and 1e-2.
RELATIVE = 2e-2


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


@pytest.mark.parametrize("kernel", ["flash"])  # the draft's; bench/investigations/ttt_attention_kernels.py times the others
def test_the_fused_attention_equals_the_reference_in_bf16(kernel):
    torch.manual_seed(0)
    batch, heads, kv_heads, length, dim = 1, 32, 8, 1024, 128
    leaf = lambda *shape: torch.randn(*shape, device="cuda", dtype=torch.bfloat16).requires_grad_()  # noqa: E731
    for steps in (0, 1, 6):
        q, k0, v0 = leaf(batch, heads, length, dim), leaf(batch, heads, length, dim), leaf(batch, heads, length, dim)
        kd = [leaf(batch, kv_heads, length, dim) for _ in range(steps)]
        vd = [leaf(batch, kv_heads, length, dim) for _ in range(steps)]
        repeat = lambda x: x.repeat_interleave(heads // kv_heads, dim=1)  # noqa: E731
        want = ttt_attention(q, k0, v0, [repeat(k) for k in kd], [repeat(v) for v in vd], None)
        got = merged_ttt_attention(q, k0, v0, kd, vd, kernel=kernel)
        torch.cuda.synchronize()
        assert relative_error(got, want) < RELATIVE, (steps, relative_error(got, want))
        upstream = torch.randn_like(want)
        inputs = [q, k0, v0, *kd, *vd]
        want_grads = torch.autograd.grad((want.float() * upstream).sum(), inputs)
        got_grads = torch.autograd.grad((got.float() * upstream).sum(), inputs)
        for i, (g, w) in enumerate(zip(got_grads, want_grads)):
            assert torch.isfinite(g).all(), (steps, i)
            assert relative_error(g, w) < RELATIVE, (steps, i, relative_error(g, w))


def test_a_bf16_draft_unrolls_the_same_with_the_fused_attention():
    from transformers import LlamaConfig

    from student_trainer.eagle3.model import Eagle3Draft

    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=8,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    torch.manual_seed(0)
    with torch.device("cuda"):
        draft = Eagle3Draft.for_target(config, torch.randn(512, 256), torch.zeros(128, dtype=torch.long),
                                       torch.zeros(512, dtype=torch.bool), (2, 4, 5)).to(torch.bfloat16)
        aux = torch.randn(2, 777, 3 * 256, dtype=torch.bfloat16)
        ids = torch.randint(0, 512, (2, 777))
    results = {}
    for attention in ("reference", "flash"):
        draft.attention = attention
        draft.zero_grad(set_to_none=True)
        logits = list(draft.unroll(aux, ids, None, 5))
        sum(l.float().logsumexp(-1).mean() for l in logits).backward()
        results[attention] = logits, {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}
    for k, (got, want) in enumerate(zip(results["flash"][0], results["reference"][0])):
        assert relative_error(got, want) < RELATIVE, (k, relative_error(got, want))
    for name, want in results["reference"][1].items():
        assert relative_error(results["flash"][1][name], want) < RELATIVE, (name, relative_error(results["flash"][1][name], want))
