"""bench/eagle3_served.py at the tiny shape on CPU: a real teacher server, a real client over gloo, the
trainer's EAGLE-3 step fed by its prefetcher, and the colocated baseline, end to end; and how the
tables show a run that ran out of memory."""

from __future__ import annotations

import json

from bench.eagle3_served import main, served_table, side_by_side


def test_the_served_bench_runs_at_a_tiny_shape_with_its_colocated_baseline(tmp_path):
    out = tmp_path / "served.md"
    # 32 tokens: the shortest a 7-step unroll trains on is 9; one length keeps it to one server's start-up.
    assert main(["--shape", "tiny", "--device", "cpu", "--seq-lens", "32", "--steps", "1", "--out", str(out)]) == 0
    results = json.loads(out.with_suffix(".json").read_text())
    (served,) = results["served"]
    assert served["length"] == 32
    for run in ("target", "draft", "served"):
        assert served[f"{run}_tokens_per_s"] > 0 and f"{run}_oom" not in served, served
    assert served["teacher_peak_gib"] is None and served["student_peak_gib"] is None  # no GPU: no peak
    (colocated,) = results["colocated"]
    assert colocated["length"] == 32 and not colocated["oom"] and colocated["tokens_per_s"] > 0
    table = out.read_text()
    assert "| tokens per sequence | target alone tok/s | draft alone tok/s | served tok/s | served / min |" in table
    assert "longest length trained: served 32, colocated 32" in table


def test_the_tables_say_where_a_run_ran_out_of_memory():
    served = [
        {"length": 4096, "target_tokens_per_s": 30000.0, "draft_tokens_per_s": 9000.0, "served_tokens_per_s": 8550.0,
         "teacher_wait_ms": 1.0, "teacher_peak_gib": 20.0, "student_peak_gib": 30.0},
        {"length": 65536, "target_tokens_per_s": 12000.0, "draft_oom": "draft GPU", "served_oom": "draft GPU",
         "teacher_peak_gib": 60.0},
    ]
    lines = served_table(served)
    assert lines[2] == "| 4096 | 30,000 | 9,000 | 8,550 | 95.0% | 1 | 20.0 | 30.0 |"
    assert lines[3] == "| 65536 | 12,000 | OOM (draft GPU) | OOM (draft GPU) | - | - | 60.0 | - |"
    colocated = [{"length": 4096, "oom": False, "tokens_per_s": 9000.0, "peak_gib": 40.1},
                 {"length": 65536, "oom": True}]
    lines = side_by_side(served, colocated)
    assert lines[2] == "| 4096 | 8,550 | 9,000 | 20.0 / 30.0 | 40.1 |"
    assert lines[3] == "| 65536 | OOM (draft GPU) | OOM | - | - |"
    assert lines[-1].endswith("served 4096, colocated 4096 (of the lengths run)")
