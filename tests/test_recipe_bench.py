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
