"""teacher_server/routing.py: the softmax-then-top-k routers' replaced forward, its check against the
router's own, and the kernel under Triton's interpreter (where Triton is installed: the GPU image
has it, this project's CPU install does not; `python -m tests.test_routing` in a child process, as
the interpreter must be chosen before the kernel is decorated).

The kernel's expected output is written independently of it: the experts are the first k of a
stable descending sort of the logits (ties by index), their weights softmax's probabilities there.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from teacher_server import routing

TINY = {
    "qwen3_moe": dict(vocab_size=96, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                      num_hidden_layers=1, head_dim=8, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                      num_attention_heads=4, num_key_value_heads=2),
    "mixtral": dict(vocab_size=96, hidden_size=32, intermediate_size=16, num_hidden_layers=1, head_dim=8,
                    num_local_experts=4, num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2),
}


def _model(model_type: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **TINY[model_type])).eval()


@pytest.mark.parametrize("model_type", sorted(TINY))
def test_the_replaced_router_gives_the_routers_own_outputs_on_a_cpu(model_type):
    model = _model(model_type)
    (router,) = routing.routers(model)
    x = torch.randn(40, router.hidden_dim, generator=torch.Generator().manual_seed(1))
    want = router(x)
    assert routing.install(model) == 1 and "forward" in router.__dict__
    got = router(x)
    for ours, theirs in zip(got, want):
        assert ours.dtype == theirs.dtype and torch.equal(ours, theirs)
    routing.uninstall(model)
    assert "forward" not in router.__dict__


def test_the_check_tells_a_tie_broken_otherwise_from_a_wrong_choice():
    model = _model("qwen3_moe")
    (router,) = routing.routers(model)
    with torch.no_grad():  # experts 0-3 alike, 4-7 alike: the top-2 are two of four equal logits in every row
        router.weight.copy_(torch.randn(2, router.weight.shape[1]).repeat_interleave(4, dim=0))
    router.routing_normalizes, router.routing_casts = True, True

    def tie_by_highest_index(x):
        logits = F.linear(x.reshape(-1, router.hidden_dim), router.weight)
        probs = F.softmax(logits, dtype=torch.float, dim=-1)
        flipped = probs.flip(-1)  # torch.topk then prefers other indices among equal values
        values, experts = torch.topk(flipped, router.top_k, dim=-1)
        values = (values / values.sum(-1, keepdim=True)).to(logits.dtype)
        return logits, values, probs.shape[-1] - 1 - experts

    def smallest(x):
        logits = F.linear(x.reshape(-1, router.hidden_dim), router.weight)
        values, experts = torch.topk(F.softmax(logits, dtype=torch.float, dim=-1), router.top_k, largest=False)
        return logits, (values / values.sum(-1, keepdim=True)).to(logits.dtype), experts

    def unnormalised(x):
        logits = F.linear(x.reshape(-1, router.hidden_dim), router.weight)
        values, experts = torch.topk(F.softmax(logits, dtype=torch.float, dim=-1), router.top_k)
        return logits, values.to(logits.dtype), experts

    def top_twice(x):  # in a tie the top expert twice: the same probabilities as a multiset
        logits, values, experts = type(router).forward(router, x)
        return logits, values, experts[:, :1].expand_as(experts)

    untied = routing.routers(_model("qwen3_moe"))[0]  # random weights: no ties
    untied.routing_normalizes, untied.routing_casts = True, True

    def weights_by_index(x):  # the right experts, in index order, with the weights largest first
        logits, values, experts = type(untied).forward(untied, x)
        return logits, values, experts.sort(dim=-1).values

    def wrong_past_1008(x):  # a program past the last full one of 16 rows writes garbage
        logits, values, experts = type(router).forward(router, x)
        experts = experts.clone()
        experts[1008:] = experts[1008:].flip(-1).remainder(2)
        return logits, values, experts

    x = torch.randn(1024, router.hidden_dim, generator=torch.Generator().manual_seed(0))  # check()'s rows
    own = type(router).forward(router, x)[2].sort(-1).values
    assert (tie_by_highest_index(x)[2].sort(-1).values != own).any(-1).sum() > 100  # other experts, by ties
    assert routing.check(router, tie_by_highest_index) == ""
    assert "other experts chosen" in routing.check(router, smallest)
    assert "the weights differ" in routing.check(router, unnormalised)
    assert "an expert chosen twice" in routing.check(router, top_twice)
    assert routing.check(untied, lambda x: type(untied).forward(untied, x)) == ""
    assert "the weights differ" in routing.check(untied, weights_by_index)
    assert "1021 rows" in routing.check(router, wrong_past_1008)


def test_a_router_whose_kernel_fails_or_differs_keeps_its_own_forward(monkeypatch, caplog):
    """As on a GPU where the kernel does not build, or chooses otherwise: the check at install keeps
    the model's router (the kernel's predicate forced here, where no kernel runs)."""
    monkeypatch.setattr(routing, "kernel_serves", lambda device, experts, k: True)
    model = _model("qwen3_moe")
    (router,) = routing.routers(model)
    with caplog.at_level("WARNING", logger="teacher_server.routing"):
        assert routing.install(model) == 0  # launch() without Triton: an error, caught
    assert "forward" not in router.__dict__ and "keep their forward" in caplog.text

    def smallest(logits, k):
        return torch.topk(F.softmax(logits, dtype=torch.float, dim=-1), k, largest=False)

    monkeypatch.setattr(routing, "softmax_topk", smallest)
    caplog.clear()
    with caplog.at_level("WARNING", logger="teacher_server.routing"):
        assert routing.install(model) == 0
    assert "forward" not in router.__dict__ and "other experts" in caplog.text


@pytest.mark.slow
def test_the_kernel_under_tritons_interpreter_equals_the_stable_sort_of_the_logits():
    pytest.importorskip("triton")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(
        [root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    done = subprocess.run([sys.executable, "-m", "tests.test_routing"], cwd=root, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0 and "interpreted router kernel matches" in done.stdout, done.stdout + done.stderr


def expected(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first k of a stable descending sort of the logits, and softmax's probabilities there."""
    experts = torch.sort(logits.float(), dim=-1, descending=True, stable=True).indices[:, :k]
    return F.softmax(logits, dtype=torch.float, dim=-1).gather(1, experts), experts


def _interpreted() -> None:
    generator = torch.Generator().manual_seed(0)
    for rows, experts, k, dtype in ((300, 128, 8, torch.bfloat16), (37, 60, 4, torch.bfloat16),
                                    (19, 8, 1, torch.float32), (9, 256, 8, torch.float32)):
        logits = (torch.randn(rows, experts + 3, generator=generator) * 2).to(dtype)[:, :experts]  # a row stride
        if dtype == torch.bfloat16:
            logits[0, :] = 0.5  # every logit tied
        values = torch.empty(rows, k)
        chosen = torch.empty(rows, k, dtype=torch.int64)
        routing.launch(logits, k, values, chosen)
        want_values, want_experts = expected(logits, k)
        assert torch.equal(chosen, want_experts), (rows, experts, k)
        torch.testing.assert_close(values, want_values, rtol=2e-6, atol=0)
    # A NaN logit, an infinite one, a row of -inf: the softmax is NaN; experts 0 .. k-1, NaN weights.
    logits = torch.randn(4, 16, generator=generator)
    logits[0, 3], logits[1, 5], logits[2] = float("nan"), float("inf"), float("-inf")
    values = torch.empty(4, 3)
    chosen = torch.empty(4, 3, dtype=torch.int64)
    routing.launch(logits, 3, values, chosen)
    assert torch.equal(chosen[:3], torch.arange(3).expand(3, 3)) and values[:3].isnan().all()
    want_values, want_experts = expected(logits[3:], 3)
    assert torch.equal(chosen[3:], want_experts) and torch.allclose(values[3:], want_values, rtol=2e-6, atol=0)
    # Some -inf logits, fewer finite ones than k: the finite first, then the -inf ones by index.
    logits = torch.full((1, 16), float("-inf"))
    logits[0, 9], logits[0, 2] = 1.0, 3.0
    routing.launch(logits, 4, values := torch.empty(1, 4), chosen := torch.empty(1, 4, dtype=torch.int64))
    assert chosen.tolist() == [[2, 9, 0, 1]] and values[0, 2:].eq(0).all(), (chosen, values)
    # check_kernel's own expectation, and install's whole check on tiny models (the interpreter runs
    # the kernel on CPU tensors, so the kernel's predicate is forced): every router takes the kernel.
    routing.kernel_serves = lambda device, experts, k: True
    for experts, k, dtype in ((128, 8, torch.bfloat16), (60, 4, torch.float32)):
        assert routing.check_kernel(torch.device("cpu"), experts, k, dtype) == "", (experts, k)
    for model_type in sorted(TINY):
        model = _model(model_type)
        assert routing.install(model) == 1 and routing.served(model) == 1, model_type
        x = torch.randn(5, 32)
        assert torch.equal(model.model.layers[0].mlp.gate(x)[2], expected(F.linear(x, routing.routers(model)[0].weight),
                                                                           2)[1])
    print("interpreted router kernel matches")


if __name__ == "__main__":
    _interpreted()
