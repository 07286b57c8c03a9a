"""`python -m distill_demo.onpolicy_compare --quick`: the whole comparison, small (slow: minutes).

It checks that every arm runs against one served teacher and is reported (table, results.json,
the figure when matplotlib is installed), not which arm wins: --quick trains a few steps. The
figures in docs/training.md come from the full run (its command is there)."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys

import pytest

from distill_demo.onpolicy_compare import ARMS
from teacher_server.launcher import child_env
from tests.helpers import ROOT

pytestmark = pytest.mark.slow


@pytest.mark.timeout(1800)
def test_the_quick_comparison_runs_every_arm_against_one_teacher(tmp_path):
    out, cache = tmp_path / "out", tmp_path / "cache"
    result = subprocess.run([sys.executable, "-m", "distill_demo.onpolicy_compare", "--quick", "--output-dir",
                             str(out), "--cache-dir", str(cache)], cwd=ROOT, env=child_env(), capture_output=True,
                            text=True, timeout=1700)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((out / "results.json").read_text())
    arms = {(arm["arm"], arm["seed"]) for arm in summary["arms"]}
    assert arms == {(name, seed) for name, _, _ in ARMS for seed in (0, 1)}
    for arm in summary["arms"]:
        assert 0 <= arm["exact_match"] <= 1 and arm["curve"][0][0] == 0
        assert math.isfinite(arm["teacher_loglik"]) and arm["teacher_loglik"] < 0
    for _, label, _ in ARMS:
        assert label in result.stdout
    assert "jobs sharing the teacher at once: up to" in result.stdout
    assert "on-policy beats no distillation by more than the spread over seeds" in result.stdout
    if importlib.util.find_spec("matplotlib"):
        assert (out / "onpolicy.png").stat().st_size > 10_000
    # A second run takes the teacher and the warm students from the cache.
    again = subprocess.run([sys.executable, "-m", "distill_demo.onpolicy_compare", "--quick", "--output-dir",
                            str(tmp_path / "again"), "--cache-dir", str(cache), "--parallel", "5"], cwd=ROOT,
                           env=child_env(), capture_output=True, text=True, timeout=1700)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert not (tmp_path / "again" / "teacher.log").exists()
