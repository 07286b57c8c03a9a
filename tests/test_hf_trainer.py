"""DistillationTrainer: a transformers.Trainer script distilling from a real teacher server, on CPU over gloo.

Built here: a BPE tokenizer trained on a few stdlib modules, a teacher (tiny Llama, hidden 64,
2 layers) briefly pre-trained on that text so that its distributions are worth matching, and
students (hidden 32, 1 layer) with its vocabulary. Rows are right-padded and some have prompt
tokens labelled -100, so the positions KD counts are the labels' and not the attention mask's.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from distill_demo.corpus import stdlib_root
from distill_demo.tokenizer import train_tokenizer
from student_trainer import TopK
from student_trainer.errors import Incompatible, TeacherUnavailable
from teacher_server.launcher import ServerProcess
from tests.helpers import free_port, wait_until

pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate (pip install '.[hf]')")

from transformers import AutoModelForCausalLM, Trainer, TrainingArguments, default_data_collator  # noqa: E402

from student_trainer.hf import DistillationTrainer  # noqa: E402

VOCAB = 400
SEQ_LEN = 32
BATCH = 4
SOURCES = ("argparse.py", "textwrap.py", "string.py", "json/decoder.py", "json/encoder.py")


# ---- building the models and the data ---------------------------------------------------


def build_llama(path: Path, *, vocab_size: int, hidden_size: int, layers: int, seed: int, tokenizer) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size,
                                         intermediate_size=2 * hidden_size, num_hidden_layers=layers,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def pretrain(model_dir: Path, rows: torch.Tensor, steps: int = 40, batch: int = 8) -> None:
    """Next-token training, so the teacher has something to teach (a random one is near-uniform)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(steps):
        chunk = rows[torch.arange(step * batch, (step + 1) * batch) % len(rows)]
        model(input_ids=chunk, labels=chunk).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(model_dir)


def make_rows(ids: torch.Tensor, lengths: list[int], prompts: list[int]) -> list[dict]:
    """Rows of SEQ_LEN tokens: `length` real tokens then padding; the first `prompt` are no targets."""
    rows = []
    for row, (length, prompt) in enumerate(zip(lengths, prompts)):
        input_ids = ids[row * SEQ_LEN:(row + 1) * SEQ_LEN].clone()
        attention_mask = (torch.arange(SEQ_LEN) < length).long()
        input_ids[length:] = 0  # <|pad|>
        labels = input_ids.masked_fill(attention_mask == 0, -100)
        labels[:prompt] = -100
        rows.append({"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels})
    return rows


class Rows(torch.utils.data.Dataset):
    def __init__(self, rows: list[dict]):
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict:
        return self.rows[index]


class InOrder(torch.utils.data.IterableDataset):
    """The rows in their order: the Trainer does not shuffle an iterable dataset."""

    def __init__(self, rows: list[dict]):
        self.rows = rows

    def __iter__(self):
        return iter(self.rows)


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("hf")
    texts = [(stdlib_root() / name).read_text() for name in SOURCES]
    tokenizer = train_tokenizer(texts, vocab_size=VOCAB)
    assert len(tokenizer) == VOCAB
    ids = torch.tensor(tokenizer("".join(texts), add_special_tokens=False)["input_ids"])
    teacher = build_llama(root / "teacher", vocab_size=VOCAB, hidden_size=64, layers=2, seed=0, tokenizer=tokenizer)
    pretrain(teacher, ids[:len(ids) // SEQ_LEN * SEQ_LEN].view(-1, SEQ_LEN))
    student = dict(hidden_size=32, layers=1, seed=1, tokenizer=tokenizer)
    lengths = [SEQ_LEN - 7 * (i % 3) for i in range(48)]
    prompts = [8 * (i % 4 == 1) for i in range(48)]
    return {
        "tokenizer": tokenizer,
        "teacher": teacher,
        "student": build_llama(root / "student", vocab_size=VOCAB, **student),
        # The teacher's tokenizer, but 448 output rows: the logits cannot be compared.
        "student_wide_head": build_llama(root / "student-448", vocab_size=448, **student),
        "rows": make_rows(ids, lengths, prompts),
        # Two micro-batches with very different numbers of target tokens (91 against 8).
        "uneven_rows": make_rows(ids[-8 * SEQ_LEN:], [SEQ_LEN, SEQ_LEN, SEQ_LEN, 10, 4, 4, 4, 4],
                                 [0, 0, 0, 0, 2, 2, 2, 2]),
    }


@pytest.fixture(scope="module")
def server(setup):
    server = ServerProcess("--model", str(setup["teacher"]), "--max-seq-len", str(2 * SEQ_LEN),
                           "--max-batch-tokens", "1024")
    yield server
    assert server.stop() == 0, server.log


def training_args(output_dir: Path, **overrides) -> TrainingArguments:
    options = dict(output_dir=str(output_dir), max_steps=20, per_device_train_batch_size=BATCH,
                   learning_rate=3e-3, report_to=[], use_cpu=True, save_strategy="no", logging_steps=1, seed=0)
    return TrainingArguments(**{**options, **overrides})


def distillation_trainer(setup, student: str, args: TrainingArguments, dataset, **options) -> DistillationTrainer:
    return DistillationTrainer(model=AutoModelForCausalLM.from_pretrained(setup[student]), args=args,
                               train_dataset=dataset, data_collator=default_data_collator,
                               processing_class=setup["tokenizer"], **{"teacher_timeout_s": 60, **options})


def logged(trainer: Trainer, key: str) -> list[float]:
    return [record[key] for record in trainer.state.log_history if key in record]


def reference_losses(student, teacher, batch: dict) -> tuple[float, float]:
    """(KL(p_teacher || q_student), CE), each a mean over every target token of `batch`."""
    with torch.no_grad():
        inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
        student_logits, teacher_logits = student(**inputs).logits[:, :-1], teacher(**inputs).logits[:, :-1]
    mask = batch["labels"][:, 1:] != -100
    log_q = F.log_softmax(student_logits[mask].double(), dim=-1)
    log_p = F.log_softmax(teacher_logits[mask].double(), dim=-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(dim=-1).mean().item()
    ce = F.cross_entropy(student_logits[mask].double(), batch["labels"][:, 1:][mask]).item()
    return kl, ce


# ---- the tests ---------------------------------------------------------------------------


def test_kd_loss_falls_and_comes_from_the_remote_teacher(setup, server, tmp_path):
    args = training_args(tmp_path, run_name="hf-kd")
    trainer = distillation_trainer(setup, "student", args, Rows(setup["rows"]), teacher_address=server.address,
                                   kd_weight=1.0)
    trainer.train()

    loss = logged(trainer, "loss")
    assert len(loss) == 20
    assert sum(loss[-5:]) < 0.8 * sum(loss[:5]), loss
    assert logged(trainer, "kd_loss") == pytest.approx(loss, abs=1e-4)  # kd_weight 1: the loss is KD
    # One session, rank 0 of the job named after run_name, left when train() returned.
    joined = re.findall(r"session (\w+) joined: job hf-kd rank (\d+)", server.log)
    assert [rank for _, rank in joined] == ["0"], server.log
    wait_until(lambda: f"session {joined[0][0]} ended: left" in server.log, 10, "the session to be left")

    # One compute_loss against KL(p || q) from the teacher run here: the logits came from the server.
    batch = default_data_collator(setup["rows"][:BATCH])
    trainer.model.train()
    kd = trainer.compute_loss(trainer.model, batch).item()
    trainer.close_teacher()
    expected, _ = reference_losses(trainer.model, AutoModelForCausalLM.from_pretrained(setup["teacher"]), batch)
    assert kd == pytest.approx(expected, abs=1e-4)


def test_gradient_accumulation_counts_every_target_token_once(setup, server, tmp_path):
    rows = setup["uneven_rows"]
    # One optimizer step over all 8 rows, in two micro-batches; the second is prefetched.
    args = training_args(tmp_path, max_steps=1, gradient_accumulation_steps=2)
    trainer = distillation_trainer(setup, "student", args, InOrder(rows), teacher_address=server.address,
                                   kd_weight=0.5)
    trainer.train()

    [loss] = logged(trainer, "loss")
    student = AutoModelForCausalLM.from_pretrained(setup["student"])  # the weights the step started from
    teacher = AutoModelForCausalLM.from_pretrained(setup["teacher"])
    kd, ce = reference_losses(student, teacher, default_data_collator(rows))
    assert loss == pytest.approx(0.5 * kd + 0.5 * ce, abs=1e-4)
    # A mean of the two micro-batches' means would weigh the 8 tokens of the second like the 91 of the first.
    halves = [reference_losses(student, teacher, default_data_collator(rows[i:i + BATCH])) for i in (0, BATCH)]
    mean_of_means = sum(0.5 * kd + 0.5 * ce for kd, ce in halves) / 2
    assert abs(mean_of_means - loss) > 1e-3  # ten times the tolerance above
    # The logged terms are the micro-batch means, averaged.
    assert logged(trainer, "kd_loss") == [pytest.approx(sum(kd for kd, _ in halves) / 2, abs=1e-4)]
    assert logged(trainer, "ce_loss") == [pytest.approx(sum(ce for _, ce in halves) / 2, abs=1e-4)]


def test_a_store_filled_by_the_teacher_gives_the_same_step(setup, server, tmp_path):
    """teacher_outputs with teacher_address writes the teacher's outputs into the store; teacher_outputs
    alone reads them back: the same step's loss, bit for bit."""
    rows, store = setup["uneven_rows"], tmp_path / "store"
    losses = []
    for run, address in (("live", server.address), ("stored", None)):
        args = training_args(tmp_path / run, max_steps=1, gradient_accumulation_steps=2)
        trainer = distillation_trainer(setup, "student", args, InOrder(rows), teacher_address=address,
                                       teacher_outputs=str(store), kd_weight=0.5, topk=8)
        trainer.train()
        losses.append(logged(trainer, "loss"))
    assert losses[0] == losses[1] and len(losses[0]) == 1


def test_topk_distils_on_the_teachers_top_k(setup, server, tmp_path):
    trainer = distillation_trainer(setup, "student", training_args(tmp_path), Rows(setup["rows"]),
                                   teacher_address=server.address, kd_weight=1.0, topk=8, temperature=2.0)
    batch = default_data_collator(setup["rows"][:BATCH])
    kd = trainer.compute_loss(trainer.model, batch).item()
    trainer.close_teacher()

    # The teacher's 8 most likely tokens and the rest, against the student's same 9 outcomes, both
    # at T = 2 (once: the teacher applied it to what it sent) and scaled by T².
    teacher = AutoModelForCausalLM.from_pretrained(setup["teacher"])
    with torch.no_grad():
        inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
        student_logits, teacher_logits = trainer.model(**inputs).logits[:, :-1], teacher(**inputs).logits[:, :-1]
    mask = batch["labels"][:, 1:] != -100
    p_all = F.softmax(teacher_logits[mask].double() / 2, dim=-1)
    q_all = F.softmax(student_logits[mask].double() / 2, dim=-1)
    p, indices = p_all.topk(8, dim=-1)
    q = q_all.gather(-1, indices)
    p, q = torch.cat([p, 1 - p.sum(-1, keepdim=True)], -1), torch.cat([q, 1 - q.sum(-1, keepdim=True)], -1)
    expected = 4 * (p * (p.log() - q.log())).sum(dim=-1).mean().item()
    assert kd == pytest.approx(expected, abs=1e-4)


def test_the_teachers_head_on_the_student_and_attention_relations(setup, server, tmp_path):
    from distill_common.attention_inputs import AttentionCapture
    from student_trainer.losses import attention_relation_loss

    trainer = distillation_trainer(setup, "student", training_args(tmp_path), Rows(setup["rows"]),
                                   teacher_address=server.address, kd_weight=0.5, head_on_student=True,
                                   attention_layers=(1,), attention_weight=0.3, attention_relation_heads=4)
    batch = default_data_collator(setup["rows"][:BATCH])
    loss = trainer.compute_loss(trainer.model, batch).item()
    assert trainer._feed.teacher.joined.head is not None
    trainer.close_teacher()

    # KD against the teacher's logits run here (the server sent no logits, only its final hidden
    # state and, at join, its head); attention: the teacher's last layer against the student's only one.
    teacher = AutoModelForCausalLM.from_pretrained(setup["teacher"])
    kd, ce = reference_losses(trainer.model, teacher, batch)
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    with torch.no_grad(), AttentionCapture(teacher, [1]) as theirs, AttentionCapture(trainer.model, [0]) as ours:
        teacher(**inputs)
        trainer.model(**inputs)
    attention = attention_relation_loss(ours.inputs[0], theirs.inputs[1], batch["attention_mask"],
                                        relation_heads=4).item()
    assert attention > 0.01
    assert loss == pytest.approx(0.5 * kd + 0.5 * ce + 0.3 * attention, abs=1e-4)


def test_kd_weight_zero_is_the_plain_trainer_and_never_joins(setup, tmp_path):
    args = training_args(tmp_path, max_steps=5)
    dataset = Rows(setup["rows"])
    plain = Trainer(model=AutoModelForCausalLM.from_pretrained(setup["student"]), args=args, train_dataset=dataset,
                    data_collator=default_data_collator, processing_class=setup["tokenizer"])
    plain.train()
    # Nothing listens at this address: joining would raise TeacherUnavailable.
    distilled = distillation_trainer(setup, "student", args, dataset, teacher_address=f"127.0.0.1:{free_port()}",
                                     kd_weight=0.0)
    distilled.train()
    assert logged(distilled, "loss") == logged(plain, "loss")
    assert len(logged(plain, "loss")) == 5


def test_unreachable_teacher_is_reported(setup, tmp_path):
    address = f"127.0.0.1:{free_port()}"
    trainer = distillation_trainer(setup, "student", training_args(tmp_path, max_steps=2), Rows(setup["rows"]),
                                   teacher_address=address, kd_weight=0.5, teacher_timeout_s=2)
    with pytest.raises(TeacherUnavailable, match=f"no teacher answered at {address}"):
        trainer.train()


def test_a_student_with_another_vocabulary_is_refused(setup, server, tmp_path):
    trainer = distillation_trainer(setup, "student_wide_head", training_args(tmp_path, max_steps=2),
                                   Rows(setup["rows"]), teacher_address=server.address, kd_weight=0.5)
    with pytest.raises(Incompatible, match="vocabulary has 448 entries, the teacher's 400"):
        trainer.train()


def test_settings_are_checked_before_anything_runs(setup, tmp_path):
    args = training_args(tmp_path)
    with pytest.raises(ValueError, match="kd_weight must lie in"):
        distillation_trainer(setup, "student", args, Rows(setup["rows"]), teacher_address="x:1", kd_weight=1.5)
    with pytest.raises(ValueError, match="jsd-beta"):
        distillation_trainer(setup, "student", args, Rows(setup["rows"]), teacher_address="x:1", kd_loss="jsd",
                             jsd_beta=1.0)
    with pytest.raises(ValueError, match="label_smoothing_factor"):
        distillation_trainer(setup, "student", training_args(tmp_path, label_smoothing_factor=0.1),
                             Rows(setup["rows"]), teacher_address="x:1")
    with pytest.raises(ValueError, match="attention_layers \\[1\\] and attention_weight 0.0 go together"):
        distillation_trainer(setup, "student", args, Rows(setup["rows"]), teacher_address="x:1", attention_layers=(1,))
    with pytest.raises(ValueError, match="head_on_student .* needs kd_weight > 0"):
        distillation_trainer(setup, "student", args, Rows(setup["rows"]), teacher_address="x:1", kd_weight=0.0,
                             head_on_student=True, attention_layers=(1,), attention_weight=1.0)
    with pytest.raises(ValueError, match="non-reentrant gradient checkpointing"):
        distillation_trainer(setup, "student", training_args(tmp_path, gradient_checkpointing=True,
                                                             gradient_checkpointing_kwargs={"use_reentrant": True}),
                             Rows(setup["rows"]), teacher_address="x:1", attention_layers=(1,), attention_weight=1.0)
    with pytest.raises(ValueError, match=r"may not set \['outputs'\]"):
        distillation_trainer(setup, "student", args, Rows(setup["rows"]), teacher_address="x:1",
                             teacher_client_options={"outputs": (TopK(3),), "weight": 2.0})
