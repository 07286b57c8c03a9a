"""MoE teachers under torchrun: attention tensor parallel, experts expert parallel (each rank holds
E / N experts), on real gloo ranks, against the same model run by one process.

Each rank loads the model through the server's own ModelRunner with its place in the world (the
sharding teacher_server/parallel.py does at load), rank 0 runs the forwards and the others follow
its broadcasts, as in a served teacher; rank 0 compares every output kind the server derives —
logits, top-k log-probabilities, every hidden state, the decoder's final hidden state — and the
expert load with a ModelRunner of the same seeded weights on one process.
"""

from __future__ import annotations

import datetime
import logging
import os

import pytest
import torch

from tests.helpers import free_port
from tests.test_moe import TINY

# float32 on both sides: what differs is the order of the sums (the all-reduces).
RTOL = 2e-5
# Larger than transformers' initialisation (0.02), so that routing and every layer's output are far
# from uniform and a misrouted pair shows.
INIT_STD = 0.3


def _config(model_type: str, size: int):
    from transformers import AutoConfig

    # Key/value heads enough for every rank to hold one.
    shape = {**TINY[model_type], "num_key_value_heads": max(size, TINY[model_type]["num_key_value_heads"])}
    return AutoConfig.for_model(model_type, initializer_range=INIT_STD, **shape)


def _model_dir(root, model_type: str, size: int) -> str:
    directory = root / model_type
    _config(model_type, size).save_pretrained(directory)
    return str(directory)


def _close(ours: torch.Tensor, theirs: torch.Tensor, what: str) -> None:
    scale = theirs.abs().max().item()
    off = (ours.float() - theirs.float()).abs().max().item()
    assert off <= RTOL * max(scale, 1.0), f"{what}: off by {off:.3g} (largest value {scale:.3g})"


def _compare(runner, reference, model_type: str) -> None:
    from distill_common.outputs import BatchOutputs, ForwardNeeds, TopK

    ids = torch.randint(0, 96, (3, 21), generator=torch.Generator().manual_seed(0))
    padded = torch.ones_like(ids)
    padded[1, 13:] = 0  # right-padded, as the engine packs
    padded[2, :6] = 0  # left-padded
    layers = runner.info.num_layers
    for mask in (torch.ones_like(ids), padded):
        everything = ForwardNeeds(logits=True, hidden_layers=frozenset(range(layers + 1)))
        ours, theirs = runner.forward(ids, mask, everything), reference.forward(ids, mask, everything)
        decoder = ForwardNeeds(final_hidden=True)  # the decoder alone: no output head, no gather
        our_final, their_final = runner.forward(ids, mask, decoder), reference.forward(ids, mask, decoder)
        real = mask.bool()
        _close(ours.logits[real], theirs.logits[real], f"{model_type} logits")
        for layer in range(layers + 1):
            _close(ours.hidden_states[layer][real], theirs.hidden_states[layer][real],
                   f"{model_type} hidden state {layer}")
        _close(our_final.final_hidden[real], their_final.final_hidden[real], f"{model_type} final hidden state")
        topk = TopK(k=5, temperature=1.5)
        our_values, our_ids = topk.derive(BatchOutputs(ours.logits), None, torch.float32)
        their_values, their_ids = topk.derive(BatchOutputs(theirs.logits), None, torch.float32)
        assert torch.equal(our_ids[real], their_ids[real]), model_type
        _close(our_values[real], their_values[real], f"{model_type} top-k log-probabilities")
    # Every rank counts every expert (each sees the whole routing); rank 0's counts are the server's.
    assert runner.expert_load.snapshot().total == reference.expert_load.snapshot().total, model_type


def _saved_dir(root, model_type: str, size: int) -> str:
    """A checkpoint saved by transformers (experts one tensor each, as published), which each rank
    reads only its experts of (teacher_server/expert_loading.py)."""
    from transformers import AutoModelForCausalLM

    config = _config(model_type, size)
    torch.manual_seed(0)
    directory = root / f"saved-{model_type}"
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    return str(directory)


def _rank(rank: int, size: int, port: int, specs: dict[str, str]) -> None:
    import torch.distributed as dist

    from teacher_server import moe
    from teacher_server.model_runner import ModelRunner
    from teacher_server.parallel import World

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=120)
    dist.init_process_group("gloo", timeout=timeout)
    said: list[str] = []
    logging.getLogger("teacher_server.parallel").addHandler(_Said(said))
    logging.getLogger("teacher_server.parallel").setLevel(logging.INFO)
    try:
        for model_type, spec in specs.items():
            # A world per model (its own control group), as a served teacher has one per start.
            world = World(rank=rank, size=size, device=torch.device("cpu"), timeout_s=120,
                          control=dist.new_group(backend="gloo", timeout=timeout))
            saved = not spec.startswith("random:")  # random: the same seeded weights on every rank
            said.clear()
            runner = ModelRunner(spec, "cpu", dtype="float32", world=world)
            assert any(("read its experts" in line) == saved for line in said), said
            experts = moe.experts_modules(runner.model)
            total = experts[0].expert_range.total
            assert [m.down_proj.shape[0] for m in experts] == [total // size] * len(experts)
            assert [m.expert_range.first for m in experts] == [rank * total // size] * len(experts)
            if rank == 0:
                try:
                    _compare(runner, ModelRunner(spec, "cpu", dtype="float32"), model_type)
                finally:
                    world.broadcast_stop()
            else:
                runner.follow()
    finally:
        dist.destroy_process_group()


class _Said(logging.Handler):
    def __init__(self, lines: list[str]):
        super().__init__()
        self.lines = lines

    def emit(self, record) -> None:
        self.lines.append(record.getMessage())


def _run(tmp_path, size: int, model_types: list[str], saved: bool = False) -> None:
    import torch.multiprocessing as mp

    specs = {model_type: _saved_dir(tmp_path, model_type, size) if saved
             else f"random:{_model_dir(tmp_path, model_type, size)}" for model_type in model_types}
    mp.start_processes(_rank, args=(size, free_port(), specs), nprocs=size, start_method="spawn", join=True)


@pytest.mark.slow
def test_tp_ep_over_2_ranks_equals_one_process(tmp_path):
    """qwen3_moe (8 experts, 4 a rank) and mixtral (4, 2 a rank) over 2 gloo ranks. Slow: two spawned
    ranks importing torch and transformers (16 s on 2 loaded cores)."""
    _run(tmp_path, 2, ["qwen3_moe", "mixtral"])


@pytest.mark.slow
def test_tp_ep_with_sinks_and_latent_attention_over_2_ranks_equals_one_process(tmp_path):
    """gpt_oss (4 experts with biases; attention sinks split by head, FlexAttention) and deepseek_v3
    (8 routed experts in groups, a shared one split like a dense MLP, latent attention split by
    head, a dense first layer) over 2 gloo ranks."""
    _run(tmp_path, 2, ["gpt_oss", "deepseek_v3"])


@pytest.mark.slow
def test_tp_ep_from_saved_checkpoints_each_rank_reading_its_experts_equals_one_process(tmp_path):
    """qwen3_moe, mixtral and deepseek_v3 saved as published (one tensor per expert) over 2 gloo
    ranks: each rank reads its experts only, and the outputs equal one process's whole load."""
    _run(tmp_path, 2, ["qwen3_moe", "mixtral", "deepseek_v3"], saved=True)


@pytest.mark.slow
def test_tp_ep_over_4_ranks_equals_one_process(tmp_path):
    """4 ranks: qwen3_moe 2 experts a rank, mixtral and gpt_oss 1, deepseek_v3 2; one query and one
    key/value head a rank."""
    _run(tmp_path, 4, ["qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3"])


def test_experts_not_divisible_by_the_ranks_are_refused_before_loading():
    from transformers import AutoConfig

    from teacher_server.parallel import check_experts

    config = AutoConfig.for_model("qwen3_moe", **{**TINY["qwen3_moe"], "num_experts": 6})
    check_experts(config, 2)
    with pytest.raises(ValueError, match=r"needs the experts \(6\) divisible by 4: run 1 or 2 ranks"):
        check_experts(config, 4)  # the heads allow 1, 2 (4 query, 2 key/value heads); the experts 1, 2, 3
    check_experts(AutoConfig.for_model("llama"), 4)  # dense: no experts to divide
