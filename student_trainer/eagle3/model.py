"""The EAGLE-3 draft: what it computes, and the directory vLLM and SGLang load it from.

    fc            [3 x target hidden] -> hidden: the three auxiliary layers of the target, projected
    midlayer      one Llama decoder layer whose attention reads [input_layernorm(embedding of the
                  next token), hidden_norm(hidden)] (2 x hidden wide); the residual is the
                  un-normed hidden
    norm          the final RMSNorm, applied before the head (the hidden carried to the next step
                  is the layer's output before it)
    lm_head       hidden -> the draft vocabulary (N ids); draft id i is target id i + d2t[i]
    embed_tokens  the target's token embedding, frozen

This is SpecForge's `LlamaForCausalLMEagle3` (specforge/modeling/draft/llama3_eagle.py), vLLM's
`Eagle3LlamaForCausalLM` (vllm/model_executor/models/llama_eagle3.py) and SGLang's
`LlamaForCausalLMEagle3` (python/sglang/srt/models/llama_eagle3.py), with their weight names:
`fc.weight`, `midlayer.{self_attn.{q,k,v,o}_proj, mlp.{gate,up,down}_proj, input_layernorm,
hidden_norm, post_attention_layernorm}.weight`, `norm.weight`, `lm_head.weight`,
`embed_tokens.weight`, and the buffers `d2t` (int64 [N]) and `t2d` (bool [V]), exported only when
N is smaller than the target's vocabulary (`Eagle3Draft._identity_maps`).
`save_pretrained` writes config.json and model.safetensors in that layout; docs/eagle3.md says
which config keys each loader reads.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

from distill_common.outputs import AUX_LAYERS
from student_trainer.eagle3.attention import CAUSAL_KERNELS, CHUNK_SCORES, merged_ttt_attention, ttt_attention

log = logging.getLogger(__name__)

ARCHITECTURE = "LlamaForCausalLMEagle3"  # the name vLLM's and SGLang's model registries map to their EAGLE-3 drafts
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"


class DraftFormatError(ValueError):
    """A draft directory is not one this module wrote (or a loader would read); the message says what differs."""


def draft_config(target_config, *, draft_vocab_size: int, aux_layers: tuple[int, ...], intermediate_size: int = 0):
    """The draft's LlamaConfig for a target: its width, heads, RoPE and vocabulary, one layer.

    `aux_layers` (HF output_hidden_states indices) are recorded for the serving engines in their
    own conventions: vLLM reads the top-level `eagle_aux_hidden_state_layer_ids`, the index of the
    layer whose *input* it captures, which is the HF index; SGLang reads
    `eagle_config.eagle_aux_hidden_state_layer_ids` and captures the input of layer id + 1, so it
    gets the HF index minus one.
    """
    from transformers import LlamaConfig

    text = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    hidden = int(text.hidden_size)
    heads = int(text.num_attention_heads)
    config = LlamaConfig(
        vocab_size=int(text.vocab_size), hidden_size=hidden,
        intermediate_size=int(intermediate_size or text.intermediate_size), num_hidden_layers=1,
        num_attention_heads=heads, num_key_value_heads=int(getattr(text, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(text, "head_dim", None) or hidden // heads), hidden_act="silu",
        rms_norm_eps=float(getattr(text, "rms_norm_eps", 1e-6)),
        max_position_embeddings=int(getattr(text, "max_position_embeddings", 4096)), tie_word_embeddings=False,
        **_rope_settings(text))
    config.architectures = [ARCHITECTURE]
    config.draft_vocab_size = int(draft_vocab_size)
    config.target_hidden_size = hidden
    config.norm_before_residual = False  # vLLM's switch for the other residual order; SpecForge's order is this
    config.eagle_aux_hidden_state_layer_ids = list(aux_layers)
    config.eagle_config = {"eagle_aux_hidden_state_layer_ids": [layer - 1 for layer in aux_layers],
                           "use_aux_hidden_state": True}
    return config


def _rope_settings(text_config) -> dict:
    """The target's RoPE, so the draft's positions rotate as the target's do (Llama 3's scaling too)."""
    parameters = getattr(text_config, "rope_parameters", None)
    if parameters:  # transformers 5
        return {"rope_parameters": dict(parameters)}
    return {"rope_theta": getattr(text_config, "rope_theta", 10000.0),
            "rope_scaling": getattr(text_config, "rope_scaling", None)}


def aux_layers_of(config) -> tuple[int, ...]:
    return tuple(int(layer) for layer in config.eagle_aux_hidden_state_layer_ids)


class DraftAttention(nn.Module):
    """Llama attention over the 2 x hidden wide input, with the TTT key/value steps (attention.py)."""

    def __init__(self, config):
        super().__init__()
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        width = 2 * config.hidden_size
        self.q_proj = nn.Linear(width, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(width, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(width, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, steps: "KeyValueSteps",
                chunk_scores: int) -> torch.Tensor:
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        batch, length, _ = x.shape
        q = self.q_proj(x).view(batch, length, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        groups = self.heads // self.kv_heads
        if steps.k0 is None and steps.kernel in ("flash", "cudnn") and q.dtype not in (torch.float16, torch.bfloat16):
            steps.kernel = None  # the CUDA kernels take half precision only: float32 training reads the reference
        if steps.kernel is None:
            steps.append(k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1))
            out = ttt_attention(q, steps.k0, steps.v0, steps.kd, steps.vd, steps.key_valid, steps.q_offset,
                                chunk_scores)
        else:  # step 0's keys repeated once for the causal kernel; the later steps' stay grouped
            first = steps.k0 is None
            steps.append(k.repeat_interleave(groups, dim=1) if first else k,
                         v.repeat_interleave(groups, dim=1) if first else v)
            out = merged_ttt_attention(q, steps.k0, steps.v0, steps.kd, steps.vd, steps.kernel)
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, self.heads * self.head_dim))


@dataclass
class KeyValueSteps:
    """The keys and values of one unroll: step 0's for every column, then each later step's for
    the query columns only (q_offset onwards)."""

    key_valid: torch.Tensor | None  # [B, S] the step-0 columns that are not padding
    q_offset: int = 0
    kernel: str | None = None  # merged_ttt_attention's causal kernel; None: ttt_attention (query chunks)
    k0: torch.Tensor | None = None
    v0: torch.Tensor | None = None

    def __post_init__(self):
        self.kd: list[torch.Tensor] = []
        self.vd: list[torch.Tensor] = []

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        if self.k0 is None:
            self.k0, self.v0 = k, v
        else:
            self.kd.append(k[:, :, -self.columns:] if k.shape[2] != self.columns else k)
            self.vd.append(v[:, :, -self.columns:] if v.shape[2] != self.columns else v)

    @property
    def columns(self) -> int:
        return self.k0.shape[2] - self.q_offset


class DraftLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

        self.self_attn = DraftAttention(config)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.hidden_norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    # The two halves around the attention, or their torch.compile'd versions (Eagle3Draft.compile_layer).
    compiled: tuple | None = None

    def attention_input(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)

    def mlp_block(self, residual: torch.Tensor, attention_out: torch.Tensor) -> torch.Tensor:
        hidden = residual + attention_out
        return hidden + self.mlp(self.post_attention_layernorm(hidden))

    def forward(self, embeds, hidden, cos, sin, steps: KeyValueSteps, chunk_scores: int) -> torch.Tensor:
        attention_input, mlp_block = self.compiled or (self.attention_input, self.mlp_block)
        x = attention_input(embeds, hidden)
        return mlp_block(hidden, self.self_attn(x, cos, sin, steps, chunk_scores))


class Eagle3Draft(nn.Module):
    """The draft (module docstring). `unroll` runs the training-time test, `propose` a chain of
    proposals at inference."""

    def __init__(self, config):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding

        self.config = config
        hidden = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, hidden)
        self.embed_tokens.requires_grad_(False)  # the target's, frozen
        self.fc = nn.Linear(AUX_LAYERS * config.target_hidden_size, hidden, bias=False)
        self.midlayer = DraftLayer(config)
        self.norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        # Not a submodule: `.to(bfloat16)` would round its inverse frequencies (a float32 buffer),
        # and the positions would rotate differently from the target's and the serving engines'.
        object.__setattr__(self, "rotary", LlamaRotaryEmbedding(config))
        self.chunk_scores = CHUNK_SCORES
        # The unroll's attention: "auto" is merged_ttt_attention over PyTorch's flash kernel on CUDA
        # and the chunked ttt_attention elsewhere; "reference" the chunked one everywhere; or a
        # causal kernel name (attention.CAUSAL_KERNELS).
        self.attention = "auto"
        std = getattr(config, "initializer_range", 0.02)
        for module in (self.fc, self.lm_head, *self.midlayer.modules()):
            if isinstance(module, nn.Linear):  # as transformers' _init_weights: N(0, initializer_range)
                nn.init.normal_(module.weight, std=std)

    @classmethod
    def for_target(cls, target_config, embedding: torch.Tensor, d2t: torch.Tensor, t2d: torch.Tensor,
                   aux_layers: tuple[int, ...], intermediate_size: int = 0) -> "Eagle3Draft":
        """A new draft for a target: its frozen embedding [V, H] and vocabulary maps."""
        config = draft_config(target_config, draft_vocab_size=len(d2t), aux_layers=aux_layers,
                              intermediate_size=intermediate_size)
        if tuple(embedding.shape) != (config.vocab_size, config.hidden_size):
            raise DraftFormatError(f"the target's embedding has shape {list(embedding.shape)}, its config says "
                                   f"[{config.vocab_size}, {config.hidden_size}]")
        draft = cls(config)
        with torch.no_grad():
            draft.embed_tokens.weight.copy_(embedding)
            draft.d2t.copy_(d2t)
            draft.t2d.copy_(t2d)
        return draft

    @property
    def target_ids(self) -> torch.Tensor:
        """The target id of each draft id: the subset of the teacher's logits the draft is trained on."""
        return torch.arange(len(self.d2t), device=self.d2t.device) + self.d2t

    # ---- the forward -----------------------------------------------------------------------

    def _step(self, tokens, hidden, positions, steps: KeyValueSteps):
        embeds = self.embed_tokens(tokens).to(hidden.dtype)
        cos, sin = self.rotary(hidden, positions)
        return self.midlayer(embeds, hidden, cos, sin, steps, self.chunk_scores)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return (self.compiled_logits or self._logits)(hidden)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))

    compiled_logits = None

    def compile_layer(self) -> None:
        """torch.compile the elementwise work around the layer's matrix products and attention
        (the norms, the concatenation, the residuals, SiLU x up): fused kernels instead of the
        eager ones, each a pass over [B, S, hidden]. Shapes recompile once, then run dynamic."""
        layer = self.midlayer
        object.__setattr__(layer, "compiled", (torch.compile(layer.attention_input), torch.compile(layer.mlp_block)))
        object.__setattr__(self, "compiled_logits", torch.compile(self._logits))

    def unroll(self, aux_hidden: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
               steps: int) -> Iterator[torch.Tensor]:
        """The training-time test: the logits [B, S, N] of each of `steps` steps, one at a time
        (a step's logits can be freed before the next is computed).

        Column t reads the target's hidden states at t and the token at t + 1 (the one the
        target chose from them); its step-k output predicts the token at t + 2 + k, reading
        the draft's own step-(k-1) output and the data's token at t + 1 + k, at position t + k.
        """
        batch, length = input_ids.shape
        columns = torch.arange(length, device=input_ids.device).expand(batch, length)
        kv = KeyValueSteps(attention_mask, kernel=self.unroll_kernel(input_ids.device))
        if kv.kernel is not None and attention_mask is not None:
            # The merged kernels mask by causality alone, which keeps real queries off padding keys only
            # when every row is padded at its right end: checked on the device, without a host sync.
            torch._assert_async((attention_mask[:, 1:] <= attention_mask[:, :-1]).all(),
                                "the EAGLE-3 draft's fused attention needs right-padded rows (ones, then zeros); "
                                "pad on the right or train with attention='reference'")
        hidden = self.fc(aux_hidden)
        for k in range(steps):
            hidden = self._step(shift_left(input_ids, 1 + k), hidden, columns + k, kv)
            yield self.logits(hidden)

    def unroll_kernel(self, device: torch.device) -> str | None:
        """The causal kernel the unroll's attention merges with its diagonal (None: the chunked reference)."""
        if self.attention == "auto":
            return "flash" if device.type == "cuda" else None
        if self.attention == "reference":
            return None
        if self.attention not in CAUSAL_KERNELS:
            raise ValueError(f"attention must be auto, reference or one of {CAUSAL_KERNELS}, not {self.attention!r}")
        return self.attention

    def propose(self, aux_hidden: torch.Tensor, input_ids: torch.Tensor, count: int) -> torch.Tensor:
        """A chain of `count` greedy proposals (target ids [B, count]) after `input_ids` [B, n]."""
        return self.propose_with_logits(aux_hidden, input_ids, count)[0]

    @torch.no_grad()
    def propose_with_logits(self, aux_hidden: torch.Tensor, input_ids: torch.Tensor,
                            count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`propose`, and the logits [B, count, N] each proposal was chosen from.

        `aux_hidden` [B, n - 1, 3H] holds the target's states for every token but the last (the
        target chose the last one from the states before it); step 0 runs over all n - 1
        columns, each later step over the last column only, attending to its own chain.
        """
        batch, length = input_ids.shape
        columns = torch.arange(length - 1, device=input_ids.device).expand(batch, length - 1)
        kv = KeyValueSteps(None)
        hidden = self._step(input_ids[:, 1:], self.fc(aux_hidden), columns, kv)[:, -1:]
        kv.q_offset = length - 2
        last = columns[:, -1:]
        proposals, logits = [], []
        for k in range(count):
            logits.append(self.logits(hidden))
            draft_ids = logits[-1].argmax(-1)
            proposals.append(draft_ids + self.d2t[draft_ids])
            if k + 1 < count:
                hidden = self._step(proposals[-1], hidden, last + k + 1, kv)
        return torch.cat(proposals, dim=1), torch.cat(logits, dim=1)

    # ---- the directory -----------------------------------------------------------------------

    def _identity_maps(self) -> tuple[str, ...]:
        """The maps the export leaves out: `d2t` and `t2d` when the draft vocabulary is the
        target's whole vocabulary (then draft id i is target id i). vLLM creates its
        `draft_id_to_target_id` only when the two sizes differ and refuses a weight it has no
        parameter for; SGLang then decodes over the whole vocabulary with no `hot_token_id`.
        `draft_vocab_size` in config.json says which case a directory is, either way."""
        if self.config.draft_vocab_size != self.config.vocab_size:
            return ()
        if self.d2t.device.type != "meta" and bool(self.d2t.any()):
            raise DraftFormatError("a draft vocabulary of the target's size must map draft id i to target id i "
                                   "(d2t all zero)")
        return ("d2t", "t2d")

    def save_pretrained(self, path: str | Path, dtype: torch.dtype | None = None) -> Path:
        """config.json and model.safetensors (module docstring), in `dtype` (None: as trained)."""
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        floats = dtype or self.fc.weight.dtype
        state = {name: (t.to(floats) if t.is_floating_point() else t).detach().cpu().contiguous()
                 for name, t in self.state_dict().items() if name not in self._identity_maps()}
        save_file(state, str(path / WEIGHTS_FILE), metadata={"format": "pt"})
        config = self.config.to_dict()
        config["torch_dtype"] = config["dtype"] = str(floats).removeprefix("torch.")
        config.update(_legacy_rope(config))
        (path / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        return path

    @classmethod
    def from_pretrained(cls, path: str | Path, *, device: str | torch.device = "cpu",
                        dtype: torch.dtype | None = None) -> "Eagle3Draft":
        """A draft saved by `save_pretrained` (weights in `dtype`, None: as saved)."""
        from safetensors.torch import load_file
        from transformers import LlamaConfig

        path = Path(path)
        try:
            raw = json.loads((path / CONFIG_FILE).read_text())
            state = load_file(str(path / WEIGHTS_FILE))
        except (OSError, ValueError) as e:
            raise DraftFormatError(f"{path} is not an EAGLE-3 draft directory ({CONFIG_FILE} and {WEIGHTS_FILE}): "
                                   f"{e}") from e
        if raw.get("architectures") != [ARCHITECTURE] or "draft_vocab_size" not in raw:
            raise DraftFormatError(f"{path}/{CONFIG_FILE} is not an EAGLE-3 draft's: architectures "
                                   f"{raw.get('architectures')}, draft_vocab_size {raw.get('draft_vocab_size')}")
        config = LlamaConfig.from_dict({k: v for k, v in raw.items() if k not in ("rope_theta", "rope_scaling")
                                        or "rope_parameters" not in raw})
        with torch.device("meta"):
            draft = cls(config)
        saved_dtype = next(t.dtype for t in state.values() if t.is_floating_point())
        state = {name: (t.to(dtype) if dtype is not None and t.is_floating_point() else t) for name, t in state.items()}
        if draft._identity_maps():  # written without them: the identity maps (`_identity_maps`)
            state.setdefault("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
            state.setdefault("t2d", torch.ones(config.vocab_size, dtype=torch.bool))
        missing = sorted(set(draft.state_dict()) - set(state))
        unexpected = sorted(set(state) - set(draft.state_dict()))
        if missing or unexpected:
            raise DraftFormatError(f"{path}/{WEIGHTS_FILE}: missing {missing}, unexpected {unexpected}")
        draft.load_state_dict(state, assign=True)
        object.__setattr__(draft, "rotary", type(draft.rotary)(config))  # it was built on the meta device
        draft.embed_tokens.requires_grad_(False)
        log.debug("loaded the draft in %s from %s", dtype or saved_dtype, path)
        return draft.to(device)


def shift_left(x: torch.Tensor, n: int) -> torch.Tensor:
    """x[:, n:] padded with zeros at the end to x's length (`padding(x, left=False)` applied n
    times in SpecForge)."""
    if n == 0:
        return x
    return torch.cat([x[:, n:], x.new_zeros((x.shape[0], min(n, x.shape[1]), *x.shape[2:]))], dim=1)


def _legacy_rope(config: dict) -> dict:
    """`rope_theta` and `rope_scaling` beside transformers 5's `rope_parameters`: serving engines
    on transformers 4 read these (SpecForge's export writes them for the same reason)."""
    parameters = config.get("rope_parameters") or {}
    legacy = {"rope_theta": parameters.get("rope_theta", config.get("rope_theta", 10000.0))}
    scaling = {k: v for k, v in parameters.items() if k not in ("rope_theta",)}
    if scaling.get("rope_type", "default") != "default":
        legacy["rope_scaling"] = scaling
    elif "rope_scaling" in config:
        legacy["rope_scaling"] = config["rope_scaling"]
    return legacy
