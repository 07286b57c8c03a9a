"""One student, two teachers, served: two real teacher servers (tiny Llamas with different
weights), the trainer against both, and the same training written out here the straightforward
way (both models run locally, each combination's loss by its formula, full-vocabulary float64):
per-step losses, each teacher's own divergence and the gradient's norm agree. Then (slow) one of
the teachers killed with SIGKILL mid-run and started again: the run repeats the uninterrupted
one's losses, and the other teacher is never asked again.

The trainer runs in this process (`train(cfg)`), as tests/test_trainer.py's store tests do: two
more trainer processes would cost the suite their start-up; the slow test runs the command line.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from distill_demo.corpus import write_jsonl_corpus
from distill_demo.tokenizer import train_tokenizer
from teacher_server.launcher import ServerProcess, child_env, metrics_samples
from tests.helpers import ROOT, divergence, run_ok, wait_until
from tests.test_trainer import build_llama

VOCAB = 300
SEQ_LEN = 32
BATCH = 4
STEPS = 3
RTOL = 2e-5  # the served float32 teachers and student against float64 formulas here


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("several")
    train, _ = write_jsonl_corpus(root / "corpus", max_files=3, seq_chars=300)
    records = [json.loads(line) for line in train.read_text().splitlines()][:24]
    texts = [record["text"] for record in records]
    data = root / "train.jsonl"  # every other example is "prose", for the routed run
    data.write_text("".join(json.dumps({"text": text, "domain": "prose" if i % 2 else "code"}) + "\n"
                            for i, text in enumerate(texts)))
    prompts = root / "prompts.jsonl"  # for on-policy training
    prompts.write_text("".join(json.dumps({"prompt": text[:12], "completion": text[12:40]}) + "\n" for text in texts))
    tokenizer = train_tokenizer(texts, vocab_size=VOCAB)
    # initializer_range: peaked distributions, whose top-k has no near ties to flip.
    shape = dict(vocab_size=VOCAB, hidden_size=32, layers=1, tokenizer=tokenizer, initializer_range=0.3)
    return {"data": data, "prompts": prompts, "tokenizer": tokenizer,
            "code": build_llama(root / "code", seed=0, **shape),
            "prose": build_llama(root / "prose", seed=1, **shape),
            "student": build_llama(root / "student", vocab_size=VOCAB, hidden_size=16, layers=1, seed=2,
                                   tokenizer=tokenizer)}


def serve(model_dir: Path, **kwargs) -> ServerProcess:
    # One trainer batch per forward: a teacher's outputs for a batch do not depend on what it was packed with.
    return ServerProcess("--model", str(model_dir), "--max-seq-len", str(SEQ_LEN),
                         "--max-batch-tokens", str(BATCH * SEQ_LEN), **kwargs)


def start_all(*starts):
    """Runs `starts` side by side (a server takes seconds to load or to stop) and returns their
    results; when one fails, stops the servers the others started and raises its error."""
    results, errors = [None] * len(starts), []

    def one(i, start):
        try:
            results[i] = start()
        except BaseException as e:  # noqa: BLE001 - raised below
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i, start)) for i, start in enumerate(starts)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        for server in results:
            if isinstance(server, ServerProcess):
                server.stop()
        raise errors[0]
    return results


@pytest.fixture(scope="module")
def servers(assets):
    code, prose = start_all(lambda: serve(assets["code"]), lambda: serve(assets["prose"]))
    yield {"code": code, "prose": prose}
    stopped = start_all(code.stop, prose.stop)  # side by side: each waits for its server to exit
    assert stopped == [0, 0], (code.log, prose.log)


def settings(assets, servers, output_dir: Path, specs: dict[str, str], stores_alone=(), **flags):
    """The run's TrainConfig: `specs` maps each teacher to its spec's keys after name and address
    (no address for those in `stores_alone`)."""
    from student_trainer.config import TrainConfig

    options = dict(model=str(assets["student"]), data=str(assets["data"]), output_dir=str(output_dir),
                   batch_size=BATCH, seq_len=SEQ_LEN, device="cpu", max_steps=STEPS, lr=1e-2, kd_weight=0.7,
                   prefetch=1, teacher_timeout_s=60, log_level="WARNING")
    options.update(flags)
    return TrainConfig(teacher_spec=[",".join(filter(None, (f"name={name}", "" if name in stores_alone else
                                                            f"address={servers[name].address}", rest)))
                                     for name, rest in specs.items()], **options)


# ---- the straightforward reference ------------------------------------------------------------------


def buckets(probs: torch.Tensor, known: torch.Tensor) -> torch.Tensor:
    """[..., V] probabilities -> [..., V + 1]: those at the known ids, 0 elsewhere, then the rest's mass."""
    at_known = torch.where(known, probs, torch.zeros_like(probs))
    return torch.cat([at_known, (1 - at_known.sum(-1, keepdim=True))], dim=-1)


def one_teacher_kd(plan, student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Teacher `plan`'s own KD loss: the mean over `mask` of D(p, q) * T², both at its T; for a
    top-k teacher over its k ids and the rest."""
    t = plan.temperature
    p, q = torch.softmax(teacher / t, -1), torch.softmax(student / t, -1)
    if plan.topk:
        known = torch.zeros_like(p, dtype=torch.bool).scatter_(-1, p.topk(plan.topk, dim=-1).indices, True)
        p, q = buckets(p, known), buckets(q, known)
    return divergence(p, q, plan.loss)[mask].mean() * t * t


def mixture_kd(cfg, student: torch.Tensor, teachers: dict, mask: torch.Tensor) -> torch.Tensor:
    """D(m, q) * T², m = sum_i w_i p_i over the ids every top-k teacher sent and the rest."""
    total = sum(plan.weight for plan in cfg.teacher_plans)
    m = sum(plan.weight / total * torch.softmax(teachers[plan.name] / plan.temperature, -1)
            for plan in cfg.teacher_plans)
    q = torch.softmax(student / cfg.temperature, -1)
    known = torch.ones_like(m, dtype=torch.bool)
    for plan in cfg.teacher_plans:
        if plan.topk:
            p = torch.softmax(teachers[plan.name] / plan.temperature, -1)
            known &= torch.zeros_like(known).scatter_(-1, p.topk(plan.topk, dim=-1).indices, True)
    if not bool(known.all()):
        m, q = buckets(m, known), buckets(q, known)
    return divergence(m, q, cfg.loss)[mask].mean() * cfg.temperature ** 2


def reference_run(cfg, teachers: dict) -> list[dict]:
    """The run trained here: the same student, data order, optimizer and schedule as the trainer's;
    both teachers run locally on every row; the KD term by the formulas above."""
    from transformers import AutoTokenizer

    from student_trainer.data import BatchIterator
    from student_trainer.train import build_student, load_dataset, lr_lambda

    student = build_student(cfg, torch.device("cpu"), None)
    dataset = load_dataset(cfg, AutoTokenizer.from_pretrained(cfg.model), cfg.data)
    batches = BatchIterator(dataset, cfg.batch_size, seed=cfg.seed)
    optimizer = torch.optim.AdamW(student.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg, cfg.max_steps))
    records = []
    for _ in range(cfg.max_steps):
        batch = next(batches)
        ids, attention = batch["input_ids"], batch["attention_mask"]
        logits = student(input_ids=ids, attention_mask=attention).logits[:, :-1]
        mask = (batch["loss_mask"][:, 1:] * attention[:, 1:]).bool()
        with torch.no_grad():
            outs = {name: model(input_ids=ids, attention_mask=attention).logits[:, :-1].double()
                    for name, model in teachers.items()}
        s = logits.double()
        own = {}
        if cfg.teacher_route != "all":
            route = batch["route"][:, 1:]
            kd = s.new_zeros(())
            for index, plan in enumerate(cfg.teacher_plans):
                mine = mask & (route == index)
                own[plan.name] = one_teacher_kd(plan, s, outs[plan.name], mine)
                kd = kd + plan.weight * own[plan.name] * mine.sum() / mask.sum()
        elif cfg.teacher_combine == "sum":
            total = sum(plan.weight for plan in cfg.teacher_plans)
            own = {plan.name: one_teacher_kd(plan, s, outs[plan.name], mask) for plan in cfg.teacher_plans}
            kd = sum(plan.weight / total * own[plan.name] for plan in cfg.teacher_plans)
        else:
            own = {plan.name: one_teacher_kd(plan, s, outs[plan.name], mask) for plan in cfg.teacher_plans}
            kd = mixture_kd(cfg, s, outs, mask)
        ce = F.cross_entropy(s[mask], ids[:, 1:][mask])
        loss = cfg.kd_weight * kd + (1 - cfg.kd_weight) * ce
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(student.parameters(), cfg.max_grad_norm).item()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        records.append({"loss": loss.item(), "kd": kd.item(), "ce": ce.item(), "grad_norm": grad_norm,
                        **{f"kd/{name}": value.item() for name, value in own.items()}})
    return records


@pytest.fixture(scope="module")
def local_teachers(assets) -> dict:
    from transformers import AutoModelForCausalLM

    return {name: AutoModelForCausalLM.from_pretrained(assets[name]).eval() for name in ("code", "prose")}


RUNS = {
    # Weighted mean of the two divergences: full logits at T 1, top-8 at T 2.
    "sum": ({"code": "weight=2", "prose": "kind=topk,topk=8,temperature=2"}, {}),
    # Reverse KL to the mixture: full logits at T 1.5 and a top-8 teacher, exact on its 8 ids and the rest.
    "mixture": ({"code": "temperature=1.5", "prose": "kind=topk,topk=8,weight=3"},
                {"teacher_combine": "mixture", "loss": "reverse_kl", "temperature": 2.0}),
    # Each token scored by its example's teacher; the rows packed across examples go to both.
    "routed": ({"code": "", "prose": "kind=topk,topk=8,weight=3"}, {"teacher_route": "field:domain"}),
}


@pytest.mark.parametrize("run", list(RUNS))
def test_two_teachers_give_the_local_references_per_step_losses(run, assets, servers, local_teachers, tmp_path):
    from student_trainer.train import train

    specs, flags = RUNS[run]
    cfg = settings(assets, servers, tmp_path / run, specs, **flags)
    served = train(cfg)["history"]
    reference = reference_run(cfg, local_teachers)
    assert [r["step"] for r in served] == list(range(1, STEPS + 1))
    for got, want in zip(served, reference):
        for key, value in want.items():
            assert got[key] == pytest.approx(value, rel=RTOL, abs=1e-7), (run, got["step"], key, got[key], value)
        for name in ("code", "prose"):
            assert got[f"teacher_wait_s/{name}"] >= 0
        sent = got["teacher_tokens/code"] + got["teacher_tokens/prose"]
        # All: both teachers get every token; routed: each the rows holding its tokens, rows with both to both.
        assert (sent == 2 * BATCH * SEQ_LEN) if run != "routed" else (BATCH * SEQ_LEN <= sent <= 2 * BATCH * SEQ_LEN)
    written = [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
    assert {"kd/code", "kd/prose", "teacher_wait_s/code", "teacher_tokens/prose"} <= set(written[-1])


def test_a_store_a_resume_and_held_out_scores_with_two_teachers(assets, servers, tmp_path):
    """One teacher's outputs written through into its store, then read from the store alone: the
    same per-step losses; a run stopped after a step and resumed repeats them (field routing, whose
    routes are part of the data's state); held-out scores against both teachers."""
    from student_trainer.train import train

    store = tmp_path / "code-store"
    specs = {"code": f"store={store}", "prose": "kind=topk,topk=8"}
    flags = dict(teacher_route="field:domain", eval_data=str(assets["data"]), eval_every=STEPS)
    live = train(settings(assets, servers, tmp_path / "live", specs, **flags))["history"]
    assert (store / "manifest.json").is_file()
    assert all(key in live[-1] for key in ("eval_ce", "eval_kd")) and live[-1]["eval_kd"] > 0, live[-1]

    stored = train(settings(assets, servers, tmp_path / "stored", specs, stores_alone={"code"},
                            teacher_route="field:domain"))["history"]
    for a, b in zip(live, stored):
        assert (a["loss"], a["kd/code"], a["kd/prose"]) == (b["loss"], b["kd/code"], b["kd/prose"]), (a, b)

    resumed_dir = tmp_path / "resumed"
    train(settings(assets, servers, resumed_dir, specs, teacher_route="field:domain", stop_after_steps=1,
                   save_every=1))
    rest = train(settings(assets, servers, resumed_dir, specs, teacher_route="field:domain", resume=True))["history"]
    assert [r["step"] for r in rest] == list(range(2, STEPS + 1))
    for a, b in zip(live[1:], rest):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6), (a, b)


@pytest.mark.parametrize("loss", ["sampled", "divergence"])
def test_on_policy_training_is_scored_by_both_teachers(loss, assets, servers, tmp_path):
    """The student samples, both teachers score (the combination itself: tests/test_teachers.py)."""
    from student_trainer.train import train

    cfg = settings(assets, servers, tmp_path, {"code": "weight=2", "prose": "temperature=2"},
                   data=str(assets["prompts"]), on_policy_fraction=1.0, on_policy_loss=loss, max_new_tokens=8,
                   student_topk=4 if loss == "divergence" else 0, teacher_combine="mixture", loss="reverse_kl",
                   max_steps=2)
    history = train(cfg)["history"]
    assert [r["on_policy"] for r in history] == [1.0, 1.0]
    for record in history:
        assert all(record[key] == record[key] for key in ("kd", "kd/code", "kd/prose")), record  # not NaN
        assert record["teacher_tokens/code"] == record["teacher_tokens/prose"] > 0


def test_the_hf_trainer_distils_from_both_teachers(assets, servers, local_teachers, tmp_path):
    """DistillationTrainer(teachers=...): a few steps log each teacher's loss; one compute_loss
    equals the mixture written out here (reverse KL at T 2 to full logits at T 1.5 and a top-8)."""
    pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate (pip install '.[hf]')")
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM, TrainingArguments, default_data_collator

    from student_trainer.data import PackedDataset
    from student_trainer.hf import DistillationTrainer

    packed = PackedDataset(assets["data"], assets["tokenizer"], SEQ_LEN)
    rows = [{"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
            for ids, mask in zip(packed.input_ids[:4 * BATCH], packed.attention_mask[:4 * BATCH])]
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=BATCH,
                             learning_rate=1e-2, report_to=[], use_cpu=True, save_strategy="no", logging_steps=1)
    trainer = DistillationTrainer(
        model=AutoModelForCausalLM.from_pretrained(assets["student"]), args=args, train_dataset=rows,
        data_collator=default_data_collator, processing_class=assets["tokenizer"], kd_weight=1.0,
        kd_loss="reverse_kl", temperature=2.0, teacher_combine="mixture", teacher_timeout_s=60,
        teachers=[{"name": "code", "address": servers["code"].address, "temperature": 1.5},
                  {"name": "prose", "address": servers["prose"].address, "kind": "topk", "topk": 8, "weight": 3}])
    trainer.train()
    logs = [record for record in trainer.state.log_history if "kd_loss" in record]
    assert len(logs) == 2 and all({"kd_loss/code", "kd_loss/prose"} <= set(record) for record in logs), logs

    batch = default_data_collator(rows[:BATCH])
    kd = trainer.compute_loss(trainer.model, batch).item()
    trainer.close_teacher()
    with torch.no_grad():
        student = trainer.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        outs = {name: model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
                for name, model in local_teachers.items()}
    settings = SimpleNamespace(teacher_plans=trainer.teacher_plans, temperature=2.0, loss="reverse_kl")
    expected = mixture_kd(settings, student[:, :-1].double(), {k: v.double() for k, v in outs.items()},
                          batch["labels"][:, 1:] != -100)
    assert kd == pytest.approx(expected.item(), rel=RTOL)


# ---- a teacher killed mid-run (slow) --------------------------------------------------------------------


def trainer_command(assets, addresses: dict, output_dir: Path, steps: int) -> list[str]:
    return [sys.executable, "-m", "student_trainer", "train", "--model", str(assets["student"]),
            "--data", str(assets["data"]), "--output-dir", str(output_dir), "--batch-size", str(BATCH),
            "--seq-len", str(SEQ_LEN), "--device", "cpu", "--max-steps", str(steps), "--kd-weight", "0.7",
            "--lr", "1e-2", "--prefetch", "2", "--teacher-timeout-s", "60", "--teacher-reconnect-timeout-s", "120",
            "--teacher-combine", "mixture",
            "--teacher-spec", f"name=code,address={addresses['code']}",
            "--teacher-spec", f"name=prose,address={addresses['prose']},kind=topk,topk=8"]


@pytest.mark.slow
def test_a_teacher_killed_mid_run_repeats_the_uninterrupted_losses_and_keeps_the_others_outputs(assets, tmp_path):
    from tests.test_restart import RestartableTeacher, logged_steps

    steps = 24
    code = serve(assets["code"])
    prose = RestartableTeacher("--model", str(assets["prose"]), "--max-seq-len", str(SEQ_LEN),
                               "--max-batch-tokens", str(BATCH * SEQ_LEN))
    try:
        addresses = {"code": code.address, "prose": prose.running().address}
        run_ok(trainer_command(assets, addresses, tmp_path / "reference", steps), 300)
        joins_before = metrics_samples(code.http)[("teacher_sessions_joined_total", ())]
        restarted_dir = tmp_path / "restarted"
        trainer = subprocess.Popen(trainer_command(assets, addresses, restarted_dir, steps), stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True, env=child_env(), cwd=ROOT)
        try:
            wait_until(lambda: logged_steps(restarted_dir) >= 3 or trainer.poll() is not None, 300,
                       "the trainer's third step", interval_s=0.002)
            prose.freeze()
            steps_at_kill = logged_steps(restarted_dir)
            assert steps_at_kill + 3 < steps, f"the run got too far ({steps_at_kill} steps) before the teacher froze"
            prose.restart()
            output, _ = trainer.communicate(timeout=300)
        except BaseException:
            trainer.kill()
            raise
        assert trainer.returncode == 0, output
        assert "reconnected to teacher" in output, output
        # The teacher that stayed up was joined once by this run and asked nothing again.
        assert metrics_samples(code.http)[("teacher_sessions_joined_total", ())] == joins_before + 1
        reference, restarted = ([json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text()
                                 .splitlines()] for name in ("reference", "restarted"))
        assert [r["step"] for r in restarted] == [r["step"] for r in reference] == list(range(1, steps + 1))
        for a, b in zip(reference, restarted):
            for key in ("loss", "kd", "ce", "grad_norm", "kd/code", "kd/prose"):
                assert b[key] == pytest.approx(a[key], rel=1e-6, abs=1e-12), (a["step"], key, a[key], b[key])
    finally:
        code.stop()
        prose.close()
