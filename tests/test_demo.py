"""`python -m distill_demo --quick` as a real subprocess: corpus, teacher training, a teacher
server, two KD students at once and two CE students, end to end in well under a minute.

The full-size claim (KD beats CE by more than the spread over seeds) needs minutes of
training and is checked by running `python -m distill_demo` itself; --quick only shows
that every step runs and reports.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys

import pytest

from distill_demo.config import DemoConfig
from distill_demo.processes import DemoError, TrainerRun, wait_all
from distill_demo.report import GroupStats, StudentResult, kd_beats_ce, loss_table
from teacher_server.launcher import child_env
from tests.helpers import ROOT, run_ok

RESULT = re.compile(r"^RESULT teacher_loss=(\d+\.\d{4}) kd_loss=(\d+\.\d{4}) ce_loss=(\d+\.\d{4})$")
RUN_TIMEOUT_S = 150


def run_demo(tmp_path, *args: str) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(
            [sys.executable, "-m", "distill_demo", "--quick", "--output-dir", str(tmp_path / "out"),
             "--cache-dir", str(tmp_path / "cache"), *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env(), cwd=ROOT,
            timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"the quick demo did not finish within {RUN_TIMEOUT_S}s:\n{e.output}") from e


@pytest.fixture(scope="module")
def cold_run(tmp_path_factory):
    """The quick demo on an empty cache."""
    tmp_path = tmp_path_factory.mktemp("demo")
    cold = run_demo(tmp_path)
    assert cold.returncode == 0, cold.stdout
    return tmp_path, cold


@pytest.fixture(scope="module")
def demo_runs(cold_run):
    """The quick demo run twice on one cache: cold, then warm."""
    tmp_path, cold = cold_run
    warm = run_demo(tmp_path)
    assert warm.returncode == 0, warm.stdout
    return tmp_path, cold, warm


def test_quick_demo_prints_the_table_and_a_result_line(cold_run):
    tmp_path, cold = cold_run
    lines = cold.stdout.strip().splitlines()
    match = RESULT.match(lines[-1])
    assert match, f"last line is not a RESULT line: {lines[-1]!r}\n{cold.stdout}"
    teacher_loss, kd_loss, ce_loss = map(float, match.groups())
    for label in ("teacher", "student, KD", "student, CE only", "seed 0", "seed 1", "spread"):
        assert label in cold.stdout, (label, cold.stdout)
    # Both KD students joined the one teacher (whether their few quick steps overlapped is up to timing).
    for seed in (0, 1):
        assert re.search(rf"- KD seed {seed}: .*steps.*waited .* for the teacher", cold.stdout), cold.stdout
    assert "KD beats CE beyond the spread over seeds" in cold.stdout
    # Even --quick's few steps take every model well below a uniform guess over 320 tokens (5.77).
    for loss in (teacher_loss, kd_loss, ce_loss):
        assert 0 < loss < 5.7
    out = tmp_path / "out"
    for run in ("kd-seed0", "kd-seed1", "ce-seed0", "ce-seed1"):
        assert (out / run / "model").is_dir(), run
    assert (out / "results.json").is_file()
    png = out / "loss_curves.png"
    if importlib.util.find_spec("matplotlib") is not None:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert "matplotlib is not installed" in cold.stdout


@pytest.mark.slow  # a second whole demo (server and four students) to see the cache used
def test_second_run_reuses_the_cached_teacher(demo_runs):
    _, cold, warm = demo_runs
    assert "teacher: training" in cold.stdout
    assert "teacher: cached" in warm.stdout and "teacher: training" not in warm.stdout, warm.stdout
    assert "data: cached" in warm.stdout
    cold_teacher = RESULT.match(cold.stdout.strip().splitlines()[-1]).group(1)
    warm_teacher = RESULT.match(warm.stdout.strip().splitlines()[-1]).group(1)
    assert cold_teacher == warm_teacher


def test_a_teacher_server_that_never_gets_ready_fails_with_its_log(cold_run):
    tmp_path, _ = cold_run
    failed = run_demo(tmp_path, "--startup-timeout-s", "0.01")
    assert failed.returncode == 1, failed.stdout
    assert "distill_demo failed: the teacher server did not print READY within" in failed.stdout
    assert "RESULT" not in failed.stdout


def test_a_failed_trainer_is_reported_with_the_end_of_its_log(tmp_path):
    run = TrainerRun("broken student", tmp_path / "run", ["--model", str(tmp_path / "missing-model"), "--data",
                                                          str(tmp_path / "train.jsonl"), "--kd-weight", "0",
                                                          "--max-steps", "1"], threads=1)
    with pytest.raises(DemoError, match=r"broken student failed \(exit code \d+\); end of .*train.log") as e:
        wait_all([run], timeout_s=120, poll_s=0.1)
    assert "missing-model" in str(e.value).split("train.log", 1)[1]  # the trainer's own error, from its log


def test_config_errors_name_the_flag():
    with pytest.raises(ValueError, match="--seeds"):
        DemoConfig(seeds=(3,))
    with pytest.raises(ValueError, match="--kd-weight"):
        DemoConfig(kd_weight=0.0)
    with pytest.raises(ValueError, match="--max-files"):
        DemoConfig(max_files=1)
    with pytest.raises(ValueError, match="--student-lr"):
        DemoConfig(student_lr=-1.0)


def test_kd_must_win_by_more_than_the_spread_over_seeds():
    assert kd_beats_ce(GroupStats([3.50, 3.52]), GroupStats([3.60, 3.61]))
    # A mean 0.05 lower, but the seeds scatter by 0.04 in each group: not shown.
    assert not kd_beats_ce(GroupStats([3.53, 3.57]), GroupStats([3.58, 3.62]))


def test_loss_table_lists_each_seed_and_the_means():
    results = [StudentResult("kd", 0, 3.5, 1.0), StudentResult("kd", 1, 3.6, 1.0),
               StudentResult("ce", 0, 3.8, 1.0), StudentResult("ce", 1, 3.9, 1.0)]
    table = loss_table(teacher_loss=3.1, teacher_params=2_000_000, student_params=170_000, results=results,
                       seeds=(0, 1), uniform_loss=6.9315)
    kd_row = next(line for line in table.splitlines() if line.startswith("student, KD"))
    assert kd_row.split()[-4:] == ["3.5000", "3.6000", "3.5500", "0.1000"]
    assert "2.00M" in table and "170k" in table and "6.9315" in table


# ---- distill_demo.cross_tokenizer --------------------------------------------------------------


def test_the_cross_tokenizer_table_compares_kd_and_ce_per_tokenizer():
    from distill_demo.cross_tokenizer import CrossTokenizerConfig, summarize, table

    cfg = CrossTokenizerConfig(quick=True, vocab_size=320, student_vocab_size=300)
    per_byte = {("kd", "same", 0): 2.80, ("kd", "same", 1): 2.82, ("ce", "same", 0): 2.90, ("ce", "same", 1): 2.92,
                ("kd", "other", 0): 2.95, ("kd", "other", 1): 2.96, ("ce", "other", 0): 3.00,
                ("ce", "other", 1): 3.04}
    result = summarize(cfg, per_byte, teacher_per_byte=2.5)
    assert result["gain"]["same"] == pytest.approx(0.10) and result["gain"]["other"] == pytest.approx(0.065)
    assert result["spread"]["other"] == pytest.approx(0.005 + 0.02)
    assert result["cross_beats_ce"] and result["kept"] == pytest.approx(0.65)
    text = table(cfg, result)
    assert "| KD across tokenizers (300, --loss gold) | 2.9500, 2.9600 | 2.9550 ± 0.0050 |" in text
    assert "keeps 65% of the same-tokenizer gain" in text
    with pytest.raises(Exception, match="--student-vocab-size 320 must .* differ from --vocab-size 320"):
        CrossTokenizerConfig(quick=True, vocab_size=320, student_vocab_size=320)


def run_quick_demo(module: str, tmp_path, timeout_s: float) -> tuple[str, dict]:
    """`python -m <module> --quick` into tmp_path, to its end: its output and its results.json."""
    import json

    output = run_ok([sys.executable, "-m", module, "--quick", "--output-dir", str(tmp_path / "out"),
                     "--cache-dir", str(tmp_path / "cache")], timeout_s)
    return output, json.loads((tmp_path / "out" / "results.json").read_text())


@pytest.mark.slow
def test_the_quick_cross_tokenizer_demo_runs_end_to_end(tmp_path):
    output, summary = run_quick_demo("distill_demo.cross_tokenizer", tmp_path, 600)
    assert "KD across tokenizers (300, --loss gold)" in output
    assert set(summary["groups"]) == {"kd_same", "ce_same", "kd_other", "ce_other"}


# ---- distill_demo.several_teachers ---------------------------------------------------------------


def test_a_file_splits_into_its_code_and_its_docstrings_and_the_mixed_set_holds_as_much_of_each():
    from distill_demo.several_teachers import balanced, split_domains

    source = ('"""A module that says what it is for, at some length."""\n'
              "import os  # a comment\n\n"
              "def f(x):\n    '''Returns x plus one, which is what this function is for.'''\n    return x + 1\n\n"
              "class C:\n    'short'\n")
    code, prose = split_domains(source, min_docstring_chars=20)
    assert "import os" in code and "return x + 1" in code and "class C" in code
    assert "comment" not in code and "at some length" not in code and "plus one" not in code
    assert prose == ("A module that says what it is for, at some length.\n\n"
                     "Returns x plus one, which is what this function is for.\n")
    assert split_domains("def (:", 20) is None
    code_rows = [{"text": "c" * 100, "domain": "code"} for _ in range(6)]
    prose_rows = [{"text": "p" * 100, "domain": "prose"} for _ in range(2)]
    mixed = balanced(code_rows, prose_rows)
    assert [row["domain"] for row in mixed] == ["code", "prose", "code", "prose"]


def test_the_several_teachers_table_says_whether_two_teachers_win_beyond_the_spread():
    from distill_demo.several_teachers import ARMS, SeveralTeachersConfig, summarize, table

    cfg = SeveralTeachersConfig(quick=True)
    means = {"code": 5.40, "prose": 5.60, "routed": 5.30, "mixture": 5.45, "ce": 5.55}
    scores = {(arm, seed): {"code": means[arm] + 0.01 * seed, "prose": means[arm] + 0.01 * seed,
                            "mixed": means[arm] + 0.01 * seed} for arm in ARMS for seed in cfg.seeds}
    result = summarize(cfg, scores, {"code": {"code": 4.5, "prose": 6.0, "mixed": 5.25},
                                     "prose": {"code": 6.1, "prose": 4.9, "mixed": 5.5}})
    assert result["beats"] == {"routed_vs_code": True, "routed_vs_prose": True, "mixture_vs_code": False,
                               "mixture_vs_prose": True}
    text = table(cfg, result)
    assert "| KD, both (each example its domain's teacher) | 5.3000 | 5.3100 | 5.3050 ± 0.0050 |" in text
    assert "beats KD, code teacher alone on the mixed set beyond the spread (5.4550 + 0.0050 < 5.4050 - 0.0050): NO" \
        in text


@pytest.mark.slow
def test_the_quick_several_teachers_demo_runs_end_to_end(tmp_path):
    output, summary = run_quick_demo("distill_demo.several_teachers", tmp_path, 900)
    assert "KD, both (each example its domain's teacher)" in output
    assert set(summary["groups"]) == {"code", "prose", "routed", "mixture", "ce"}
