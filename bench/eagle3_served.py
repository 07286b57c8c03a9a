"""EAGLE-3 draft training from a served target on another GPU, against each side alone and the colocated baseline.

    python -m bench.eagle3_served --out eagle3_served.md                   # two GPUs: target on 0, draft on 1
    python -m bench.eagle3_served --shape tiny --device cpu --seq-lens 64,128 --steps 1   # a check on the CPU

The target is bench.eagle3_colocated's Llama-3-8B shape (vocabulary 128,256, random bfloat16
weights), served by `python -m teacher_server` (teacher_server.launcher.ServerProcess) on
--teacher-gpu. The draft trains on --student-gpu as `student-trainer eagle3 --bf16` trains it:
the same draft as the colocated baseline's fused path (32k draft ids, layers 2, 16, 29, 7 TTT
steps, bf16 weights with float32 master weights, AdamW, the fused unroll attention), one sequence of S tokens per step. For each S of --seq-lens,
in increasing order, three runs of a warm-up step and --steps timed steps each:

  target alone  a TeacherClient on the draft's GPU receiving what the draft reads (SubsetLogits
                over the draft ids, AuxHiddenStates, Argmax) and dropping it, --prefetch + 1
                batches in flight: the teacher's forward and the transfer
  draft alone   the trainer's step (student_trainer.eagle3.train.train_step) on one batch of the
                teacher's outputs, received in the run before and kept on the draft's GPU
  served        the same step fed by the trainer's TeacherPrefetcher, --prefetch batches ahead of
                the step: the path `student-trainer eagle3` runs, minus its metrics and checkpoints

The bar: served >= 90% of min(target alone, draft alone) at 4k and 8k tokens. Peak
memory, per GPU, over the served run: the draft's GPU from torch's allocator in this process
(the prefetched outputs included); the teacher's from the server's
`teacher_gpu_memory_peak_allocated_bytes` (/metrics), a peak since the server started, which is
each length's own because the lengths run in increasing order and the teacher's memory grows
with S. A run that runs out of memory on either GPU says OOM and the next length is tried.

Then (unless --no-colocated), with the server stopped and the draft freed, the colocated
baseline on the draft's GPU (bench.eagle3_colocated.measure: the target in this process), so
that one command gives both and a table of the two side by side. The colocated step is the
draft's forward, backward and AdamW step without the trainer's gradient clipping and per-step
record; the served runs use the trainer's own step. Both set TF32 for float32 matmuls, as the
colocated baseline was measured (the trainer itself leaves torch's default).

The draft's embedding. The draft needs the target's input embedding. The server builds its
`random:` target with distill_common.models.load_causal_lm (seeded by `_seeded_init`, built
directly on its device in bfloat16); this bench makes the same call, for the same spec, dtype
and device type, on the draft's GPU, keeps the embedding and frees the rest before anything is
measured: the server's weights (the same seeded draws), in seconds and 16 GB of the draft's GPU
for a moment, where the trainer's `target_embedding` would build the whole target in float32 on
the CPU (32 GB). A session asking for the teacher's layer 0 (the embedding's output) checks it:
the bench stops if the two differ.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # as the programs do
import torch  # noqa: E402

from bench.distill_pipeline import SyntheticBatches  # noqa: E402
from bench.eagle3_colocated import DRAFT_VOCAB, SHAPES, gib  # noqa: E402
from bench.eagle3_colocated import measure as measure_colocated  # noqa: E402
from bench.table import emit  # noqa: E402
from teacher_server.launcher import multicast_off  # noqa: E402

PEAK_METRIC = "teacher_gpu_memory_peak_allocated_bytes"
# The longest a batch's outputs may take: an 8B forward of 64k tokens is seconds, the wait of a
# prefetched batch behind a draft step of that length tens of seconds.
OUTPUTS_TIMEOUT_S = 300.0
# Tokens of the embedding check (the teacher's layer 0 against the draft's embedding rows).
CHECK_TOKENS = 256


@dataclass
class Side:
    """Where each part runs: the server's flags and the draft's device."""

    teacher_device: str
    student_device: torch.device
    dtype: torch.dtype  # the target's: bfloat16 on GPUs, float32 on the CPU

    @property
    def on_gpu(self) -> bool:
        return self.student_device.type == "cuda"

    def synchronize(self) -> None:
        if self.on_gpu:
            torch.cuda.synchronize(self.student_device)

    def reset_peak(self) -> None:
        if self.on_gpu:
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.student_device)

    def peak_gib(self) -> float | None:
        return torch.cuda.max_memory_allocated(self.student_device) / 2**30 if self.on_gpu else None


def out_of_memory(error: BaseException) -> str:
    """Where `error` ran out of memory ("" if it is not that): the draft's own step, the teacher
    (its forward or send failed the batch: BatchFailed, whose reason is the teacher's exception),
    or the client receiving on the draft's GPU."""
    from student_trainer.errors import BatchFailed

    if isinstance(error, torch.cuda.OutOfMemoryError):
        return "draft GPU"
    if "out of memory" not in str(error).lower():
        return ""
    return "teacher GPU" if isinstance(error, BatchFailed) else "draft GPU, receiving"


def record_oom(row: dict, run: str, error: BaseException) -> None:
    """Marks `run` out of memory in `row`, keeping the error's first line; re-raises any other error."""
    where = out_of_memory(error)
    if not where:
        raise error
    row[f"{run}_oom"] = where
    row[f"{run}_error"] = str(error).splitlines()[0][:300]
    print(f"S={row['length']}: {run} ran out of memory on the {where}: {row[f'{run}_error']}", flush=True)


def write_target(shape: str, directory: Path) -> str:
    from transformers import LlamaConfig

    LlamaConfig(**SHAPES[shape]).save_pretrained(directory)
    return f"random:{directory}"


def server_embedding(spec: str, side: Side) -> torch.Tensor:
    """The served target's input embedding, on the draft's device (module docstring)."""
    from distill_common.models import load_causal_lm

    model = load_causal_lm(spec, device=side.student_device, dtype=side.dtype)
    embedding = model.get_input_embeddings().weight.detach().clone()
    del model
    side.reset_peak()
    return embedding


def check_embedding(address: str, side: Side, embedding: torch.Tensor, length: int) -> None:
    """Refuses to go on unless the teacher's layer 0 is the embedding this bench built (`length` tokens)."""
    from distill_common.outputs import HiddenStates
    from student_trainer import TeacherClient

    ids = torch.randint(0, embedding.shape[0], (1, length), generator=torch.Generator().manual_seed(3))
    with TeacherClient(address, side.student_device, outputs=(HiddenStates((0,)),), job_id="bench-eagle3-check",
                       max_resubmits=0, reconnect_timeout_s=0) as client:
        served = client.submit(ids).result(timeout=OUTPUTS_TIMEOUT_S).hidden_states[0]
    if not torch.equal(served, embedding[ids.to(embedding.device)].to(served.dtype)):
        raise SystemExit("the teacher's embedding differs from the one built here for the draft: "
                         "distill_common.models builds random: targets differently on the two devices")


def target_alone(client, batches, steps: int, prefetch: int):
    """Tokens/s of outputs received with prefetch + 1 in flight; the last batch's outputs."""
    futures: deque = deque()
    last = None
    try:
        for step in range(1 + steps):
            if step == 1:  # the warm-up batch in, then the clock
                while futures:
                    last = futures.popleft().result(timeout=OUTPUTS_TIMEOUT_S)
                started = time.perf_counter()
            futures.append(client.submit(next(batches)["input_ids"]))
            while len(futures) > prefetch:
                last = futures.popleft().result(timeout=OUTPUTS_TIMEOUT_S)
        while futures:
            last = futures.popleft().result(timeout=OUTPUTS_TIMEOUT_S)
    finally:  # a failed batch leaves the others in flight: settled before the next run
        for future in futures:
            future.exception(timeout=OUTPUTS_TIMEOUT_S)
    return steps * batches.seq / (time.perf_counter() - started), last


def train(step, next_micro_batch, steps: int, length: int, side: Side) -> tuple[float, float]:
    """Tokens/s over `steps` timed steps after a warm-up step, and the mean teacher wait in ms."""
    waits = []
    for index in range(1 + steps):
        if index == 1:
            side.synchronize()
            started = time.perf_counter()
        waits.append(step(next_micro_batch)["teacher_wait_s"])
    side.synchronize()
    return steps * length / (time.perf_counter() - started), 1e3 * sum(waits[1:]) / steps


def run_length(length: int, args, side: Side, client, step, server, vocab: int) -> dict:
    from student_trainer.train import TeacherPrefetcher
    from teacher_server.launcher import metrics_samples

    row = {"length": length}
    batches = SyntheticBatches(1, length, seed=length, vocab=vocab)
    fixed = None
    try:
        row["target_tokens_per_s"], fixed = target_alone(client, batches, args.steps, args.prefetch)
    except Exception as e:
        record_oom(row, "target", e)
    if fixed is not None:
        # Other ids than the fixed outputs' batch: what the step costs does not depend on which.
        batch = next(batches)
        side.reset_peak()
        try:
            row["draft_tokens_per_s"], _ = train(step, lambda: (batch, fixed, 0.0), args.steps, length, side)
            row["draft_alone_peak_gib"] = side.peak_gib()
        except torch.cuda.OutOfMemoryError as e:
            record_oom(row, "draft", e)
        del fixed
    side.reset_peak()
    prefetcher = TeacherPrefetcher(client, SyntheticBatches(1, length, seed=length + 1, vocab=vocab), args.prefetch,
                                   OUTPUTS_TIMEOUT_S)
    try:
        row["served_tokens_per_s"], row["teacher_wait_ms"] = train(step, prefetcher.next, args.steps, length, side)
        row["student_peak_gib"] = side.peak_gib()
    except Exception as e:
        record_oom(row, "served", e)
    finally:
        prefetcher.drop_ahead()  # the batches fetched ahead of the last step
    teacher_peak = metrics_samples(server.http).get((PEAK_METRIC, ()), 0.0)
    row["teacher_peak_gib"] = teacher_peak / 2**30 if side.on_gpu else None
    print(f"S={length}: {row}", flush=True)
    return row


def served_runs(args, side: Side) -> tuple[str, list[dict]]:
    from distill_common.models import model_config
    from distill_common.outputs import default_aux_layers
    from distill_common.wire import dtype_name
    from student_trainer import TeacherClient
    from student_trainer.eagle3.config import Eagle3Config
    from student_trainer.eagle3.loss import Eagle3Training
    from student_trainer.eagle3.model import Eagle3Draft
    from student_trainer.eagle3.precision import MasterWeights
    from student_trainer.eagle3.train import teacher_outputs, train_step
    from student_trainer.train import lr_lambda
    from teacher_server.launcher import ServerProcess

    lengths = sorted(args.lengths)
    spec = write_target(args.shape, Path(tempfile.mkdtemp()) / "target")
    config = model_config(spec)
    layers = default_aux_layers(config.num_hidden_layers)
    draft_vocab = DRAFT_VOCAB[args.shape]
    # The colocated baseline's draft vocabulary: the same draft either way.
    used = torch.randperm(config.vocab_size, generator=torch.Generator().manual_seed(1))[:draft_vocab].sort().values
    t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
    t2d[used] = True
    embedding = server_embedding(spec, side)
    cfg = Eagle3Config(target_model=spec, data="synthetic", teacher="bench", bf16=side.on_gpu,
                       prefetch=args.prefetch, ttt_steps=args.ttt_steps, max_steps=2 * len(lengths) * (1 + args.steps))  # the steps trained below

    server = ServerProcess("--model", spec, "--device", side.teacher_device, "--dtype", dtype_name(side.dtype),
                           "--max-batch-tokens", str(lengths[-1]), "--max-seq-len", str(lengths[-1]),
                           startup_timeout_s=300)
    try:
        check_embedding(server.address, side, embedding, min(CHECK_TOKENS, lengths[0]))
        d2t = used - torch.arange(draft_vocab)  # on the CPU: copied into the draft's buffer
        torch.manual_seed(0)
        with torch.device(side.student_device):  # built where it trains (its embedding is 2 GiB in float32)
            draft = Eagle3Draft.for_target(config, embedding, d2t, t2d, layers)
        del embedding  # the draft holds its copy
        draft.chunk_scores = args.chunk_scores
        draft.train()
        trained = Eagle3Training(draft, cfg.ttt_steps)
        params = [p for p in draft.parameters() if p.requires_grad]
        master = None
        if cfg.bf16:  # as the trainer trains on CUDA: bf16 weights, float32 masters
            draft.to(torch.bfloat16)
            master = MasterWeights(params)
        optimizer = torch.optim.AdamW(params if master is None else master.master, lr=cfg.lr,
                                      weight_decay=cfg.weight_decay, fused=master is not None)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg, cfg.max_steps))

        def step(next_micro_batch) -> dict:
            try:
                return train_step(cfg, trained, params, optimizer, scheduler, next_micro_batch, side.student_device,
                                  master=master)
            except BaseException:
                optimizer.zero_grad(set_to_none=True)  # a failed step's gradients are not the next one's
                if master is not None:
                    master.zero_grad()
                raise

        # Bounded waits: a batch that cannot be served fails its run instead of being sent again for minutes.
        with TeacherClient(server.address, side.student_device, outputs=teacher_outputs(used, layers),
                           max_inflight=args.prefetch + 1, job_id="bench-eagle3-served",
                           transfer_timeout_s=OUTPUTS_TIMEOUT_S, reconnect_timeout_s=60, max_resubmits=1) as client:
            rows = [run_length(length, args, side, client, step, server, config.vocab_size) for length in lengths]
        trainable = sum(p.numel() for p in params)
    finally:
        server.stop()
    name = torch.cuda.get_device_name(side.student_device) if side.on_gpu else "CPU"
    about = (f"EAGLE-3 draft training from a served target ({args.shape}, {name}): target on "
             f"{side.teacher_device}, draft on {side.student_device}, draft of {trainable / 1e6:.1f}M trainable "
             f"parameters, {draft_vocab} draft ids, {args.ttt_steps} TTT steps, aux layers {layers}, 1 sequence per "
             f"step, prefetch {args.prefetch}, {args.steps} timed steps after a warm-up step")
    return about, rows


def tokens(row: dict, key: str, oom: str) -> str:
    if row.get(oom):
        return f"OOM ({row[oom]})"
    return f"{row[key]:,.0f}" if key in row else "-"


def served_table(rows: list[dict]) -> list[str]:
    lines = ["| tokens per sequence | target alone tok/s | draft alone tok/s | served tok/s | served / min | "
             "teacher wait ms/step | teacher GPU peak GiB | draft GPU peak GiB |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        floor = min(r.get("target_tokens_per_s", 0.0), r.get("draft_tokens_per_s", 0.0))
        share = f"{r['served_tokens_per_s'] / floor:.1%}" if floor and "served_tokens_per_s" in r else "-"
        wait = f"{r['teacher_wait_ms']:.0f}" if "teacher_wait_ms" in r else "-"
        lines.append(f"| {r['length']} | {tokens(r, 'target_tokens_per_s', 'target_oom')} | "
                     f"{tokens(r, 'draft_tokens_per_s', 'draft_oom')} | {tokens(r, 'served_tokens_per_s', 'served_oom')}"
                     f" | {share} | {wait} | {gib(r.get('teacher_peak_gib'))} | {gib(r.get('student_peak_gib'))} |")
    return lines


def side_by_side(served: list[dict], colocated: list[dict]) -> list[str]:
    by_length = {r["length"]: r for r in colocated}
    lines = ["| tokens per sequence | served tok/s | colocated tok/s | served peak GiB (teacher GPU / draft GPU) | "
             "colocated peak GiB |", "|---:|---:|---:|---:|---:|"]
    for r in served:
        c = by_length.get(r["length"])
        if c is None:
            continue
        colocated_speed = "OOM" if c["oom"] else f"{c['tokens_per_s']:,.0f}"
        served_peak = ("-" if r.get("served_oom") else
                       f"{gib(r.get('teacher_peak_gib'))} / {gib(r.get('student_peak_gib'))}")
        lines.append(f"| {r['length']} | {tokens(r, 'served_tokens_per_s', 'served_oom')} | {colocated_speed} | "
                     f"{served_peak} | {'-' if c['oom'] else gib(c['peak_gib'])} |")
    trains_served = [r["length"] for r in served if "served_tokens_per_s" in r]
    trains_colocated = [r["length"] for r in colocated if not r["oom"]]
    lines.append(f"\nlongest length trained: served {max(trains_served, default=0)}, colocated "
                 f"{max(trains_colocated, default=0)} (of the lengths run)")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    parser.add_argument("--seq-lens", default="2048,4096,8192,16384,32768", help="tokens per sequence")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per run (after a warm-up step)")
    parser.add_argument("--ttt-steps", type=int, default=7)
    parser.add_argument("--prefetch", type=int, default=2, help="batches the trainer keeps in flight ahead")
    parser.add_argument("--teacher-gpu", type=int, default=0)
    parser.add_argument("--student-gpu", type=int, default=1)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: both sides on the CPU, the data plane over gloo (a check of the code)")
    parser.add_argument("--chunk-scores", type=int, default=1 << 28,
                        help="attention scores held per query chunk of the draft (float32 elements)")
    parser.add_argument("--colocated", action=argparse.BooleanOptionalAction, default=True,
                        help="also run the colocated baseline (bench.eagle3_colocated) on the draft's GPU")
    parser.add_argument("--out", default="", help="also write the tables here (and the figures as JSON beside)")
    args = parser.parse_args(argv)
    args.lengths = [int(x) for x in args.seq_lens.split(",")]
    multicast_off(os.environ)
    if args.device == "cuda":
        if args.teacher_gpu == args.student_gpu:
            parser.error("--teacher-gpu and --student-gpu must differ: the point is the target off the draft's GPU")
        side = Side(f"cuda:{args.teacher_gpu}", torch.device("cuda", args.student_gpu), torch.bfloat16)
        torch.cuda.set_device(side.student_device)
    else:
        side = Side("cpu", torch.device("cpu"), torch.float32)
    torch.set_float32_matmul_precision("high")  # TF32, as the colocated baseline (module docstring)

    about, served = served_runs(args, side)
    lines = [about, "", *served_table(served)]
    results = {"served": served}
    if args.colocated:
        gc.collect()
        if side.on_gpu:
            torch.cuda.empty_cache()
        colocated_about, colocated = measure_colocated(args.shape, sorted(args.lengths), args.steps, args.ttt_steps,
                                                       side.student_device, ["fused"], "flash", args.chunk_scores,
                                                       [], "")
        results["colocated"] = colocated
        lines += ["", colocated_about, "", *side_by_side(served, colocated)]
    emit(lines, args.out)
    if args.out:
        Path(args.out).with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
