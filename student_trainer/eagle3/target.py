"""What the draft takes from the target's model directory: its config and its token embedding.

The embedding is read alone from the directory's safetensors (the index names its file), as
SpecForge's `_load_embedding_tensor` does: an 8B target's other 15 GB are never loaded. The
teacher's join answer is checked against it (vocabulary, width, tokenizer), so a directory
that is not the served model's is refused before training starts.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from distill_common.models import BUILTIN_PREFIX, RANDOM_PREFIX, load_causal_lm, model_config
from distill_common.settings import ConfigError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def target_config(spec: str):
    try:
        return model_config(spec)
    except ValueError as e:
        raise ConfigError(f"--target-model {spec}: {e}") from e


def target_embedding(spec: str) -> torch.Tensor:
    """The target's input embedding [V, H] (float, on the CPU)."""
    if spec.startswith((BUILTIN_PREFIX, RANDOM_PREFIX)):  # built from a seed: build it and take it
        return load_causal_lm(spec, device=torch.device("cpu")).get_input_embeddings().weight.detach().clone()
    from safetensors import safe_open

    directory = Path(spec)
    name = _embedding_name(spec)
    if (directory / INDEX_FILE).is_file():
        weight_map = json.loads((directory / INDEX_FILE).read_text()).get("weight_map", {})
        if name not in weight_map:
            raise ConfigError(f"--target-model {spec}: {INDEX_FILE} has no {name}")
        path = directory / weight_map[name]
    elif (directory / SINGLE_FILE).is_file():
        path = directory / SINGLE_FILE
    else:
        raise ConfigError(f"--target-model {spec}: no {SINGLE_FILE} or {INDEX_FILE} there; give the local directory "
                          "of the model the teacher serves, in safetensors")
    with safe_open(str(path), framework="pt") as weights:
        if name not in weights.keys():
            raise ConfigError(f"--target-model {spec}: {path.name} has no {name}")
        return weights.get_tensor(name)


def _embedding_name(spec: str) -> str:
    """The input embedding's name in the checkpoint, from the architecture built without memory."""
    from transformers import AutoModelForCausalLM

    config = target_config(spec)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    embedding = model.get_input_embeddings().weight
    return next(name for name, parameter in model.named_parameters() if parameter is embedding)
