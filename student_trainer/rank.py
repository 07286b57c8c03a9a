"""This process's place in its job (torchrun's RANK, WORLD_SIZE, LOCAL_RANK), set up once at start.

Every entry point that runs as one rank of a job starts here: the trainer (student_trainer/train.py,
student_trainer/eagle3/train.py) and `student-trainer dump` (student_trainer/store/dump.py).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist


def set_up_rank(device: str, output_dir: str, seed: int):
    """This process's place in its job, as torchrun describes it (RANK, WORLD_SIZE, LOCAL_RANK;
    one process: rank 0 of 1): (rank, world size, device, barrier, output directory). Joins the
    job's process group when there are several ranks, makes the output directory, seeds torch.
    `device` empty: the local rank's GPU, or the CPU without one."""
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device(device or (f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    barrier = dist.barrier if world_size > 1 else (lambda: None)
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    return rank, world_size, device, barrier, output_dir
