"""The longest sequence a teacher accepts follows what its architecture can run.

`position_limit` judges an architecture by its structure; the reference is the model itself:
a tiny model of each architecture, run on CPU one position below and one past what was found.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import transformers

from distill_common.models import position_limit
from teacher_server.launcher import child_env

DECLARED = 16  # positions each tiny config declares
SMALL = dict(vocab_size=64)


def _configs():
    t = transformers
    return {
        # Learned position tables: a position past the table has no row.
        "gpt2": t.GPT2Config(n_positions=DECLARED, n_embd=16, n_layer=1, n_head=2, **SMALL),
        "opt": t.OPTConfig(max_position_embeddings=DECLARED, hidden_size=16, num_hidden_layers=1,
                           num_attention_heads=2, ffn_dim=32, word_embed_proj_dim=16, **SMALL),
        "gpt_neo": t.GPTNeoConfig(max_position_embeddings=DECLARED, hidden_size=16, num_layers=1, num_heads=2,
                                  attention_types=[[["global"], 1]], **SMALL),
        # Rotary, but its sin/cos are precomputed for n_positions: a hard limit too.
        "gptj": t.GPTJConfig(n_positions=DECLARED, n_embd=16, n_layer=1, n_head=2, rotary_dim=4, **SMALL),
        # Rotary computed on the fly, ALiBi: max_position_embeddings is no bound.
        "llama": t.LlamaConfig(max_position_embeddings=DECLARED, hidden_size=16, num_hidden_layers=1,
                               num_attention_heads=2, intermediate_size=32, **SMALL),
        "gpt_neox": t.GPTNeoXConfig(max_position_embeddings=DECLARED, hidden_size=16, num_hidden_layers=1,
                                    num_attention_heads=2, intermediate_size=32, **SMALL),
        "bloom": t.BloomConfig(hidden_size=16, n_layer=1, n_head=2, **SMALL),
    }


def _runs(model, length: int) -> bool:
    try:
        with torch.no_grad():
            model(input_ids=torch.zeros(1, length, dtype=torch.long))
    except (IndexError, RuntimeError):
        return False
    return True


@pytest.mark.parametrize("name", list(_configs()))
def test_the_limit_found_is_where_the_model_stops_running(name):
    config = _configs()[name]
    limit = position_limit(config)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    if limit is None:
        assert _runs(model, 4 * DECLARED), f"{name}: no limit found, yet it cannot run {4 * DECLARED} positions"
    else:
        assert limit.positions == DECLARED and limit.table
        assert _runs(model, limit.positions) and not _runs(model, limit.positions + 1), name


def test_a_longer_max_seq_len_than_the_model_can_run_is_refused_at_start_up(tmp_path):
    model_dir = tmp_path / "gpt2"
    transformers.GPT2LMHeadModel(_configs()["gpt2"]).save_pretrained(model_dir)
    assert json.loads((model_dir / "config.json").read_text())["n_positions"] == DECLARED
    command = [sys.executable, "-m", "teacher_server", "--model", str(model_dir), "--max-seq-len", str(DECLARED + 1),
               "--host", "127.0.0.1", "--port", "0", "--http-port", "0"]
    try:  # refused before the weights load: no server starts
        done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env(),
                              timeout=120)
    except subprocess.TimeoutExpired as e:  # its output comes as bytes then
        raise AssertionError(f"the teacher started instead of refusing --max-seq-len:\n{e.output.decode()}") from None
    assert done.returncode == 2, done.stdout
    assert f"--max-seq-len {DECLARED + 1}" in done.stdout, done.stdout
    assert f"{DECLARED} (its position table transformer.wpe" in done.stdout, done.stdout
