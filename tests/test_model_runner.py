"""The model runner on its own: the engine's forward equals the model called the plain way,
and its shortcut past transformers' packed-sequence check stays inside its own forward."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from distill_common.models import load_causal_lm
from teacher_server.launcher import child_env
from teacher_server.model_runner import ModelRunner
from tests.helpers import ROOT


def test_forward_equals_the_model_with_and_without_padding():
    runner = ModelRunner("builtin:tiny", "cpu", dtype="float32")
    reference = load_causal_lm("builtin:tiny", device=torch.device("cpu"), dtype=torch.float32).eval()
    ids = torch.randint(0, runner.info.vocab_size, (3, 17), generator=torch.Generator().manual_seed(0))
    full = torch.ones_like(ids)
    padded = full.clone()
    padded[1, 9:] = 0
    for mask in (full, padded):
        got = runner.forward(ids, mask, hidden=True)
        with torch.inference_mode():
            want = reference(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        valid = mask.bool()
        assert (got.logits - want.logits)[valid].abs().max() <= 1e-5
        assert (got.hidden_states[-1] - want.hidden_states[-1])[valid].abs().max() <= 1e-5


def test_a_sequence_run_a_chunk_at_a_time_on_its_kv_cache_gives_the_whole_forwards_logits():
    from teacher_server.model_runner import Chunk, Prefix

    runner = ModelRunner("builtin:tiny", "cpu", dtype="float32")
    ids = torch.randint(0, runner.info.vocab_size, (1, 23), generator=torch.Generator().manual_seed(1))
    whole = runner.forward(ids, torch.ones_like(ids)).logits
    prefix, parts = Prefix(), []
    for begin in range(0, 23, 8):
        part = ids[:, begin:begin + 8]
        parts.append(runner.forward(part, torch.ones_like(part), chunk=Chunk(prefix, begin)).logits)
    assert prefix.length == 23
    assert (torch.cat(parts, dim=1) - whole).abs().max() <= 1e-5
    # A chunk whose predecessor did not run (it failed) is refused, not run on a cache without it.
    with pytest.raises(ValueError, match="a chunk before it failed"):
        runner.forward(ids[:, :4], torch.ones_like(ids[:, :4]), chunk=Chunk(Prefix(), 8))


def test_packed_sequences_are_still_found_outside_the_runners_forward():
    from transformers import masking_utils

    from teacher_server.transformers_overrides import ONE_SEQUENCE_PER_ROW

    ModelRunner("builtin:tiny", "cpu", dtype="float32")  # installs the shortcut
    assert getattr(masking_utils.find_packed_sequence_indices, "thread_override", None) is ONE_SEQUENCE_PER_ROW
    packed = torch.tensor([[0, 1, 2, 0, 1]])  # two sequences in one row
    assert masking_utils.find_packed_sequence_indices(packed).tolist() == [[0, 0, 0, 1, 1]]
    assert masking_utils.find_packed_sequence_indices(torch.arange(5)[None]) is None


def test_cuda_graphs_are_refused_on_cpu_and_under_tensor_parallelism():
    with pytest.raises(ValueError, match="--cuda-graphs needs a CUDA device"):
        ModelRunner("builtin:tiny", "cpu", cuda_graphs=2)
    # Under torchrun every rank refuses it before loading the model, so none is left waiting
    # for another (whichever says so first ends the launch).
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
              "-m", "teacher_server", "--port", "0", "--http-port", "0", "--cuda-graphs", "2"]
    done = subprocess.run(launch, capture_output=True, text=True, timeout=180, env=child_env(), cwd=ROOT)
    output = done.stdout + done.stderr
    assert done.returncode != 0
    assert "--cuda-graphs is for a teacher on one GPU" in output and "loaded builtin:tiny" not in output, output[-3000:]


def test_a_forward_without_logits_runs_the_decoder_alone():
    from distill_common.outputs import ForwardNeeds

    runner = ModelRunner("builtin:tiny", "cpu", dtype="float32")
    ids = torch.randint(0, runner.info.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    head_calls = []
    runner.model.get_output_embeddings().register_forward_hook(lambda *args: head_calls.append(1))
    got = runner.forward(ids, mask, ForwardNeeds(final_hidden=True, attention_layers=frozenset({1})))
    assert got.logits is None and head_calls == [] and sorted(got.attention) == [1]
    with_logits = runner.forward(ids, mask, ForwardNeeds(logits=True, final_hidden=True))
    assert head_calls == [1]
    valid = mask.bool()
    assert (got.final_hidden - with_logits.final_hidden)[valid].abs().max() <= 1e-6
    head = runner.join_data.head
    assert (head.logits(got.final_hidden) - with_logits.logits)[valid].abs().max() <= 1e-5


def test_the_probe_reads_soft_caps_and_scales_and_refuses_what_it_cannot_reproduce(tmp_path):
    from transformers import CohereConfig, CohereForCausalLM, Gemma2Config, Gemma2ForCausalLM

    shape = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2)
    torch.manual_seed(0)
    Gemma2ForCausalLM(Gemma2Config(head_dim=8, final_logit_softcapping=2.0, **shape)).save_pretrained(tmp_path / "g")
    CohereForCausalLM(CohereConfig(logit_scale=0.25, **shape)).save_pretrained(tmp_path / "c")
    gemma = ModelRunner(str(tmp_path / "g"), "cpu")
    # Gemma 2 runs eager attention (outside transformers' interface): captured all the same.
    assert gemma.model.config._attn_implementation == "eager"
    assert (gemma.info.head.final_logit_softcapping, gemma.info.head.unavailable) == (2.0, "")
    assert (gemma.info.attention.query_width, gemma.info.attention.key_width) == (32, 16)
    cohere = ModelRunner(str(tmp_path / "c"), "cpu")
    assert (cohere.info.head.logit_scale, cohere.info.head.unavailable) == (0.25, "")

    # Something after the head that the project does not know of: refused, with the reason.
    runner = ModelRunner("builtin:tiny", "cpu", dtype="float32")
    runner.model.get_output_embeddings().register_forward_hook(lambda module, args, out: out * 2)
    head, attention = runner._probe()
    assert "logits are not its output head (weight, bias, final_logit_softcapping 0, logit scale 1) applied to its " \
           "final hidden state" in head.unavailable, head
    assert attention.unavailable == "" and attention.query_width == 64


def test_compiled_layers_compile_once_for_all_layers_through_the_start_up_probe(tmp_path):
    """A teacher whose decoder layers are compiled (an FP8 teacher's) and that captures attention
    inputs (the start-up probe does, of every layer): the layers share their compilations. Traced
    into, the capture's lookup by module would compile each layer apart, and past dynamo's recompile
    limit (8) every layer would run uncompiled from then on, silently; here that limit is an error."""
    from tests.helpers import build_tiny_model

    model_dir = build_tiny_model(tmp_path / "m", layers=10)
    model = load_causal_lm(str(model_dir), device=torch.device("cpu"))
    ids = torch.randint(0, 384, (2, 16))
    with torch.inference_mode():
        want = model(input_ids=ids).logits
    for layer in model.model.layers:
        layer.compile(backend="eager", dynamic=True)  # dynamo's tracing and guards, no code generation
    torch._dynamo.reset()
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        runner = ModelRunner(str(model_dir), "cpu", model=model)  # the probe: attention of all 10 layers
        got = runner.forward(ids, torch.ones_like(ids)).logits
    torch._dynamo.reset()
    assert torch.allclose(got, want, atol=1e-5)


def test_a_model_directory_without_tokenizer_files_has_no_tokenizer(tmp_path):
    """transformers (5.25) builds a tokenizer with no vocabulary from config.json alone, which encodes
    every text to no tokens: a directory without tokenizer files has none (no vocabulary check, the
    FP8 calibration's bytes stand for ids), one with them has its own."""
    from transformers import AutoConfig, PreTrainedTokenizerFast

    from teacher_server.model_loading import load_tokenizer
    from tests.test_alignment import TEACHER_MERGES, byte_level_tokenizer

    # A Qwen config: transformers maps it to a tokenizer class it then builds empty.
    AutoConfig.for_model("qwen2", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2).save_pretrained(tmp_path)
    assert load_tokenizer(str(tmp_path)) is None
    PreTrainedTokenizerFast(tokenizer_object=byte_level_tokenizer(TEACHER_MERGES)).save_pretrained(tmp_path)
    assert load_tokenizer(str(tmp_path))("hello world", add_special_tokens=False)["input_ids"]
