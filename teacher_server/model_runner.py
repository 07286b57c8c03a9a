"""Loads the teacher model and runs one forward over a packed batch.

The runner knows nothing of sessions or the network: it takes token ids and a mask
and returns the tensors the engine asked for.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from distill_common.models import load_causal_lm
from distill_common.session_group import nccl_version
from distill_common.vocab import tokenizer_fingerprint
from distill_common.wire import dtype_name, parse_output_dtype

log = logging.getLogger(__name__)

@dataclass
class ModelInfo:
    model_name: str
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    dtype: torch.dtype
    device: torch.device
    tokenizer_fingerprint: str
    torch_version: str = torch.__version__
    nccl_version: str = ""


@dataclass
class ForwardOutputs:
    logits: torch.Tensor  # [N, S, V]
    hidden_states: tuple[torch.Tensor, ...] | None  # num_layers + 1 of [N, S, H], or None


class ModelRunner:
    def __init__(self, model_name: str, device: str, dtype: str = "", trust_remote_code: bool = False):
        self.device = torch.device(device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.model = self._load(model_name, dtype, trust_remote_code)
        self.model.eval().requires_grad_(False)
        config = self.model.config
        text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        self.info = ModelInfo(
            model_name=model_name,
            architecture=(config.architectures or [type(self.model).__name__])[0],
            vocab_size=int(self.model.get_output_embeddings().weight.shape[0]),
            hidden_size=int(text_config.hidden_size),
            num_layers=int(text_config.num_hidden_layers),
            dtype=next(self.model.parameters()).dtype,
            device=self.device,
            tokenizer_fingerprint=self._fingerprint(model_name),
            nccl_version=nccl_version() if self.device.type == "cuda" else "",
        )
        log.info("loaded %s (%s) on %s in %s: vocab %d, hidden %d, %d layers", model_name, self.info.architecture,
                 self.device, dtype_name(self.info.dtype), self.info.vocab_size, self.info.hidden_size,
                 self.info.num_layers)

    def _load(self, model_name: str, dtype: str, trust_remote_code: bool):
        try:
            return load_causal_lm(model_name, device=self.device, dtype=parse_output_dtype(dtype) if dtype else None,
                                  trust_remote_code=trust_remote_code)
        except ValueError as e:
            raise ValueError(f"--model: {e}") from e

    @staticmethod
    def _fingerprint(model_name: str) -> str:
        if not os.path.isdir(model_name):  # builtin:, random: and hub ids without a local copy
            return ""
        try:
            from transformers import AutoTokenizer

            return tokenizer_fingerprint(AutoTokenizer.from_pretrained(model_name))
        except Exception as e:  # a model directory without a tokenizer: no check possible
            log.warning("no tokenizer in %s (%s): students' vocabularies cannot be checked", model_name, e)
            return ""

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, hidden: bool) -> ForwardOutputs:
        out = self.model(input_ids=input_ids.to(self.device, non_blocking=True),
                         attention_mask=attention_mask.to(self.device, non_blocking=True),
                         output_hidden_states=hidden, use_cache=False, return_dict=True)
        return ForwardOutputs(logits=out.logits, hidden_states=out.hidden_states if hidden else None)
