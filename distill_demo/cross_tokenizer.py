"""Distillation across tokenizers on the demo's corpus: `python -m distill_demo.cross_tokenizer`.

The demo's teacher (distill_demo/demo.py, cached) serves students of two tokenizers at once:
the teacher's own, and a second byte-level BPE of another vocabulary size trained on the same
corpus. Per seed, four students from one random body:

    KD, same tokenizer     --loss forward_kl (the teacher's logits)
    CE, same tokenizer     no teacher
    KD, other tokenizer    --loss gold (or uld): the teacher re-tokenizes each row's text and
                           sends tensors shaped to the student's tokens (distill_common/alignment.py)
    CE, other tokenizer    no teacher

Losses per token cannot be compared across tokenizers, so each trained student is scored by
its held-out loss per byte: the summed cross-entropy over the held-out text, in nats, divided
by the bytes the predicted tokens spell. The table says how far KD beats CE with each tokenizer,
against the spread over seeds, and how much of the same-tokenizer gain the cross-tokenizer
student keeps. docs/training.md quotes it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from distill_demo.config import DemoConfig


def _help(text: str) -> dict:
    return {"help": text}


@dataclass
class CrossTokenizerConfig(DemoConfig):
    output_dir: str = field(default="runs/cross_tokenizer", metadata=_help(
        "student runs, logs and results.json"))
    student_vocab_size: int = field(default=640, metadata=_help(
        "the other tokenizer's vocabulary (a byte-level BPE trained on the same corpus)"))
    cross_loss: Literal["gold", "uld"] = field(default="gold", metadata=_help("the cross-tokenizer KD loss"))
    cross_match: Literal["exact", "prefix"] = field(default="prefix", metadata=_help(
        "--loss gold's projection (student_trainer --cross-match)"))
    cross_topk: int = field(default=8, metadata=_help("student_trainer --cross-topk"))

    def __post_init__(self) -> None:
        super().__post_init__()
        from distill_common.settings import ConfigError
        from distill_demo.tokenizer import MIN_VOCAB_SIZE

        if self.student_vocab_size < MIN_VOCAB_SIZE or self.student_vocab_size == self.vocab_size:
            raise ConfigError(f"--student-vocab-size {self.student_vocab_size} must be at least {MIN_VOCAB_SIZE} and "
                              f"differ from --vocab-size {self.vocab_size} (the teacher's)")


KINDS = (("kd", "same"), ("ce", "same"), ("kd", "other"), ("ce", "other"))


def run(cfg: CrossTokenizerConfig) -> dict:
    from distill_demo.demo import _quiet_transformers, ensure_teacher, prepare_data, say, save_random_llama
    from distill_demo.processes import TeacherProcess, TrainerRun, wait_all

    started = time.monotonic()
    out, cache = Path(cfg.output_dir), Path(cfg.cache_dir)
    _quiet_transformers()
    data = prepare_data(cfg, cache)
    teacher = ensure_teacher(cfg, cache, data, out, threads=os.cpu_count() or 1)
    other = dataclasses.replace(data, tokenizer_dir=_other_tokenizer(cfg, data))
    tokenizers = {"same": data, "other": other}
    inits = {(side, seed): out / "init" / f"{side}-seed{seed}" for side in tokenizers for seed in cfg.seeds}
    for (side, seed), path in inits.items():
        save_random_llama(path, cfg.student, tokenizers[side], cfg.seq_len, seed)

    def args(kind: str, side: str, seed: int) -> list[str]:
        common = ["--model", str(inits[side, seed]), "--data", str(data.train), "--max-steps", str(cfg.student_steps),
                  "--batch-size", str(cfg.student_batch_size), "--seq-len", str(cfg.seq_len),
                  "--lr", str(cfg.student_lr), "--warmup-steps", str(cfg.student_steps // 10), "--seed", str(seed),
                  "--job-id", f"{kind}-{side}-seed{seed}"]
        if kind == "ce":
            return [*common, "--kd-weight", "0"]
        loss = (["--loss", "forward_kl"] if side == "same" else
                ["--loss", cfg.cross_loss, "--cross-topk", str(cfg.cross_topk), "--cross-match", cfg.cross_match])
        return [*common, "--kd-weight", str(cfg.kd_weight), *loss]

    runs: dict[tuple[str, str, int], TrainerRun] = {}
    say(f"\nKD students (same and other tokenizer, seeds {cfg.seeds}) against one teacher, "
        f"{cfg.student_steps} steps each")
    with TeacherProcess(teacher.model_dir, out / "teacher_server.log", startup_timeout_s=cfg.startup_timeout_s,
                        threads=1) as server:
        for side in tokenizers:
            for seed in cfg.seeds:
                runs["kd", side, seed] = TrainerRun(f"KD {side} seed {seed}", out / f"kd-{side}-seed{seed}",
                                                    [*args("kd", side, seed), "--teacher", server.address], threads=1)
        wait_all([runs[k] for k in runs], timeout_s=cfg.run_timeout_s, on_poll=server.check_alive)
    say("CE students (no teacher)")
    for side in tokenizers:
        for seed in cfg.seeds:
            runs["ce", side, seed] = TrainerRun(f"CE {side} seed {seed}", out / f"ce-{side}-seed{seed}",
                                                args("ce", side, seed), threads=1)
    wait_all([runs["ce", side, seed] for side in tokenizers for seed in cfg.seeds], timeout_s=cfg.run_timeout_s)

    heldout = [json.loads(line)["text"] for line in open(data.heldout)]
    per_byte = {key: heldout_nats_per_byte(run.run_dir / "model", heldout, cfg.seq_len)
                for key, run in runs.items()}
    result = summarize(cfg, per_byte, teacher_per_byte=heldout_nats_per_byte(teacher.model_dir, heldout, cfg.seq_len))
    result["wall_s"] = time.monotonic() - started
    result["students_wall_s"] = sum(r.wall_s for r in runs.values())  # summed over the student processes
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    say(table(cfg, result))
    return result


def _other_tokenizer(cfg: CrossTokenizerConfig, data) -> Path:
    """The second tokenizer: byte-level BPE of --student-vocab-size on the same training text, cached."""
    from distill_demo.demo import _texts
    from distill_demo.tokenizer import load_or_train_tokenizer

    path = data.tokenizer_dir.parent / f"tokenizer-{cfg.student_vocab_size}"
    load_or_train_tokenizer(path, lambda: _texts(data.train), cfg.student_vocab_size)
    return path


def heldout_nats_per_byte(model_dir: Path, texts: list[str], seq_len: int) -> float:
    """Summed next-token cross-entropy over `texts` (each cut into windows of `seq_len` tokens) in
    nats, divided by the bytes the predicted tokens spell: comparable across tokenizers."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from distill_common.alignment import vocabulary_bytes

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    lengths = torch.tensor([len(piece) for piece in vocabulary_bytes(tokenizer)])
    nats, nbytes = 0.0, 0
    with torch.no_grad():
        for text in texts:
            ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"])
            for start in range(0, max(1, len(ids) - 1), seq_len):
                window = ids[start:start + seq_len + 1]
                if len(window) < 2:
                    continue
                logits = model(input_ids=window[None, :-1]).logits[0]
                nats += F.cross_entropy(logits.float(), window[1:], reduction="sum").item()
                nbytes += int(lengths[window[1:]].sum())
    return nats / nbytes


def summarize(cfg: CrossTokenizerConfig, per_byte: dict, teacher_per_byte: float) -> dict:
    def stats(kind: str, side: str) -> dict:
        values = [per_byte[kind, side, seed] for seed in cfg.seeds]
        return {"values": values, "mean": statistics.fmean(values), "spread": (max(values) - min(values)) / 2}

    groups = {f"{kind}_{side}": stats(kind, side) for kind, side in KINDS}
    gain = {side: groups[f"ce_{side}"]["mean"] - groups[f"kd_{side}"]["mean"] for side in ("same", "other")}
    spread = {side: groups[f"ce_{side}"]["spread"] + groups[f"kd_{side}"]["spread"] for side in ("same", "other")}
    return {"teacher_nats_per_byte": teacher_per_byte, "groups": groups, "gain": gain, "spread": spread,
            "cross_beats_ce": gain["other"] > spread["other"],
            "kept": gain["other"] / gain["same"] if gain["same"] > 0 else math.nan,
            "settings": {"teacher_vocab": cfg.vocab_size, "student_vocab": cfg.student_vocab_size,
                         "cross_loss": cfg.cross_loss, "cross_match": cfg.cross_match, "cross_topk": cfg.cross_topk,
                         "kd_weight": cfg.kd_weight, "steps": cfg.student_steps, "seeds": list(cfg.seeds)}}


def table(cfg: CrossTokenizerConfig, result: dict) -> str:
    names = {"kd_same": f"KD, teacher's tokenizer ({cfg.vocab_size})", "ce_same": f"CE only ({cfg.vocab_size})",
             "kd_other": f"KD across tokenizers ({cfg.student_vocab_size}, --loss {cfg.cross_loss})",
             "ce_other": f"CE only ({cfg.student_vocab_size})"}
    lines = ["| student | held-out nats/byte, per seed | mean ± half-range |", "|---|---|---|"]
    for key, name in names.items():
        group = result["groups"][key]
        lines.append(f"| {name} | {', '.join(f'{v:.4f}' for v in group['values'])} | "
                     f"{group['mean']:.4f} ± {group['spread']:.4f} |")
    lines.append(f"| teacher ({cfg.vocab_size}) | {result['teacher_nats_per_byte']:.4f} | |")
    gain, spread = result["gain"], result["spread"]
    lines.append("")
    lines.append(f"KD gain over CE: same tokenizer {gain['same']:+.4f} (spread {spread['same']:.4f}), across "
                 f"tokenizers {gain['other']:+.4f} (spread {spread['other']:.4f}): beats CE beyond the spread: "
                 f"{'yes' if result['cross_beats_ce'] else 'NO'}; keeps {100 * result['kept']:.0f}% of the "
                 "same-tokenizer gain")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from distill_demo.config import QUICK, parse_settings

    config = parse_settings(CrossTokenizerConfig, argv, "python -m distill_demo.cross_tokenizer",
                            __doc__.splitlines()[0], quick={**QUICK, "student_vocab_size": 300})
    from distill_demo.processes import run_command

    return run_command("distill_demo.cross_tokenizer", lambda: run(config))


if __name__ == "__main__":
    sys.exit(main())
