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


def _rank(rank: int, size: int, port: int, specs: dict[str, tuple[str, bool]], fp8_activations: str = "") -> None:
    """`specs`: model label -> (--model, whether each rank reads only its experts from it).
    `fp8_activations` "float32": FP8 weights' activations left unquantized (`_unquantized_activations`)."""
    import torch.distributed as dist

    from teacher_server import moe
    from teacher_server.model_runner import ModelRunner
    from teacher_server.parallel import World

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    if fp8_activations == "float32":
        _unquantized_activations()
    timeout = datetime.timedelta(seconds=120)
    dist.init_process_group("gloo", timeout=timeout)
    said: list[str] = []
    logging.getLogger("teacher_server.parallel").addHandler(_Said(said))
    logging.getLogger("teacher_server.parallel").setLevel(logging.INFO)
    try:
        for model_type, (spec, reads_experts) in specs.items():
            # A world per model (its own control group), as a served teacher has one per start.
            world = World(rank=rank, size=size, device=torch.device("cpu"), timeout_s=120,
                          control=dist.new_group(backend="gloo", timeout=timeout))
            said.clear()
            runner = ModelRunner(spec, "cpu", dtype="float32", world=world)
            assert any("read its experts" in line for line in said) == reads_experts, said
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
    # random: the same seeded weights on every rank; saved: each rank reads its experts only.
    specs = {model_type: (_saved_dir(tmp_path, model_type, size), True) if saved
             else (f"random:{_model_dir(tmp_path, model_type, size)}", False) for model_type in model_types}
    _spawn(size, specs)


def _spawn(size: int, specs: dict[str, tuple[str, bool]], fp8_activations: str = "") -> None:
    import torch.multiprocessing as mp

    mp.start_processes(_rank, args=(size, free_port(), specs, fp8_activations), nprocs=size, start_method="spawn",
                       join=True)


def _unquantized_activations() -> None:
    """Block-scaled FP8 products with their activations in float32 (scales of 1), in this process:
    what differs between ranks and one process is then the order of the sums alone. (Quantizing an
    activation is the same computation on every rank, 1 x 128 blocks that the shards' whole tiles
    align with; but a sum's order moves some values across an e4m3 rounding boundary, a whole step.)
    The load's self-check holds products to quantized activations, so it is left out here."""
    from teacher_server import fp8, fp8_experts

    def float32_blocks(x: torch.Tensor, block: int = fp8.BLOCK):
        return x.float(), torch.ones(x.shape[0], x.shape[1] // block, device=x.device)

    fp8.quantize_row_blocks = float32_blocks
    fp8.verify = fp8_experts.verify = lambda model, dtype, rows=96: 0


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


@pytest.mark.slow
def test_tp_ep_of_a_published_fp8_checkpoint_over_2_ranks_equals_one_process(tmp_path):
    """A published FP8 checkpoint (e4m3 attention linears and experts, 128 x 128 tile scales) over 2
    gloo ranks: each linear's tile scales split with its weight (q's 512 rows and k/v's 256: 2 and 1
    tiles a rank; o's 512 columns), each expert's with the expert, each rank reading only its experts
    and their scales from the checkpoint; every output kind equal to one process's,
    the activations in float32 (`_unquantized_activations`; with them quantized, the ranks' other
    order of sums moves a few values a whole e4m3 step, and this model's logits moved by 2.6% of the
    largest, measured once). With every rank given rank 0's tiles the logits are 0.167 off (of
    1.42), 7e-7 as it is."""
    from tests.test_fp8_experts import PUBLISHED, write_published

    path = tmp_path / "qwen3-moe-fp8"
    write_published(path, {**PUBLISHED, "head_dim": 128})
    # and its experts stored 3-D: each rank loads them whole, then keeps its own (ExpertShard of
    # transformers' FP8 experts, scales and all)
    whole = tmp_path / "qwen3-moe-fp8-3d"
    write_published(whole, {**PUBLISHED, "head_dim": 128}, experts_3d=True)
    _spawn(2, {"published FP8 qwen3_moe": (str(path), True), "published FP8 qwen3_moe, 3-D experts": (str(whole), False)},
           fp8_activations="float32")


# DeepSeek-V3 in 128-wide pieces, so that each rank's part of every split linear is whole 128 x 128
# tiles over 2 ranks: latent attention's q_b (2 heads x 256 rows) and kv_b (2 x 256), o (256 columns),
# the dense first layer's MLP (256), a shared expert pair (2 x 128), routed experts of 128.
DEEPSEEK_FP8 = dict(vocab_size=96, hidden_size=256, intermediate_size=256, moe_intermediate_size=128,
                    num_hidden_layers=2, first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2,
                    n_group=2, topk_group=1, n_shared_experts=2, q_lora_rank=128, kv_lora_rank=128,
                    qk_rope_head_dim=128, qk_nope_head_dim=128, v_head_dim=128, num_attention_heads=2,
                    num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)


@pytest.mark.slow
def test_tp_ep_of_a_published_fp8_deepseek_v3_over_2_ranks_equals_one_process(tmp_path):
    """A published FP8 deepseek_v3 (every decoder linear in e4m3 with tile scales: latent attention,
    the dense first layer's MLP, the shared experts, the routed experts one tensor each) over 2 gloo
    ranks, each reading its 4 routed experts: every output kind equal to one process's (activations
    in float32, as above)."""
    from tests.test_fp8_experts import write_published

    path = tmp_path / "deepseek-v3-fp8"
    stored = write_published(path, DEEPSEEK_FP8, "deepseek_v3")
    assert "model.layers.1.mlp.shared_experts.gate_proj.weight_scale_inv" in stored
    assert "model.layers.0.self_attn.kv_b_proj.weight_scale_inv" in stored
    _spawn(2, {"published FP8 deepseek_v3": (str(path), True)}, fp8_activations="float32")


def _fp8_linear(rows: int, columns: int) -> torch.nn.Linear:
    """A linear as transformers' FP8 loader builds it for a published checkpoint: an e4m3 weight and
    `weight_scale_inv`, one scale per 128 x 128 tile (distinct, so a wrong tile shows)."""
    linear = torch.nn.Linear(columns, rows, bias=False)
    weight = torch.randn(rows, columns, generator=torch.Generator().manual_seed(rows + columns))
    linear.weight = torch.nn.Parameter(weight.to(torch.float8_e4m3fn), requires_grad=False)
    linear.weight_scale_inv = torch.nn.Parameter(
        torch.arange(1.0, 1.0 + -(-rows // 128) * (columns // 128)).reshape(-(-rows // 128), columns // 128),
        requires_grad=False)
    return linear


def _shard_as(style, rank: int, size: int, module) -> None:
    style.group, style.rank, style.size = None, rank, size
    style.shard(module)


def test_a_published_fp8_linears_tile_scales_split_with_its_weight_in_whole_tiles():
    """parallel's column- and row-wise shards of an FP8 checkpoint's linear: each rank keeps the
    tile scales of its own rows (columns), whole tiles a rank; a split inside a tile is refused with
    the sizes that work, and so is an FP8 output head (gathered, padded)."""
    from teacher_server.parallel import ColwiseShard, RowwiseShard

    whole = _fp8_linear(512, 256)
    for rank in range(2):
        linear = _fp8_linear(512, 256)
        _shard_as(ColwiseShard(), rank, 2, linear)
        assert torch.equal(linear.weight.view(torch.uint8), whole.weight[rank * 256:(rank + 1) * 256].view(torch.uint8))
        assert torch.equal(linear.weight_scale_inv, whole.weight_scale_inv[rank * 2:(rank + 1) * 2])
    whole = _fp8_linear(256, 512)
    for rank in range(4):
        linear = _fp8_linear(256, 512)
        _shard_as(RowwiseShard(), rank, 4, linear)
        assert torch.equal(linear.weight.view(torch.uint8), whole.weight[:, rank * 128:(rank + 1) * 128].view(torch.uint8))
        assert torch.equal(linear.weight_scale_inv, whole.weight_scale_inv[:, rank:rank + 1])
    with pytest.raises(ValueError, match=r"splits its 256 rows into parts of whole blocks only; run 1 or 2 rank"):
        _shard_as(ColwiseShard(), 0, 4, _fp8_linear(256, 256))  # 64 rows a rank: half a tile
    with pytest.raises(ValueError, match=r"256 columns into parts of whole blocks only; run 1 or 2 rank"):
        _shard_as(RowwiseShard(), 1, 4, _fp8_linear(128, 256))
    with pytest.raises(ValueError, match="output head of this FP8 checkpoint is stored in FP8"):
        _shard_as(ColwiseShard(gather=True), 0, 2, _fp8_linear(256, 256))
    other_blocks = _fp8_linear(256, 256)
    other_blocks.weight_scale_inv = torch.nn.Parameter(torch.ones(4, 4), requires_grad=False)  # 64 x 64 tiles
    with pytest.raises(ValueError, match=r"weight scales of \(4, 4\), not one per 128 x 128 tile"):
        _shard_as(ColwiseShard(), 0, 2, other_blocks)


def test_experts_not_divisible_by_the_ranks_are_refused_before_loading():
    from transformers import AutoConfig

    from teacher_server.parallel import check_experts

    config = AutoConfig.for_model("qwen3_moe", **{**TINY["qwen3_moe"], "num_experts": 6})
    check_experts(config, 2)
    with pytest.raises(ValueError, match=r"needs the experts \(6\) divisible by 4: run 1 or 2 ranks"):
        check_experts(config, 4)  # the heads allow 1, 2 (4 query, 2 key/value heads); the experts 1, 2, 3
    check_experts(AutoConfig.for_model("llama"), 4)  # dense: no experts to divide
