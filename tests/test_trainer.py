"""The student trainer end to end: a real teacher server process, `python -m student_trainer
train` in child processes (and under `torchrun` for DDP), all on CPU over gloo.

Everything is built here: a BPE tokenizer trained on stdlib source, a teacher (tiny Llama,
hidden 64, 2 layers) briefly pre-trained on that text so that it has something to teach,
and students (hidden 32, 1 layer) that share its vocabulary or deliberately do not.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from distill_common.vocab import tokenizer_fingerprint
from distill_demo.corpus import write_jsonl_corpus
from distill_demo.tokenizer import train_tokenizer
from student_trainer import TeacherClient
from teacher_server.launcher import ServerProcess, child_env, metrics_samples
from tests.helpers import ROOT, free_port, wait_until

VOCAB = 400
SEQ_LEN = 64
BATCH = 4
TRAINER_TIMEOUT_S = 120
# Resumed runs must repeat the uninterrupted run's losses. Not bitwise: the teacher may pack a
# session's rows with other rows into one forward, which can change the last bits.
RESUME_RTOL = 1e-5


# ---- building the models ---------------------------------------------------------------


def build_llama(path: Path, *, vocab_size: int, hidden_size: int, layers: int, seed: int, tokenizer=None,
                **config) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size,
                                         intermediate_size=2 * hidden_size, num_hidden_layers=layers,
                                         num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=256, **config))
    model.save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return path


def pretrain(model_dir: Path, tokenizer, texts: list[str], steps: int = 60, batch: int = 8) -> None:
    """A few steps of next-token training, so the teacher's distributions are worth matching
    (a random teacher's are near-uniform and give a KD loss of ~0.02 with nothing to learn)."""
    from transformers import AutoModelForCausalLM

    ids = tokenizer("".join(texts), add_special_tokens=False)["input_ids"]
    usable = len(ids) // SEQ_LEN * SEQ_LEN
    rows = torch.tensor(ids[:usable]).view(-1, SEQ_LEN)
    assert len(rows) >= steps * batch, "the corpus is too small to pre-train the teacher"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(steps):
        chunk = rows[step * batch:(step + 1) * batch]
        model(input_ids=chunk, labels=chunk).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(model_dir)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict:
    train, heldout = write_jsonl_corpus(tmp_path_factory.mktemp("corpus"), max_files=8, seq_chars=1500)
    texts = [json.loads(line)["text"] for line in train.read_text().splitlines()]
    return {"train": train, "heldout": heldout, "texts": texts}


@pytest.fixture(scope="module")
def models(tmp_path_factory, corpus) -> dict:
    root = tmp_path_factory.mktemp("models")
    texts = corpus["texts"]
    tokenizer = train_tokenizer(texts, vocab_size=VOCAB)
    assert len(tokenizer) == VOCAB
    teacher = build_llama(root / "teacher", vocab_size=VOCAB, hidden_size=64, layers=2, seed=0, tokenizer=tokenizer)
    pretrain(teacher, tokenizer, texts)
    student = dict(hidden_size=32, layers=1, seed=1)

    # Same size, different merges: only the fingerprint tells them apart.
    other = train_tokenizer([text.upper() for text in texts], vocab_size=VOCAB)
    assert len(other) == VOCAB and tokenizer_fingerprint(other) != tokenizer_fingerprint(tokenizer)
    small = train_tokenizer(texts, vocab_size=300)
    return {
        "tokenizer": tokenizer,
        "small_tokenizer": small,
        "teacher": teacher,
        "student": build_llama(root / "student", vocab_size=VOCAB, tokenizer=tokenizer, **student),
        # Dropout draws from the RNG, so a resume that did not restore it would show.
        "student_dropout": build_llama(root / "student-dropout", vocab_size=VOCAB, tokenizer=tokenizer,
                                       attention_dropout=0.1, **student),
        # Ids below 300 are valid teacher ids too; a larger student vocabulary would be refused at Submit.
        "student_small_vocab": build_llama(root / "student-300", vocab_size=len(small), tokenizer=small, **student),
        "student_other_tokenizer": build_llama(root / "student-other", vocab_size=VOCAB, tokenizer=other, **student),
        # The teacher's tokenizer, but 448 output rows: the logits cannot be compared.
        "student_wide_head": build_llama(root / "student-448", vocab_size=448, tokenizer=tokenizer, **student),
    }


@pytest.fixture(scope="module")
def server(models):
    server = ServerProcess("--model", str(models["teacher"]), "--max-seq-len", str(2 * SEQ_LEN),
                           "--max-batch-tokens", "2048")
    yield server
    assert server.stop() == 0, server.log


# ---- running the trainer ---------------------------------------------------------------------


def trainer_args(server, model_dir: Path, data: Path, output_dir: Path, *args: str) -> list[str]:
    return ["-m", "student_trainer", "train", "--teacher", server.address, "--model", str(model_dir),
            "--data", str(data), "--output-dir", str(output_dir), "--batch-size", str(BATCH),
            "--seq-len", str(SEQ_LEN), "--device", "cpu", "--teacher-timeout-s", "60", *args]


def run(command: list[str], timeout_s: float = TRAINER_TIMEOUT_S) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=child_env(), cwd=ROOT, timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"{' '.join(command)} did not finish within {timeout_s}s:\n{e.output}") from None


def train(server, model_dir: Path, data: Path, output_dir: Path, *args: str) -> subprocess.CompletedProcess:
    return run([sys.executable, *trainer_args(server, model_dir, data, output_dir, *args)])


def train_ok(*args, **kwargs) -> subprocess.CompletedProcess:
    result = train(*args, **kwargs)
    assert result.returncode == 0, result.stdout
    return result


def torchrun(server, model_dir: Path, data: Path, output_dir: Path, *args: str) -> subprocess.CompletedProcess:
    # `python -m torch.distributed.run` is torchrun, without relying on PATH.
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                "--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    result = run([*launcher, *trainer_args(server, model_dir, data, output_dir, *args)])
    assert result.returncode == 0, result.stdout
    return result



def read_metrics(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def column(records: list[dict], key: str) -> list[float]:
    values = [record[key] for record in records]
    assert all(math.isfinite(value) for value in values), (key, values)
    return values


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def sessions_joined(server) -> float:
    return metrics_samples(server.http)[("teacher_sessions_joined_total", ())]


def joined_lines(server, job_id: str) -> list[tuple[str, int, str]]:
    """(session, rank, the rest of the line) of every session of `job_id` in the server's log."""
    pattern = re.compile(rf"session (\w+) joined: job {re.escape(job_id)} rank (\d+), (.*)")
    return [(m.group(1), int(m.group(2)), m.group(3)) for m in map(pattern.search, server.log_lines) if m]


def assert_same_run(a: list[dict], b: list[dict], keys=("loss", "kd", "ce", "lr"), rtol: float = RESUME_RTOL):
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for ra, rb in zip(a, b):
        for key in keys:
            if key in ra or key in rb:
                assert rb[key] == pytest.approx(ra[key], rel=rtol, abs=1e-12), (ra["step"], key, ra[key], rb[key])


# ---- the tests ---------------------------------------------------------------------------


def test_kd_loss_falls_and_the_model_loads(server, models, corpus, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "run"
    result = train_ok(server, models["student"], corpus["train"], out, "--kd-weight", "1.0", "--max-steps", "30",
                      "--lr", "3e-3", "--eval-data", str(corpus["heldout"]), "--eval-every", "30")
    assert "trained to step 30" in result.stdout
    records = read_metrics(out)
    assert [r["step"] for r in records] == list(range(1, 31))
    kd = column(records, "kd")
    assert mean(kd[-5:]) < 0.8 * mean(kd[:5]), kd
    assert not any("eval_ce" in r or "eval_kd" in r for r in records[:-1])

    # The saved model is what was trained: identical to the last checkpoint's, closer to the
    # teacher than the student it started from (on held-out text, not the training batches).
    final = AutoModelForCausalLM.from_pretrained(out / "model").eval()
    checkpoint = AutoModelForCausalLM.from_pretrained(out / "checkpoint-0000030" / "model").eval()
    initial = AutoModelForCausalLM.from_pretrained(models["student"]).eval()
    teacher = AutoModelForCausalLM.from_pretrained(models["teacher"]).eval()
    saved_tokenizer = AutoTokenizer.from_pretrained(out / "model")
    assert tokenizer_fingerprint(saved_tokenizer) == tokenizer_fingerprint(models["tokenizer"])
    text = "".join(json.loads(line)["text"] for line in corpus["heldout"].read_text().splitlines())
    ids = saved_tokenizer(text, add_special_tokens=False)["input_ids"][:4 * SEQ_LEN]
    assert len(ids) == 4 * SEQ_LEN
    ids = torch.tensor(ids).view(4, SEQ_LEN)
    with torch.no_grad():
        logits = {name: model(input_ids=ids).logits for name, model in
                  (("final", final), ("checkpoint", checkpoint), ("initial", initial), ("teacher", teacher))}
    assert torch.equal(logits["final"], logits["checkpoint"])

    def kl_to_teacher(student_logits):
        return F.kl_div(F.log_softmax(student_logits, -1).flatten(0, 1),
                        F.log_softmax(logits["teacher"], -1).flatten(0, 1), log_target=True,
                        reduction="batchmean").item()

    assert kl_to_teacher(logits["final"]) < 0.8 * kl_to_teacher(logits["initial"])

    # The held-out scores of the last step: the final model's CE, and its KL(teacher || student)
    # against the served teacher, per target token of the held-out set, as the trainer reads it.
    from student_trainer.data import PackedDataset

    heldout = PackedDataset(corpus["heldout"], saved_tokenizer, SEQ_LEN)
    mask = (heldout.loss_mask[:, 1:] * heldout.attention_mask[:, 1:]).bool()
    targets = heldout.input_ids[:, 1:]
    with torch.no_grad():
        student, teacher_logits = (model(input_ids=heldout.input_ids, attention_mask=heldout.attention_mask)
                                   .logits[:, :-1] for model in (final, teacher))
    ce = F.cross_entropy(student[mask], targets[mask]).item()
    teacher_p = F.softmax(teacher_logits, -1)
    kl = (teacher_p * (F.log_softmax(teacher_logits, -1) - F.log_softmax(student, -1))).sum(-1)[mask].mean().item()
    assert records[-1]["eval_ce"] == pytest.approx(ce, rel=1e-4)
    assert records[-1]["eval_kd"] == pytest.approx(kl, rel=1e-4)
    assert re.search(r"step 30 held-out: eval_ce \S+, eval_kd \S+", result.stdout), result.stdout


def test_resume_repeats_the_uninterrupted_run(server, models, corpus, tmp_path):
    common = ("--kd-weight", "0.5", "--max-steps", "8", "--save-every", "4", "--lr", "3e-3", "--warmup-steps", "2")
    a, b = tmp_path / "a", tmp_path / "b"
    train_ok(server, models["student_dropout"], corpus["train"], a, *common)
    first = train_ok(server, models["student_dropout"], corpus["train"], b, *common, "--stop-after-steps", "4")
    assert "trained to step 4" in first.stdout
    assert [r["step"] for r in read_metrics(b)] == [1, 2, 3, 4]
    assert sorted(p.name for p in b.iterdir() if p.name.startswith("checkpoint-")) == ["checkpoint-0000004"]
    assert not (b / "model").exists(), "a run stopped early must not write the final model"
    second = train_ok(server, models["student_dropout"], corpus["train"], b, *common, "--resume")
    assert re.search(r"resumed from \S+checkpoint-0000004 at step 4", second.stdout), second.stdout

    assert_same_run(read_metrics(a), read_metrics(b))
    # The same data: both runs' checkpoints name the same next batch.
    for name in ("checkpoint-0000004", "checkpoint-0000008"):
        states = [torch.load(run_dir / name / "trainer_state.pt", weights_only=True) for run_dir in (a, b)]
        assert states[0]["data"] == states[1]["data"], name
        assert states[0]["step"] == states[1]["step"]
    from safetensors.torch import load_file

    weights_a, weights_b = (load_file(run_dir / "model" / "model.safetensors") for run_dir in (a, b))
    assert weights_a.keys() == weights_b.keys()
    for key in weights_a:
        torch.testing.assert_close(weights_b[key], weights_a[key], rtol=RESUME_RTOL, atol=1e-7, msg=key)


def test_ddp_ranks_join_as_two_sessions(server, models, corpus, tmp_path):
    job_id = "ddp-two-ranks"
    joined_before = sessions_joined(server)
    out = tmp_path / "run"
    torchrun(server, models["student"], corpus["train"], out, "--max-steps", "4", "--job-id", job_id)
    assert sessions_joined(server) - joined_before == 2
    sessions = joined_lines(server, job_id)
    assert sorted(rank for _, rank, _ in sessions) == [0, 1], server.log
    assert all(rest.startswith("gloo") for _, _, rest in sessions)
    for session, _, _ in sessions:
        wait_until(lambda: f"session {session} ended: left" in server.log, 10, f"session {session} to leave")
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3, 4]  # rank 0 writes the metrics
    checkpoint = out / "checkpoint-0000004"
    assert {p.name for p in checkpoint.iterdir()} >= {"model", "trainer_state.pt", "rng_rank0.pt", "rng_rank1.pt"}
    assert (out / "model" / "model.safetensors").is_file()


@pytest.mark.slow  # six trainer ranks; resume and DDP each have a default-suite test of their own
def test_ddp_resume_with_hidden_states_repeats_the_run(server, models, corpus, tmp_path):
    # The hidden-state projections live outside the DDP-wrapped student: their gradients must be
    # averaged across ranks too, or rank 1 trains its own and a resume hands it rank 0's.
    common = ("--kd-weight", "0.5", "--hidden-layers", "1,2", "--hidden-weight", "1.0", "--max-steps", "8",
              "--save-every", "4", "--lr", "1e-2", "--schedule", "constant")
    a, b = tmp_path / "a", tmp_path / "b"
    torchrun(server, models["student"], corpus["train"], a, *common)
    torchrun(server, models["student"], corpus["train"], b, *common, "--stop-after-steps", "4")
    torchrun(server, models["student"], corpus["train"], b, *common, "--resume")
    assert_same_run(read_metrics(a), read_metrics(b), keys=("loss", "kd", "ce", "hidden"))


@pytest.mark.parametrize("student, refused_at, words", [
    ("student_small_vocab", "join", ["vocabulary has 300 entries, the teacher's 400"]),
    ("student_other_tokenizer", "join", ["tokenizer differs from the teacher's", "fingerprints"]),
    # Same tokenizer, wider head: the join compares the logits' widths.
    ("student_wide_head", "join", ["vocabulary has 448 entries, the teacher's 400"]),
])
def test_mismatched_vocabulary_is_refused(server, models, corpus, tmp_path, student, refused_at, words):
    out = tmp_path / "run"
    joined_before = sessions_joined(server)
    result = train(server, models[student], corpus["train"], out, "--kd-weight", "0.5", "--max-steps", "2")
    assert result.returncode != 0, result.stdout
    for expected in [*words, "same tokenizer"]:
        assert expected in result.stdout, (expected, result.stdout)
    assert sessions_joined(server) - joined_before == (0 if refused_at == "join" else 1)
    assert not (out / "metrics.jsonl").exists()


def test_bad_jsonl_line_is_reported_with_its_number(server, models, corpus, tmp_path):
    lines = corpus["train"].read_text().splitlines()[:40]
    lines.insert(2, '{"text": "an unterminated string')
    data = tmp_path / "bad.jsonl"
    data.write_text("\n".join(lines) + "\n")

    refused = train(server, models["student"], data, tmp_path / "refused", "--max-steps", "2")
    assert refused.returncode != 0
    assert f"{data}:3: invalid JSON" in refused.stdout, refused.stdout

    skipped = train_ok(server, models["student"], data, tmp_path / "skipped", "--max-steps", "2", "--skip-bad-lines")
    assert f"skipped bad line {data}:3:" in skipped.stdout, skipped.stdout
    assert [r["step"] for r in read_metrics(tmp_path / "skipped")] == [1, 2]


def test_hidden_state_distillation_across_vocabularies(server, models, corpus, tmp_path):
    job_id = "hidden-only"
    out = tmp_path / "run"
    train_ok(server, models["student_small_vocab"], corpus["train"], out, "--kd-weight", "0", "--hidden-layers", "1,2",
             "--hidden-weight", "1.0", "--max-steps", "10", "--lr", "3e-3", "--job-id", job_id)
    records = read_metrics(out)
    assert "kd" not in records[0]
    hidden = column(records, "hidden")
    assert mean(hidden[-3:]) < 0.9 * mean(hidden[:3]), hidden
    [(_, _, outputs)] = joined_lines(server, job_id)
    assert "outputs hidden_layers=(1, 2) in " in outputs  # hidden states only: no logits, no top-k


def test_topk_distillation(server, models, corpus, tmp_path):
    job_id = "topk-8"
    out = tmp_path / "run"
    train_ok(server, models["student"], corpus["train"], out, "--kd-weight", "1.0", "--topk", "8", "--max-steps", "12",
             "--lr", "3e-3", "--job-id", job_id)
    kd = column(read_metrics(out), "kd")
    assert len(kd) == 12 and mean(kd[-3:]) < 0.9 * mean(kd[:3]), kd
    [(_, _, outputs)] = joined_lines(server, job_id)
    assert "outputs topk=8(T=1) in " in outputs  # the top-k path, not full logits cut down on the student


# A teacher whose output head is padded past its tokenizer (as Qwen2's and Phi-3's are)
# serves a student with the same tokenizer and head: the join compares logit widths.
@pytest.mark.slow  # a teacher server of its own for one two-step run
def test_padded_output_embedding_with_the_same_tokenizer_is_accepted(models, corpus, tmp_path):
    padded = dict(vocab_size=VOCAB + 16, tokenizer=models["tokenizer"])
    teacher = build_llama(tmp_path / "teacher", hidden_size=64, layers=2, seed=0, **padded)
    student = build_llama(tmp_path / "student", hidden_size=32, layers=1, seed=1, **padded)
    server = ServerProcess("--model", str(teacher), "--max-seq-len", str(SEQ_LEN), "--max-batch-tokens", "1024")
    try:
        result = train(server, student, corpus["train"], tmp_path / "run", "--kd-weight", "0.5", "--max-steps", "2")
    finally:
        server.stop()
    assert result.returncode == 0, result.stdout


@pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="LoRA needs peft (the lora extra)")
def test_lora_saves_the_adapter_and_a_merged_model(server, models, corpus, tmp_path):
    # A LoRA run's resume is the recipe's test (below).
    a = tmp_path / "a"
    train_ok(server, models["student"], corpus["train"], a, "--kd-weight", "0.5", "--lora-r", "4", "--lora-alpha", "8",
             "--max-steps", "6", "--lr", "1e-2")
    assert (a / "adapter" / "adapter_config.json").is_file()
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(a / "model")
    base = AutoModelForCausalLM.from_pretrained(models["student"])
    changed = [name for (name, p), (_, q) in zip(merged.named_parameters(), base.named_parameters())
               if not torch.equal(p, q)]
    assert changed and all("proj" in name for name in changed), changed  # only the adapted linears moved


@pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="LoRA needs peft (the lora extra)")
def test_the_recipe_trains_all_three_losses_and_resumes(server, models, corpus, tmp_path):
    """docs/training.md's recipe: LoRA, KD 0.7 + attention 0.2 + hidden 0.1, bf16, gradient
    checkpointing, the teacher's head applied on the student. One batch, the same every step
    (four examples, one sequence each): each loss falls unless the run does not learn it."""
    data = tmp_path / "batch.jsonl"
    data.write_text("".join(json.dumps({"text": text}) + "\n" for text in corpus["texts"][:BATCH]))
    common = ("--lora-r", "8", "--lora-alpha", "16", "--kd-weight", "0.7", "--ce-weight", "0", "--head-on-student",
              "--attention-layers", "1", "--attention-weight", "0.2", "--attention-relation-heads", "4",
              "--hidden-layers", "2", "--hidden-weight", "0.1", "--bf16", "--grad-checkpointing",
              "--pack-mode", "truncate", "--max-steps", "6", "--save-every", "3", "--lr", "5e-3")
    a, b = tmp_path / "a", tmp_path / "b"
    train_ok(server, models["student"], data, a, *common, "--job-id", "recipe")
    records = read_metrics(a)
    # A LoRA adapter on a one-layer student moves KD and attention little in 6 steps (about 1%),
    # but at every step (at 2e-2 the first steps overshoot and attention rises before it falls).
    for key, factor in (("kd", 0.995), ("attention", 0.995), ("hidden", 0.8)):
        values = column(records, key)
        assert values[-1] < factor * values[0] and all(b <= a for a, b in zip(values, values[1:])), (key, values)
    assert "ce" not in records[0]  # --ce-weight 0: not computed
    (outputs,) = {rest for _, _, rest in joined_lines(server, "recipe")}
    assert "outputs hidden_layers=(2,), final_hidden, attention_layers=(1,) in " in outputs, outputs
    train_ok(server, models["student"], data, b, *common, "--stop-after-steps", "3")
    train_ok(server, models["student"], data, b, *common, "--resume")
    assert_same_run(records, read_metrics(b), keys=("loss", "kd", "attention", "hidden", "lr"))


# ---- a student with another tokenizer (distill_common/alignment.py) ---------------------------

CROSS_TEXTS = ["def hello(world):\n    return 1234  # café", "x = [12, 345]\nprint(x)"]


def _cross_batch(tokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    rows = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in CROSS_TEXTS]
    rows[1] = rows[1] + [tokenizer.eos_token_id] + tokenizer("import os", add_special_tokens=False)["input_ids"]
    width = max(map(len, rows)) + 2
    ids = torch.zeros(len(rows), width, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for r, row in enumerate(rows):
        ids[r, :len(row)] = torch.tensor(row)
        mask[r, :len(row)] = 1
    return ids, mask


def test_a_student_with_another_tokenizer_gets_tensors_shaped_to_its_tokens(server, models):
    """What arrives equals the teacher's model on the teacher's tokens of the same text, per the
    straightforward references of tests/test_alignment.py."""
    from transformers import LlamaForCausalLM

    from distill_common.alignment import (StudentVocabulary, TeacherTokenizer, VocabularyMatch, align_batch,
                                          row_texts)
    from distill_common.outputs import ProjectedNext, SortedProbs, SpanLogprobs
    from tests.test_alignment import reference_spans

    student_tokenizer = models["small_tokenizer"]
    ids, mask = _cross_batch(student_tokenizer)
    outputs = [SpanLogprobs(), ProjectedNext(4), SortedProbs(5)]
    with TeacherClient(server.address, "cpu", outputs=outputs, tokenizer=student_tokenizer) as client:
        out = client.submit(ids, mask).result(timeout=60)
        matched = client.matched_student_ids
    teacher = TeacherTokenizer(models["tokenizer"])
    vocabulary = StudentVocabulary.of(student_tokenizer)
    match = VocabularyMatch.build(vocabulary.pieces, teacher.pieces)
    assert matched.tolist() == match.student_ids.tolist()
    aligned = align_batch(ids, mask, row_texts(ids, mask, vocabulary), vocabulary, teacher, match, 2 * SEQ_LEN)
    model = LlamaForCausalLM.from_pretrained(models["teacher"]).eval()
    with torch.no_grad():
        logits = model(input_ids=aligned.teacher_ids, attention_mask=aligned.teacher_mask).logits.double()
    log_probs = torch.log_softmax(logits, -1)
    for r in range(len(CROSS_TEXTS)):
        positions = mask[r].nonzero()[:, 0].tolist()
        t_ids = aligned.teacher_ids[r][aligned.teacher_mask[r].bool()].tolist()
        token_logprobs = [0.0] + [log_probs[r, j - 1, t_ids[j]].item() for j in range(1, len(t_ids))]
        values, exact = reference_spans([vocabulary.pieces[i] for i in ids[r, positions].tolist()],
                                        [teacher.pieces[i] for i in t_ids], token_logprobs)
        assert out.span_logprobs[r, positions].tolist() == pytest.approx(values, abs=1e-3)
        assert out.span_exact[r, positions].tolist() == exact
        for t in positions[:-1]:
            j = int(aligned.context[r, t])
            if j < 0:
                assert out.sorted_probs[r, t].sum() == 0 and out.unmatched_mass[r, t] == 0
                continue
            probs = torch.softmax(logits[r, j], -1)
            assert out.sorted_probs[r, t].tolist() == pytest.approx(probs.sort(descending=True).values[:5].tolist(),
                                                                    abs=1e-5)
            assert out.projected_probs[r, t, :].tolist() == pytest.approx(
                [probs[match.teacher_column == column].sum().item() for column in range(match.size)], abs=1e-5)
    assert out.projected_probs.shape == (*ids.shape, len(matched)) and out.unmatched_topk.shape == (*ids.shape, 4)
    assert out.span_exact.any() and (out.unmatched_mass > 0).any() and out.sorted_probs.sum() > 0


def test_cross_tokenizer_bad_input_is_refused_clearly_and_the_teacher_keeps_serving(server, models):
    import grpc

    from distill_common.alignment import StudentVocabulary, row_texts
    from distill_common.outputs import SpanLogprobs
    from distill_common.proto.teacher.v1 import teacher_pb2 as pb
    from distill_common.proto.teacher.v1 import teacher_pb2_grpc as pb_grpc
    from student_trainer.errors import InvalidRequest

    peer = pb.PeerInfo(device_type="cpu", torch_version=torch.__version__)
    span = pb.OutputSpec(cross_tokenizer=pb.CrossTokenizerOutputs(span_logprobs=True))
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.TeacherServiceStub(channel)
        too_big = pb.JoinRequest(outputs=span, peer=peer)  # --max-student-vocab defaults to the teacher's VOCAB
        StudentVocabulary(tuple(bytes([i % 256, i // 256]) for i in range(VOCAB + 1))).to_proto(
            too_big.student_vocabulary)
        for request, code, message in (
                (too_big, grpc.StatusCode.INVALID_ARGUMENT, f"more than the teacher's --max-student-vocab {VOCAB}"),
                (pb.JoinRequest(outputs=span, peer=peer), grpc.StatusCode.INVALID_ARGUMENT,
                 "need the student's vocabulary"),
                (pb.JoinRequest(outputs=pb.OutputSpec(logits=True, cross_tokenizer=span.cross_tokenizer), peer=peer),
                 grpc.StatusCode.INVALID_ARGUMENT, "a session asks for one or the other")):
            with pytest.raises(grpc.RpcError) as e:
                stub.Join(request, timeout=10)
            assert e.value.code() == code and message in e.value.details()

    student_tokenizer = models["small_tokenizer"]
    ids, mask = _cross_batch(student_tokenizer)
    with TeacherClient(server.address, "cpu", outputs=[SpanLogprobs()], tokenizer=student_tokenizer) as client:
        texts = row_texts(ids, mask, client.vocabulary)
        for bad, why in (([texts[0], texts[1] + b"x"], "batch 0: row 1: its text and its ids disagree from byte"),
                         ([texts[0][:-1], texts[1]], "batch 1: row 0: its text and its ids disagree")):
            with pytest.raises(InvalidRequest, match=why):
                client.submit(ids, mask, student_text=bad).result(timeout=60)
        outside = ids.clone()
        outside[0, 0] = len(client.vocabulary)
        with pytest.raises(InvalidRequest, match="the student vocabulary sent at join"):
            client.submit(outside, mask, student_text=texts).result(timeout=60)
        out = client.submit(ids, mask).result(timeout=60)  # and it still serves the session
        assert out.span_logprobs.shape == ids.shape and out.span_exact.any()


def test_a_student_with_another_tokenizer_trains_with_loss_gold(server, models, corpus, tmp_path):
    out = tmp_path / "gold"
    result = train_ok(server, models["student_small_vocab"], corpus["train"], out, "--loss", "gold",
                      "--kd-weight", "0.7", "--cross-topk", "4", "--max-steps", "6", "--lr", "3e-3",
                      "--eval-data", str(corpus["heldout"]), "--eval-every", "6", "--job-id", "gold-job")
    assert "trained to step 6" in result.stdout
    records = read_metrics(out)
    kd = column(records, "kd")
    assert all(value > 0 for value in kd)
    assert any("eval_kd" in record for record in records)
    assert any("projected(rest_topk=4)" in rest for _, _, rest in joined_lines(server, "gold-job"))


def test_training_from_the_store_repeats_the_live_run(server, models, corpus, tmp_path):
    """A run given --teacher and --teacher-outputs trains on the teacher's outputs and writes them
    into the store; a run from the store alone then has the same per-step losses, bit for bit. In
    this process: two trainer processes would cost the suite their start-up twice."""
    from student_trainer.config import TrainConfig
    from student_trainer.train import train as run_training

    store = tmp_path / "store"
    common = dict(model=str(models["student"]), data=str(corpus["train"]), batch_size=BATCH, seq_len=SEQ_LEN,
                  device="cpu", kd_weight=0.5, topk=8, max_steps=3, lr=3e-3, teacher_outputs=str(store),
                  teacher_timeout_s=60, log_level="WARNING")
    live = run_training(TrainConfig(**common, teacher=server.address, output_dir=str(tmp_path / "live")))
    manifest = json.loads((store / "manifest.json").read_text())
    # The rows of the 3 batches trained on and of the 2 prefetched (--prefetch), written through.
    assert sum(shard["rows"] for shard in manifest["shards"]) == (3 + 2) * BATCH
    stored = run_training(TrainConfig(**common, output_dir=str(tmp_path / "stored")))
    assert [r["step"] for r in stored["history"]] == [1, 2, 3]
    for a, b in zip(live["history"], stored["history"]):
        assert (a["loss"], a["kd"], a["ce"]) == (b["loss"], b["kd"], b["ce"]), (a, b)
    # Stopped after a step and resumed: the same batches' rows, so the same losses.
    resumed = tmp_path / "resumed"
    run_training(TrainConfig(**common, output_dir=str(resumed), stop_after_steps=1, save_every=1))
    rest = run_training(TrainConfig(**common, output_dir=str(resumed), resume=True))
    assert [r["step"] for r in rest["history"]] == [2, 3]
    assert_same_run(stored["history"][1:], rest["history"], rtol=1e-6)


def test_a_store_dumped_from_the_served_teacher_trains_as_the_teacher_does(server, models, corpus, tmp_path):
    """`student-trainer dump --teacher` (its code, in this process), then training from the store: the
    losses of training from the teacher but for the last bits (the teacher computed the rows in other
    batches than the training's)."""
    from student_trainer.config import DumpConfig, TrainConfig
    from student_trainer.store import dump
    from student_trainer.train import train as run_training

    common = dict(model=str(models["student"]), batch_size=BATCH, seq_len=SEQ_LEN, device="cpu", kd_weight=0.5,
                  topk=8, max_steps=3, lr=3e-3, teacher_timeout_s=60, log_level="WARNING")
    small = tmp_path / "small.jsonl"  # a few batches' rows: the dump asks for every row of the data
    small.write_text("".join(corpus["train"].read_text().splitlines(keepends=True)[:2]))
    dumped = dump(DumpConfig(data=str(small), teacher_outputs=str(tmp_path / "dumped"), teacher=server.address,
                             tokenizer=str(models["student"]), seq_len=SEQ_LEN, topk=8, batch_size=8,
                             rows_per_shard=16, device="cpu", log_level="WARNING"))
    assert dumped.rows == dumped.rows_written >= 3 * BATCH
    runs = [run_training(TrainConfig(**common, data=str(small), teacher_outputs=store, teacher=address,
                                     output_dir=str(tmp_path / name)))
            for name, store, address in (("live", "", server.address), ("from-dump", str(tmp_path / "dumped"), ""))]
    assert_same_run(runs[0]["history"], runs[1]["history"])


@pytest.mark.parametrize("kind", ["random", "builtin"])
def test_the_seed_draws_a_random_students_weights(tmp_path, kind):
    """`random:CONFIG` and `builtin:NAME` students built the way the trainer builds them: --seed
    decides the weights, the same seed gives the same weights; a built-in model at seed 0 is the
    teacher's (built with seed 0 wherever it runs)."""
    from distill_common.models import builtin_model
    from transformers import LlamaConfig

    from student_trainer.config import TrainConfig
    from student_trainer.train import build_student

    LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=2).save_pretrained(tmp_path)

    def flat(model) -> torch.Tensor:
        return torch.cat([p.detach().flatten() for p in model.parameters()])

    def weights(seed: int) -> torch.Tensor:
        spec = f"random:{tmp_path}" if kind == "random" else "builtin:tiny"
        return flat(build_student(TrainConfig(model=spec, data="data", teacher="host:1", seed=seed),
                                  torch.device("cpu"), None))

    assert not torch.equal(weights(0), weights(1))
    assert torch.equal(weights(1), weights(1))
    if kind == "builtin":
        assert torch.equal(weights(0), flat(builtin_model("tiny")))


def test_a_student_vocabulary_too_large_for_the_join_is_told_to_raise_max_student_vocab(server):
    """A 262,144-entry student vocabulary (Gemma's size) joining a teacher with default limits:
    grpc refuses the Join for its size, and the client names --max-student-vocab, the flag that
    admits it, with the vocabulary's entries."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    from distill_common.outputs import SpanLogprobs
    from student_trainer.errors import LimitExceeded
    from tests.test_alignment import byte_level

    entries = 262_144
    # Distinct 3-byte pieces: 1 MiB of Join, over the teacher's default request limit (about 160 KiB).
    vocab = {byte_level(i.to_bytes(3, "big")): i for i in range(entries)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token=byte_level(b"\0\0\0")))
    tokenizer.decoder = decoders.ByteLevel()
    with pytest.raises(LimitExceeded) as refused:
        TeacherClient(server.address, "cpu", outputs=[SpanLogprobs()],
                      tokenizer=PreTrainedTokenizerFast(tokenizer_object=tokenizer), join_timeout_s=30)
    message = str(refused.value)
    assert "Received message larger than max" in message
    assert f"--max-student-vocab {entries}" in message and "262,144 entries" in message
