"""The attention-relation loss (MiniLMv2) against a dense reference written the straightforward way:
the whole [S, S] relation of every head, masked, softmaxed, compared, differentiated by autograd.

The blocked loss must give the same value and the same gradient (float64) whatever the block size,
head counts and widths, and padding; and its memory must grow linearly with the sequence length
for a fixed block, where the dense one grows quadratically.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

from distill_common.settings import ConfigError
from student_trainer.losses import attention_relation_loss, relation_kl
from tests.helpers import ROOT

TOLERANCE = 1e-9  # float64; the bar is 1e-5


def dense_relation_kl(student, teacher, mask, heads):
    """KL(teacher relation || student relation), every head's [S, S] relation built whole."""
    batch, seq, _ = student.shape
    valid = torch.ones(batch, seq, dtype=torch.bool) if mask is None else mask.bool()
    causal = torch.tril(torch.ones(seq, seq, dtype=torch.bool))
    allowed = (causal[None, None] & valid[:, None, None, :]) | torch.eye(seq, dtype=torch.bool)[None, None]

    def log_relation(states):
        width = states.shape[-1] // heads
        split = states.reshape(batch, seq, heads, width).transpose(1, 2)
        scores = split @ split.transpose(-1, -2) / math.sqrt(width)
        return scores.masked_fill(~allowed, -math.inf).log_softmax(dim=-1)

    log_p, log_q = log_relation(teacher), log_relation(student)
    per_row = (log_p.exp() * (log_p - log_q)).masked_fill(~allowed, 0.0).sum(dim=-1)  # [B, R, S]
    return (per_row * valid[:, None, :]).sum() / (heads * valid.sum())


def _states(batch, seq, width, seed, requires_grad=False):
    generator = torch.Generator().manual_seed(seed)
    # Scaled so that relations are peaked, not uniform: the comparison then means something.
    states = 2.0 * torch.randn(batch, seq, width, generator=generator, dtype=torch.float64)
    return states.requires_grad_(requires_grad)


def _mask(kind: str, batch: int, seq: int):
    if kind == "none":
        return None
    mask = torch.ones(batch, seq, dtype=torch.int64)
    if kind == "right":
        mask[0, seq - 4:] = 0
        mask[-1, 3:] = 0
    elif kind == "left":  # left padding: a padding row that sees no real token before it
        mask[0, :5] = 0
    elif kind == "holes":
        mask[:, 1::3] = 0
    return mask


# (student width, teacher width, relation heads, padding, block rows): other head counts and
# widths on each side, each kind of padding, blocks of one row, blocks that do not divide S = 13,
# one block for all rows and a block longer than S.
CASES = [(24, 24, 4, "none", 5), (24, 48, 4, "right", 1), (16, 40, 8, "left", 5), (30, 12, 6, "holes", 13),
         (24, 48, 4, "holes", 64), (16, 40, 8, "right", 3), (30, 12, 6, "left", 4), (24, 24, 4, "right", 13)]


@pytest.mark.parametrize("student_width, teacher_width, heads, mask_kind, block", CASES)
def test_blocked_relation_kl_equals_the_dense_reference_in_value_and_gradient(student_width, teacher_width, heads,
                                                                               mask_kind, block):
    batch, seq = 2, 13
    student = _states(batch, seq, student_width, seed=1, requires_grad=True)
    teacher = _states(batch, seq, teacher_width, seed=2)
    mask = _mask(mask_kind, batch, seq)

    want = dense_relation_kl(student, teacher, mask, heads)
    (want_grad,) = torch.autograd.grad(want, student)
    got = relation_kl(student, teacher, mask, relation_heads=heads, block_rows=block)
    (got_grad,) = torch.autograd.grad(got, student)
    assert got.dtype == torch.float64 and want.item() > 0.05  # a relation that differs, not a trivial 0
    assert abs(got.item() - want.item()) <= TOLERANCE
    assert (got_grad - want_grad).abs().max().item() <= TOLERANCE


def test_the_three_relations_are_summed_and_the_teacher_gets_no_gradient():
    student = [_states(2, 9, width, seed=i, requires_grad=True) for i, width in enumerate((32, 16, 16))]
    teacher = [_states(2, 9, width, seed=10 + i, requires_grad=True) for i, width in enumerate((64, 16, 32))]
    mask = _mask("right", 2, 9)
    got = attention_relation_loss(student, teacher, mask, relation_heads=4, block_rows=4)
    want = sum(dense_relation_kl(s, t, mask, 4) for s, t in zip(student, teacher))
    assert abs(got.item() - want.item()) <= TOLERANCE
    got.backward()
    assert all(s.grad is not None for s in student) and all(t.grad is None for t in teacher)


def test_equal_relations_give_zero_whatever_the_widths():
    states = _states(1, 11, 32, seed=3, requires_grad=True)
    assert relation_kl(states, states.detach(), relation_heads=4).abs().item() <= 1e-12
    # Each relation head's vectors written twice over: dot products double and so does the width,
    # so scores scaled by 1/sqrt(d) differ; scaled by sqrt(2) more they are the same relation.
    doubled = torch.cat([states.reshape(1, 11, 4, 8)] * 2, dim=-1).reshape(1, 11, 64) / math.sqrt(2) ** 0.5
    assert relation_kl(doubled, states.detach(), relation_heads=4).abs().item() <= 1e-12
    assert relation_kl(3 * states, states.detach(), relation_heads=4).item() > 1e-3


def test_bf16_students_get_a_bf16_gradient_and_a_float32_loss():
    student = _states(2, 10, 16, seed=4).to(torch.bfloat16).requires_grad_()
    teacher = _states(2, 10, 32, seed=5).to(torch.bfloat16)
    loss = relation_kl(student, teacher, relation_heads=4, block_rows=3)
    loss.backward()
    assert loss.dtype == torch.float32 and student.grad.dtype == torch.bfloat16
    want = dense_relation_kl(student.detach().double(), teacher.double(), None, 4)
    assert abs(loss.item() - want.item()) <= 1e-5


def test_a_batch_of_padding_only_gives_a_connected_zero():
    student = _states(2, 6, 16, seed=6, requires_grad=True)
    loss = relation_kl(student, _states(2, 6, 16, seed=7), torch.zeros(2, 6, dtype=torch.int64), relation_heads=2)
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(student.grad, torch.zeros_like(student))


def test_settings_that_cannot_work_are_refused_with_the_flag_to_change():
    student, teacher = _states(1, 5, 24, seed=8), _states(1, 5, 20, seed=9)
    with pytest.raises(ValueError, match="teacher's keys are 20 wide, which 8 relation heads do not divide.*"
                                         "--attention-relation-heads"):
        relation_kl(student, teacher, relation_heads=8, what="keys")
    with pytest.raises(ConfigError, match="--attention-relation-heads must be an int >= 1"):
        relation_kl(student, student, relation_heads=0)
    with pytest.raises(ConfigError, match="--attention-block-rows must be an int >= 1"):
        relation_kl(student, student, relation_heads=4, block_rows=0)
    with pytest.raises(ValueError, match="differ in \\[batch, seq\\]"):
        relation_kl(student, _states(1, 6, 24, seed=1), relation_heads=4)


# ---- memory: linear in S for a fixed block ------------------------------------------------

_MEASURE = r"""
import sys, torch
from student_trainer.losses import relation_kl

def status_kib(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key))

torch.set_num_threads(1)
block = int(sys.argv[1])
g = torch.Generator().manual_seed(0)
relation_kl(torch.randn(1, 256, 64, requires_grad=True), torch.randn(1, 256, 64), relation_heads=4,
            block_rows=block).backward()  # warm-up
for seq in map(int, sys.argv[2:]):
    student = torch.randn(1, seq, 64, generator=g, requires_grad=True)
    teacher = torch.randn(1, seq, 64, generator=g)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak resident size starts again from the current one
    before = status_kib("VmRSS")
    relation_kl(student, teacher, relation_heads=4, block_rows=block).backward()
    print(seq, (status_kib("VmHWM") - before) / 1024)
    del student, teacher
"""


def _peaks_mib(block: int, seqs: tuple[int, ...]) -> dict[int, float]:
    """The loss's peak memory above what the process held just before (Linux's peak resident
    size, reset before each length), for each sequence length, in a process of its own.

    A fixed mmap threshold makes every large buffer its own mapping, returned when freed, so
    the resident size follows what is alive at once (glibc otherwise raises the threshold as
    buffers are freed and keeps later ones in its heap)."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", _MEASURE, str(block), *map(str, seqs)], capture_output=True,
                          text=True, timeout=180, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    return {int(seq): float(mib) for seq, mib in (line.split() for line in done.stdout.splitlines())}


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's resettable peak RSS")
def test_peak_memory_grows_linearly_in_the_sequence_length_for_a_fixed_block():
    peaks = _peaks_mib(64, (1024, 2048, 4096))
    # One block's float32 [1, 4 heads, 64, S] temporaries: 4 MiB at S = 4096; a dense relation
    # would be 256 MiB each. Doubling S doubles a linear peak and quadruples a quadratic one.
    assert peaks[4096] < 64, peaks
    assert peaks[2048] <= 2.6 * peaks[1024] and peaks[4096] <= 2.6 * peaks[2048], peaks
