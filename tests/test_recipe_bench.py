"""bench/recipe_student.py at a tiny shape on CPU: the GPU bench's code runs (the trainer's own step
on in-memory teacher outputs, full logits and the head on the student)."""

from __future__ import annotations

import json



def test_the_recipe_bench_runs_at_a_tiny_shape(tmp_path, capsys):
    import pytest

    pytest.importorskip("peft", reason="the recipe's student is LoRA (the lora extra)")
    from bench.recipe_student import main

    out = tmp_path / "recipe.md"
    assert main(["--tiny", "--steps", "1", "--warmup", "0", "--out", str(out)]) == 0
    results = json.loads(out.with_suffix(".json").read_text())
    assert [r["mode"] for r in results] == ["full logits", "head on student"]
    for result in results:
        assert set(result["last_losses"]) == {"kd", "attention", "hidden", "loss"}  # no CE: --ce-weight 0
        assert result["tokens_per_s"] > 0
    # The head's input, not the logits: hidden / vocab of the KD part of the bytes (64 / 512).
    full, head = (r["teacher_bytes_per_step"] for r in results)
    assert full - head == 2 * 32 * (512 - 64) * 2
    assert "| 2 x 32 | head on student |" in out.read_text()


def test_the_served_recipe_bench_runs_at_a_tiny_shape(tmp_path):
    """bench/recipe_served.py end to end on CPU: a real teacher server and the trainer's step over gloo
    (teacher alone, student alone, served), and the teacher in the student's process (colocated)."""
    import pytest

    pytest.importorskip("peft", reason="the recipe's student is LoRA (the lora extra)")
    from bench.recipe_served import main

    out = tmp_path / "served.md"
    assert main(["--tiny", "--steps", "1", "--warmup", "0", "--out", str(out)]) == 0
    results = json.loads(out.with_suffix(".json").read_text())
    runs = {(r["mode"], r["run"]): r for r in results}
    assert set(runs) == {(mode, run) for mode in ("full logits", "head on student")
                         for run in ("teacher alone", "student alone", "served", "colocated")}
    for (mode, run), result in runs.items():
        assert result["tokens_per_s"] > 0 and "oom" not in result, (mode, run)
        if run != "teacher alone":  # trained: every term of the recipe, no CE (--ce-weight 0)
            assert set(result["last_losses"]) == {"kd", "attention", "hidden", "loss"}, (mode, run)
        assert "vs_min" in result
    table = out.read_text()
    assert "| 2 x 32 | full logits | served |" in table and "| 2 x 32 | head on student | colocated |" in table


def test_the_local_teacher_sends_the_recipes_kinds_as_the_server_does(tmp_path):
    """The colocated baseline computes what the served teacher sends: final hidden states with the
    head given at join, hidden states and attention inputs, equal to the server's outputs."""
    import torch

    from distill_common.outputs import AttentionInputs, FinalHidden, HiddenStates
    from student_trainer import TeacherClient
    from student_trainer.local_teacher import LocalTeacher
    from teacher_server.launcher import ServerProcess
    from tests.helpers import build_tiny_model
    from transformers import AutoModelForCausalLM

    model_dir = build_tiny_model(tmp_path / "teacher")
    kinds = (FinalHidden(), HiddenStates((1, 2)), AttentionInputs((0, 1)))
    ids = torch.randint(0, 384, (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0  # padding too
    local = LocalTeacher(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), kinds)
    mine = local.submit(ids, mask).result(timeout=0)
    with ServerProcess("--model", str(model_dir), "--max-batch-tokens", "64", "--max-seq-len", "32") as server:
        with TeacherClient(server.address, "cpu", outputs=kinds) as teacher:
            served = teacher.submit(ids, mask).result(timeout=60)
            head = teacher.joined.head
    real = mask.bool()
    assert torch.equal(local.joined.head.weight, head.weight)
    assert (mine.final_hidden - served.final_hidden)[real].abs().max() <= 1e-5
    for layer in (1, 2):
        assert (mine.hidden_states[layer] - served.hidden_states[layer])[real].abs().max() <= 1e-5
    for layer in (0, 1):
        for a, b in zip(mine.attention_inputs[layer], served.attention_inputs[layer]):
            assert (a - b)[real].abs().max() <= 1e-5
    assert not mine.final_hidden.is_inference()  # the losses save it for backward
