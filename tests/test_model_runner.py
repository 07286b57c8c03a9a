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


def test_packed_sequences_are_still_found_outside_the_runners_forward():
    from transformers import masking_utils

    ModelRunner("builtin:tiny", "cpu", dtype="float32")  # installs the shortcut
    assert getattr(masking_utils.find_packed_sequence_indices, "one_sequence_per_row", False)
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
