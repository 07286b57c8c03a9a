"""KD with the teacher's head applied on the student equals KD on the logits the teacher would send.

The reference is the served path: the teacher's full logits computed the straightforward way
(h W^T + b, scaled, soft-capped as Gemma does), then `kd_loss`, or `torch.topk` of them and
`topk_kd_loss`. `kd_loss_from_hidden` never builds those logits for more than a chunk of rows.
"""

from __future__ import annotations

import pytest
import torch

from distill_common.outputs import OutputHead
from student_trainer.losses import LOSS_KINDS, kd_loss, kd_loss_from_hidden, topk_kd_loss

TOLERANCE = 1e-4  # float32
BATCH, SEQ, HIDDEN, VOCAB = 2, 11, 16, 40


def _head(variant: str, generator: torch.Generator) -> OutputHead:
    weight = torch.randn(VOCAB, HIDDEN, generator=generator) / HIDDEN ** 0.5 * 4
    if variant == "plain":
        return OutputHead(weight)
    # Gemma's final soft cap (small enough to bend the logits), Cohere's scale, a bias.
    return OutputHead(weight, torch.randn(VOCAB, generator=generator), final_logit_softcapping=3.0, logit_scale=0.7)


def _teacher_logits(hidden: torch.Tensor, head: OutputHead) -> torch.Tensor:
    logits = hidden @ head.weight.T
    if head.bias is not None:
        logits = logits + head.bias
    logits = logits * head.logit_scale
    if head.final_logit_softcapping:
        logits = head.final_logit_softcapping * torch.tanh(logits / head.final_logit_softcapping)
    return logits


@pytest.mark.parametrize("kind", LOSS_KINDS)
@pytest.mark.parametrize("variant", ["plain", "capped"])
@pytest.mark.parametrize("topk", [0, 6])
def test_head_on_student_equals_the_full_logit_path(kind, variant, topk):
    generator = torch.Generator().manual_seed(10 * LOSS_KINDS.index(kind) + 2 * (variant == "capped") + bool(topk))
    head = _head(variant, generator)
    hidden = torch.randn(BATCH, SEQ, HIDDEN, generator=generator)
    student = (2 * torch.randn(BATCH, SEQ, VOCAB, generator=generator)).requires_grad_()
    mask = torch.ones(BATCH, SEQ, dtype=torch.bool)
    mask[1, 7:] = False
    options = dict(kind=kind, temperature=1.5, jsd_beta=0.3)

    teacher = _teacher_logits(hidden, head)
    if variant == "capped":
        assert teacher.abs().max() < 3.0 and (teacher - teacher.clamp(-2, 2)).abs().max() > 0  # the cap bends them
    if topk:  # what TopK would send: log-probabilities at the temperature
        values, indices = torch.log_softmax(teacher / options["temperature"], dim=-1).topk(topk, dim=-1)
        want = topk_kd_loss(student, values, indices, mask, chunk_tokens=7, **options)
    else:
        want = kd_loss(student, teacher, mask, chunk_tokens=7, **options)
    (want_grad,) = torch.autograd.grad(want, student)
    for chunk in (1, 5, 64):
        got = kd_loss_from_hidden(student, hidden, head, mask, chunk_tokens=chunk, topk=topk, **options)
        (got_grad,) = torch.autograd.grad(got, student)
        assert want.item() > 1e-2
        assert abs(got.item() - want.item()) <= TOLERANCE, (chunk, got.item(), want.item())
        assert (got_grad - want_grad).abs().max().item() <= TOLERANCE, chunk


def test_without_a_mask_every_token_counts_and_no_grad_gives_the_value_only():
    generator = torch.Generator().manual_seed(1)
    head = _head("capped", generator)
    hidden = torch.randn(BATCH, SEQ, HIDDEN, generator=generator)
    student = torch.randn(BATCH, SEQ, VOCAB, generator=generator)
    want = kd_loss(student, _teacher_logits(hidden, head))
    with torch.no_grad():
        got = kd_loss_from_hidden(student, hidden, head, chunk_tokens=4)
    assert abs(got.item() - want.item()) <= TOLERANCE


def test_a_bf16_head_is_applied_in_bf16_as_the_teacher_does():
    generator = torch.Generator().manual_seed(2)
    head = _head("plain", generator)
    hidden = torch.randn(BATCH, SEQ, HIDDEN, generator=generator)
    half = OutputHead(head.weight.bfloat16())
    student = torch.randn(BATCH, SEQ, VOCAB, generator=generator, dtype=torch.bfloat16, requires_grad=True)
    # The teacher's logits in bf16 are its bf16 product; sent as bf16, that is what the student compares with.
    want = kd_loss(student, (hidden.bfloat16() @ half.weight.T))
    got = kd_loss_from_hidden(student, hidden.bfloat16(), half)
    got.backward()
    assert got.dtype == torch.float32 and student.grad.dtype == torch.bfloat16
    assert abs(got.item() - want.item()) <= 1e-3


def test_shapes_that_cannot_be_the_teachers_are_refused():
    head = OutputHead(torch.randn(VOCAB, HIDDEN))
    student = torch.randn(BATCH, SEQ, VOCAB)
    with pytest.raises(ValueError, match="does not take hidden states of width 8"):
        kd_loss_from_hidden(student, torch.randn(BATCH, SEQ, 8), head)
    with pytest.raises(ValueError, match="student vocab 41 != teacher vocab 40"):
        kd_loss_from_hidden(torch.randn(BATCH, SEQ, VOCAB + 1), torch.randn(BATCH, SEQ, HIDDEN), head)
    with pytest.raises(ValueError, match="differ in \\[batch, seq\\]"):
        kd_loss_from_hidden(student, torch.randn(BATCH, SEQ - 1, HIDDEN), head)
    with pytest.raises(ValueError, match="topk must be an int in \\[0, 40\\]"):
        kd_loss_from_hidden(student, torch.randn(BATCH, SEQ, HIDDEN), head, topk=VOCAB + 1)
