"""EAGLE-3 draft training against a served teacher (or a store of its outputs), top to bottom.

One process per rank (torchrun for several: DDP, each rank its own teacher session), the KD
trainer's machinery throughout: the same JSONL data and packing (student_trainer/data.py), the
prefetcher that keeps the teacher `--prefetch` micro-batches ahead, checkpoints that resume
exactly (student_trainer/checkpoint.py), the loop and its metrics.jsonl (student_trainer/loop.py).
What differs is what is asked of the teacher and what is trained:

- the teacher sends, per batch, its logits over the draft vocabulary, its argmax over the whole
  vocabulary and three layers' hidden states side by side ([B, S, N], [B, S], [B, S, 3H]);
- the draft (model.py) is unrolled `--ttt-steps` times and scored per step (loss.py).
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import torch
import torch.distributed as dist

from distill_common.outputs import Argmax, AuxHiddenStates, Output, SubsetLogits
from distill_common.settings import ConfigError, non_defaults
from student_trainer.checkpoint import latest_checkpoint, save_checkpoint
from student_trainer.client import TeacherClient
from student_trainer.data import BatchIterator, PackedDataset
from student_trainer.eagle3.config import Eagle3Config
from student_trainer.eagle3.loss import Eagle3Training, StepResults, TeacherTargets
from student_trainer.eagle3.model import Eagle3Draft, aux_layers_of
from student_trainer.eagle3.precision import MasterWeights
from student_trainer.eagle3.target import target_config, target_embedding
from student_trainer.eagle3.vocab import draft_vocabulary
from student_trainer.loop import resume, run_loop
from student_trainer.rank import set_up_rank
from student_trainer.train import TeacherPrefetcher, lr_lambda, open_teacher

log = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def teacher_outputs(target_ids: torch.Tensor, aux_layers: tuple[int, ...]) -> tuple[Output, ...]:
    """What a draft reads of the teacher: its logits over the draft vocabulary, its greedy token
    (is it in the draft vocabulary?) and the three layers (empty: the teacher's default)."""
    return SubsetLogits(target_ids.tolist()), AuxHiddenStates(aux_layers), Argmax()


def draft_inputs(batch: dict, out, device: torch.device, dtype: torch.dtype | None):
    """The forward's arguments for one micro-batch and its teacher outputs."""
    aux = out.aux_hidden_states if dtype is None else out.aux_hidden_states.to(dtype)
    return (aux, batch["input_ids"].to(device), batch["attention_mask"].to(device), batch["loss_mask"].to(device),
            TeacherTargets(out.subset_logits, out.argmax))


def step_record(results: list[StepResults], grad_accum: int, decay: float) -> dict[str, float]:
    """Per-step losses (averaged over micro-batches) and accuracies (over every trained position)."""
    steps = len(results[0].losses)
    record = {"loss": sum(r.total(decay).item() for r in results) / grad_accum}
    correct = sum(r.correct for r in results).double()
    counted = sum(r.counted for r in results).double()
    if dist.is_initialized():
        dist.all_reduce(correct)
        dist.all_reduce(counted)
    for k in range(steps):
        record[f"loss_{k}"] = sum(r.losses[k].item() for r in results) / grad_accum
    for k in range(steps):
        record[f"acc_{k}"] = (correct[k] / counted[k]).item() if counted[k] > 0 else 0.0
    return record


def check_target(teacher: TeacherClient, embedding: torch.Tensor, spec: str) -> None:
    vocab, hidden = embedding.shape
    if (teacher.info.vocab_size, teacher.info.hidden_size) != (vocab, hidden):
        raise ConfigError(f"--target-model {spec} has a {vocab} x {hidden} embedding, the teacher serves "
                          f"{teacher.info.model_name} with vocabulary {teacher.info.vocab_size} and hidden size "
                          f"{teacher.info.hidden_size}: give the directory of the model the teacher serves")


def warn_if_not_servable(aux_layers: tuple[int, ...], num_layers: int) -> None:
    outside = [layer for layer in aux_layers if not 1 <= layer <= num_layers - 1]
    if outside:
        log.warning("aux layers %s include %s: vLLM and SGLang capture the inputs of layers 1 .. %d only (not the "
                    "embeddings, 0, nor the final norm's output, %d), so they would not serve this draft as trained",
                    aux_layers, outside, num_layers - 1, num_layers)


def train_eagle3(cfg: Eagle3Config) -> dict:
    rank, world_size, device, barrier, output_dir = set_up_rank(cfg.device, cfg.output_dir, cfg.seed)
    if rank == 0:
        log.info("eagle3 settings (non-default): %s", non_defaults(cfg) or "none")

    from transformers import AutoTokenizer

    checkpoint = latest_checkpoint(output_dir) if cfg.resume else None
    if cfg.resume and checkpoint is None:
        log.warning("--resume: no checkpoint in %s, starting from scratch", output_dir)
    tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer or cfg.target_model)
    dataset = PackedDataset(cfg.data, tokenizer, cfg.seq_len, mode=cfg.pack_mode, skip_bad_lines=cfg.skip_bad_lines)
    batches = BatchIterator(dataset, cfg.batch_size, seed=cfg.seed, rank=rank, world_size=world_size)
    total_steps = cfg.max_steps or cfg.epochs * max(1, batches.steps_per_epoch // cfg.grad_accum)

    embedding = target_embedding(cfg.target_model)
    if checkpoint is not None:
        draft = Eagle3Draft.from_pretrained(checkpoint / "model", device=device)
        target_ids, aux_layers = draft.target_ids.cpu(), aux_layers_of(draft.config)
        if cfg.aux_layers and tuple(cfg.aux_layers) != aux_layers:
            raise ConfigError(f"--aux-layers {cfg.aux_layers} differs from the checkpoint's {aux_layers}: resume "
                              "with the layers the draft was trained on")
    else:
        size = min(cfg.draft_vocab_size, embedding.shape[0])
        vocab = draft_vocabulary(dataset.input_ids, dataset.loss_mask, embedding.shape[0], size)
        if rank == 0:
            log.info("draft vocabulary: the %d most frequent of %d target tokens cover %.1f%% of the trained tokens "
                     "of %s", size, embedding.shape[0], 100 * vocab.coverage, cfg.data)
        target_ids, aux_layers = vocab.target_ids, tuple(cfg.aux_layers)

    teacher = open_teacher(cfg, device, teacher_outputs(target_ids, aux_layers), dtype=cfg.teacher_dtype or None,
                           tokenizer=tokenizer, vocab_size=embedding.shape[0], dataset=dataset,
                           job_id=cfg.job_id or output_dir.name, rank=rank)
    try:
        check_target(teacher, embedding, cfg.target_model)
        if checkpoint is None:
            aux_layers = next(kind.layers for kind in teacher.outputs if isinstance(kind, AuxHiddenStates))
            with torch.random.fork_rng():  # the draft's init depends on --seed only
                torch.manual_seed(cfg.seed)
                draft = Eagle3Draft.for_target(target_config(cfg.target_model), embedding, vocab.d2t, vocab.t2d,
                                               aux_layers, cfg.intermediate_size).to(device)
        del embedding  # the draft holds its copy
        if rank == 0:
            log.info("draft: %d trainable parameters, reading teacher layers %s, %d-token vocabulary, %d steps",
                     sum(p.numel() for p in draft.parameters() if p.requires_grad), aux_layers,
                     len(draft.d2t), cfg.ttt_steps)
        return _train(cfg, draft, teacher, tokenizer, batches, total_steps, checkpoint, device, rank, world_size,
                      barrier)
    finally:
        teacher.close(timeout_s=5)
        if world_size > 1 and dist.is_initialized():
            dist.destroy_process_group()


def train_step(cfg: Eagle3Config, trained: torch.nn.Module, params: list[torch.Tensor], optimizer, scheduler,
               next_micro_batch, device: torch.device, world_size: int = 1, master: MasterWeights | None = None) -> dict:
    """One optimizer step over `cfg.grad_accum` micro-batches, as `student-trainer eagle3` trains.

    `trained`: the `Eagle3Training` (DDP-wrapped across ranks); `next_micro_batch()` gives a
    batch, its teacher outputs and the seconds spent waiting for them (`TeacherPrefetcher.next`,
    or fixed outputs where a bench times the draft alone). Returns the step's record: per-step
    losses and accuracies, `grad_norm`, `teacher_wait_s` and the `tokens` trained on. `master`:
    the float32 master weights `optimizer` updates, when `params` are bfloat16.
    """
    autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if cfg.bf16 and master is None
                else contextlib.nullcontext())
    # Without autocast the teacher's states are read in the dtype of the draft's weights.
    aux_dtype = None if cfg.bf16 else params[0].dtype
    teacher_wait_s, tokens, results = 0.0, 0, []
    for micro in range(cfg.grad_accum):
        batch, out, wait_s = next_micro_batch()
        teacher_wait_s += wait_s
        tokens += batch["attention_mask"].sum().item()
        sync = micro == cfg.grad_accum - 1 or world_size == 1
        # DDP all-reduces gradients on the last micro-batch only.
        with contextlib.nullcontext() if sync else trained.no_sync():
            with autocast:
                result = trained(*draft_inputs(batch, out, device, aux_dtype))
            (result.total(cfg.step_decay) / cfg.grad_accum).backward()
        results.append(result)
        del out
    if master is not None:
        master.grads_to_master()
    stepped = params if master is None else master.master
    grad_norm = (torch.nn.utils.clip_grad_norm_(stepped, cfg.max_grad_norm).item()
                 if cfg.max_grad_norm > 0 else 0.0)
    optimizer.step()
    scheduler.step()
    if master is not None:
        master.master_to_params()
        master.zero_grad()
    else:
        optimizer.zero_grad(set_to_none=True)
    return {**step_record(results, cfg.grad_accum, cfg.step_decay), "grad_norm": grad_norm,
            "teacher_wait_s": teacher_wait_s, "tokens": tokens}


def _train(cfg: Eagle3Config, draft: Eagle3Draft, teacher, tokenizer, batches: BatchIterator, total_steps: int,
           checkpoint: Path | None, device: torch.device, rank: int, world_size: int, barrier) -> dict:
    output_dir = Path(cfg.output_dir)
    draft.train()
    params = [p for p in draft.parameters() if p.requires_grad]
    master = None
    if cfg.bf16 and device.type == "cuda":  # bf16 weights, float32 masters (precision.py)
        draft.to(torch.bfloat16)
        master = MasterWeights(params)
    optimizer = torch.optim.AdamW(params if master is None else master.master, lr=cfg.lr,
                                  weight_decay=cfg.weight_decay, fused=master is not None)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg, total_steps))
    step = 0
    if checkpoint is not None:
        state = resume(checkpoint, rank, optimizer, scheduler, batches)
        if master is not None:  # the float32 weights, not the bfloat16 ones the model directory holds
            with torch.no_grad():
                torch._foreach_copy_(master.master, [t.to(device) for t in state["master_weights"]])
            master.master_to_params()
        step = state["step"]

    compiled = cfg.compile == "on" or (cfg.compile == "auto" and device.type == "cuda")
    if compiled:
        draft.compile_layer()
        if rank == 0:
            log.info("draft layer and loss chunks through torch.compile (--compile off to run them eagerly); the "
                     "first steps include the compilation")
    trained = Eagle3Training(draft, cfg.ttt_steps, compile_loss=compiled)
    if world_size > 1:
        # The buffers (d2t, t2d) never change: nothing to broadcast each forward.
        trained = torch.nn.parallel.DistributedDataParallel(
            trained, device_ids=[device.index] if device.type == "cuda" else None, broadcast_buffers=False)
    # A batch may wait out a reconnect as well as its transfer (see student_trainer/train.py).
    outputs_timeout_s = cfg.teacher_timeout_s + cfg.teacher_reconnect_timeout_s
    prefetcher = TeacherPrefetcher(teacher, batches, cfg.prefetch, outputs_timeout_s)

    def checkpoint_now(step: int) -> Path:
        state = {"step": step, "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                 "data": prefetcher.data_state()}
        if master is not None:
            state["master_weights"] = master.master
        return save_checkpoint(output_dir, step, model=draft, tokenizer=tokenizer, trainer_state=state, rank=rank,
                               world_size=world_size, barrier=barrier)

    def export() -> None:
        directory = output_dir / "draft"
        draft.save_pretrained(directory, dtype=DTYPES[cfg.export_dtype])
        tokenizer.save_pretrained(directory)
        warn_if_not_servable(aux_layers_of(draft.config), teacher.info.num_layers)
        log.info("exported the draft to %s (%s)", directory, cfg.export_dtype)

    return run_loop(
        cfg, step=step, total_steps=total_steps, scheduler=scheduler, output_dir=output_dir, rank=rank,
        world_size=world_size, checkpoint=checkpoint_now, export=export, barrier=barrier, desc="eagle3",
        train_step=lambda: train_step(cfg, trained, params, optimizer, scheduler, prefetcher.next, device, world_size,
                                      master),
        postfix=lambda record: dict(loss=f"{record['loss']:.3f}", acc0=f"{record['acc_0']:.2f}",
                                    wait=f"{record['teacher_wait_s']:.2f}s"))
