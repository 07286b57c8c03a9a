"""Where a model comes from: a Hugging Face directory or hub id, a built-in random
model, or random weights in the shape of a real model's config.

    builtin:tiny          a small random Llama built from a config (demos, tests)
    builtin:wide          a Llama-3-sized vocabulary on a one-layer body (data-plane benches)
    random:DIR_OR_HUB_ID  that model's config with random weights, built on the target
                          device (benchmarks of real shapes without their weights)
    anything else         AutoModelForCausalLM.from_pretrained
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BUILTIN_PREFIX = "builtin:"
RANDOM_PREFIX = "random:"

BUILTIN_SHAPES = {
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2),
    # Outputs as large as a real teacher's for almost no compute.
    "wide": dict(vocab_size=128256, hidden_size=256, intermediate_size=512, num_hidden_layers=1,
                 num_attention_heads=4, num_key_value_heads=4),
}


def _seeded_init(build, seed: int = 0):
    """Builds with a fixed seed, leaving the caller's RNG as it was: every process that
    builds the same random model gets the same weights."""
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        return build()


def builtin_config(name: str):
    from transformers import LlamaConfig

    if name not in BUILTIN_SHAPES:
        raise ValueError(f"builtin:{name} is unknown; builtin models: "
                         f"{', '.join(BUILTIN_PREFIX + k for k in BUILTIN_SHAPES)}")
    return LlamaConfig(max_position_embeddings=8192, **BUILTIN_SHAPES[name])


def builtin_model(name: str, dtype: torch.dtype = torch.float32, seed: int = 0):
    from transformers import LlamaForCausalLM

    config = builtin_config(name)
    return _seeded_init(lambda: LlamaForCausalLM(config), seed).to(dtype)


def model_config(spec: str, trust_remote_code: bool = False):
    """The config of the model named by `spec`, without its weights."""
    from transformers import AutoConfig

    if spec.startswith(BUILTIN_PREFIX):
        return builtin_config(spec[len(BUILTIN_PREFIX):])
    name = spec[len(RANDOM_PREFIX):] if spec.startswith(RANDOM_PREFIX) else spec
    try:
        return AutoConfig.from_pretrained(name, trust_remote_code=trust_remote_code)
    except OSError as e:
        raise ValueError(f"model {spec!r}: no config could be read ({e})") from e


def load_causal_lm(spec: str, *, device: torch.device, dtype: torch.dtype | None = None,
                   trust_remote_code: bool = False, random_seed: int = 0, key_mapping: dict[str, str] | None = None,
                   loading_info: dict | None = None):
    """The model named by `spec` on `device` (dtype None: the model's own, float32 for random ones).
    `random_seed` draws a `random:` or `builtin:` model's weights: the same seed, the same weights
    in every process (a teacher's ranks, a student's DDP ranks); the trainer passes its `--seed`,
    the teacher 0. `key_mapping` renames a saved model's checkpoint keys (transformers' argument);
    `loading_info`, a dict, receives transformers' report of the keys it did not load."""
    from transformers import AutoModelForCausalLM

    if spec.startswith(BUILTIN_PREFIX):
        # Built on the CPU and moved: the same weights on every device (a CUDA generator would
        # draw others), so a built-in teacher on a GPU matches the same model built anywhere.
        return builtin_model(spec[len(BUILTIN_PREFIX):], dtype or torch.float32, random_seed).to(device)
    if spec.startswith(RANDOM_PREFIX):
        config = model_config(spec, trust_remote_code)
        # Built directly on the device, in the target dtype: an 8B model never touches host memory.
        with torch.device(device):
            previous = torch.get_default_dtype()
            torch.set_default_dtype(dtype or torch.float32)
            try:
                return _seeded_init(lambda: AutoModelForCausalLM.from_config(config,
                                                                             trust_remote_code=trust_remote_code),
                                    random_seed)
            finally:
                torch.set_default_dtype(previous)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            spec, dtype=dtype or "auto", trust_remote_code=trust_remote_code,
            device_map=str(device) if device.type == "cuda" else None,
            **({"key_mapping": key_mapping} if key_mapping else {}),
            **({"output_loading_info": True} if loading_info is not None else {}))
        if loading_info is not None:
            model, info = model
            loading_info.update(info)
    except OSError as e:
        raise ValueError(f"model {spec!r} could not be loaded: {e}. Give a local model directory, a hub id this "
                         f"machine can download, or {BUILTIN_PREFIX}NAME / {RANDOM_PREFIX}CONFIG_DIR") from e
    return model.to(device)


# Config attributes that declare how many positions an architecture was built for.
_DECLARED_POSITIONS = ("n_positions", "max_position_embeddings", "n_ctx")
# A learned table may hold a few rows more than it serves: OPT and BioGPT offset positions by 2.
_TABLE_OFFSET_MAX = 2


@dataclass(frozen=True)
class PositionLimit:
    """The longest sequence an architecture can run at all, and what sets it."""

    positions: int
    table: str  # the module or buffer that has one row per position

    def __str__(self) -> str:
        return f"{self.positions} (its position table {self.table} has no row for a later position)"


def position_limit(config, trust_remote_code: bool = False) -> PositionLimit | None:
    """The hard limit on sequence length of the architecture `config` describes, or None.

    Per architecture, by the model's structure rather than a list of names (so models loaded
    with trust_remote_code are judged the same way): an architecture that looks positions
    up in a table built for the positions its config declares (`n_positions`,
    `max_position_embeddings`, `n_ctx`) cannot run a longer sequence. Its forward then fails
    (IndexError on CPU; on CUDA a device-side assert, which leaves the CUDA context unusable
    for every later forward, so the teacher must refuse such a batch before it runs). Such
    tables are learned position embeddings (GPT-2's `wpe`, OPT's and BioGPT's, offset by 2
    rows) and precomputed ones kept as buffers (GPT-J's and CodeGen's rotary sin/cos of
    `n_positions` rows, CTRL's sinusoids).

    Rotary positions computed on the fly (Llama, Qwen, Mistral, Gemma, GPT-NeoX, Phi) and
    ALiBi (BLOOM) have no such table: their `max_position_embeddings` is the length they
    were trained on, not a bound. A longer sequence runs, if less well, and the operator
    may allow it; there is no limit to enforce. One architecture is judged too strictly:
    XGLM keeps its sinusoids in a buffer of the declared length but rebuilds it longer when
    needed; its declared length is taken as its limit.

    The structure is read from the model built on the meta device: no weights, no memory,
    a few seconds for a 70B-shaped model. A model that cannot be built there is taken to
    have no limit (logged).
    """
    import logging

    from transformers import AutoModelForCausalLM

    declared = {int(value) for name in _DECLARED_POSITIONS
                if isinstance(value := getattr(config, name, None), int) and value > 0}
    if not declared:
        return None
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    except Exception as e:
        logging.getLogger(__name__).warning(
            "could not build %s on the meta device to look for a position table (%s): no sequence length "
            "limit is known for it", type(config).__name__, e)
        return None
    tokens = {id(model.get_input_embeddings()), id(model.get_output_embeddings())}
    tables = [(name, module.num_embeddings) for name, module in model.named_modules()
              if isinstance(module, torch.nn.Embedding) and id(module) not in tokens]
    tables += [(name, buffer.shape[0]) for name, buffer in model.named_buffers() if buffer.dim() >= 1]
    limits = [PositionLimit(positions, name) for name, rows in tables for positions in sorted(declared)
              if positions <= rows <= positions + _TABLE_OFFSET_MAX]
    return min(limits, key=lambda limit: limit.positions, default=None)
