"""Random-weight models of real shapes for the benches, built where they run."""

from __future__ import annotations

import torch


def random_model(config, device: torch.device | str, dtype: torch.dtype, seed: int = 0):
    """`AutoModelForCausalLM.from_config(config)` in `dtype`, its weights made on `device` (an
    8B model never touches the host), frozen for inference."""
    from transformers import AutoModelForCausalLM

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval().requires_grad_(False)
