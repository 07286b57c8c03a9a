"""Checkpoints that resume exactly: weights, optimizer, scheduler, data position, RNG.

Layout of OUTPUT_DIR/checkpoint-0000012/:
    model/                  save_pretrained of the student (the adapter with LoRA) + tokenizer
    trainer_state.pt        step, optimizer, scheduler, data position, hidden projections
    rng_rank{R}.pt          each rank's RNG states
    state_rank{R}.pt        what else differs by rank (on-policy: the batches it sampled ahead), if any
A checkpoint is written to a temporary folder and renamed, so a crash never leaves a
half-written one that --resume would pick. These files are our own, written locally;
they are loaded with weights_only=True all the same.
"""

from __future__ import annotations

import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch

CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


def rng_state() -> dict:
    name, keys, pos, has_gauss, cached = np.random.get_state()
    # Plain tensors and tuples only, so that torch.load(weights_only=True) reads it back.
    state = {"torch": torch.random.get_rng_state(), "python": random.getstate(),
             "numpy": (name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached)}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.random.set_rng_state(state["torch"])
    random.setstate(state["python"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    found = [(int(m.group(1)), p) for p in Path(output_dir).glob("checkpoint-*")
             if (m := CHECKPOINT.match(p.name)) and (p / "trainer_state.pt").exists()]
    return max(found)[1] if found else None


def save_checkpoint(output_dir: str | Path, step: int, *, model, tokenizer, trainer_state: dict, rank: int,
                    world_size: int, barrier, rank_state: dict | None = None) -> Path:
    """Rank 0 writes the model and trainer state; every rank writes its RNG state (and its `rank_state`)."""
    final = Path(output_dir) / f"checkpoint-{step:07d}"
    staging = Path(output_dir) / f".staging-checkpoint-{step:07d}"
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        model.save_pretrained(staging / "model")
        if tokenizer is not None:
            tokenizer.save_pretrained(staging / "model")
        torch.save(trainer_state, staging / "trainer_state.pt")
    barrier()
    torch.save(rng_state(), staging / f"rng_rank{rank}.pt")
    if rank_state is not None:
        torch.save(rank_state, staging / f"state_rank{rank}.pt")
    barrier()
    if rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        staging.rename(final)
    barrier()
    return final


def load_trainer_state(checkpoint: Path, rank: int) -> tuple[dict, dict]:
    trainer_state = torch.load(checkpoint / "trainer_state.pt", weights_only=True)
    rng = torch.load(checkpoint / f"rng_rank{rank}.pt", weights_only=True)
    return trainer_state, rng


def load_rank_state(checkpoint: Path, rank: int) -> dict:
    """This rank's `rank_state` of `save_checkpoint` ({} when none was saved)."""
    path = checkpoint / f"state_rank{rank}.pt"
    return torch.load(path, weights_only=True) if path.exists() else {}
