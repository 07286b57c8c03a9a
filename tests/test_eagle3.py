"""EAGLE-3 draft training against a real teacher server (one per module, a 7-layer tiny Llama on CPU).

- The teacher's outputs for drafts (logits over a subset, three layers side by side, its
  argmax) equal the local model's, over a real session group; bad subsets are refused at join.
- Draft training from the served teacher gives the per-step losses of the same training with
  the teacher run in this process, written here the straightforward way: the attention over all
  steps' keys with one explicit mask, the loss from log_softmax, autograd, a Counter for the
  draft vocabulary. Meanwhile a KD student (tests/student_proc.py) shares the teacher and checks
  its own outputs: two jobs at once, each served correctly.
- A run resumed from one of that run's checkpoints repeats its losses.
- The chain the draft proposes at inference is what its training unroll computes; the export
  loads back with identical outputs and has the names vLLM's and SGLang's loaders read.
- Speculative decoding with the served teacher decodes exactly the teacher's greedy tokens.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import shutil
import time
from collections import Counter

import pytest
import torch
import torch.nn.functional as F

from distill_common.outputs import Argmax, AuxHiddenStates, SubsetLogits
from distill_demo.corpus import write_jsonl_corpus
from distill_demo.tokenizer import train_tokenizer
from student_trainer.client import TeacherClient
from student_trainer.data import BatchIterator, PackedDataset
from student_trainer.eagle3.config import Eagle3Config
from student_trainer.eagle3.evaluate import Acceptance, decode
from student_trainer.eagle3.model import Eagle3Draft
from student_trainer.eagle3.train import train_eagle3
from student_trainer.errors import InvalidRequest, LimitExceeded
from student_trainer.train import lr_lambda
from teacher_server.launcher import ServerProcess
from tests.helpers import finish_student, start_student, wait_for_line

VOCAB, HIDDEN, LAYERS = 320, 32, 7
DEFAULT_AUX = (2, 3, 4)  # 2, L // 2, L - 3 for L = 7
SEQ_LEN, BATCH, TTT_STEPS, DRAFT_VOCAB, TRAIN_STEPS = 32, 2, 4, 200, 3
LOSS_ATOL = 1e-5  # the bound, float32 on CPU


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    train, heldout = write_jsonl_corpus(tmp_path_factory.mktemp("corpus"), max_files=4, seq_chars=800)
    return {"train": train, "heldout": heldout}


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory, corpus):
    from transformers import LlamaConfig, LlamaForCausalLM

    texts = [json.loads(line)["text"] for line in corpus["train"].read_text().splitlines()]
    tokenizer = train_tokenizer(texts, vocab_size=VOCAB)
    path = tmp_path_factory.mktemp("teacher") / "model"
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                                 num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                                 max_position_embeddings=256)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def server(teacher_dir):
    server = ServerProcess("--model", str(teacher_dir), "--max-batch-tokens", "512", "--max-seq-len", "128")
    yield server
    assert server.stop() == 0, server.log


@pytest.fixture(scope="module")
def local_teacher(teacher_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32).eval()


def settings(server, teacher_dir, corpus, output_dir, **changes) -> Eagle3Config:
    values = dict(teacher=server.address, target_model=str(teacher_dir), data=str(corpus["train"]),
                  output_dir=str(output_dir), seq_len=SEQ_LEN, batch_size=BATCH, ttt_steps=TTT_STEPS,
                  draft_vocab_size=DRAFT_VOCAB, max_steps=TRAIN_STEPS, lr=3e-3, warmup_steps=1,
                  teacher_dtype="float32", export_dtype="float32", prefetch=1, seed=3)
    return Eagle3Config(**{**values, **changes})


# ---- the teacher's outputs for drafts ---------------------------------------------------------


def test_subset_logits_aux_states_and_argmax_equal_the_local_models(server, local_teacher):
    subset = (5, 0, VOCAB - 1, 17, 200)
    generator = torch.Generator().manual_seed(1)
    with TeacherClient(server.address, "cpu", outputs=(SubsetLogits(subset), AuxHiddenStates(), Argmax()),
                       dtype="float32", job_id="outputs-check") as teacher:
        assert [kind for kind in teacher.outputs if isinstance(kind, AuxHiddenStates)] == [AuxHiddenStates(DEFAULT_AUX)]
        batches = []
        for rows, length in ((2, 9), (1, 30), (3, 5)):
            ids = torch.randint(0, VOCAB, (rows, length), generator=generator)
            mask = torch.ones(rows, length, dtype=torch.long)
            mask[0, length // 2:] = 0  # right padding in the first row
            batches.append((ids, mask, teacher.submit(ids, mask)))
        for ids, mask, future in batches:
            out = future.result(timeout=60)
            with torch.no_grad():
                ref = local_teacher(input_ids=ids, attention_mask=mask, output_hidden_states=True)
            real = mask.bool()
            want_aux = torch.cat([ref.hidden_states[layer] for layer in DEFAULT_AUX], dim=-1)
            assert out.subset_logits.shape == (*ids.shape, len(subset))
            assert out.aux_hidden_states.shape == want_aux.shape
            assert (out.subset_logits - ref.logits[..., list(subset)])[real].abs().max() <= 1e-4
            assert (out.aux_hidden_states - want_aux)[real].abs().max() <= 1e-4
            assert torch.equal(out.argmax.long()[real], ref.logits.argmax(-1)[real])


@pytest.mark.parametrize("subset, words", [
    ((), "outputs.logit_subset is empty: send at least one vocabulary id"),
    ((3, 8, 3), "outputs.logit_subset repeats ids [3]: send each id once"),
    ((1, VOCAB, 2), f"outputs.logit_subset has ids outside the teacher's vocabulary [0, {VOCAB}): [{VOCAB}]"),
])
def test_a_bad_subset_is_refused_at_join_with_what_to_change(server, subset, words):
    with pytest.raises(InvalidRequest) as refused:
        TeacherClient(server.address, "cpu", outputs=(SubsetLogits(subset),), job_id="bad-subset")
    assert words in str(refused.value) and "INVALID_ARGUMENT" in str(refused.value)


def test_a_subset_over_the_teachers_request_limit_is_refused_at_once_naming_the_flag(server):
    # 40,000 int32 ids: 160 KB, over this teacher's request limit ((16 + 4 x --max-score-ids 8) x
    # --max-batch-tokens 512 + 64 KiB = 90 KiB). grpc refuses it as RESOURCE_EXHAUSTED, as a full teacher
    # is refused; asking again would not help.
    started = time.monotonic()
    with pytest.raises(LimitExceeded) as refused:
        TeacherClient(server.address, "cpu", outputs=(SubsetLogits(range(40_000)),), job_id="long-subset",
                      join_timeout_s=60)
    assert time.monotonic() - started < 10, "the client asked again as if the teacher were full"
    message = str(refused.value)
    assert "larger than max" in message and "--max-request-bytes" in message and "fewer ids" in message


# ---- training: served vs. in process -----------------------------------------------------------


def rotate(x: torch.Tensor, positions: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """RoPE on [B, heads, S, d] at `positions` [S], as Llama applies it (rotate_half)."""
    dim = x.shape[-1]
    angles = positions[:, None].double() * (1.0 / theta ** (torch.arange(0, dim, 2).double() / dim))[None]
    cos, sin = torch.cat([angles, angles], -1).cos().float(), torch.cat([angles, angles], -1).sin().float()
    halves = torch.cat([-x[..., dim // 2:], x[..., :dim // 2]], dim=-1)
    return x * cos + halves * sin


def reference_unroll(draft: Eagle3Draft, aux, ids, attention_mask, loss_mask, teacher_logits, greedy, steps: int):
    """The training-time test as the references state it: at step k the query of column t
    attends to step 0's keys of columns <= t and to its own column's keys of steps 1..k, one
    softmax over all steps' keys concatenated under one mask. Returns losses and accuracies."""
    layer, attention = draft.midlayer, draft.midlayer.self_attn
    batch, length = ids.shape
    heads, kv_heads, dim = attention.heads, attention.kv_heads, attention.head_dim
    used = draft.target_ids
    hidden = aux @ draft.fc.weight.T
    keys, values, losses, accuracies = [], [], [], []
    for k in range(steps):
        tokens = torch.cat([ids[:, 1 + k:], torch.zeros(batch, 1 + k, dtype=ids.dtype)], dim=1)
        x = torch.cat([layer.input_layernorm(draft.embed_tokens.weight[tokens]), layer.hidden_norm(hidden)], -1)
        positions = torch.arange(length) + k
        q = rotate((x @ attention.q_proj.weight.T).view(batch, length, heads, dim).transpose(1, 2), positions)
        key = rotate((x @ attention.k_proj.weight.T).view(batch, length, kv_heads, dim).transpose(1, 2), positions)
        value = (x @ attention.v_proj.weight.T).view(batch, length, kv_heads, dim).transpose(1, 2)
        keys.append(key.repeat_interleave(heads // kv_heads, dim=1))
        values.append(value.repeat_interleave(heads // kv_heads, dim=1))
        allowed = torch.zeros(batch, length, length * (k + 1), dtype=torch.bool)
        causal = torch.tril(torch.ones(length, length, dtype=torch.bool))
        allowed[:, :, :length] = causal & attention_mask.bool()[:, None]
        for step in range(1, k + 1):
            allowed[:, torch.arange(length), step * length + torch.arange(length)] = True
        scores = q @ torch.cat(keys, dim=2).transpose(-1, -2) / dim ** 0.5
        weights = scores.masked_fill(~allowed[:, None], float("-inf")).softmax(-1)
        mixed = (weights @ torch.cat(values, dim=2)).transpose(1, 2).reshape(batch, length, heads * dim)
        hidden = hidden + mixed @ attention.o_proj.weight.T
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        logits = draft.lm_head(draft.norm(hidden))
        # Column t of step k predicts the token at t + 2 + k from the teacher's logits at t + 1 + k.
        trained = torch.zeros(batch, length, dtype=torch.bool)
        target_at = torch.arange(length) + 1 + k
        inside = target_at + 1 < length
        trained[:, inside] = (loss_mask * attention_mask).bool()[:, target_at[inside] + 1]
        teacher_p = torch.zeros(batch, length, len(used))
        teacher_p[:, inside] = teacher_logits[:, target_at[inside]].softmax(-1)
        teacher_token = torch.zeros(batch, length, dtype=torch.long)
        teacher_token[:, inside] = greedy[:, target_at[inside]]
        counted = trained & draft.t2d[teacher_token]
        loss = -(F.log_softmax(logits, -1) * teacher_p).sum(-1)[counted].sum() / (batch * length)
        losses.append(loss)
        hits = (used[logits.argmax(-1)] == teacher_token) & trained
        accuracies.append(hits.sum().item() / max(1, trained.sum().item()))
    return losses, accuracies


def reference_training(cfg: Eagle3Config, target, steps: int) -> list[dict]:
    """The same training with the teacher in this process."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(cfg.target_model)
    dataset = PackedDataset(cfg.data, tokenizer, cfg.seq_len)
    counts = Counter(dataset.input_ids[dataset.loss_mask.bool()].tolist())
    ranked = sorted(range(VOCAB), key=lambda token: (-counts[token], token))
    used = torch.tensor(sorted(ranked[:cfg.draft_vocab_size]))
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[used] = True
    torch.manual_seed(cfg.seed)  # the trainer's initial weights: built the same way from the same seed
    draft = Eagle3Draft.for_target(target.config, target.get_input_embeddings().weight.detach(),
                                   used - torch.arange(len(used)), t2d, DEFAULT_AUX)
    params = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg, steps))
    batches = BatchIterator(dataset, cfg.batch_size, seed=cfg.seed)
    records = []
    for _ in range(steps):
        batch = next(batches)
        with torch.no_grad():
            out = target(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                         output_hidden_states=True)
        aux = torch.cat([out.hidden_states[layer] for layer in DEFAULT_AUX], dim=-1)
        losses, accuracies = reference_unroll(draft, aux, batch["input_ids"], batch["attention_mask"],
                                              batch["loss_mask"], out.logits[..., used], out.logits.argmax(-1),
                                              cfg.ttt_steps)
        sum(cfg.step_decay ** k * loss for k, loss in enumerate(losses)).backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        records.append({**{f"loss_{k}": loss.item() for k, loss in enumerate(losses)},
                        **{f"acc_{k}": acc for k, acc in enumerate(accuracies)}})
    return records


@pytest.fixture(scope="module")
def served_run(server, teacher_dir, corpus, tmp_path_factory):
    """A draft trained from the served teacher (a checkpoint every step) while a KD student
    (tests/student_proc.py, another process and job) is served by the same teacher and
    checks its outputs against its local model."""
    tmp_path = tmp_path_factory.mktemp("served")
    stop = tmp_path / "stop-kd"
    kd = start_student(server.address, teacher_dir, tmp_path / "kd.json", "--batches", "0", "--stop-file", str(stop),
                       "--pause-s", "0.05", "--job-id", "kd-job", "--topk", "5", "--hidden-layers", "3")
    try:
        wait_for_line(kd, "JOINED")
        cfg = settings(server, teacher_dir, corpus, tmp_path / "draft-run", save_every=1)
        history = train_eagle3(cfg)["history"]
        kd_outlived_the_draft = kd.poll() is None
    finally:
        stop.touch()
    return {"cfg": cfg, "history": history, "kd": finish_student(kd, tmp_path / "kd.json"),
            "kd_outlived_the_draft": kd_outlived_the_draft}


def test_served_training_gives_the_in_process_references_per_step_losses(served_run, local_teacher):
    served = served_run["history"]
    reference = reference_training(served_run["cfg"], local_teacher, TRAIN_STEPS)
    assert len(served) == len(reference) == TRAIN_STEPS
    for step, (got, want) in enumerate(zip(served, reference)):
        for k in range(TTT_STEPS):
            assert abs(got[f"loss_{k}"] - want[f"loss_{k}"]) <= LOSS_ATOL, (step, k, got, want)
            assert got[f"acc_{k}"] == pytest.approx(want[f"acc_{k}"], abs=1e-9), (step, k, got, want)
        assert got["loss"] == pytest.approx(sum(0.8 ** k * want[f"loss_{k}"] for k in range(TTT_STEPS)), abs=1e-5)


def test_a_kd_student_and_a_draft_share_the_teacher_each_served_correctly(served_run):
    report = served_run["kd"]
    assert served_run["kd_outlived_the_draft"], "the KD job ended before the draft's: they did not share the teacher"
    assert report["checked"] >= 3 and max(report["worst"].values()) <= 1e-4, report
    # The draft's own outputs are checked by its losses (the test above).


def test_a_resumed_run_repeats_the_uninterrupted_one(served_run, tmp_path):
    cfg = served_run["cfg"]
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(cfg.output_dir, resumed_dir, ignore=shutil.ignore_patterns(
        "checkpoint-0000002", "checkpoint-0000003", "draft", "metrics.jsonl"))
    resumed = train_eagle3(dataclasses.replace(cfg, output_dir=str(resumed_dir), resume=True))["history"]
    assert [r["step"] for r in resumed] == [2, 3]
    for got, want in zip(resumed, served_run["history"][1:]):
        for key in ("loss", "loss_0", "loss_3", "acc_0", "acc_3", "lr", "grad_norm"):
            # Not bitwise: the teacher packed the first run's rows with the KD student's.
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), (key, got, want)
    exported = Eagle3Draft.from_pretrained(resumed_dir / "draft")
    assert exported.fc.weight.dtype == torch.float32 and len(exported.d2t) == DRAFT_VOCAB


def test_the_command_line_refuses_bad_settings_by_flag(capsys):
    from student_trainer.__main__ import main

    with pytest.raises(SystemExit):
        main(["eagle3", "--teacher", "h:1", "--target-model", "m", "--data", "d", "--aux-layers", "1,2"])
    assert "--aux-layers 1,2: name exactly three layers" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["eagle3", "--teacher", "h:1", "--target-model", "m", "--data", "d", "--seq-len", "8"])
    assert "--seq-len 8 leaves nothing for step 7 of the unroll" in capsys.readouterr().err


# ---- the draft on its own ----------------------------------------------------------------------


def test_the_draft_vocabulary_is_the_most_trained_ids_then_the_lowest_unseen_ones():
    from student_trainer.eagle3.vocab import draft_vocabulary

    ids = torch.tensor([[5, 5, 5, 9, 9, 2, 7, 7, 7, 7]])
    trained = torch.tensor([[1, 1, 1, 1, 1, 1, 0, 0, 0, 0]])  # 7 is frequent but never a target
    two = draft_vocabulary(ids, trained, 12, 2)
    assert two.target_ids.tolist() == [5, 9] and two.coverage == pytest.approx(5 / 6)
    five = draft_vocabulary(ids, trained, 12, 5)
    assert five.target_ids.tolist() == [0, 1, 2, 5, 9] and five.coverage == 1.0
    assert five.d2t.tolist() == [0, 0, 0, 2, 5]  # draft id i is target id i + d2t[i]
    assert five.t2d.nonzero().flatten().tolist() == [0, 1, 2, 5, 9] and len(five.t2d) == 12
    with pytest.raises(ValueError, match="outside the target's vocabulary"):
        draft_vocabulary(ids, trained, 8, 2)


@pytest.mark.parametrize("q_offset, chunk_scores", [(0, 1 << 26), (0, 2 * 3 * 2 * 9), (7, 1 << 26)])
def test_the_unroll_attention_in_chunks_equals_one_softmax_over_all_keys(q_offset, chunk_scores):
    """Values and gradients of ttt_attention (chunks of queries, recomputed in the backward)
    against one masked softmax over step 0's keys and each later step's diagonal key."""
    from student_trainer.eagle3.attention import ttt_attention

    torch.manual_seed(0)
    batch, heads, keys, dim, later_steps = 2, 3, 9, 4, 2
    queries = keys - q_offset
    leaf = lambda *shape: torch.randn(*shape, dtype=torch.float64, requires_grad=True)  # noqa: E731
    q, k0, v0 = leaf(batch, heads, queries, dim), leaf(batch, heads, keys, dim), leaf(batch, heads, keys, dim)
    kd = [leaf(batch, heads, queries, dim) for _ in range(later_steps)]
    vd = [leaf(batch, heads, queries, dim) for _ in range(later_steps)]
    valid = torch.ones(batch, keys, dtype=torch.bool)
    valid[1, -3:] = False  # right padding
    columns = torch.arange(q_offset, keys)
    allowed = (torch.arange(keys)[None, :] <= columns[:, None])[None, None] & valid[:, None, None, :]
    step0 = (q @ k0.transpose(-1, -2) / dim ** 0.5).masked_fill(~allowed, float("-inf"))
    weights = torch.cat([step0, *[(q * k).sum(-1, keepdim=True) / dim ** 0.5 for k in kd]], -1).softmax(-1)
    want = weights[..., :keys] @ v0 + sum(weights[..., keys + i, None] * v for i, v in enumerate(vd))
    got = ttt_attention(q, k0, v0, kd, vd, valid, q_offset, chunk_scores)
    upstream = torch.randn_like(want)
    inputs = [q, k0, v0, *kd, *vd]
    for got_grad, want_grad in zip(torch.autograd.grad((got * upstream).sum(), inputs),
                                   torch.autograd.grad((want * upstream).sum(), inputs)):
        assert (got_grad - want_grad).abs().max() <= 1e-5  # float32 inside
    assert (got - want).abs().max() <= 1e-5


@pytest.mark.parametrize("later_steps", [0, 1, 3])
def test_the_fused_unroll_attention_equals_the_chunked_reference(later_steps):
    """merged_ttt_attention (the causal block through a kernel, the diagonal merged by log-sum-exp;
    here the float32 "math" kernel the CPU runs) against ttt_attention in float32: values and
    gradients, grouped key heads, and a right-padded row whose padded queries the loss ignores."""
    from student_trainer.eagle3.attention import merged_ttt_attention, ttt_attention

    torch.manual_seed(later_steps)
    batch, heads, kv_heads, length, dim = 2, 4, 2, 10, 8
    leaf = lambda h: torch.randn(batch, h, length, dim).requires_grad_()  # noqa: E731
    q, k0, v0 = leaf(heads), leaf(heads), leaf(heads)
    kd, vd = [leaf(kv_heads) for _ in range(later_steps)], [leaf(kv_heads) for _ in range(later_steps)]
    valid = torch.ones(batch, length, dtype=torch.bool)
    valid[1, -4:] = False
    repeat = lambda x: x.repeat_interleave(heads // kv_heads, dim=1)  # noqa: E731
    want = ttt_attention(q, k0, v0, [repeat(k) for k in kd], [repeat(v) for v in vd], valid)
    got = merged_ttt_attention(q, k0, v0, kd, vd, kernel="math")
    rows = valid[:, None, :, None]  # the padded queries' outputs differ (they see padded keys) and count nowhere
    assert (got - want).mul(rows).abs().max() <= 1e-5
    upstream = torch.randn_like(want) * rows
    inputs = [q, k0, v0, *kd, *vd]
    for i, (g, w) in enumerate(zip(torch.autograd.grad((got * upstream).sum(), inputs),
                                   torch.autograd.grad((want * upstream).sum(), inputs))):
        assert (g - w).abs().max() <= 1e-5, i


def test_the_fused_unroll_refuses_a_left_padded_row(draft):
    """The merged kernels keep real queries off padding keys by causality alone: a row padded on
    its left would attend its padding, so the unroll refuses it instead of training on it."""
    fused = copy.copy(draft)
    fused.attention = "math"
    ids = torch.randint(0, VOCAB, (2, 6))
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, :2] = 0
    with torch.no_grad(), pytest.raises(RuntimeError, match="right-padded"):
        list(fused.unroll(torch.randn(2, 6, 3 * HIDDEN), ids, mask, 2))
    mask = mask.flip(1)  # the same row padded on its right trains
    with torch.no_grad():
        assert len(list(fused.unroll(torch.randn(2, 6, 3 * HIDDEN), ids, mask, 2))) == 2


@pytest.fixture(scope="module")
def draft(local_teacher):
    torch.manual_seed(5)
    used = torch.randperm(VOCAB)[:60].sort().values
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[used] = True
    return Eagle3Draft.for_target(local_teacher.config, local_teacher.get_input_embeddings().weight.detach(),
                                  used - torch.arange(60), t2d, DEFAULT_AUX).eval()


def test_the_inference_chain_is_the_training_unroll_at_the_last_column(draft):
    """propose() runs step 0 over the prefix and later steps over the last column only; the
    unroll over the prefix followed by the proposals computes the same at that column."""
    torch.manual_seed(0)
    length, count = 11, 4
    ids = torch.randint(0, VOCAB, (2, length))
    aux = torch.randn(2, length + count, 3 * HIDDEN)  # columns past length - 2 do not reach column length - 2
    proposals, chain_logits = draft.propose_with_logits(aux[:, :length - 1], ids, count)
    assert torch.equal(proposals, draft.propose(aux[:, :length - 1], ids, count))
    extended = torch.cat([ids, proposals], dim=1)
    with torch.no_grad():
        unrolled = list(draft.unroll(aux, extended, None, count))  # column t, step k reads token t + 1 + k
    for k, logits in enumerate(unrolled):
        torch.testing.assert_close(chain_logits[:, k], logits[:, length - 2], rtol=0, atol=1e-5)
        chosen = logits[:, length - 2].argmax(-1)
        assert torch.equal(chosen + draft.d2t[chosen], proposals[:, k]), k


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_export_loads_back_with_identical_outputs(draft, tmp_path, dtype):
    draft.save_pretrained(tmp_path, dtype=dtype)
    loaded = Eagle3Draft.from_pretrained(tmp_path)
    assert loaded.fc.weight.dtype == dtype and loaded.d2t.dtype == torch.int64 and loaded.t2d.dtype == torch.bool
    cast = {name: (t.to(dtype) if t.is_floating_point() else t) for name, t in draft.state_dict().items()}
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, cast[name]), name
    torch.manual_seed(1)
    ids, aux = torch.randint(0, VOCAB, (1, 9)), torch.randn(1, 8, 3 * HIDDEN, dtype=dtype)
    reference = copy.deepcopy(draft).to(dtype)
    assert torch.equal(loaded.propose(aux, ids, 3), reference.propose(aux, ids, 3))
    with torch.no_grad():
        for got, want in zip(loaded.unroll(aux, ids[:, :8], None, 3), reference.unroll(aux, ids[:, :8], None, 3)):
            assert torch.equal(got, want)


# What vLLM and SGLang read, from their loaders (docs/eagle3.md cites the files and commits).
VLLM_PARAMETERS = {  # Eagle3LlamaForCausalLM: model = LlamaModel(prefix="model"), lm_head (+ draft_id_to_target_id)
    "model.embed_tokens.weight", "model.fc.weight", "model.norm.weight", "lm_head.weight",
    "model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.self_attn.o_proj.weight",
    "model.layers.0.mlp.gate_up_proj.weight", "model.layers.0.mlp.down_proj.weight",
    "model.layers.0.input_layernorm.weight", "model.layers.0.hidden_norm.weight",
    "model.layers.0.post_attention_layernorm.weight"}
SGLANG_PARAMETERS = {  # LlamaForCausalLMEagle3: model = LlamaModel (fc, midlayer, norm), lm_head
    "model.embed_tokens.weight", "model.fc.weight", "model.norm.weight", "lm_head.weight",
    "model.midlayer.self_attn.qkv_proj.weight", "model.midlayer.self_attn.o_proj.weight",
    "model.midlayer.mlp.gate_up_proj.weight", "model.midlayer.mlp.down_proj.weight",
    "model.midlayer.input_layernorm.weight", "model.midlayer.hidden_norm.weight",
    "model.midlayer.post_attention_layernorm.weight"}
STACKED = [(".qkv_proj", ".q_proj"), (".qkv_proj", ".k_proj"), (".qkv_proj", ".v_proj"),
           (".gate_up_proj", ".gate_proj"), (".gate_up_proj", ".up_proj")]


class LoaderRefused(Exception):
    pass


def vllm_load(tensors: dict, config: dict, target_vocab: int) -> torch.Tensor:
    """vLLM's Eagle3LlamaForCausalLM (__init__, load_weights) and LlamaModel.load_weights
    (llama_eagle3.py): the target id of each draft id, or LoaderRefused with vLLM's reason.

    - draft_vocab_size defaults to vocab_size when absent; lm_head has draft_vocab_size rows;
    - the parameter draft_id_to_target_id exists only when draft_vocab_size differs from the
      target model's vocabulary (None otherwise: draft ids are target ids);
    - t2d is skipped; d2t is renamed draft_id_to_target_id; every other name but lm_head's gets
      "model."; midlayer. becomes layers.0.; q/k/v stack into qkv_proj, gate/up into gate_up_proj;
    - AutoWeightsLoader skips names containing a skipped substring (draft_id_to_target_id when the
      checkpoint had no d2t) and refuses any other name with no parameter ("There is no module or
      parameter named ..."); the model loader refuses a parameter the checkpoint did not fill.
    """
    draft_vocab = config.get("draft_vocab_size") or config["vocab_size"]
    parameters = set(VLLM_PARAMETERS) | ({"draft_id_to_target_id"} if draft_vocab != target_vocab else set())
    loaded, includes_mapping, renamed = {}, False, {}
    for name, tensor in tensors.items():
        if "t2d" in name:
            continue
        if "d2t" in name:
            name, includes_mapping = name.replace("d2t", "draft_id_to_target_id"), True
        elif "lm_head" not in name:
            name = "model." + name
        renamed[name] = tensor
    skip = [] if includes_mapping else ["draft_id_to_target_id"]
    for name, tensor in renamed.items():
        name = name.replace("midlayer.", "layers.0.")
        name = next((name.replace(shard, param) for param, shard in STACKED if shard in name), name)
        if any(part in name for part in skip):
            continue
        if name not in parameters:
            raise LoaderRefused(f"There is no module or parameter named {name!r}")
        loaded[name] = tensor
    if parameters - set(loaded):
        raise LoaderRefused(f"weights not initialized from the checkpoint: {sorted(parameters - set(loaded))}")
    if loaded["lm_head.weight"].shape[0] != draft_vocab:
        raise LoaderRefused("lm_head rows differ from draft_vocab_size")
    mapping = loaded.get("draft_id_to_target_id")
    return torch.arange(draft_vocab) + (0 if mapping is None else mapping)


def sglang_load(tensors: dict, config: dict, target_vocab: int) -> torch.Tensor:
    """SGLang's LlamaForCausalLMEagle3 (__init__, load_weights; llama_eagle3.py): the target id
    of each draft id, or LoaderRefused where SGLang would serve something other than the export.

    - tie_word_embeddings makes lm_head the embedding; a missing draft_vocab_size loads the
      target's head (load_lm_head_from_target) instead of the exported one;
    - d2t becomes hot_token_id = d2t + arange; none (hot_token_id None) decodes over the whole
      vocabulary; t2d is skipped;
    - q/k/v and gate/up are stacked; a name is tried as is, then with "model."; a name with no
      parameter is skipped without a word (so here: refused, every exported weight must land).
    """
    if config.get("tie_word_embeddings") or config.get("draft_vocab_size") is None:
        raise LoaderRefused("lm_head would not be the exported one")
    hot_token_id, loaded = None, set()
    for name, tensor in tensors.items():
        if "d2t" in name:
            hot_token_id = tensor + torch.arange(tensor.shape[0])
            continue
        if "t2d" in name:
            continue
        name = next((name.replace(shard, param) for param, shard in STACKED if shard in name), name)
        name = name if name in SGLANG_PARAMETERS else f"model.{name}"
        if name not in SGLANG_PARAMETERS:
            raise LoaderRefused(f"{name} would be skipped")
        loaded.add(name)
    if loaded != SGLANG_PARAMETERS:
        raise LoaderRefused(f"not loaded: {sorted(SGLANG_PARAMETERS - loaded)}")
    if tensors["lm_head.weight"].shape[0] != config["draft_vocab_size"]:
        raise LoaderRefused("lm_head rows differ from draft_vocab_size")
    return torch.arange(target_vocab) if hot_token_id is None else hot_token_id


def read_export(path) -> tuple[dict, dict]:
    from safetensors import safe_open

    config = json.loads((path / "config.json").read_text())
    with safe_open(str(path / "model.safetensors"), framework="pt") as weights:
        return config, {name: weights.get_tensor(name) for name in weights.keys()}


def test_the_export_has_the_config_and_weight_names_vllm_and_sglang_read(draft, tmp_path):
    draft.save_pretrained(tmp_path, dtype=torch.bfloat16)
    config, tensors = read_export(tmp_path)
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]  # both registries' name for the draft
    assert config["draft_vocab_size"] == 60 and config["vocab_size"] == VOCAB
    assert config["num_hidden_layers"] == 1 and config["tie_word_embeddings"] is False  # SGLang: else lm_head = embed
    assert config["target_hidden_size"] == config["hidden_size"] == HIDDEN
    assert config["norm_before_residual"] is False  # vLLM: the residual taken before hidden_norm
    assert config["torch_dtype"] == "bfloat16" and config["model_type"] == "llama"
    for key in ("intermediate_size", "num_attention_heads", "num_key_value_heads", "rms_norm_eps",
                "max_position_embeddings", "rope_theta", "hidden_act"):
        assert key in config, key
    # vLLM reads the top-level ids as the layers whose input it captures (= HF index); SGLang reads
    # eagle_config's and captures the input of layer id + 1.
    assert config["eagle_aux_hidden_state_layer_ids"] == list(DEFAULT_AUX)
    assert [i + 1 for i in config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]] == list(DEFAULT_AUX)

    assert torch.equal(vllm_load(tensors, config, VOCAB), draft.target_ids)
    assert torch.equal(sglang_load(tensors, config, VOCAB), draft.target_ids)  # its hot_token_id
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    assert all(t.dtype == torch.bfloat16 for name, t in tensors.items() if name not in ("d2t", "t2d"))
    # Shapes the loaders build: qkv reads [embedding, hidden] (2 x hidden), fc 3 x target hidden.
    assert tensors["midlayer.self_attn.q_proj.weight"].shape == (HIDDEN, 2 * HIDDEN)
    assert tensors["fc.weight"].shape == (HIDDEN, 3 * HIDDEN) and tensors["lm_head.weight"].shape == (60, HIDDEN)


def test_a_draft_over_the_whole_vocabulary_exports_no_maps_and_loads_in_both_engines(local_teacher, tmp_path):
    """With the target's whole vocabulary vLLM has no draft_id_to_target_id to load d2t into:
    the export leaves d2t and t2d out and still says draft_vocab_size."""
    whole = Eagle3Draft.for_target(local_teacher.config, local_teacher.get_input_embeddings().weight.detach(),
                                   torch.zeros(VOCAB, dtype=torch.long), torch.ones(VOCAB, dtype=torch.bool),
                                   DEFAULT_AUX).eval()
    whole.save_pretrained(tmp_path, dtype=torch.bfloat16)
    config, tensors = read_export(tmp_path)
    assert config["draft_vocab_size"] == config["vocab_size"] == VOCAB
    assert "d2t" not in tensors and "t2d" not in tensors
    assert torch.equal(vllm_load(tensors, config, VOCAB), torch.arange(VOCAB))
    assert torch.equal(sglang_load(tensors, config, VOCAB), torch.arange(VOCAB))
    # The rules refuse what the export used to write: vLLM has no parameter for d2t here.
    with pytest.raises(LoaderRefused, match="draft_id_to_target_id"):
        vllm_load({**tensors, "d2t": torch.zeros(VOCAB, dtype=torch.long)}, config, VOCAB)
    loaded = Eagle3Draft.from_pretrained(tmp_path)
    assert torch.equal(loaded.d2t, whole.d2t) and torch.equal(loaded.t2d, whole.t2d)
    torch.manual_seed(1)
    ids, aux = torch.randint(0, VOCAB, (1, 9)), torch.randn(1, 8, 3 * HIDDEN, dtype=torch.bfloat16)
    assert torch.equal(loaded.propose(aux, ids, 3), copy.deepcopy(whole).to(torch.bfloat16).propose(aux, ids, 3))


# ---- speculative decoding with the served teacher -----------------------------------------------


def test_speculative_decoding_yields_exactly_the_teachers_greedy_tokens(server, draft, local_teacher, teacher_dir):
    from transformers import AutoTokenizer

    torch.manual_seed(2)
    prompts = [torch.randint(0, VOCAB, (n,)).tolist() for n in (6, 13)]
    acceptance = Acceptance(steps=3)
    tokenizer = AutoTokenizer.from_pretrained(teacher_dir)
    with TeacherClient(server.address, "cpu", outputs=(AuxHiddenStates(DEFAULT_AUX), Argmax()), dtype="float32",
                       tokenizer=tokenizer, job_id="acceptance") as teacher:
        for prompt in prompts:
            decode(teacher, draft, prompt, 10, 3, 60, acceptance)
    for prompt, generated in zip(prompts, acceptance.generated):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            for _ in range(10):
                ids = torch.cat([ids, local_teacher(ids).logits[:, -1:].argmax(-1)], dim=1)
        assert generated == ids[0, len(prompt):].tolist()
    # Every round yields its accepted proposals and the teacher's token; the prefill one more.
    assert sum(a + 1 for a in acceptance.accepted) + len(prompts) >= 2 * 10
    assert acceptance.rates == sorted(acceptance.rates, reverse=True)  # position i needs every one before it
    assert 1.0 <= acceptance.mean_acceptance_length <= 4.0
