"""The training-time test's loss: K unrolled steps, each scored against the teacher's distribution.

What the reference implementations compute (SpecForge `OnlineEagle3Model.forward`,
specforge/algorithms/eagle3/model.py; the EAGLE-3 reference, eagle/traineagle3/cnets.py):

- the target distribution of a step is the softmax of the teacher's logits over the draft
  vocabulary only (renormalised over those N ids), at the position the step predicts;
- a position counts (`position_mask`) where the data trains on the predicted token and the
  teacher's own choice (its argmax over the whole vocabulary) lies in the draft vocabulary;
- a step's loss is -sum_v p_v log q_v over the counted positions, divided by all B x S
  positions (`-torch.sum(position_mask * plogp, 2).mean()`);
- the training loss is sum_k 0.8^k loss_k (SpecForge's `ploss_decay`, EAGLE's
  `ploss_weight = [0.8 ** i ...]`);
- a step's accuracy is the share of trained positions where the draft's argmax, mapped to a
  target id, is the teacher's argmax (SpecForge's `_compute_metric_counts`).

Which position a step predicts: column t of step k predicts the token at t + 2 + k from the
teacher's logits at t + 1 + k, and counts when the data's loss mask marks that token
(student_trainer/data.py's convention: `loss_mask[t]` marks the token at t as a target).

The per-step loss is computed chunk by chunk of positions with its gradient in closed form,
(softmax(z) - p) * mask / (B * S), kept in the logits' dtype: no float32 [B, S, N] tensor of
the draft's or the teacher's lives past its chunk (SpecForge's `LogSoftmaxLoss` keeps the
gradient the same way, in a Triton kernel).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from student_trainer.eagle3.model import Eagle3Draft, shift_left

STEP_DECAY = 0.8
# Positions per chunk of the loss (float32 work: ~4 x 4 B x chunk x N).
LOSS_CHUNK_TOKENS = 2048


def step_weights(steps: int, decay: float = STEP_DECAY) -> list[float]:
    return [decay ** k for k in range(steps)]


@dataclass
class TeacherTargets:
    """What the teacher gives for one batch, at every position t."""

    subset_logits: torch.Tensor  # [B, S, N] over the draft vocabulary
    argmax: torch.Tensor  # [B, S] its greedy token over the whole vocabulary


@dataclass
class StepResults:
    losses: list[torch.Tensor]  # per step, differentiable
    correct: torch.Tensor  # [K] positions where the draft's argmax is the teacher's
    counted: torch.Tensor  # [K] positions trained on (the data's loss mask)

    def total(self, decay: float = STEP_DECAY) -> torch.Tensor:
        return sum(w * loss for w, loss in zip(step_weights(len(self.losses), decay), self.losses))


class Eagle3Training(nn.Module):
    """The draft and its unroll's losses as one module, so DDP wraps the whole forward."""

    def __init__(self, draft: Eagle3Draft, steps: int, chunk_tokens: int = LOSS_CHUNK_TOKENS,
                 compile_loss: bool = False):
        super().__init__()
        self.draft, self.steps, self.chunk_tokens = draft, steps, chunk_tokens
        self.compile_loss = compile_loss  # the chunk's elementwise work as one compiled function

    def forward(self, aux_hidden: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                loss_mask: torch.Tensor, targets: TeacherTargets) -> StepResults:
        batch, length = input_ids.shape
        trained = (loss_mask * attention_mask).bool()
        in_vocabulary = self.draft.t2d[targets.argmax.long()]
        losses, correct, counted = [], [], []
        for k, logits in enumerate(self.draft.unroll(aux_hidden, input_ids, attention_mask, self.steps)):
            counts = shift_left(trained, 2 + k)  # the predicted token, t + 2 + k, is a target
            teacher_ids = shift_left(targets.argmax.long(), 1 + k)
            position_mask = counts & shift_left(in_vocabulary, 1 + k)
            loss, predicted = soft_cross_entropy(logits, shift_left(targets.subset_logits, 1 + k), position_mask,
                                                 batch * length, self.chunk_tokens, self.compile_loss)
            losses.append(loss)
            with torch.no_grad():
                hit = (predicted + self.draft.d2t[predicted]) == teacher_ids
                correct.append((hit & counts).sum())
                counted.append(counts.sum())
        return StepResults(losses, torch.stack(correct), torch.stack(counted))


def soft_cross_entropy(logits: torch.Tensor, teacher_logits: torch.Tensor, mask: torch.Tensor, normalizer: int,
                       chunk_tokens: int = LOSS_CHUNK_TOKENS, compiled: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """sum over masked positions of -sum_v softmax(teacher)_v log_softmax(logits)_v, divided by
    `normalizer`; and the argmax of `logits` [B, S] (not differentiable). `compiled`: each
    chunk's work through torch.compile (a few fused kernels instead of about ten passes)."""
    return _SoftCrossEntropy.apply(logits, teacher_logits, mask, normalizer, chunk_tokens, compiled)


def _chunk_loss(z: torch.Tensor, teacher: torch.Tensor, w: torch.Tensor):
    """One chunk of rows: its share of the loss, its gradient (in z's dtype), its argmax."""
    log_q = torch.log_softmax(z.float(), dim=-1)
    p = torch.softmax(teacher.float(), dim=-1)
    return -(w * (p * log_q).sum(-1)).sum(), ((log_q.exp() - p) * w[:, None]).to(z.dtype), z.argmax(-1)


_compiled_chunk_loss = None


def _chunk_loss_compiled():
    global _compiled_chunk_loss
    if _compiled_chunk_loss is None:
        _compiled_chunk_loss = torch.compile(_chunk_loss, dynamic=False)
    return _compiled_chunk_loss


class _SoftCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, teacher_logits, mask, normalizer: int, chunk_tokens: int, compiled: bool):
        flat = logits.reshape(-1, logits.shape[-1])
        teacher = teacher_logits.reshape(-1, teacher_logits.shape[-1])
        weights = mask.reshape(-1).float() / normalizer
        grad = torch.empty_like(flat)
        predicted = torch.empty(flat.shape[0], dtype=torch.long, device=flat.device)
        total = torch.zeros((), dtype=torch.float32, device=flat.device)
        chunk_loss = _chunk_loss_compiled() if compiled else _chunk_loss
        for start in range(0, flat.shape[0], chunk_tokens):
            rows = slice(start, start + chunk_tokens)
            loss, grad[rows], predicted[rows] = chunk_loss(flat[rows], teacher[rows], weights[rows])
            total += loss
        ctx.save_for_backward(grad)
        ctx.shape = logits.shape
        ctx.mark_non_differentiable(predicted)
        return total, predicted.view(logits.shape[:-1])

    @staticmethod
    def backward(ctx, grad_total, grad_predicted):
        (grad,) = ctx.saved_tensors
        return (grad * grad_total.to(grad.dtype)).view(ctx.shape), None, None, None, None, None
