"""Expert parallelism reads each rank's experts only (teacher_server/expert_loading.py): for the
per-expert layouts saved by transformers (Qwen3-MoE's, Mixtral's, DeepSeek-V3's), each rank's model equals transformers' own load of the whole
checkpoint in every parameter (its experts the rank's slice of the whole one's), and a rank's
memory grows by its experts, not all of them. Outputs over real gloo ranks: test_moe_parallel.py.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys

import pytest
import torch

from teacher_server import expert_loading
from tests.helpers import ROOT
from tests.test_moe import TINY

INIT_STD = 0.3


def _saved(root, model_type: str, **shape):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, initializer_range=INIT_STD, **{**TINY[model_type], **shape})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    directory = root / model_type
    model.save_pretrained(directory)
    return directory, config


def _rank_model(directory, config, rank: int, size: int):
    from distill_common.models import load_causal_lm
    from teacher_server.parallel import _declares_experts

    total = _declares_experts(config)
    expert_plan, why = expert_loading.plan(str(directory), config, rank, size, total, False)
    assert expert_plan is not None, why
    loading_info: dict = {}
    with expert_loading.local_experts(expert_plan) as key_mapping:
        model = load_causal_lm(str(directory), device=torch.device("cpu"), key_mapping=key_mapping,
                               loading_info=loading_info)
    assert expert_loading.loaded_as_planned(expert_plan, loading_info) == ""
    expert_loading.read_experts(model, expert_plan)
    return model, expert_plan


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral", "deepseek_v3"])
def test_each_rank_holds_its_slice_of_what_transformers_loads(tmp_path, model_type):
    from transformers import AutoModelForCausalLM

    directory, config = _saved(tmp_path, model_type)
    whole = dict(AutoModelForCausalLM.from_pretrained(directory).named_parameters())
    for experts, checked in _each_rank_against(whole, directory, config):
        assert experts > 0 and checked == 2 * experts  # gate_up_proj and down_proj


def _each_rank_against(whole: dict, directory, config, loading=contextlib.nullcontext):
    """Each rank's model at 2 and 4 ranks (loaded within `loading()`) against the whole load's
    parameters: the experts' its slice, every other parameter the same (dtype, shape, bytes), and
    each experts module's range. Yields (experts modules, expert parameters checked) per rank."""
    from teacher_server.moe import experts_modules

    for size in (2, 4):
        for rank in range(size):
            with loading():
                model, expert_plan = _rank_model(directory, config, rank, size)
            count = expert_plan.count
            experts = {name for name, module in model.named_modules() if module in experts_modules(model)}
            assert len(experts) == len(expert_plan.sources), (size, rank)
            checked = 0
            for name, param in model.named_parameters():
                reference = whole[name]
                if name.rpartition(".")[0] in experts:
                    reference = reference[rank * count:(rank + 1) * count]
                    checked += 1
                assert param.dtype == reference.dtype and param.shape == reference.shape, (size, rank, name)
                assert torch.equal(_bytes(param), _bytes(reference)), (size, rank, name)
            for name in experts:
                span = model.get_submodule(name).expert_range
                assert (span.first, span.count, span.total) == (rank * count, count, count * size)
            yield len(experts), checked


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def test_each_rank_holds_its_slice_of_a_published_fp8_checkpoint(tmp_path):
    """A published FP8 checkpoint (per-expert e4m3 weights, each with its 128 x 128 tile scales):
    each rank's FP8 experts (transformers' FP8Experts, loaded as stored) hold the bytes and scales
    of its slice of transformers' whole load, every other parameter the whole load's."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from teacher_server import fp8
    from tests.test_fp8_experts import PUBLISHED, write_published

    directory = tmp_path / "qwen3-moe-fp8"
    write_published(directory, PUBLISHED)
    config = AutoConfig.from_pretrained(directory)
    with fp8.loaded_as_stored():
        whole = dict(AutoModelForCausalLM.from_pretrained(directory).named_parameters())
    for experts, checked in _each_rank_against(whole, directory, config, fp8.loaded_as_stored):
        assert experts == 2 and checked == 4 * experts  # two e4m3 weights and their scales each


def test_layouts_it_cannot_read_a_rank_at_a_time_say_why(tmp_path):
    from safetensors.torch import load_file, save_file

    directory, config = _saved(tmp_path, "qwen3_moe")
    state = load_file(directory / "model.safetensors")
    # An unquantized checkpoint with one expert's block scales beside its weight.
    state["model.layers.0.mlp.experts.0.gate_proj.weight_scale_inv"] = torch.ones(1, 1)
    save_file(state, directory / "model.safetensors", metadata={"format": "pt"})
    expert_plan, why = expert_loading.plan(str(directory), config, 0, 2, 8, False)
    assert expert_plan is None and "stored quantized" in why
    assert expert_loading.plan(str(tmp_path / "absent"), config, 0, 2, 8, False)[1].startswith("the model is not")
    config.quantization_config = {"quant_method": "mxfp4"}  # gpt-oss's published experts: packed 4-bit blocks
    assert "other than FP8 in 128 x 128 blocks" in expert_loading.plan(str(directory), config, 0, 2, 8, False)[1]
    config.quantization_config = None
    assert "its own" in expert_loading.plan(str(directory), config, 0, 2, 8, True)[1]  # --trust-remote-code
    (directory / "model.safetensors").unlink()
    index = directory / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"lm_head.weight": "../elsewhere.safetensors"}}))
    expert_plan, why = expert_loading.plan(str(directory), config, 0, 2, 8, False)
    assert expert_plan is None and "not a safetensors file inside the directory" in why
    directory, config = _saved(tmp_path, "gpt_oss")  # 3-D experts, which transformers would read whole
    expert_plan, why = expert_loading.plan(str(directory), config, 0, 2, 4, False)
    assert expert_plan is None and "stored 3-D" in why


def test_the_weights_are_found_where_transformers_finds_them(tmp_path):
    """A stale index beside model.safetensors (a model saved sharded, then whole, into one
    directory: transformers reads the whole file), and shards in a folder of the directory."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    directory, config = _saved(tmp_path, "qwen3_moe")
    whole = dict(AutoModelForCausalLM.from_pretrained(directory).named_parameters())
    state = load_file(directory / "model.safetensors")
    stale = {key: torch.zeros_like(value) for key, value in state.items()}  # another model's weights
    save_file(stale, directory / "old-00001-of-00001.safetensors", metadata={"format": "pt"})
    (directory / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {key: "old-00001-of-00001.safetensors" for key in stale}}))
    model, expert_plan = _rank_model(directory, config, 1, 2)
    experts = model.get_submodule("model.layers.0.mlp.experts")
    assert torch.equal(experts.down_proj, whole["model.layers.0.mlp.experts.down_proj"][4:])
    # What transformers must have left unloaded: the experts, nothing else.
    planned = [f"model.layers.{i}.mlp.experts.{p}" for i in (0, 1) for p in ("gate_up_proj", "down_proj")]
    assert "unloaded" in expert_loading.loaded_as_planned(expert_plan, {"missing_keys": planned + ["lm_head.weight"]})
    assert "unread" in expert_loading.loaded_as_planned(expert_plan, {"missing_keys": planned,
                                                                      "unexpected_keys": ["model.norm.weight"]})

    # A hub cache's snapshot: each file a link to a blob outside the directory.
    (directory / "model.safetensors").unlink()
    (tmp_path / "blobs").mkdir()
    save_file(state, tmp_path / "blobs" / "3f9ab1c0", metadata={"format": "pt"})
    (directory / "model-00001-of-00001.safetensors").symlink_to(tmp_path / "blobs" / "3f9ab1c0")
    (directory / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {key: "model-00001-of-00001.safetensors" for key in state}}))
    model, expert_plan = _rank_model(directory, config, 1, 2)
    experts = model.get_submodule("model.layers.0.mlp.experts")
    assert torch.equal(experts.down_proj, whole["model.layers.0.mlp.experts.down_proj"][4:])

    (directory / "shards").mkdir()
    save_file(state, directory / "shards" / "all.safetensors", metadata={"format": "pt"})
    (directory / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {key: "shards/all.safetensors" for key in state}}))
    model, expert_plan = _rank_model(directory, config, 1, 2)
    experts = model.get_submodule("model.layers.0.mlp.experts")
    assert torch.equal(experts.down_proj, whole["model.layers.0.mlp.experts.down_proj"][4:])


_MEMORY = """
import os, sys, torch
from transformers import AutoConfig
from tests.test_expert_loading import _rank_model
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
directory, size = sys.argv[1], int(sys.argv[2])
config = AutoConfig.from_pretrained(directory)
before = rss()
if size:
    model = _rank_model(directory, config, 0, size)
else:
    from distill_common.models import load_causal_lm
    model = load_causal_lm(directory, device=torch.device("cpu"))
print(rss() - before)
"""


def test_a_rank_reads_a_quarter_of_the_experts_at_4_ranks(tmp_path):
    """What a load leaves resident, in a process of its own, qwen3_moe with 96 MiB of experts
    (float32): whole, against rank 0 of 4."""
    directory, _ = _saved(tmp_path, "qwen3_moe", hidden_size=256, moe_intermediate_size=512, num_experts=16,
                          num_hidden_layers=4)
    experts_bytes = 4 * 16 * 3 * 256 * 512 * 4

    def grown(size: int) -> int:
        done = subprocess.run([sys.executable, "-c", _MEMORY, str(directory), str(size)], cwd=ROOT, timeout=300,
                              capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-3000:]
        return int(done.stdout.split()[-1])

    whole, rank = grown(0), grown(4)
    print(f"resident after the load: whole {whole / 2**20:.0f} MiB, rank 0 of 4 {rank / 2**20:.0f} MiB "
          f"(experts {experts_bytes / 2**20:.0f} MiB)")
    assert whole > experts_bytes
    assert rank < whole - experts_bytes / 2
