"""The distillation losses against straightforward float64 references written out in full here.

The references build whole [B, S, V] tensors and let autograd differentiate them; the losses
under test chunk over tokens and compute their gradients in closed form, so matching values
and gradients w.r.t. the student's logits checks both the math and the chunk bookkeeping.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from distill_common.settings import ConfigError
from student_trainer.losses import (
    HIDDEN_LOSS_KINDS,
    LOSS_KINDS,
    TAIL_FLOOR,
    TOPK_TAILS,
    HiddenProjection,
    hidden_state_loss,
    kd_loss,
    topk_kd_loss,
)

BATCH, SEQ, VOCAB, TOPK = 3, 17, 50, 8
TEMPERATURE = 2.0
JSD_BETA = 0.3
RTOL, ATOL = 1e-5, 1e-6


# --------------------------------------------------------------------------- references


def reference_per_token(student_logits, teacher_logits, kind, temperature, beta):
    """Divergence per token in float64, the textbook way: p teacher, q student."""
    log_q = torch.log_softmax(student_logits.double() / temperature, dim=-1)
    log_p = torch.log_softmax(teacher_logits.double() / temperature, dim=-1)
    return reference_divergence(log_p, log_q, kind, beta)


def masked_mean(per_token, mask):
    weights = torch.ones_like(per_token) if mask is None else mask.double()
    return (per_token * weights).sum() / weights.sum()


def reference_kd(student_logits, teacher_logits, mask, kind, temperature, beta):
    per_token = reference_per_token(student_logits, teacher_logits, kind, temperature, beta)
    return temperature**2 * masked_mean(per_token, mask)


def reference_divergence(log_p, log_q, kind, beta):
    """The divergence per row between two distributions given by their log-probabilities."""
    p, q = log_p.exp(), log_q.exp()
    if kind == "forward_kl":
        return (p * (log_p - log_q)).sum(-1)
    if kind == "reverse_kl":
        return (q * (log_q - log_p)).sum(-1)
    log_m = (beta * p + (1 - beta) * q).log()
    return beta * (p * (log_p - log_m)).sum(-1) + (1 - beta) * (q * (log_q - log_m)).sum(-1)


def reference_topk(student_logits, logprobs, indices, mask, kind, temperature, beta, tail="bucket"):
    """The top-k loss the long way: the student's full softmax, and the teacher's k
    log-probabilities (already at the temperature) with its tail 1 - sum exp as one outcome
    ("bucket") or dropped ("none")."""
    q = torch.softmax(student_logits.double() / temperature, dim=-1)
    ids = indices.long()
    p_k = logprobs.double().exp()
    q_k = q.gather(-1, ids)
    teacher_tail = (1 - p_k.sum(-1, keepdim=True)).clamp_min(TAIL_FLOOR)
    if tail == "none":
        p, q = p_k / p_k.sum(-1, keepdim=True), q_k / q_k.sum(-1, keepdim=True)
    else:
        p = torch.cat([p_k, teacher_tail], -1)
        q = torch.cat([q_k, q.sum(-1, keepdim=True) - q_k.sum(-1, keepdim=True)], -1)  # the rest of the student
    p = p / p.sum(-1, keepdim=True)
    per_token = reference_divergence(p.log(), q.log(), kind, beta)
    return temperature**2 * masked_mean(per_token, mask)


# --------------------------------------------------------------------------- inputs


def make_inputs(seed=0, *, batch=BATCH, seq=SEQ, vocab=VOCAB, student_dtype=torch.float32, teacher_dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    # Scale 3 gives peaked distributions, where softmax precision and small probabilities matter.
    student = (3 * torch.randn(batch, seq, vocab, generator=gen)).to(student_dtype).requires_grad_()
    teacher = (3 * torch.randn(batch, seq, vocab, generator=gen)).to(teacher_dtype)
    mask = torch.rand(batch, seq, generator=gen) > 0.3
    mask[0, 0] = True
    return student, teacher, mask


def reference_grad(fn, student, *args):
    """(value, gradient w.r.t. student) of a reference evaluated on a float64 copy of ``student``."""
    student64 = student.detach().double().requires_grad_()
    value = fn(student64, *args)
    value.backward()
    return value.detach(), student64.grad


def assert_close(actual, expected, rtol=RTOL, atol=ATOL):
    torch.testing.assert_close(actual.double(), expected.double(), rtol=rtol, atol=atol)


# --------------------------------------------------------------------------- full-logit loss


@pytest.mark.parametrize("chunk_tokens", [7, 4096])
@pytest.mark.parametrize("kind", LOSS_KINDS)
def test_kd_loss_matches_reference(kind, chunk_tokens):
    student, teacher, mask = make_inputs()
    loss = kd_loss(student, teacher, mask, kind=kind, temperature=TEMPERATURE, jsd_beta=JSD_BETA,
                   chunk_tokens=chunk_tokens)
    loss.backward()
    expected, expected_grad = reference_grad(reference_kd, student, teacher, mask, kind, TEMPERATURE, JSD_BETA)
    assert loss.dtype == torch.float32 and loss.dim() == 0
    assert_close(loss, expected)
    assert_close(student.grad, expected_grad)
    assert (student.grad[~mask] == 0).all(), "padding tokens must get no gradient"


@pytest.mark.parametrize("kind", LOSS_KINDS)
def test_kd_loss_without_mask_counts_every_token(kind):
    student, teacher, _ = make_inputs(seed=1)
    loss = kd_loss(student, teacher, kind=kind, temperature=0.7, jsd_beta=0.8, chunk_tokens=5)
    loss.backward()
    expected, expected_grad = reference_grad(reference_kd, student, teacher, None, kind, 0.7, 0.8)
    assert_close(loss, expected)
    assert_close(student.grad, expected_grad)


@pytest.mark.parametrize("kind", LOSS_KINDS)
def test_kd_loss_float64_gradient_is_exact(kind):
    """In float64 the closed-form gradient must agree with autograd to rounding, not just to float32."""
    student, teacher, mask = make_inputs(seed=2, student_dtype=torch.float64, teacher_dtype=torch.float64)
    loss = kd_loss(student, teacher, mask, kind=kind, temperature=1.5, jsd_beta=JSD_BETA, chunk_tokens=4)
    loss.backward()
    expected, expected_grad = reference_grad(reference_kd, student, teacher, mask, kind, 1.5, JSD_BETA)
    assert loss.dtype == torch.float64
    assert_close(loss, expected, rtol=1e-12, atol=1e-13)
    assert_close(student.grad, expected_grad, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("kind", LOSS_KINDS)
def test_kd_loss_bf16_teacher(kind):
    student, teacher, mask = make_inputs(seed=3, teacher_dtype=torch.bfloat16)
    loss = kd_loss(student, teacher, mask, kind=kind, temperature=TEMPERATURE, jsd_beta=JSD_BETA, chunk_tokens=7)
    loss.backward()
    # The reference sees the same bf16-rounded teacher values, upcast.
    expected, expected_grad = reference_grad(reference_kd, student, teacher, mask, kind, TEMPERATURE, JSD_BETA)
    assert loss.dtype == torch.float32
    assert_close(loss, expected)
    assert_close(student.grad, expected_grad)


@pytest.mark.parametrize("kind", LOSS_KINDS)
def test_kd_loss_bf16_student_gets_bf16_gradient(kind):
    student, teacher, mask = make_inputs(seed=4, student_dtype=torch.bfloat16, teacher_dtype=torch.bfloat16)
    loss = kd_loss(student, teacher, mask, kind=kind, temperature=TEMPERATURE, jsd_beta=JSD_BETA, chunk_tokens=7)
    loss.backward()
    expected, expected_grad = reference_grad(reference_kd, student, teacher, mask, kind, TEMPERATURE, JSD_BETA)
    assert loss.dtype == torch.float32 and student.grad.dtype == torch.bfloat16
    assert_close(loss, expected)  # the loss itself is accumulated in float32
    assert_close(student.grad, expected_grad, rtol=1e-2, atol=1e-5)  # only the stored gradient is rounded


def test_kd_loss_scales_gradient_by_upstream_gradient():
    student, teacher, mask = make_inputs(seed=5)
    (0.25 * kd_loss(student, teacher, mask, kind="jsd", chunk_tokens=7)).backward()
    _, expected_grad = reference_grad(lambda s: 0.25 * reference_kd(s, teacher, mask, "jsd", 1.0, 0.5), student)
    assert_close(student.grad, expected_grad)


def test_kd_loss_supports_retain_graph_and_second_backward():
    student, teacher, mask = make_inputs(seed=6)
    loss = kd_loss(student, teacher, mask, kind="reverse_kl", chunk_tokens=7)
    loss.backward(retain_graph=True)
    first = student.grad.clone()
    loss.backward()
    assert_close(student.grad, 2 * first)


def test_kd_loss_flows_through_a_non_leaf_and_not_into_the_teacher():
    student, teacher, mask = make_inputs(seed=7)
    weight = torch.tensor(1.5, requires_grad=True)
    teacher.requires_grad_()
    loss = kd_loss(student * weight, teacher, mask, chunk_tokens=7)
    loss.backward()
    _, expected_grad = reference_grad(lambda s: reference_kd(s * 1.5, teacher.detach(), mask, "forward_kl", 1.0, 0.5),
                                      student)
    assert_close(student.grad, expected_grad)
    assert weight.grad is not None and teacher.grad is None


def test_kd_loss_under_no_grad_gives_the_value_only():
    student, teacher, mask = make_inputs(seed=8)
    with torch.no_grad():
        loss = kd_loss(student, teacher, mask, kind="jsd", chunk_tokens=7)
    assert loss.grad_fn is None
    assert_close(loss, reference_kd(student.detach(), teacher, mask, "jsd", 1.0, 0.5))


@pytest.mark.parametrize("kind", LOSS_KINDS)
def test_kd_loss_zero_probabilities_contribute_nothing(kind):
    """Vocabulary entries at -inf on both sides (e.g. padding) act as if they were not there."""
    student, teacher, mask = make_inputs(seed=9)
    dead = torch.zeros(VOCAB, dtype=torch.bool)
    dead[[3, 17, 40]] = True
    student_masked = student.detach().masked_fill(dead, float("-inf")).requires_grad_()
    loss = kd_loss(student_masked, teacher.masked_fill(dead, float("-inf")), mask, kind=kind, chunk_tokens=7)
    loss.backward()
    live_student = student.detach()[..., ~dead].requires_grad_()
    expected = kd_loss(live_student, teacher[..., ~dead], mask, kind=kind, chunk_tokens=7)
    expected.backward()
    assert torch.isfinite(loss)
    assert_close(loss, expected)
    assert_close(student_masked.grad[..., ~dead], live_student.grad)
    assert (student_masked.grad[..., dead] == 0).all()


def test_kd_loss_identical_distributions_give_zero():
    student, _, mask = make_inputs(seed=10)
    for kind in LOSS_KINDS:
        loss = kd_loss(student, student.detach(), mask, kind=kind, temperature=3.0, chunk_tokens=7)
        assert abs(loss.item()) < 1e-6


# --------------------------------------------------------------------------- top-k loss


def make_topk(teacher, k=TOPK, index_dtype=torch.int64, temperature=1.0):
    """What TopK sends: the teacher's k largest log-probabilities at `temperature` and their ids."""
    logprobs = torch.log_softmax(teacher.float() / temperature, dim=-1).to(teacher.dtype)
    values, indices = torch.topk(logprobs, k, dim=-1)
    return values, indices.to(index_dtype)


@pytest.mark.parametrize(("chunk_tokens", "index_dtype"), [(7, torch.int32), (4096, torch.int64)])
@pytest.mark.parametrize("kind", LOSS_KINDS)
def test_topk_kd_loss_matches_reference(kind, chunk_tokens, index_dtype):
    student, teacher, mask = make_inputs(seed=11)
    values, indices = make_topk(teacher, index_dtype=index_dtype, temperature=TEMPERATURE)
    for tail in TOPK_TAILS:
        student.grad = None
        loss = topk_kd_loss(student, values, indices, mask, kind=kind, temperature=TEMPERATURE, jsd_beta=JSD_BETA,
                            chunk_tokens=chunk_tokens, tail=tail)
        loss.backward()
        expected, expected_grad = reference_grad(reference_topk, student, values, indices, mask, kind, TEMPERATURE,
                                                 JSD_BETA, tail)
        assert_close(loss, expected)
        assert_close(student.grad, expected_grad)
        assert (student.grad[~mask] == 0).all()
        if tail == "none":
            off_support = torch.ones_like(student.grad, dtype=torch.bool).scatter_(-1, indices.long(), False)
            assert (student.grad[off_support] == 0).all()


@pytest.mark.parametrize("kind", LOSS_KINDS)
def test_topk_kd_loss_float64_is_exact(kind):
    """In float64 the closed-form gradient through the tail bucket agrees with autograd to rounding."""
    student, teacher, mask = make_inputs(seed=17, student_dtype=torch.float64, teacher_dtype=torch.float64)
    values, indices = make_topk(teacher, temperature=1.5)
    for tail in TOPK_TAILS:
        student.grad = None
        loss = topk_kd_loss(student, values, indices, mask, kind=kind, temperature=1.5, jsd_beta=JSD_BETA,
                            chunk_tokens=4, tail=tail)
        loss.backward()
        expected, expected_grad = reference_grad(reference_topk, student, values, indices, mask, kind, 1.5, JSD_BETA,
                                                 tail)
        assert_close(loss, expected, rtol=1e-12, atol=1e-13)
        assert_close(student.grad, expected_grad, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("kind", LOSS_KINDS)
def test_topk_kd_loss_bf16_teacher_and_no_mask(kind):
    student, teacher, _ = make_inputs(seed=12, teacher_dtype=torch.bfloat16)
    values, indices = make_topk(teacher, index_dtype=torch.int32, temperature=0.5)
    loss = topk_kd_loss(student, values, indices, kind=kind, temperature=0.5, jsd_beta=0.9, chunk_tokens=7)
    loss.backward()
    expected, expected_grad = reference_grad(reference_topk, student, values, indices, None, kind, 0.5, 0.9)
    assert_close(loss, expected)
    assert_close(student.grad, expected_grad)


def test_topk_with_the_full_vocabulary_equals_the_full_loss():
    student, teacher, mask = make_inputs(seed=13)
    values, indices = make_topk(teacher, k=VOCAB, temperature=TEMPERATURE)
    for kind in LOSS_KINDS:
        full = kd_loss(student, teacher, mask, kind=kind, temperature=TEMPERATURE, chunk_tokens=7)
        for tail in TOPK_TAILS:
            topk = topk_kd_loss(student, values, indices, mask, kind=kind, temperature=TEMPERATURE, chunk_tokens=7,
                                tail=tail)
            assert_close(topk, full)


def test_the_tail_bucket_bounds_the_full_loss_from_below():
    """Merging outcomes never increases a divergence: k ids + the rest is at most the full KD loss,
    and more ids close the gap."""
    student, teacher, mask = make_inputs(seed=18)
    full = kd_loss(student, teacher, mask, temperature=TEMPERATURE).item()
    gaps = []
    for k in (1, 8, 32):
        values, indices = make_topk(teacher, k=k, temperature=TEMPERATURE)
        gaps.append(full - topk_kd_loss(student, values, indices, mask, temperature=TEMPERATURE).item())
    assert all(gap >= -1e-6 for gap in gaps) and gaps[0] > gaps[1] > gaps[2], gaps


def test_topk_ignores_garbage_at_padding_positions():
    student, teacher, mask = make_inputs(seed=14)
    values, indices = make_topk(teacher)
    indices[~mask] = -1  # what a sender might leave in padding: out of range and repeated
    loss = topk_kd_loss(student, values, indices, mask, chunk_tokens=7)
    clean_values, clean_indices = make_topk(teacher)
    assert_close(loss, reference_topk(student.detach(), clean_values, clean_indices, mask, "forward_kl", 1.0, 0.5))


# --------------------------------------------------------------------------- empty masks


def test_all_masked_gives_a_connected_zero():
    student, teacher, _ = make_inputs(seed=15)
    student.detach().view(-1)[0] = float("inf")  # 0 * sum(x) would be NaN here
    nothing = torch.zeros(BATCH, SEQ, dtype=torch.int64)
    values, indices = make_topk(teacher)
    for loss in (
        kd_loss(student, teacher, nothing, kind="jsd"),
        topk_kd_loss(student, values, indices, nothing, kind="reverse_kl"),
    ):
        assert loss.item() == 0.0 and loss.dtype == torch.float32 and loss.requires_grad
        student.grad = None
        loss.backward()
        assert student.grad is not None and (student.grad == 0).all()


def test_hidden_all_masked_gives_a_connected_zero():
    gen = torch.Generator().manual_seed(16)
    student = torch.randn(BATCH, SEQ, 6, generator=gen, requires_grad=True)
    projection = HiddenProjection(6, 10)
    loss = hidden_state_loss(student, torch.randn(BATCH, SEQ, 10, generator=gen),
                             torch.zeros(BATCH, SEQ, dtype=torch.bool), projection=projection)
    loss.backward()
    assert loss.item() == 0.0
    assert (student.grad == 0).all() and (projection.weight.grad == 0).all()


# --------------------------------------------------------------------------- hidden states


def reference_hidden(student_hidden, teacher_hidden, mask, kind, weight):
    student = student_hidden.double() if weight is None else student_hidden.double() @ weight.double().T
    teacher = teacher_hidden.double()
    if kind == "mse":
        per_token = ((student - teacher) ** 2).mean(-1)
    else:
        per_token = 1 - (student * teacher).sum(-1) / (student.norm(dim=-1) * teacher.norm(dim=-1))
    return masked_mean(per_token, mask)


@pytest.mark.parametrize("kind", HIDDEN_LOSS_KINDS)
def test_hidden_state_loss_with_projection_matches_reference(kind):
    gen = torch.Generator().manual_seed(17)
    student = torch.randn(BATCH, SEQ, 6, generator=gen, requires_grad=True)
    teacher = torch.randn(BATCH, SEQ, 10, generator=gen).to(torch.bfloat16)
    mask = torch.rand(BATCH, SEQ, generator=gen) > 0.3
    projection = HiddenProjection(6, 10)
    with torch.no_grad():  # away from the init, so the test does not depend on it
        projection.weight.add_(0.1 * torch.randn(10, 6, generator=gen))

    loss = hidden_state_loss(student, teacher, mask, kind=kind, projection=projection)
    loss.backward()

    student64 = student.detach().double().requires_grad_()
    weight64 = projection.weight.detach().double().requires_grad_()
    expected = reference_hidden(student64, teacher, mask, kind, weight64)
    expected.backward()
    assert loss.dtype == torch.float32
    assert_close(loss, expected)
    assert_close(student.grad, student64.grad)
    assert_close(projection.weight.grad, weight64.grad)


@pytest.mark.parametrize("kind", HIDDEN_LOSS_KINDS)
def test_hidden_state_loss_same_size_without_projection(kind):
    gen = torch.Generator().manual_seed(18)
    student = torch.randn(BATCH, SEQ, 12, generator=gen, requires_grad=True)
    teacher = torch.randn(BATCH, SEQ, 12, generator=gen)
    loss = hidden_state_loss(student, teacher, kind=kind)
    loss.backward()
    expected, expected_grad = reference_grad(reference_hidden, student, teacher, None, kind, None)
    assert_close(loss, expected)
    assert_close(student.grad, expected_grad)


def test_hidden_projection_init():
    assert torch.equal(HiddenProjection(7, 7).weight, torch.eye(7))
    up = HiddenProjection(4, 9).weight.detach()  # columns orthonormal: norms preserved
    torch.testing.assert_close(up.T @ up, torch.eye(4), atol=1e-5, rtol=0)
    down = HiddenProjection(9, 4).weight.detach()  # rows orthonormal
    torch.testing.assert_close(down @ down.T, torch.eye(4), atol=1e-5, rtol=0)
    x = torch.randn(2, 3, 4)
    projected = HiddenProjection(4, 9)(x.to(torch.bfloat16))  # casts to the weight's dtype
    assert projected.shape == (2, 3, 9) and projected.dtype == torch.float32


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(kind="kl"), "--loss 'kl'"),
        (dict(temperature=0.0), "--temperature must be > 0"),
        (dict(temperature=float("nan")), "--temperature must be > 0"),
        (dict(kind="jsd", jsd_beta=0.0), "--jsd-beta must be strictly between 0 and 1"),
        (dict(kind="jsd", jsd_beta=1.0), "use --loss reverse_kl"),
        (dict(chunk_tokens=0), "--kd-chunk-tokens"),
        (dict(tail="fitted"), "--topk-tail 'fitted'"),
    ],
)
def test_options_are_validated(kwargs, message):
    student, teacher, mask = make_inputs()
    values, indices = make_topk(teacher)
    if "tail" not in kwargs:
        with pytest.raises(ConfigError, match=message):
            kd_loss(student, teacher, mask, **kwargs)
    with pytest.raises(ConfigError, match=message):
        topk_kd_loss(student, values, indices, mask, **kwargs)


def test_jsd_beta_is_not_checked_for_other_kinds():
    student, teacher, mask = make_inputs()
    kd_loss(student, teacher, mask, kind="forward_kl", jsd_beta=0.0)


def test_shape_errors_say_what_is_wrong():
    student, teacher, mask = make_inputs()
    with pytest.raises(ValueError, match="student vocab 50 != teacher vocab 64: logit distillation needs the same tokenizer"):
        kd_loss(student, torch.randn(BATCH, SEQ, 64), mask)
    with pytest.raises(ValueError, match=r"differ in \[batch, seq\]"):
        kd_loss(student, teacher[:, :-1], mask[:, :-1])
    with pytest.raises(ValueError, match=r"mask \(3, 16\) must be \[batch, seq\]"):
        kd_loss(student, teacher, mask[:, :-1])
    with pytest.raises(ValueError, match="mask must be bool or integer"):
        kd_loss(student, teacher, mask.float())
    with pytest.raises(ValueError, match="float tensor"):
        kd_loss(student[0], teacher[0])

    values, indices = make_topk(teacher)
    with pytest.raises(ValueError, match="int32 or int64"):
        topk_kd_loss(student, values, indices.float(), mask)
    with pytest.raises(ValueError, match=r"span \[0, 50\] but the student vocab has 50"):
        topk_kd_loss(student, values, indices.masked_fill(indices == indices.max(), 50), mask)
    with pytest.raises(ValueError, match="must be distinct"):
        topk_kd_loss(student, values, indices[..., :1].expand(-1, -1, TOPK), mask)

    hidden = torch.randn(BATCH, SEQ, 6)
    with pytest.raises(ValueError, match=r"pass projection=HiddenProjection\(6, 10\)"):
        hidden_state_loss(hidden, torch.randn(BATCH, SEQ, 10))
    with pytest.raises(ValueError, match="--hidden-loss 'l1'"):
        hidden_state_loss(hidden, hidden, kind="l1")
    with pytest.raises(ValueError, match="the teacher's hidden size is 10"):
        hidden_state_loss(hidden, torch.randn(BATCH, SEQ, 10), projection=HiddenProjection(6, 8))


# --------------------------------------------------------------------------- memory

_PEAK_MEMORY_SCRIPT = """
import sys, torch
from student_trainer.losses import kd_loss

def status_kb(key):
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(key + ":"))

kd_loss(torch.randn(1, 4, 16, requires_grad=True), torch.randn(1, 4, 16), kind="jsd").backward()  # warm-up allocations
student = torch.randn(1, 1024, 16000, requires_grad=True)
teacher = torch.randn(1, 1024, 16000)
# The peak from here: "5" resets the process's high-water mark (VmHWM) to its current RSS, so an
# earlier, higher peak (imports, the inputs' own temporaries) cannot hide this one.
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
baseline_kb = status_kb("VmRSS")
kd_loss(student, teacher, kind="jsd", chunk_tokens=int(sys.argv[1])).backward()
print(status_kb("VmHWM") - baseline_kb)
"""


def _peak_kb(chunk_tokens: int) -> int:
    """The high-water mark a JSD forward+backward adds, in a fresh process of its own (one
    measurement per process: memory freed by an earlier one could be reused unseen)."""
    # A fixed mmap threshold: glibc's sliding one keeps freed large blocks on the heap, where a
    # later allocation may reuse them unseen; mmapped blocks go back at free, so the peak is live.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
    result = subprocess.run([sys.executable, "-c", _PEAK_MEMORY_SCRIPT, str(chunk_tokens)], capture_output=True,
                            text=True, timeout=120, cwd=Path(__file__).resolve().parent.parent, check=True, env=env)
    return int(result.stdout.split()[-1])


@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK), reason="needs Linux's /proc/self/clear_refs")
def test_chunking_bounds_peak_memory_in_forward_and_backward():
    """Peak memory above the inputs is the one gradient buffer plus a chunk's temporaries, not
    [tokens, vocab] float32 temporaries."""
    logits_kb = 1024 * 16000 * 4 / 1024
    chunked_kb, whole_kb = _peak_kb(32), _peak_kb(1024)
    # How many of JSD's float32 temporaries are alive at once in one chunk depends on the
    # allocator (seen: 2.6x to 6.4x); that the measurement sees more than the gradient buffer (1x)
    # is what counts.
    assert whole_kb > 1.5 * logits_kb, "one chunk: the measurement must see JSD's float32 temporaries"
    assert chunked_kb < 2 * logits_kb, "chunked: the gradient buffer (1x the logits) and small chunk temporaries"
    assert whole_kb > chunked_kb + logits_kb / 2, (chunked_kb, whole_kb)


# --------------------------------------------------------------------------- across tokenizers


def _cross_inputs(seed: int = 0, matched: int = 20, rest_k: int = 6):
    """Student logits, and a teacher distribution over its own vocabulary of 70 ids, projected
    onto `matched` student ids the straightforward way; some positions unaligned (all zeros)."""
    generator = torch.Generator().manual_seed(seed)
    student = torch.randn(BATCH, SEQ, VOCAB, generator=generator, dtype=torch.float64) * 2
    matched_ids = torch.randperm(VOCAB, generator=generator)[:matched].sort().values
    teacher = torch.softmax(torch.randn(BATCH, SEQ, 70, generator=generator, dtype=torch.float64) * 2, -1)
    projected, rest = teacher[..., :matched], teacher[..., matched:]  # teacher ids < matched match column j
    unaligned = torch.rand(BATCH, SEQ, generator=generator) < 0.2
    projected = projected.masked_fill(unaligned[..., None], 0.0)
    mass = rest.sum(-1).masked_fill(unaligned, 0.0)
    rest_topk = rest.sort(-1, descending=True).values[..., :rest_k].masked_fill(unaligned[..., None], 0.0)
    sorted_probs = teacher.sort(-1, descending=True).values[..., :rest_k].masked_fill(unaligned[..., None], 0.0)
    mask = torch.rand(BATCH, SEQ, generator=generator) > 0.1
    return student, projected, mass, matched_ids, rest_topk, sorted_probs, mask, ~unaligned & mask


def reference_gold(student, projected, mass, matched_ids, rest_topk, selected):
    """Position by position, in float64."""
    losses = []
    for b in range(student.shape[0]):
        for t in range(student.shape[1]):
            if not selected[b, t]:
                continue
            q = torch.softmax(student[b, t].double(), -1)
            p = projected[b, t].double()
            kl = sum(p[j] * (torch.log(p[j]) - torch.log(q[matched_ids[j]])) for j in range(len(p)) if p[j] > 0)
            others = [i for i in range(len(q)) if i not in set(matched_ids.tolist())]
            if rest_topk is None:
                rest = (mass[b, t] - q[others].sum()).abs()
            else:
                k = rest_topk.shape[-1]
                rest = (rest_topk[b, t].double() - q[others].sort(descending=True).values[:k]).abs().sum()
            losses.append(kl + rest)
    return torch.stack(losses).mean()


def reference_uld(student, sorted_probs, selected):
    losses = []
    for b in range(student.shape[0]):
        for t in range(student.shape[1]):
            if selected[b, t]:
                q = torch.softmax(student[b, t].double(), -1).sort(descending=True).values[:sorted_probs.shape[-1]]
                losses.append((sorted_probs[b, t].double() - q).abs().sum())
    return torch.stack(losses).mean()


@pytest.mark.parametrize("with_rest", [True, False])
@pytest.mark.parametrize("chunk_tokens", [1, 7, 4096])
def test_gold_loss_and_gradient_match_the_reference(with_rest, chunk_tokens):
    from student_trainer.losses import gold_loss

    student, projected, mass, matched_ids, rest_topk, _, mask, selected = _cross_inputs()
    rest = rest_topk if with_rest else None
    ours_in = student.float().requires_grad_()
    ours = gold_loss(ours_in, projected.float(), mass.float(), matched_ids, None if rest is None else rest.float(),
                     mask, chunk_tokens=chunk_tokens)
    ref_in = student.clone().requires_grad_()
    reference = reference_gold(ref_in, projected, mass, matched_ids, rest, selected)
    ours.backward()
    reference.backward()
    assert ours.item() == pytest.approx(reference.item(), rel=1e-5)
    torch.testing.assert_close(ours_in.grad.double(), ref_in.grad, rtol=1e-4, atol=1e-6)
    assert ours_in.grad[~selected].abs().sum() == 0  # unaligned and masked positions learn nothing


@pytest.mark.parametrize("chunk_tokens", [1, 7, 4096])
def test_uld_loss_and_gradient_match_the_reference(chunk_tokens):
    from student_trainer.losses import uld_loss

    student, *_, sorted_probs, mask, selected = _cross_inputs(seed=1)
    ours_in = student.float().requires_grad_()
    ours = uld_loss(ours_in, sorted_probs.float(), mask, chunk_tokens=chunk_tokens)
    ref_in = student.clone().requires_grad_()
    reference = reference_uld(ref_in, sorted_probs, selected)
    ours.backward()
    reference.backward()
    assert ours.item() == pytest.approx(reference.item(), rel=1e-5)
    torch.testing.assert_close(ours_in.grad.double(), ref_in.grad, rtol=1e-4, atol=1e-6)


def test_cross_tokenizer_losses_of_nothing_aligned_are_a_connected_zero():
    from student_trainer.losses import gold_loss, uld_loss

    student = torch.randn(2, 3, VOCAB, requires_grad=True)
    zeros = torch.zeros(2, 3, 4)
    for loss in (gold_loss(student, zeros, torch.zeros(2, 3), torch.arange(4)), uld_loss(student, zeros)):
        loss.backward()
        assert loss.item() == 0 and student.grad.abs().sum() == 0
    with pytest.raises(ValueError, match="matched_ids must lie in"):
        gold_loss(student, zeros, torch.zeros(2, 3), torch.tensor([0, 1, 2, VOCAB]))
