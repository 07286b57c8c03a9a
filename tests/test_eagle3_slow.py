"""EAGLE-3 runs too long for the default suite (`make test-slow`, or `pytest -m slow tests/test_eagle3_slow.py`).

- DDP: two ranks of `torchrun ... student_trainer eagle3` (one sequence each) train the draft
  that one process trains on both sequences: the same weights, the same accuracies.
- `--compile on` (torch.compile of the draft layer and the loss chunks, the default on CUDA)
  trains the draft that `--compile off` trains: the same per-step losses in float32.
- The demo: `python -m distill_demo.eagle3` drafts for the demo's teacher with a mean acceptance
  length above 1.5 on held-out source, and its per-step accuracies fall with the step index.
  It reuses the cache `make demo` fills (.cache/distill_demo): a cold cache trains the teacher
  first, which takes minutes more.
"""

from __future__ import annotations

import json
import re
import sys

import pytest
import torch

from student_trainer.eagle3.model import Eagle3Draft
from tests.helpers import ROOT, free_port, run_ok as run
from tests.test_eagle3 import DRAFT_VOCAB, SEQ_LEN
from tests.test_eagle3 import corpus, server, teacher_dir  # noqa: F401  (fixtures of this module too)

pytestmark = pytest.mark.slow


def eagle3_command(server, teacher_dir, corpus, output_dir, batch_size: int, *extra: str) -> list[str]:
    return ["-m", "student_trainer", "eagle3", "--teacher", server.address, "--target-model", str(teacher_dir),
            "--data", str(corpus["train"]), "--output-dir", str(output_dir), "--seq-len", str(SEQ_LEN),
            "--batch-size", str(batch_size), "--ttt-steps", "3", "--draft-vocab-size", str(DRAFT_VOCAB),
            "--max-steps", "3", "--teacher-dtype", "float32", "--export-dtype", "float32", "--lr", "3e-3",
            "--device", "cpu", "--job-id", output_dir.name, *extra]


@pytest.mark.timeout(900)
def test_the_compiled_draft_step_trains_the_eager_ones_draft(server, teacher_dir, corpus, tmp_path):  # noqa: F811
    losses = {}
    for mode in ("off", "on"):
        run([sys.executable, *eagle3_command(server, teacher_dir, corpus, tmp_path / mode, 2, "--compile", mode)], 600)
        records = [json.loads(line) for line in (tmp_path / mode / "metrics.jsonl").read_text().splitlines()]
        losses[mode] = [r["loss"] for r in records if "loss" in r]
    assert len(losses["on"]) == len(losses["off"]) == 3, losses
    # float32: compiled kernels sum in another order, nothing more
    assert losses["on"] == pytest.approx(losses["off"], rel=1e-4), losses


@pytest.mark.timeout(900)
def test_two_ddp_ranks_train_the_draft_one_process_trains(server, teacher_dir, corpus, tmp_path):  # noqa: F811
    def eagle3(output_dir, batch_size: int) -> list[str]:
        return eagle3_command(server, teacher_dir, corpus, output_dir, batch_size)

    single, ddp = tmp_path / "single", tmp_path / "ddp"
    run([sys.executable, *eagle3(single, 2)], 300)
    run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
         "--master-port", str(free_port()), *eagle3(ddp, 1)], 300)
    joined = re.findall(r"joined: job ddp rank (\d)", server.log)
    assert sorted(joined) == ["0", "1"], server.log

    metrics = {run_dir: [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
               for run_dir in (single, ddp)}
    for one, two in zip(metrics[single], metrics[ddp]):
        for k in range(3):  # accuracies are counted over every rank's positions
            assert two[f"acc_{k}"] == pytest.approx(one[f"acc_{k}"], abs=1e-9), (k, one, two)
    # The mean of the ranks' gradients is the gradient of the batch of both: the same draft.
    a, b = Eagle3Draft.from_pretrained(single / "draft"), Eagle3Draft.from_pretrained(ddp / "draft")
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-6, msg=name)


RESULT = re.compile(r"^RESULT acceptance_length=(\d+\.\d\d) baseline=1\.00$")


@pytest.mark.timeout(5700)  # a cold cache trains the demo's teacher first
def test_the_demo_draft_yields_more_than_one_and_a_half_tokens_per_teacher_forward(tmp_path):
    output = run([sys.executable, "-m", "distill_demo.eagle3", "--output-dir", str(tmp_path / "out"),
                  "--cache-dir", str(ROOT / ".cache" / "distill_demo")], 5400)
    match = RESULT.match(output.strip().splitlines()[-1])
    assert match, output
    assert float(match.group(1)) > 1.5, output
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    accuracies = results["accuracies"]
    assert all(a > b for a, b in zip(accuracies, accuracies[1:])), accuracies  # later steps are harder
    assert results["rates"][0] > 0.3, results
