"""Distillation losses: the student's logits against the teacher's (full, top-k, or computed on the
student from the teacher's final hidden state and output head), hidden states, and attention relations.

Conventions shared by every loss here:

* ``p`` is the teacher's distribution, ``q`` the student's, both ``softmax(logits / T)``.
  ``forward_kl`` is KL(p || q) (mass-covering), ``reverse_kl`` is KL(q || p) (mode-seeking),
  ``jsd`` is the generalized Jensen-Shannon divergence of the GKD paper (Agarwal et al., 2024)
  and TRL's ``generalized_jsd_loss``::

      m = beta * p + (1 - beta) * q
      JSD(beta) = beta * KL(p || m) + (1 - beta) * KL(q || m)

  so ``beta`` weighs the *teacher*. It must lie strictly inside (0, 1): at either end JSD(beta)
  is identically 0 (m equals one of the two distributions and its term has weight 0). TRL
  maps beta=0 and beta=1 to forward and reverse KL, which are the limits of JSD(beta)/beta and
  JSD(beta)/(1-beta), not of JSD(beta) itself; rather than jump from ~0 to a full KL at the
  boundary we refuse the endpoints and say which ``kind`` to use instead.
* The result is the mean over the tokens the mask selects of the per-token divergence,
  times T² (Hinton et al., 2015: the gradient w.r.t. the logits scales as 1/T, so T² keeps
  the loss's gradient magnitude comparable across temperatures). The result is a float32
  scalar (float64 when an input is float64).
* ``mask`` is [B, S], bool or integer, nonzero = the token counts. A mask that selects no
  token gives a 0 that is still connected to the student's graph (its gradient is zeros), so
  a step on an all-padding micro-batch neither crashes nor produces NaN.
* A probability of exactly 0 (a logit of -inf, e.g. vocabulary padding masked on both sides)
  contributes 0 to the divergence and to the gradient (0 * log 0 = 0), not NaN.
* The teacher is a constant: no gradient ever flows into teacher tensors.

Memory. With a 150k vocabulary, float32 [tokens, vocab] tensors are ~0.6 MB per token, so the
logit losses never build them for the whole batch, in forward or backward. ``_ChunkedDivergence``
is an autograd Function (the Liger-kernel approach): its forward walks over the selected tokens
``chunk_tokens`` at a time, upcasts one chunk of student and teacher rows to float32, computes
the chunk's loss *and* its gradient w.r.t. the student logits in closed form, and writes that
gradient, in the student logits' dtype, into one preallocated buffer shaped like the student
logits. Backward only scales the buffer by the incoming gradient (and returns it as is when
that is 1). Peak extra memory is that one buffer, which autograd would hold as the student
logits' gradient anyway, plus at most five float32 [chunk_tokens, vocab] temporaries (JSD;
three for forward KL): 5 * 4 B * chunk_tokens * vocab, i.e. ~12 GB for the default 4096 tokens
at a 152k vocabulary, so pick chunk_tokens from the vocabulary size (1024 there: ~3 GB). We chose this
over per-chunk ``torch.utils.checkpoint`` because checkpointing re-runs each chunk's forward
during backward and keeps autograd's own saved tensors per chunk alive while it does so; the
closed-form gradients below are short and checked against autograd in tests/test_losses.py.
Tokens are selected by the mask before anything is upcast, so padding costs nothing.
The gradient is computed in forward whenever grad mode is on and the student logits require
grad; under ``torch.no_grad()`` (evaluation) only the loss is computed.

Top-k (``topk_kd_loss``). The teacher sends its k most likely ids and their log-probabilities
under its *full* softmax at the temperature (distill_common/outputs/logits.py: ``TopK``; the
temperature is applied there, once, so the loss divides only the student's logits by it). Its
tail mass, 1 - sum exp, is then known, and ``tail`` says what the loss does with it:

* ``"bucket"`` (default): k + 1 outcomes, the k ids and "the rest", on both sides; the student's
  rest is computed exactly, as the log-sum-exp of its logits off the k ids (in log space, where
  1 - sum would cancel). Merging outcomes never increases a divergence, so this is a lower bound
  of the full-logit loss that reaches it as k grows; it teaches the student how much mass to
  leave outside the teacher's candidates, and says nothing about how to spread it there.
* ``"none"``: both sides renormalised over the k ids, p_k = softmax(log p at the ids),
  q_k = softmax(student_logits[..., ids] / T): only the student's *relative* preferences among
  the teacher's candidates, nothing about its mass outside them (what the cross-entropy on the
  labels, usually mixed in, then has to do alone).

A model of how the teacher spreads its tail (DistillKit fits one) would say more than one bucket;
the simplest, the tail mass spread evenly over the other V - k ids with the divergence taken over
the whole vocabulary, did worse than the bucket on the demo (93.6% of full KD's gain at k = 64
against 99.0%, docs/training.md): it also pulls the student's own tail towards flat, which a real
tail is not. It is not kept.

The gradient through the rest bucket: with u = logsumexp of the student's scaled logits off the k
ids, the divergence is the full one on the k + 1 "bucket logits" (s at the ids, u), whose
gradient ``_divergence_and_grad`` gives, and d u / d s_i = exp(s_i - u) off the ids. Chunked as
the full loss, with two float32 [chunk_tokens, V] temporaries (the chunk and its gradient). The
teacher's tail is known to float32 resolution at best (worse when the values come in 16 bits:
a bfloat16 log-probability l carries an error of up to |l| 2^-8, so p = e^l one of p |l| 2^-8),
so it is floored at ``TAIL_FLOOR`` and the k + 1 masses renormalised.

The teacher's head on the student (``kd_loss_from_hidden``). The teacher sends its final hidden
state [B, S, H] and, once at join, its output head (distill_common/outputs/base.py: ``OutputHead``);
each chunk of ``chunk_tokens`` rows computes that chunk's teacher logits from the head, in the
head's dtype as the teacher does, then upcast, scaled and soft-capped, and meets the student's
chunk in the same closed-form divergence: no [B, S, V] teacher tensor exists, on either side. With
``topk`` > 0 each chunk keeps the teacher's k most likely ids and their log-probabilities, and
compares as ``topk_kd_loss`` does (``tail`` alike) with the k the teacher sends. One more
[chunk_tokens, V] temporary than the full-logit path (the product in the head's dtype, before its
upcast).

Attention relations (``attention_relation_loss``), after MiniLMv2 (Wang et al., 2021). For each
of a layer's queries, keys and values, the vectors of all heads side by side ([B, S, width]) are
split again into ``relation_heads`` heads of width / relation_heads; per head, the relation of
token i to token j is softmax_j(a_i . a_j / sqrt(d)) over the tokens j <= i that are not padding
(causal), and the loss is KL(teacher relation || student relation) averaged over relation heads
and real tokens, summed over the three (q-q, k-k, v-v). Teacher and student may have different
head counts and widths: only ``relation_heads`` must divide both widths. The [S, S] relation of a
head is never built at once: ``_BlockedRelationKL`` walks over ``block_rows`` query rows at a time
(columns up to the block's last row) and computes the gradient in closed form per block, so
memory is O(B * relation_heads * block_rows * S) whatever S, plus the float32 copies of the
[B, S, width] inputs and their gradient.

On the student's samples (``sampled_reverse_kl_loss``, on-policy distillation). With tokens x_t
sampled from the student q and the teacher's log-probability log p(x_t | x_<t) of each, the
per-token log ratio log q(x_t) - log p(x_t) has, summed over a sequence, the expectation
KL(q || p) of whole sequences: the value returned is that estimate per token. Its gradient is
E[(log q(x_t) - log p(x_t)) * grad log q(x_t)], the score-function estimator (the log ratio is a
constant, a per-token reward) whose expectation is the gradient of the token-level reverse KL
sum_t E_{x_<t ~ q}[KL(q(.|x_<t) || p(.|x_<t))] with the prefixes' distribution held fixed (GKD's
objective; what Thinking Machines' on-policy distillation uses, "discount 0"). It leaves out how a
token changes the later tokens' divergences: lower variance, not the full sequence gradient.
tests/test_onpolicy_losses.py checks both expectations by enumerating a small case. It needs the
teacher's log-probability of each sampled token only: 4 bytes a token.

On given ids (``scored_kd_loss``): the teacher's exact log-probabilities at k ids per position
(the student's own top k, say) and the rest as one bucket: the computation of ``topk_kd_loss``
with ``tail="bucket"``, on ids the student chose instead of the teacher. The divergence between
those two (k + 1)-outcome distributions is a lower bound of the full one (coarse-graining never
increases a divergence), and equals it when the k ids hold all the mass that differs; with
k = vocab there is no tail.

Several teachers' mixture (``mixture_kd_loss``). The divergence of the student from
m = sum_i w_i p_i (weights normalised to sum to 1; each p_i at its own temperature), chunked and
with its gradient in closed form like the others. Where every teacher's distribution is known
over the whole vocabulary (full logits, its head on the student) m is exact there. A teacher that
sent only its top k is known at its k ids and in one bucket, the rest; its probability at an id
another teacher sent is not known. So the mixture is taken over the finest partition on which
every teacher's mass is known: the ids *every* top-k teacher sent (their intersection; all ids for
full-vocabulary teachers) one by one, and one bucket for everything else, whose mixture mass is
1 - the rest (floored at ``TAIL_FLOOR``) and whose student mass is exact, as for one teacher's
top-k. No coarser choice is needed and no finer one is exact: an id in one teacher's top k and
not another's falls in that other teacher's tail, whose split is unknown. With one teacher this
is ``topk_kd_loss(tail="bucket")`` (or ``kd_loss``); with teachers scored at the same ids (the
student's own top k, on-policy) the ids are the same for all and the mixture is exact on them and
the rest. Like every bucketed divergence, it is a lower bound of the full one.

Hidden states (``hidden_state_loss``). Per-token MSE (mean over features) or 1 - cosine
similarity, averaged over masked tokens, in float32. A ``HiddenProjection`` maps the student's
hidden size to the teacher's when they differ.
"""

from __future__ import annotations

import functools
import math
import typing
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from distill_common.settings import ConfigError

LossKind = Literal["forward_kl", "reverse_kl", "jsd"]
HiddenLossKind = Literal["mse", "cosine"]
TopKTail = Literal["bucket", "none"]
LOSS_KINDS = typing.get_args(LossKind)
HIDDEN_LOSS_KINDS = typing.get_args(HiddenLossKind)
TOPK_TAILS = typing.get_args(TopKTail)

# The teacher's tail mass (1 - the sum of k probabilities in float32) is known to about this much.
TAIL_FLOOR = 1e-7


# --------------------------------------------------------------------------- logit losses


def kd_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    kind: str = "forward_kl",
    temperature: float = 1.0,
    jsd_beta: float = 0.5,
    chunk_tokens: int = 4096,
) -> torch.Tensor:
    """Divergence between the teacher's and the student's full next-token distributions.

    student_logits [B, S, V] (any float dtype), teacher_logits [B, S, V] (any float dtype,
    e.g. bf16 as received), mask [B, S] or None (all tokens count). Returns the mean over
    masked tokens of the per-token divergence, times temperature². See the module docstring
    for ``kind``, ``jsd_beta`` and how ``chunk_tokens`` bounds memory.
    """
    check_options(kind, temperature, jsd_beta, chunk_tokens)
    _check_logits("student_logits", student_logits)
    _check_logits("teacher_logits", teacher_logits)
    batch, seq, vocab = student_logits.shape
    if teacher_logits.shape[-1] != vocab:
        raise ValueError(
            f"student vocab {vocab} != teacher vocab {teacher_logits.shape[-1]}: logit distillation needs the same "
            "tokenizer on both sides (distil hidden states or use a teacher with the student's tokenizer)"
        )
    if teacher_logits.shape[:2] != (batch, seq):
        raise ValueError(
            f"teacher_logits {tuple(teacher_logits.shape)} and student_logits {tuple(student_logits.shape)} differ in "
            "[batch, seq]: the teacher's outputs must be for the same batch the student ran on"
        )
    _check_same_device(student_logits, teacher_logits=teacher_logits, mask=mask)
    token_index = _selected_tokens(mask, batch, seq)

    student_rows = student_logits.reshape(batch * seq, vocab)
    teacher_rows = _LogitRows(teacher_logits.detach().reshape(batch * seq, vocab))
    if token_index is not None and token_index.numel() == 0:
        return _connected_zero(student_logits)
    return _ChunkedDivergence.apply(
        student_rows, teacher_rows, token_index, kind, float(temperature), float(jsd_beta), int(chunk_tokens),
        torch.is_grad_enabled() and student_logits.requires_grad,
    )


def kd_loss_from_hidden(
    student_logits: torch.Tensor,
    teacher_hidden: torch.Tensor,
    head,
    mask: torch.Tensor | None = None,
    *,
    kind: str = "forward_kl",
    temperature: float = 1.0,
    jsd_beta: float = 0.5,
    chunk_tokens: int = 4096,
    topk: int = 0,
    tail: str = "bucket",
) -> torch.Tensor:
    """``kd_loss`` (``topk`` = 0) or ``topk_kd_loss`` (with ``tail``) against the logits the
    teacher's output head gives its final hidden state, computed chunk by chunk (module docstring).

    student_logits [B, S, V]; teacher_hidden [B, S, H] (``TeacherOutput.final_hidden``); head an
    ``OutputHead`` (``TeacherClient.joined.head``: weight [V, H], bias, soft cap, scale) on the
    student's device.
    """
    check_options(kind, temperature, jsd_beta, chunk_tokens)
    check_topk_tail(tail)
    _check_logits("student_logits", student_logits)
    if teacher_hidden.dim() != 3 or not teacher_hidden.is_floating_point():
        raise ValueError(f"teacher_hidden must be a float tensor [batch, seq, hidden], got {teacher_hidden.dtype} "
                         f"{tuple(teacher_hidden.shape)}")
    batch, seq, vocab = student_logits.shape
    if head.weight.dim() != 2 or head.weight.shape[1] != teacher_hidden.shape[-1]:
        raise ValueError(f"the head's weight {tuple(head.weight.shape)} does not take hidden states of width "
                         f"{teacher_hidden.shape[-1]}: it must be [vocab, hidden] of the teacher that sent them")
    if head.weight.shape[0] != vocab:
        raise ValueError(f"student vocab {vocab} != teacher vocab {head.weight.shape[0]}: logit distillation needs the "
                         "same tokenizer on both sides")
    if teacher_hidden.shape[:2] != (batch, seq):
        raise ValueError(f"teacher_hidden {tuple(teacher_hidden.shape)} and student_logits "
                         f"{tuple(student_logits.shape)} differ in [batch, seq]: the teacher's outputs must be for "
                         "the same batch the student ran on")
    if isinstance(topk, bool) or not isinstance(topk, int) or not 0 <= topk <= vocab:
        raise ValueError(f"topk must be an int in [0, {vocab}] (0: the full distribution), got {topk!r}")
    _check_same_device(student_logits, teacher_hidden=teacher_hidden, head_weight=head.weight, mask=mask)
    token_index = _selected_tokens(mask, batch, seq)
    if token_index is not None and token_index.numel() == 0:
        return _connected_zero(student_logits)
    student_rows = student_logits.reshape(batch * seq, vocab)
    teacher_rows = _HeadRows(teacher_hidden.detach().reshape(batch * seq, teacher_hidden.shape[-1]), head, topk, tail)
    return _ChunkedDivergence.apply(
        student_rows, teacher_rows, token_index, kind, float(temperature), float(jsd_beta), int(chunk_tokens),
        torch.is_grad_enabled() and student_logits.requires_grad,
    )


def topk_kd_loss(
    student_logits: torch.Tensor,
    teacher_topk_logprobs: torch.Tensor,
    teacher_topk_indices: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    kind: str = "forward_kl",
    temperature: float = 1.0,
    jsd_beta: float = 0.5,
    chunk_tokens: int = 4096,
    tail: str = "bucket",
) -> torch.Tensor:
    """Divergence against the teacher's top k: its k ids and, with ``tail="bucket"``, the rest as
    one outcome (module docstring).

    student_logits [B, S, V]; teacher_topk_logprobs [B, S, k] the teacher's log-probabilities
    under its full softmax at ``temperature`` (what ``TopK`` sends) at teacher_topk_indices
    [B, S, k] (int32 or int64, distinct per token, as ``torch.topk`` gives). ``tail``: "bucket"
    (the teacher's tail mass 1 - sum exp against the student's exact tail) or "none" (both sides
    renormalised over the k ids).
    Only the indices of masked tokens are checked and used, so padding positions may hold anything.
    """
    check_options(kind, temperature, jsd_beta, chunk_tokens)
    check_topk_tail(tail)
    _check_logits("student_logits", student_logits)
    _check_logits("teacher_topk_logprobs", teacher_topk_logprobs)
    batch, seq, vocab = student_logits.shape
    if teacher_topk_indices.shape != teacher_topk_logprobs.shape:
        raise ValueError(
            f"teacher_topk_indices {tuple(teacher_topk_indices.shape)} != teacher_topk_logprobs "
            f"{tuple(teacher_topk_logprobs.shape)}: both must be [B, S, k]"
        )
    if teacher_topk_indices.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"teacher_topk_indices must be int32 or int64, got {teacher_topk_indices.dtype}")
    if teacher_topk_logprobs.shape[:2] != (batch, seq):
        raise ValueError(
            f"teacher top-k {tuple(teacher_topk_logprobs.shape)} and student_logits {tuple(student_logits.shape)} "
            "differ in [batch, seq]: the teacher's outputs must be for the same batch the student ran on"
        )
    if teacher_topk_logprobs.shape[-1] < 1:
        raise ValueError("teacher top-k has k = 0: ask the teacher for --topk >= 1 or distil full logits")
    _check_same_device(student_logits, teacher_topk_logprobs=teacher_topk_logprobs,
                       teacher_topk_indices=teacher_topk_indices, mask=mask)
    return _divergence_at_ids(student_logits, teacher_topk_indices, teacher_topk_logprobs, mask, kind, temperature,
                              jsd_beta, chunk_tokens, tail)


def _divergence_at_ids(student_logits, ids, teacher_logprobs, mask, kind, temperature, jsd_beta, chunk_tokens,
                       tail) -> torch.Tensor:
    """The chunked divergence on k ids per position (+ the tail as `tail` says), inputs checked."""
    batch, seq, vocab = student_logits.shape
    k = ids.shape[-1]
    token_index = _selected_tokens(mask, batch, seq)
    if token_index is None:
        token_index = torch.arange(batch * seq, device=student_logits.device)
    if token_index.numel() == 0:
        return _connected_zero(student_logits)
    # Only the selected tokens' ids and log-probabilities: [N, k], small.
    selected_ids = ids.reshape(batch * seq, k)[token_index].long()
    _check_topk_indices(selected_ids, vocab)
    log_p = teacher_logprobs.detach().reshape(batch * seq, k)[token_index]
    return _ChunkedDivergence.apply(
        student_logits.reshape(batch * seq, vocab), _IdRows(selected_ids, log_p, tail), token_index, kind,
        float(temperature), float(jsd_beta), int(chunk_tokens),
        torch.is_grad_enabled() and student_logits.requires_grad,
    )


class _LogitRows:
    """The teacher's logits as rows [rows, V] that a chunk selects."""

    def __init__(self, rows_2d: torch.Tensor):
        self.rows_2d = rows_2d
        self.dtype = rows_2d.dtype

    def divergence(self, student_chunk, rows, span, kind, temperature, jsd_beta, need_grad, compute_dtype):
        return _divergence_and_grad(
            lambda: student_chunk().div_(temperature),
            lambda: _take_rows(self.rows_2d, rows).to(compute_dtype, copy=True).div_(temperature), kind, jsd_beta,
            need_grad)


class _HeadRows:
    """The teacher's logits computed per chunk from its final hidden states [rows, H] and its head;
    with topk > 0 only their k largest count, as `TopK` would have sent them (`tail` as in
    `topk_kd_loss`)."""

    def __init__(self, hidden_2d: torch.Tensor, head, topk: int = 0, tail: str = "bucket"):
        self.hidden_2d, self.head, self.topk, self.tail = hidden_2d, head, topk, tail
        self.dtype = head.weight.dtype

    def _logits(self, rows, compute_dtype, temperature) -> torch.Tensor:
        return self.head.logits(_take_rows(self.hidden_2d, rows), compute_dtype).div_(temperature)

    def divergence(self, student_chunk, rows, span, kind, temperature, jsd_beta, need_grad, compute_dtype):
        if not self.topk:
            return _divergence_and_grad(lambda: student_chunk().div_(temperature),
                                        lambda: self._logits(rows, compute_dtype, temperature), kind, jsd_beta,
                                        need_grad)
        scaled = self._logits(rows, compute_dtype, temperature)
        values, ids = scaled.topk(self.topk, dim=-1)
        log_p = values - scaled.logsumexp(-1, keepdim=True)
        del scaled, values
        return _ids_divergence(student_chunk().div_(temperature), ids, log_p, self.tail, kind, jsd_beta, need_grad)


class _IdRows:
    """The teacher's log-probabilities at k ids per selected token ([N, k] each, in the order of
    the selected tokens): `TopK`'s top k, or the ids a student had scored."""

    def __init__(self, ids: torch.Tensor, logprobs: torch.Tensor, tail: str):
        self.ids, self.logprobs, self.tail = ids, logprobs, tail
        self.dtype = logprobs.dtype

    def divergence(self, student_chunk, rows, span, kind, temperature, jsd_beta, need_grad, compute_dtype):
        return _ids_divergence(student_chunk().div_(temperature), self.ids[span], self.logprobs[span].to(compute_dtype),
                               self.tail, kind, jsd_beta, need_grad)


def _ids_divergence(scaled: torch.Tensor, ids: torch.Tensor, log_p: torch.Tensor, tail: str, kind: str,
                    jsd_beta: float, need_grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One chunk's divergence between the teacher, known by its log-probabilities log_p [rows, k]
    at ids [rows, k], and the student's scaled logits [rows, V] (owned: modified in place): the
    chunk's loss and its gradient w.r.t. the scaled logits [rows, V] (module docstring).

    "bucket": the k + 1 outcomes' log-probabilities are the student's k logits and, for the rest,
    u = logsumexp of its logits off the k ids; the divergence's gradient w.r.t. those k + 1
    "bucket logits" is `_divergence_and_grad`'s, and d u / d s_i = exp(s_i - u) off the k ids.
    """
    vocab, k = scaled.shape[-1], ids.shape[-1]
    at_ids = scaled.gather(1, ids)
    if tail == "none":
        loss, grad = _divergence_and_grad(lambda: at_ids, lambda: log_p.clone(), kind, jsd_beta, need_grad)
        return loss, (scaled.zero_().scatter_(1, ids, grad) if need_grad else None)
    if k == vocab:  # no tail: the k ids are the vocabulary
        loss, grad = _divergence_and_grad(lambda: at_ids, lambda: log_p.clone(), kind, jsd_beta, need_grad)
        return loss, (scaled.zero_().scatter_(1, ids, grad) if need_grad else None)
    # The teacher's tail mass in float64: 1 - sum cancels, and it is known to TAIL_FLOOR at best.
    tail_mass = (1 - log_p.double().exp().sum(-1, keepdim=True)).clamp_min(TAIL_FLOOR)
    rest = scaled.scatter_(1, ids, -math.inf).logsumexp(-1, keepdim=True)  # the student's tail, exact
    bucket_logits = torch.cat([at_ids, rest], dim=1)
    bucket_teacher = torch.cat([log_p, tail_mass.log().to(log_p.dtype)], dim=1)
    loss, grad = _divergence_and_grad(lambda: bucket_logits, lambda: bucket_teacher, kind, jsd_beta, need_grad)
    if not need_grad:
        return loss, None
    # Off the k ids: the rest bucket's gradient times softmax over the rest (0 where the rest is empty).
    spread = scaled.sub_(rest).exp_().nan_to_num_(0.0).mul_(grad[:, k:])
    return loss, spread.scatter_(1, ids, grad[:, :k])


class _ChunkedDivergence(torch.autograd.Function):
    """mean over selected rows of divergence(teacher, softmax(student/T)) * T².

    student_rows [rows, V]; teacher_rows a `_LogitRows`, `_HeadRows` or `_IdRows`, whose
    `divergence` gives one chunk's loss and its gradient w.r.t. the chunk's student logits / T
    (rows: the chunk's rows of student_rows; span: its place among the selected rows);
    token_index (long [N]) selects the rows that count, or None for all of them. The gradient
    w.r.t. student_rows is computed chunk by chunk in forward; see the module docstring.
    """

    @staticmethod
    def forward(ctx, student_rows, teacher_rows, token_index, kind, temperature, jsd_beta, chunk_tokens, need_grad):
        n_tokens = student_rows.shape[0] if token_index is None else token_index.numel()
        compute_dtype = torch.promote_types(torch.promote_types(student_rows.dtype, teacher_rows.dtype), torch.float32)
        # Rows the mask drops get a zero gradient, hence zeros rather than empty.
        grad_buffer = torch.zeros_like(student_rows) if need_grad else None
        loss_sum = torch.zeros((), dtype=compute_dtype, device=student_rows.device)
        # d(T² * L / N)/d(student logits) = T² / N * (1/T) * dL/d(student logits / T).
        grad_scale = temperature / n_tokens
        for start in range(0, n_tokens, chunk_tokens):
            end = min(start + chunk_tokens, n_tokens)
            rows = slice(start, end) if token_index is None else token_index[start:end]
            # A fresh copy in the compute dtype, which the chunk's divergence may modify in place.
            chunk_loss, chunk_grad = teacher_rows.divergence(
                lambda: _take_rows(student_rows, rows).to(compute_dtype, copy=True), rows, slice(start, end), kind,
                temperature, jsd_beta, need_grad, compute_dtype)
            loss_sum += chunk_loss
            if need_grad:
                grad_buffer[rows] = chunk_grad.mul_(grad_scale).to(grad_buffer.dtype)
            del chunk_grad  # free this chunk's float32 gradient before the next chunk's temporaries appear
        ctx.save_for_backward(grad_buffer)
        return loss_sum * (temperature * temperature / n_tokens)

    @staticmethod
    def backward(ctx, grad_output):
        (grad_buffer,) = ctx.saved_tensors
        # Scaling a vocabulary-sized buffer allocates a second one; skip that in the usual case
        # of backward on the loss itself. Not scaled in place, so that retain_graph and a second
        # backward still see the unscaled buffer. (.item() syncs, but forward already synced on
        # the number of selected tokens.)
        if grad_output.numel() == 1 and grad_output.item() == 1.0:
            grad_student = grad_buffer
        else:
            grad_student = grad_buffer * grad_output  # a 0-dim grad_output keeps the buffer's dtype
        return grad_student, None, None, None, None, None, None, None


def _divergence_and_grad(
    student_chunk,
    teacher_chunk,
    kind: str,
    jsd_beta: float,
    need_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """For one chunk of rows, given as callables that return its student and teacher logits
    already divided by the temperature, [rows, n] (fresh tensors in the compute dtype, or the
    teacher's log-probabilities, which the softmax leaves as they are): (sum over its rows of the
    divergence, the gradient of that sum w.r.t. the student's scaled logits).

    With s = student / T, q = softmax(s), p = softmax(teacher / T), per row:
      forward_kl  KL(p||q)              d/ds = q - p
      reverse_kl  KL(q||p)              d/ds = q * (log q - log p - KL(q||p))
      jsd         b KL(p||m) + (1-b) KL(q||m), m = b p + (1-b) q
                                        d/ds = (1-b) * q * (log q - log m - KL(q||m))
    (JSD: the two terms' derivatives through m cancel, leaving dL/dq_i = (1-b) log(q_i/m_i);
    the softmax Jacobian then gives q * (g - <q, g>)).

    The chunk's rows are made, upcast and scaled by the callables so that those copies die at
    once, and later steps work in place on tensors this function owns: at most five float32
    [rows, V] tensors are alive at a time (JSD; three for forward KL, four for reverse KL).
    """
    log_q = torch.log_softmax(student_chunk(), dim=-1)
    log_p = torch.log_softmax(teacher_chunk(), dim=-1)
    if kind == "forward_kl":
        p = log_p.exp()
        loss = _xlog_ratio_(p, log_p.sub_(log_q)).sum()
        del log_p
        return loss, (log_q.exp_().sub_(p) if need_grad else None)

    q = log_q.exp()
    if kind == "reverse_kl":
        log_ratio, grad_weight, teacher_term = log_q.sub_(log_p), 1.0, 0.0  # log q - log p
        del log_p
    else:
        log_m = log_q + math.log1p(-jsd_beta)
        torch.logaddexp(log_p + math.log(jsd_beta), log_m, out=log_m)  # log(b p + (1-b) q)
        p = log_p.exp()
        teacher_term = jsd_beta * _xlog_ratio_(p, log_p.sub_(log_m)).sum()
        del p, log_p
        log_ratio, grad_weight = log_q.sub_(log_m), 1.0 - jsd_beta  # log q - log m
        del log_m
    kl_q = _xlog_ratio_(q, log_ratio.clone()).sum(dim=-1, keepdim=True)  # per row KL(q||p) or KL(q||m)
    loss = grad_weight * kl_q.sum() + teacher_term
    if not need_grad:
        return loss, None
    grad = log_ratio.sub_(kl_q).mul_(q).masked_fill_(q == 0, 0.0)  # q = 0 may have a NaN log ratio
    if grad_weight != 1.0:
        grad.mul_(grad_weight)
    return loss, grad


def _take_rows(rows_2d: torch.Tensor, rows: slice | torch.Tensor) -> torch.Tensor:
    return rows_2d[rows] if isinstance(rows, slice) else rows_2d.index_select(0, rows)


def _xlog_ratio_(prob: torch.Tensor, log_ratio: torch.Tensor) -> torch.Tensor:
    """prob * log_ratio, in place in log_ratio, and 0 where prob == 0: 0 * log 0 = 0, whereas
    a log ratio of -inf - (-inf) would make it NaN."""
    return log_ratio.mul_(prob).masked_fill_(prob == 0, 0.0)


# --------------------------------------------------------------------------- attention relations


def attention_relation_loss(
    student: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    teacher: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    mask: torch.Tensor | None = None,
    *,
    relation_heads: int,
    block_rows: int = 256,
) -> torch.Tensor:
    """MiniLMv2's attention-relation loss of one layer: the sum over queries, keys and values of
    ``relation_kl`` (module docstring).

    student, teacher: (q, k, v), each [B, S, width] (``TeacherOutput.attention_inputs[layer]``,
    distill_common.attention_inputs.AttentionCapture on the student); mask [B, S] (1: a real
    token) or None.
    """
    if len(student) != 3 or len(teacher) != 3:
        raise ValueError("attention inputs are (queries, keys, values) on both sides")
    return sum(relation_kl(s, t, mask, relation_heads=relation_heads, block_rows=block_rows, what=what)
               for s, t, what in zip(student, teacher, ("queries", "keys", "values")))


def relation_kl(
    student_states: torch.Tensor,
    teacher_states: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    relation_heads: int,
    block_rows: int = 256,
    what: str = "states",
) -> torch.Tensor:
    """KL(teacher relation || student relation) of one kind of vectors [B, S, width], averaged
    over relation heads and real tokens (module docstring), float32 (float64 for float64 inputs).

    The relation of token i is a softmax over the tokens j <= i whose mask is 1. Rows of padding
    do not count. Computed ``block_rows`` query rows at a time, with the gradient w.r.t.
    ``student_states`` in closed form.
    """
    check_relation_options(relation_heads, block_rows)
    for name, tensor in (("student", student_states), ("teacher", teacher_states)):
        if tensor.dim() != 3 or not tensor.is_floating_point():
            raise ValueError(f"the {name}'s {what} must be a float tensor [batch, seq, width], got {tensor.dtype} "
                             f"{tuple(tensor.shape)}")
        if tensor.shape[-1] % relation_heads:
            raise ValueError(f"the {name}'s {what} are {tensor.shape[-1]} wide, which {relation_heads} relation heads "
                             "do not divide: choose --attention-relation-heads dividing the query, key and value "
                             "widths of both models")
    batch, seq, _ = student_states.shape
    if teacher_states.shape[:2] != (batch, seq):
        raise ValueError(f"the teacher's {what} {tuple(teacher_states.shape)} and the student's "
                         f"{tuple(student_states.shape)} differ in [batch, seq]: the teacher's outputs must be for the "
                         "same batch the student ran on")
    _check_same_device(student_states, teacher_states=teacher_states, mask=mask)
    valid = None
    if mask is not None:
        if tuple(mask.shape) != (batch, seq):
            raise ValueError(f"mask {tuple(mask.shape)} must be [batch, seq] = {(batch, seq)}")
        if mask.is_floating_point() or mask.is_complex():
            raise ValueError(f"mask must be bool or integer (1 = a real token), got {mask.dtype}")
        valid = mask.bool()
        if not bool(valid.any()):
            return _connected_zero(student_states)
    return _BlockedRelationKL.apply(student_states, teacher_states.detach(), valid, int(relation_heads),
                                    int(block_rows), torch.is_grad_enabled() and student_states.requires_grad)


def check_relation_options(relation_heads: int, block_rows: int) -> None:
    """The attention loss's settings, checked once for the trainer's flags and DistillationTrainer's arguments."""
    if isinstance(relation_heads, bool) or not isinstance(relation_heads, int) or relation_heads < 1:
        raise ConfigError(f"--attention-relation-heads must be an int >= 1, got {relation_heads!r}")
    if isinstance(block_rows, bool) or not isinstance(block_rows, int) or block_rows < 1:
        raise ConfigError(f"--attention-block-rows must be an int >= 1, got {block_rows!r}")


class _BlockedRelationKL(torch.autograd.Function):
    """relation_kl's value, and its gradient computed in forward, block of query rows by block.

    Per relation head, with a the student's vectors (width d), s_ij = a_i . a_j / sqrt(d),
    q_i = softmax(s_i) and p_i the teacher's: d KL(p_i || q_i) / d s_ij = q_ij - p_ij, and s_ij
    reaches both a_i and a_j, so a block of rows I adds G[I] a / sqrt(d) to its own rows' gradient
    and G[I]^T a[I] / sqrt(d) to its columns'.
    """

    @staticmethod
    def forward(ctx, student, teacher, valid, heads, block_rows, need_grad):
        batch, seq, _ = student.shape
        compute_dtype = torch.promote_types(torch.promote_types(student.dtype, teacher.dtype), torch.float32)
        device = student.device
        a = _relation_heads(student.detach(), heads, compute_dtype)  # [B, R, S, ds]
        t = _relation_heads(teacher, heads, compute_dtype)  # [B, R, S, dt]
        scale_s, scale_t = a.shape[-1] ** -0.5, t.shape[-1] ** -0.5
        if valid is None:
            valid = torch.ones(batch, seq, dtype=torch.bool, device=device)
        rows_counted = valid.sum()
        weight = 1.0 / (heads * rows_counted.to(compute_dtype))  # each counted row and head: 1 / (R N)
        grad_a = torch.zeros_like(a) if need_grad else None
        loss = torch.zeros((), dtype=compute_dtype, device=device)
        positions = torch.arange(seq, device=device)
        for start in range(0, seq, block_rows):
            end = min(start + block_rows, seq)  # the block's rows see the columns before `end` (causal)
            rows = positions[start:end]
            # Causal and not padding; a row always sees itself, so padding rows (weighted 0) stay finite.
            allowed = ((positions[None, :end] <= rows[:, None])[None] & valid[:, None, :end]) \
                | (positions[None, :end] == rows[:, None])[None]  # [B, block, end]
            allowed = allowed[:, None]  # [B, 1, block, end]
            log_p = torch.log_softmax((t[:, :, start:end] @ t[:, :, :end].transpose(-1, -2))
                                      .mul_(scale_t).masked_fill_(~allowed, -math.inf), dim=-1)
            log_q = torch.log_softmax((a[:, :, start:end] @ a[:, :, :end].transpose(-1, -2))
                                      .mul_(scale_s).masked_fill_(~allowed, -math.inf), dim=-1)
            p = log_p.exp()
            row_kl = _xlog_ratio_(p, log_p.sub_(log_q)).sum(dim=-1)  # [B, R, block]
            del log_p
            counted = valid[:, None, start:end]
            loss += (row_kl * counted).sum()
            if need_grad:
                # (q - p) on counted rows, / (R N), through s = a a^T / sqrt(d).
                grad_s = log_q.exp_().sub_(p).mul_(counted[..., None] * (weight * scale_s))
                grad_a[:, :, start:end] += grad_s @ a[:, :, :end]
                grad_a[:, :, :end] += grad_s.transpose(-1, -2) @ a[:, :, start:end]
                del grad_s
            del log_q, p
        grad_student = None
        if need_grad:
            grad_student = grad_a.transpose(1, 2).reshape(student.shape).to(student.dtype)
        ctx.save_for_backward(grad_student)
        return loss * weight

    @staticmethod
    def backward(ctx, grad_output):
        (grad_student,) = ctx.saved_tensors
        return grad_student * grad_output, None, None, None, None, None


def _relation_heads(states: torch.Tensor, heads: int, dtype: torch.dtype) -> torch.Tensor:
    """[B, S, width] -> [B, heads, S, width / heads] in `dtype`."""
    batch, seq, width = states.shape
    return states.to(dtype).reshape(batch, seq, heads, width // heads).transpose(1, 2).contiguous()

# --------------------------------------------------------------------------- on the student's samples

def sampled_reverse_kl_loss(
    student_logits: torch.Tensor,
    tokens: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
    baseline: bool = True,
) -> torch.Tensor:
    """The per-token reverse KL on tokens the student sampled (see the module docstring).

    student_logits [B, S, V] predict tokens [B, S] (the sampled ones; each row a sequence
    sampled independently), whose log-probabilities under the teacher are teacher_logprobs
    [B, S]. ``temperature`` is the one the tokens were sampled at: the student's
    log-probabilities are taken at it, so that the estimate is of the divergence from the
    distribution sampled. Returns the mean over masked tokens of log q - log p (float32), whose
    gradient is the mean of (log q - log p - b) * grad log q. With ``baseline``, b is the mean
    log ratio of the *other* rows' tokens (leave one out, as RLOO): independent of the row's own
    samples, so the expectation stays the same, while the common offset of the log ratios (their
    mean is the KL, > 0) no longer pushes every sampled token down. On batches of the arithmetic
    task (distill_demo/onpolicy_compare.py) it cut the gradient's variance by 40%. Without, b = 0.
    """
    _check_logits("student_logits", student_logits)
    batch, seq, vocab = student_logits.shape
    for name, tensor in (("tokens", tokens), ("teacher_logprobs", teacher_logprobs)):
        if tuple(tensor.shape) != (batch, seq):
            raise ValueError(f"{name} {tuple(tensor.shape)} must be [batch, seq] = {(batch, seq)}, as the student "
                             "logits that predict them")
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be > 0 and finite, got {temperature!r}")
    _check_same_device(student_logits, tokens=tokens, teacher_logprobs=teacher_logprobs, mask=mask)
    token_index = _selected_tokens(mask, batch, seq)
    if token_index is None:
        token_index = torch.arange(batch * seq, device=student_logits.device)
    if token_index.numel() == 0:
        return _connected_zero(student_logits)
    compute_dtype = torch.promote_types(student_logits.dtype, torch.float32)
    rows = student_logits.reshape(batch * seq, vocab)[token_index].to(compute_dtype) / temperature
    log_q = -F.cross_entropy(rows, tokens.reshape(-1)[token_index].long(), reduction="none")
    log_ratio = (log_q - teacher_logprobs.reshape(-1)[token_index].to(compute_dtype)).detach()
    weight = log_ratio - _other_rows_mean(log_ratio, token_index // seq, batch) if baseline else log_ratio
    # Value: the estimate; gradient: weight * grad log q (the second term is 0 but for its gradient).
    return log_ratio.mean() + (weight * (log_q - log_q.detach())).mean()


def _other_rows_mean(values: torch.Tensor, rows: torch.Tensor, batch: int) -> torch.Tensor:
    """For each value, the mean of the values of the other rows (0 where no other row has one)."""
    sums = torch.zeros(batch, dtype=values.dtype, device=values.device).index_add_(0, rows, values)
    counts = torch.zeros(batch, dtype=values.dtype, device=values.device).index_add_(0, rows, torch.ones_like(values))
    others = counts.sum() - counts[rows]
    return torch.where(others > 0, (sums.sum() - sums[rows]) / others.clamp_min(1), 0.0)


def scored_kd_loss(
    student_logits: torch.Tensor,
    score_ids: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    kind: str = "forward_kl",
    temperature: float = 1.0,
    jsd_beta: float = 0.5,
    chunk_tokens: int = 4096,
) -> torch.Tensor:
    """Divergence on k + 1 buckets: k ids per position and the rest (see the module docstring).

    student_logits [B, S, V]; score_ids [B, S, k] distinct ids per position; teacher_logprobs
    [B, S, k] the teacher's log-probabilities at them, at ``temperature`` (the teacher's
    logprob_temperature), as the student's are taken. Returns the mean over masked tokens of the
    divergence, times temperature² as ``kd_loss``. The same computation as ``topk_kd_loss`` with
    ``tail="bucket"``, on ids the student chose.
    """
    check_options(kind, temperature, jsd_beta, chunk_tokens)
    _check_logits("student_logits", student_logits)
    _check_logits("teacher_logprobs", teacher_logprobs)
    batch, seq, vocab = student_logits.shape
    if score_ids.shape != teacher_logprobs.shape or tuple(score_ids.shape[:2]) != (batch, seq):
        raise ValueError(f"score_ids {tuple(score_ids.shape)} and teacher_logprobs {tuple(teacher_logprobs.shape)} "
                         f"must both be [batch, seq, k] with the student logits' [batch, seq] = {(batch, seq)}")
    if score_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"score_ids must be int32 or int64, got {score_ids.dtype}")
    _check_same_device(student_logits, score_ids=score_ids, teacher_logprobs=teacher_logprobs, mask=mask)
    return _divergence_at_ids(student_logits, score_ids, teacher_logprobs, mask, kind, temperature, jsd_beta,
                              chunk_tokens, "bucket")


# --------------------------------------------------------------------------- several teachers' mixture


class MixtureTeacher(typing.NamedTuple):
    """One teacher of a mixture (``mixture_kd_loss``): its weight and its distribution, given one
    of three ways, each [B, S, ...] for the student's [B, S] positions:

    * ``logits`` [B, S, V]: its full logits, taken at ``temperature``;
    * ``logprobs`` [B, S, k] at ``ids`` [B, S, k]: its log-probabilities at k ids per position,
      already at its temperature (what ``TopK`` and ``ScoredLogprobs`` send);
    * ``hidden`` [B, S, H] and ``head`` (an ``OutputHead``): its final hidden state, its logits
      computed per chunk at ``temperature``, all of them or (``topk`` > 0) their k largest.
    """

    weight: float
    logits: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None
    ids: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
    head: typing.Any = None
    temperature: float = 1.0
    topk: int = 0


def mixture_kd_loss(
    student_logits: torch.Tensor,
    teachers: typing.Sequence[MixtureTeacher],
    mask: torch.Tensor | None = None,
    *,
    kind: str = "forward_kl",
    temperature: float = 1.0,
    jsd_beta: float = 0.5,
    chunk_tokens: int = 4096,
) -> torch.Tensor:
    """The divergence of the student (at ``temperature``) from the teachers' mixture
    m = sum_i w_i p_i, w_i = weight_i / sum of weights, over the ids every teacher's distribution is
    known at and one bucket for the rest (module docstring). Mean over masked tokens, times
    temperature², as ``kd_loss``."""
    check_options(kind, temperature, jsd_beta, chunk_tokens)
    _check_logits("student_logits", student_logits)
    if not teachers:
        raise ValueError("a mixture needs at least one teacher")
    batch, seq, vocab = student_logits.shape
    total_weight = sum(float(t.weight) for t in teachers)
    if not all(float(t.weight) > 0 for t in teachers) or not math.isfinite(total_weight):
        raise ValueError(f"mixture weights must be finite and > 0, got {[t.weight for t in teachers]}")
    members = [(math.log(float(t.weight) / total_weight), _mixture_member(t, batch, seq, vocab, student_logits))
               for t in teachers]
    token_index = _selected_tokens(mask, batch, seq)
    if token_index is not None and token_index.numel() == 0:
        return _connected_zero(student_logits)
    for _, member in members:
        member.check_ids(slice(None) if token_index is None else token_index)
    return _ChunkedDivergence.apply(
        student_logits.reshape(batch * seq, vocab), _MixtureRows(members), token_index, kind, float(temperature),
        float(jsd_beta), int(chunk_tokens), torch.is_grad_enabled() and student_logits.requires_grad,
    )


def _mixture_member(teacher: MixtureTeacher, batch: int, seq: int, vocab: int, student: torch.Tensor):
    given = [name for name in ("logits", "logprobs", "hidden") if getattr(teacher, name) is not None]
    if len(given) != 1:
        raise ValueError(f"a mixture teacher gives exactly one of logits, logprobs (with ids) or hidden (with head), "
                         f"got {given or 'none'}")
    if not (math.isfinite(teacher.temperature) and teacher.temperature > 0):
        raise ValueError(f"a mixture teacher's temperature must be > 0 and finite, got {teacher.temperature!r}")
    if teacher.logits is not None:
        _check_logits("logits", teacher.logits)
        if tuple(teacher.logits.shape) != (batch, seq, vocab):
            raise ValueError(f"a mixture teacher's logits {tuple(teacher.logits.shape)} must be the student's "
                             f"{(batch, seq, vocab)}: the same batch and vocabulary")
        _check_same_device(student, logits=teacher.logits)
        return _LogitMember(teacher.logits.detach().reshape(batch * seq, vocab), teacher.temperature)
    if teacher.logprobs is not None:
        _check_logits("logprobs", teacher.logprobs)
        if teacher.ids is None or teacher.ids.shape != teacher.logprobs.shape \
                or tuple(teacher.ids.shape[:2]) != (batch, seq) or teacher.ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"a mixture teacher's ids must be int32/int64 [batch, seq, k] like its logprobs "
                             f"{tuple(teacher.logprobs.shape)}, for the student's {(batch, seq)}")
        _check_same_device(student, logprobs=teacher.logprobs, ids=teacher.ids)
        k = teacher.ids.shape[-1]
        return _IdMember(teacher.ids.reshape(batch * seq, k), teacher.logprobs.detach().reshape(batch * seq, k), vocab)
    hidden, head = teacher.hidden, teacher.head
    if head is None or hidden.dim() != 3 or tuple(hidden.shape[:2]) != (batch, seq) \
            or tuple(head.weight.shape) != (vocab, hidden.shape[-1]):
        raise ValueError(f"a mixture teacher's hidden {tuple(hidden.shape)} needs its head, [vocab, hidden] = "
                         f"[{vocab}, {hidden.shape[-1]}], for the student's {(batch, seq)}")
    if isinstance(teacher.topk, bool) or not 0 <= teacher.topk <= vocab:
        raise ValueError(f"topk must be an int in [0, {vocab}], got {teacher.topk!r}")
    _check_same_device(student, hidden=hidden, head_weight=head.weight)
    return _HeadMember(hidden.detach().reshape(batch * seq, hidden.shape[-1]), head, teacher.temperature,
                       teacher.topk if teacher.topk < vocab else 0)


class _LogitMember:
    """A teacher known over the whole vocabulary by its logits."""

    def __init__(self, rows_2d: torch.Tensor, temperature: float):
        self.rows_2d, self.temperature, self.dtype = rows_2d, temperature, rows_2d.dtype

    def check_ids(self, token_index: torch.Tensor | slice) -> None:
        pass

    def log_probs(self, rows, compute_dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[n, V] log-probabilities of the chunk's rows, and where they are known (None: everywhere)."""
        scaled = _take_rows(self.rows_2d, rows).to(compute_dtype, copy=True).div_(self.temperature)
        return torch.log_softmax(scaled, dim=-1), None


class _IdMember:
    """A teacher known at k ids per position (and, as one bucket, off them)."""

    def __init__(self, ids_2d: torch.Tensor, logprobs_2d: torch.Tensor, vocab: int):
        self.ids_2d, self.logprobs_2d, self.vocab, self.dtype = ids_2d, logprobs_2d, vocab, logprobs_2d.dtype

    def check_ids(self, token_index: torch.Tensor | slice) -> None:
        _check_topk_indices(self.ids_2d[token_index].long(), self.vocab)

    def log_probs(self, rows, compute_dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
        ids = _take_rows(self.ids_2d, rows).long()
        values = _take_rows(self.logprobs_2d, rows).to(compute_dtype)
        return _scattered(ids, values, self.vocab)


class _HeadMember:
    """A teacher whose logits its head gives its final hidden states, chunk by chunk."""

    def __init__(self, hidden_2d: torch.Tensor, head, temperature: float, topk: int):
        self.hidden_2d, self.head, self.temperature, self.topk = hidden_2d, head, temperature, topk
        self.dtype = head.weight.dtype

    def check_ids(self, token_index: torch.Tensor | slice) -> None:
        pass

    def log_probs(self, rows, compute_dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
        log_p = torch.log_softmax(self.head.logits(_take_rows(self.hidden_2d, rows), compute_dtype)
                                  .div_(self.temperature), dim=-1)
        if not self.topk:
            return log_p, None
        values, ids = log_p.topk(self.topk, dim=-1)
        return _scattered(ids, values, log_p.shape[-1])


def _scattered(ids: torch.Tensor, values: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """k log-probabilities per row written into [n, V] (-inf elsewhere), and where they are (None: k = V)."""
    full = values.new_full((ids.shape[0], vocab), -math.inf).scatter_(1, ids, values)
    if ids.shape[-1] >= vocab:
        return full, None
    return full, torch.zeros(full.shape, dtype=torch.bool, device=full.device).scatter_(1, ids, True)


class _MixtureRows:
    """The teachers' mixture as the rows a chunk selects (`_ChunkedDivergence`'s teacher side)."""

    def __init__(self, members: list):
        self.members = members  # (log of the normalised weight, a _LogitMember / _IdMember / _HeadMember)
        self.dtype = functools.reduce(torch.promote_types, (member.dtype for _, member in members))

    def divergence(self, student_chunk, rows, span, kind, temperature, jsd_beta, need_grad, compute_dtype):
        log_m, known = None, None
        for log_weight, member in self.members:
            log_p, member_known = member.log_probs(rows, compute_dtype)
            log_p.add_(log_weight)
            log_m = log_p if log_m is None else torch.logaddexp(log_m, log_p, out=log_m)
            del log_p
            if member_known is not None:
                known = member_known if known is None else known.logical_and_(member_known)
        scaled = student_chunk().div_(temperature)
        if known is None:  # every teacher known everywhere: the mixture itself
            return _divergence_and_grad(lambda: scaled, lambda: log_m, kind, jsd_beta, need_grad)
        vocab = scaled.shape[-1]
        unknown = known.logical_not_()
        log_m.masked_fill_(unknown, -math.inf)  # the mixture at the ids every teacher sent
        # Its mass off them in float64, as for one teacher's tail: 1 - sum cancels.
        tail_mass = (1 - log_m.double().exp().sum(-1, keepdim=True)).clamp_min(TAIL_FLOOR)
        teacher_buckets = torch.cat([log_m, tail_mass.log().to(log_m.dtype)], dim=1)
        del log_m
        rest = scaled.masked_fill(~unknown, -math.inf).logsumexp(-1, keepdim=True)  # the student's, exact
        student_buckets = torch.cat([scaled.masked_fill(unknown, -math.inf), rest], dim=1)
        loss, grad = _divergence_and_grad(lambda: student_buckets, lambda: teacher_buckets, kind, jsd_beta, need_grad)
        del teacher_buckets, student_buckets
        if not need_grad:
            return loss, None
        # Off the known ids: the rest bucket's gradient times softmax over the rest.
        spread = scaled.sub_(rest).exp_().mul_(grad[:, vocab:])
        return loss, torch.where(unknown, spread, grad[:, :vocab])


# --------------------------------------------------------------------------- hidden states


class HiddenProjection(nn.Module):
    """A learned, bias-free linear map from the student's hidden size to the teacher's.

    Initialised to the identity when the sizes are equal, so distillation starts by comparing
    the raw hidden states, and to a random (semi-)orthogonal matrix otherwise: that preserves
    the norm of the student's states when projecting up (W^T W = I) and is a norm-preserving
    projection onto a random subspace when projecting down, so the initial loss reflects the
    states and not a scale set by the init (the default Kaiming-uniform init shrinks them ~1/sqrt(3)).
    """

    def __init__(self, student_hidden_size: int, teacher_hidden_size: int, *,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if student_hidden_size < 1 or teacher_hidden_size < 1:
            raise ValueError(f"hidden sizes must be >= 1, got student {student_hidden_size}, teacher {teacher_hidden_size}")
        self.student_hidden_size = student_hidden_size
        self.teacher_hidden_size = teacher_hidden_size
        self.weight = nn.Parameter(torch.empty(teacher_hidden_size, student_hidden_size, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            if self.student_hidden_size == self.teacher_hidden_size:
                self.weight.copy_(torch.eye(self.teacher_hidden_size))
            else:
                nn.init.orthogonal_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Cast to the weight's dtype: a float32 projection on bf16 activations would otherwise fail in F.linear.
        return F.linear(x.to(self.weight.dtype), self.weight)

    def extra_repr(self) -> str:
        return f"student_hidden_size={self.student_hidden_size}, teacher_hidden_size={self.teacher_hidden_size}"


def hidden_state_loss(
    student_hidden: torch.Tensor,
    teacher_hidden: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    kind: str = "mse",
    projection: nn.Module | None = None,
) -> torch.Tensor:
    """Per-token distance between hidden states, averaged over masked tokens, in float32.

    student_hidden [B, S, Hs], teacher_hidden [B, S, Ht]. ``projection`` (e.g. a
    ``HiddenProjection(Hs, Ht)``) is applied to the student's states first, to the masked
    tokens only. ``mse``: mean over features of the squared error; ``cosine``: 1 - cosine
    similarity. The projection's output is upcast to float32 (float64 stays float64).
    """
    if kind not in HIDDEN_LOSS_KINDS:
        raise ValueError(f"--hidden-loss {kind!r} is not supported: use one of {', '.join(HIDDEN_LOSS_KINDS)}")
    for name, tensor in (("student_hidden", student_hidden), ("teacher_hidden", teacher_hidden)):
        if tensor.dim() != 3 or not tensor.is_floating_point():
            raise ValueError(f"{name} must be a float tensor [batch, seq, hidden], got {tensor.dtype} {tuple(tensor.shape)}")
    batch, seq, _ = student_hidden.shape
    if teacher_hidden.shape[:2] != (batch, seq):
        raise ValueError(
            f"teacher_hidden {tuple(teacher_hidden.shape)} and student_hidden {tuple(student_hidden.shape)} differ in "
            "[batch, seq]: the teacher's outputs must be for the same batch the student ran on"
        )
    _check_same_device(student_hidden, teacher_hidden=teacher_hidden, mask=mask)
    student_size, teacher_size = student_hidden.shape[-1], teacher_hidden.shape[-1]
    if projection is None and student_size != teacher_size:
        raise ValueError(
            f"student hidden size {student_size} != teacher hidden size {teacher_size}: pass "
            f"projection=HiddenProjection({student_size}, {teacher_size}) (and train it with the student)"
        )
    token_index = _selected_tokens(mask, batch, seq)
    if token_index is not None and token_index.numel() == 0:
        return _connected_zero(student_hidden, *(projection.parameters() if projection is not None else ()))

    student = student_hidden.reshape(batch * seq, student_size)
    teacher = teacher_hidden.detach().reshape(batch * seq, teacher_size)
    if token_index is not None:
        student, teacher = student[token_index], teacher[token_index]
    if projection is not None:
        student = projection(student)
        if student.shape[-1] != teacher_size:
            raise ValueError(f"projection maps student hidden size {student_size} to {student.shape[-1]}, "
                             f"but the teacher's hidden size is {teacher_size}")
    compute_dtype = torch.promote_types(torch.promote_types(student.dtype, teacher.dtype), torch.float32)
    student, teacher = student.to(compute_dtype), teacher.to(compute_dtype)
    if kind == "mse":
        per_token = (student - teacher).square().mean(dim=-1)
    else:
        per_token = 1.0 - F.cosine_similarity(student, teacher, dim=-1)
    return per_token.mean()


# --------------------------------------------------------------------------- validation and helpers


def check_options(kind: str, temperature: float, jsd_beta: float, chunk_tokens: int) -> None:
    """The logit losses' settings, checked once for the trainer's flags and DistillationTrainer's arguments."""
    if kind not in LOSS_KINDS:
        raise ConfigError(f"--loss {kind!r} is not supported: use one of {', '.join(LOSS_KINDS)}")
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
        raise ConfigError(f"--temperature must be > 0 and finite, got {temperature!r}")
    if kind == "jsd" and not (isinstance(jsd_beta, (int, float)) and 0.0 < jsd_beta < 1.0):
        raise ConfigError(
            f"--jsd-beta must be strictly between 0 and 1, got {jsd_beta!r}: JSD(beta) vanishes at the ends; "
            "for the beta -> 0 limit use --loss forward_kl, for beta -> 1 use --loss reverse_kl"
        )
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ConfigError(f"--kd-chunk-tokens must be an int >= 1, got {chunk_tokens!r}")


def check_topk_tail(tail: str) -> None:
    if tail not in TOPK_TAILS:
        raise ConfigError(f"--topk-tail {tail!r} is not supported: use one of {', '.join(TOPK_TAILS)}")


def _check_logits(name: str, tensor: torch.Tensor) -> None:
    if tensor.dim() != 3 or not tensor.is_floating_point():
        raise ValueError(f"{name} must be a float tensor [batch, seq, vocab or k], got {tensor.dtype} {tuple(tensor.shape)}")


def _check_same_device(reference: torch.Tensor, **others: torch.Tensor | None) -> None:
    for name, tensor in others.items():
        if tensor is not None and tensor.device != reference.device:
            raise ValueError(f"{name} is on {tensor.device} but the student's tensor is on {reference.device}: "
                             "move the teacher's outputs to the student's device first")


def _check_topk_indices(indices: torch.Tensor, vocab: int) -> None:
    """Range and distinctness of the masked tokens' top-k indices (out of range would be a
    device-side assert on CUDA; a repeated index would silently count a vocabulary entry twice)."""
    if indices.numel() == 0:
        return
    low, high = int(indices.min()), int(indices.max())
    if low < 0 or high >= vocab:
        raise ValueError(f"teacher_topk_indices span [{low}, {high}] but the student vocab has {vocab} entries: "
                         "logit distillation needs the same tokenizer on both sides")
    if indices.shape[-1] > 1:
        ordered = indices.sort(dim=-1).values
        if bool((ordered[:, 1:] == ordered[:, :-1]).any()):
            raise ValueError("teacher_topk_indices repeat a vocabulary index within a token: top-k indices must be "
                             "distinct (as torch.topk returns them)")


def _selected_tokens(mask: torch.Tensor | None, batch: int, seq: int) -> torch.Tensor | None:
    """Flat indices (into batch * seq) of the tokens that count, or None when all do."""
    if mask is None:
        return None
    if tuple(mask.shape) != (batch, seq):
        raise ValueError(f"mask {tuple(mask.shape)} must be [batch, seq] = {(batch, seq)}")
    if mask.is_floating_point() or mask.is_complex():
        raise ValueError(f"mask must be bool or integer (1 = the token counts), got {mask.dtype}; "
                         "per-token weights are not supported")
    return torch.nonzero(mask.reshape(-1), as_tuple=False).squeeze(1)


def _connected_zero(*tensors: torch.Tensor) -> torch.Tensor:
    """A float32 zero attached to the graph of ``tensors`` (their gradients come out as zeros).

    Summing an empty slice rather than 0 * sum(x) keeps it 0 even when x holds inf.
    """
    zero = torch.zeros((), dtype=torch.float32, device=tensors[0].device)
    for tensor in tensors:
        zero = zero + tensor.reshape(-1)[:0].sum().to(torch.float32)
    return zero


# --------------------------------------------------------------------------- across tokenizers

CrossTokenizerLossKind = Literal["gold", "uld"]
CROSS_TOKENIZER_LOSS_KINDS = typing.get_args(CrossTokenizerLossKind)


def gold_loss(student_logits: torch.Tensor, projected: torch.Tensor, unmatched_mass: torch.Tensor,
              matched_ids: torch.Tensor, unmatched_topk: torch.Tensor | None = None, mask: torch.Tensor | None = None,
              *, chunk_tokens: int = 4096) -> torch.Tensor:
    """GOLD-style loss for a student with another tokenizer (TRL's GOLD trainer; ULD on the rest).

    `projected` [B, S, M] is the teacher's next-token distribution on the student ids
    `matched_ids` [M] (the entries whose bytes match exactly), `unmatched_mass` [B, S] the rest of
    it, `unmatched_topk` [B, S, k] the k largest teacher probabilities of that rest, sorted
    (distill_common/outputs/cross_tokenizer.py: ProjectedNext). Per aligned position (matched +
    unmatched = 1; all zeros where the teacher has no position ending where the student's text
    does), with q the student's softmax::

        sum_j p_j (log p_j - log q[matched_ids[j]])          direct KL on the matched entries
      + sum_i |sort(p_rest)_i - sort(q_rest)_i|, i < k      sorted L1 on the rest (ULD)

    q_rest is q with the matched ids left out. Without `unmatched_topk` the rest compares its mass
    alone: |unmatched_mass - (1 - sum_j q[matched_ids[j]])|. Averaged over the aligned positions the
    mask selects; float32 at temperature 1. Chunked over `chunk_tokens` positions, each chunk's
    [chunk, V] intermediates recomputed in backward (`torch.utils.checkpoint`) rather than kept.
    """
    _check_logits("student_logits", student_logits)
    batch, seq, vocab = student_logits.shape
    if projected.shape[:2] != (batch, seq) or projected.shape[-1] != matched_ids.numel():
        raise ValueError(f"projected {list(projected.shape)} must be [{batch}, {seq}, len(matched_ids) = "
                         f"{matched_ids.numel()}]")
    if unmatched_mass.shape != (batch, seq):
        raise ValueError(f"unmatched_mass {list(unmatched_mass.shape)} must be [{batch}, {seq}]")
    if unmatched_topk is not None and unmatched_topk.shape[:2] != (batch, seq):
        raise ValueError(f"unmatched_topk {list(unmatched_topk.shape)} must be [{batch}, {seq}, k]")
    if matched_ids.numel() and not 0 <= int(matched_ids.min()) <= int(matched_ids.max()) < vocab:
        raise ValueError(f"matched_ids must lie in [0, {vocab}) (the student's vocabulary)")
    selected = _aligned_positions(projected.sum(-1) + unmatched_mass, mask)
    rows = selected.nonzero(as_tuple=True)
    if not len(rows[0]):
        return _connected_zero(student_logits)
    matched_ids = matched_ids.to(student_logits.device).long()
    rest = unmatched_topk[rows].float() if unmatched_topk is not None and unmatched_topk.shape[-1] else None

    def chunk_loss(logits, p, mass, rest_p):
        log_q = torch.log_softmax(logits.float(), dim=-1)
        log_q_matched = log_q[:, matched_ids]
        kl = torch.where(p > 0, p * (torch.log(p.clamp_min(1e-38)) - log_q_matched), 0.0).sum(-1)
        if rest_p is None:
            return (kl + (mass - (1 - log_q_matched.exp().sum(-1))).abs()).sum()
        q_rest = log_q.exp().index_fill(1, matched_ids, 0.0)
        k = min(rest_p.shape[-1], vocab)
        return (kl + (rest_p[:, :k] - q_rest.topk(k, dim=-1).values).abs().sum(-1)).sum()

    tensors = (student_logits[rows], projected[rows].float(), unmatched_mass[rows].float(), rest)
    return _chunked_mean(chunk_loss, tensors, chunk_tokens)


def uld_loss(student_logits: torch.Tensor, sorted_probs: torch.Tensor, mask: torch.Tensor | None = None, *,
             chunk_tokens: int = 4096) -> torch.Tensor:
    """Universal Logit Distillation (Boizard et al., 2024) on the k largest probabilities: the L1
    distance between the teacher's sorted probabilities `sorted_probs` [B, S, k] (SortedProbs; all
    zeros where the teacher has no aligned position) and the student's k largest, sorted. No id
    is compared, so any two vocabularies meet. Averaged over the aligned positions the mask
    selects; float32 at temperature 1; chunked as `gold_loss` is."""
    _check_logits("student_logits", student_logits)
    batch, seq, vocab = student_logits.shape
    if sorted_probs.shape[:2] != (batch, seq):
        raise ValueError(f"sorted_probs {list(sorted_probs.shape)} must be [{batch}, {seq}, k]")
    selected = _aligned_positions(sorted_probs.sum(-1), mask)
    rows = selected.nonzero(as_tuple=True)
    if not len(rows[0]):
        return _connected_zero(student_logits)
    k = min(sorted_probs.shape[-1], vocab)

    def chunk_loss(logits, teacher):
        q = torch.softmax(logits.float(), dim=-1)
        return (teacher[:, :k] - q.topk(k, dim=-1).values).abs().sum()

    return _chunked_mean(chunk_loss, (student_logits[rows], sorted_probs[rows].float()), chunk_tokens)


def _aligned_positions(total_mass: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """The positions the teacher aligned (its probabilities there are not all zero) and the mask selects."""
    selected = total_mass.to(torch.float32) > 0
    if mask is not None:
        selected = selected & mask.to(selected.device).bool()
    return selected


def _chunked_mean(chunk_loss, tensors: tuple, chunk_tokens: int) -> torch.Tensor:
    """The mean over rows of `chunk_loss`'s per-chunk sums, `chunk_tokens` rows at a time; a chunk's
    intermediates are recomputed in backward when the student needs a gradient."""
    from torch.utils.checkpoint import checkpoint

    count = tensors[0].shape[0]
    total = tensors[0].new_zeros((), dtype=torch.float32)
    for start in range(0, count, chunk_tokens):
        parts = [None if t is None else t[start:start + chunk_tokens] for t in tensors]
        if torch.is_grad_enabled() and tensors[0].requires_grad:
            total = total + checkpoint(chunk_loss, *parts, use_reentrant=False)
        else:
            total = total + chunk_loss(*parts)
    return total / count
