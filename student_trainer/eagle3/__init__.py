"""EAGLE-3 draft training against a served teacher (docs/eagle3.md).

A draft for speculative decoding learns to predict several tokens ahead from the teacher's
("target's") hidden states and next-token distribution. The teacher serves what the draft
needs as output kinds (distill_common/outputs/): `AuxHiddenStates` (three layers side by
side, [B, S, 3H]), `SubsetLogits` over the draft's vocabulary and `Argmax`.

    model.py      the draft: fc (3H -> H), one decoder layer, norm, head over the draft vocabulary
    attention.py  the draft's attention during the training-time test: a causal kernel merged with
                  the diagonal (CUDA), and the reference in query chunks
    precision.py  bf16 weights with float32 master weights for the optimizer
    loss.py       the unroll of K steps, its per-step loss and accuracy
    vocab.py      the draft vocabulary: the N most frequent target tokens of the data, d2t / t2d
    config.py     the settings of `student-trainer eagle3` and `eagle3-eval`
    train.py      the training loop (data, DDP, prefetch, resume from student_trainer)
    evaluate.py   acceptance length: the teacher decodes greedily and verifies the draft's proposals
"""
