"""The training loop both trainers share (the KD trainer's, student_trainer/train.py, and
EAGLE-3's, student_trainer/eagle3/train.py), top to bottom: resume, then step, record, log,
checkpoint until the run's last step or `--stop-after-steps`, then the final checkpoint and
export. Each trainer supplies its step, its checkpoint and its export.
"""

from __future__ import annotations

import gc
import json
import logging
import time
from pathlib import Path
from typing import Callable

from tqdm import tqdm

from student_trainer.checkpoint import load_trainer_state, set_rng_state

log = logging.getLogger(__name__)


class MetricsWriter:
    """metrics.jsonl in the output directory (and TensorBoard when it is installed)."""

    def __init__(self, output_dir: Path, enabled: bool):
        self.enabled = enabled
        self._file = open(output_dir / "metrics.jsonl", "a") if enabled else None
        self._tb = None
        if enabled:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(output_dir / "tensorboard"))
            except ImportError:
                pass

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self._tb.add_scalar(key, value, record["step"])

    def close(self) -> None:
        if self._file:
            self._file.close()
        if self._tb is not None:
            self._tb.close()


def resume(checkpoint: Path, rank: int, optimizer, scheduler, batches) -> dict:
    """Restores what every trainer checkpoints (optimizer, schedule, data position, the random
    state) from `checkpoint`; returns its trainer state, "step" and the trainer's own entries."""
    state, rng = load_trainer_state(checkpoint, rank)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    batches.load_state_dict(state["data"])
    set_rng_state(rng)
    log.info("resumed from %s at step %d", checkpoint, state["step"])
    return state


def run_loop(cfg, *, step: int, total_steps: int, train_step: Callable[[], dict], scheduler, output_dir: Path,
             rank: int, world_size: int, checkpoint: Callable[[int], Path], export: Callable[[], None], barrier,
             postfix: Callable[[dict], dict], desc: str, evaluate: Callable[[int, dict], None] | None = None) -> dict:
    """Trains from `step` to the run's end (`total_steps`, or `cfg.stop_after_steps` more).

    `train_step()` makes one optimizer step and returns its record (losses, "grad_norm",
    "teacher_wait_s", ...) with the "tokens" it trained on; `evaluate(step, record)` adds held-out
    scores to a step's record (not counted in its time); `checkpoint(step)` saves one (every
    `cfg.save_every` steps and at the end); `export()` writes the finished model (rank 0, on the
    run's last step); `postfix(record)` is what the progress bar shows. Returns the step reached
    and every step's record.
    """
    metrics = MetricsWriter(output_dir, enabled=rank == 0)
    # The model and libraries live for the whole run: keep the cyclic GC from walking
    # them (a pause of tens of ms) while the loop allocates.
    gc.collect()
    gc.freeze()
    stop_at = min(total_steps, step + cfg.stop_after_steps) if cfg.stop_after_steps else total_steps
    progress = tqdm(total=total_steps, initial=step, disable=rank != 0, desc=desc, dynamic_ncols=True)
    history = []
    try:
        while step < stop_at:
            start = time.perf_counter()
            outcome = train_step()
            step += 1
            elapsed = time.perf_counter() - start
            tokens = outcome.pop("tokens")
            record = {"step": step, **outcome, "lr": scheduler.get_last_lr()[0],
                      "tokens_per_s": tokens * world_size / elapsed, "step_s": elapsed}
            if evaluate is not None:
                evaluate(step, record)
            history.append(record)
            if step % cfg.log_every == 0 or step == stop_at:
                metrics.write(record)
            progress.set_postfix(**postfix(record))
            progress.update(1)
            if cfg.save_every and step % cfg.save_every == 0 and step < stop_at:
                checkpoint(step)
        checkpoint(step)
        if step == total_steps and rank == 0:
            export()
        barrier()
    finally:
        progress.close()
        metrics.close()
    return {"step": step, "history": history}
