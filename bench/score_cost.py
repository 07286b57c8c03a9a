"""The teacher's cost per scored token: log-probabilities at given tokens against full logits.

On one teacher model (default builtin:wide, a Llama-3-sized vocabulary of 128,256 on a one-layer
body: its outputs weigh what a real teacher's do, its forward costs little), on CPU (or with
--device cuda:0 --student-device cuda:1, on two GPUs over NCCL):

  derive  what the teacher computes for a batch beyond its forward, in this process: the full
          logits in the output dtype (Logits), log_softmax gathered at the next tokens
          (NextTokenLogprobs) or at k ids per position (ScoredLogprobs);
  served  a teacher server (python -m teacher_server) and a TeacherClient here keeping
          --inflight batches in flight: wall time per token at the client, forward included.

Prints a table (and writes it to --out): output, bytes sent per token, derive µs per token,
served ms per token, and served time against full logits'. Each time is the best of its repeats
(--repeats derives, --rounds rounds of --batches batches): on a shared machine the other
processes only ever add time.

    python -m bench.score_cost [--rows 1 --seq 256] [--batches 4 --rounds 3] [--k 8,32] [--out score_cost.md]
    python -m bench.score_cost --device cuda:0 --student-device cuda:1 --rows 4 --seq 2048 --batches 20
"""

from __future__ import annotations

import argparse
import time

import torch

from bench.table import emit
from distill_common.outputs import (BatchOutputs, Logits, NextTokenLogprobs, OutputRequest, ScoredLogprobs,
                                    TeacherFacts, output_spec)
from student_trainer import TeacherClient
from teacher_server.launcher import ServerProcess
from teacher_server.sessions import Batch


def kinds(ks: list[int]) -> list[tuple[str, tuple]]:
    return [("full logits", (Logits(),)), ("next-token log-probs", (NextTokenLogprobs(),)),
            *[(f"log-probs at {k} ids", (ScoredLogprobs(k),)) for k in ks]]


def batch(rows: int, seq: int, vocab: int, k: int, generator: torch.Generator) -> tuple:
    ids = torch.randint(0, vocab, (rows, seq), generator=generator)
    score_ids = torch.randint(0, vocab, (rows, seq, k), generator=generator) if k else None
    return ids, score_ids


def time_derive(request: OutputRequest, rows: int, seq: int, vocab: int, repeats: int, device: torch.device) -> float:
    """Seconds per token of the request's derive on a forward of random logits on `device`."""
    generator = torch.Generator().manual_seed(0)
    forward = BatchOutputs(torch.randn(rows, seq, vocab, generator=generator).to(device, request.teacher.dtype))
    k = next((kind.k for kind in request if isinstance(kind, ScoredLogprobs)), 0)
    ids, score_ids = batch(rows, seq, vocab, k, generator)
    submitted = Batch(0, ids, torch.ones_like(ids), {"score_ids": score_ids} if k else {})
    request.derive(forward, submitted)  # warm-up
    best = float("inf")
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        request.derive(forward, submitted)
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best / (rows * seq)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_served(address: str, outputs: tuple, rows: int, seq: int, vocab: int, batches: int,
                inflight: int, device: str, rounds: int) -> float:
    """Seconds per token through the server, with `inflight` batches in flight (after a warm-up),
    the best of `rounds` rounds of `batches` batches."""
    k = next((kind.k for kind in outputs if isinstance(kind, ScoredLogprobs)), 0)
    generator = torch.Generator().manual_seed(1)
    work = [batch(rows, seq, vocab, k, generator) for _ in range(batches)]
    with TeacherClient(address, device, outputs=outputs, max_inflight=inflight, job_id="score-cost") as teacher:
        ids, score_ids = work[0]
        teacher.submit(ids, score_ids=score_ids).result(timeout=600)  # warm-up
        best = float("inf")
        for _ in range(rounds):
            start = time.perf_counter()
            futures = [teacher.submit(ids, score_ids=score_ids) for ids, score_ids in work]
            for future in futures:
                future.result(timeout=600)
            best = min(best, time.perf_counter() - start)
        return best / (batches * rows * seq)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="builtin:wide", help="the teacher (default: builtin:wide)")
    parser.add_argument("--device", default="cpu", help="the teacher's device")
    parser.add_argument("--dtype", default="", help="the teacher's dtype (default: its own, float32 for builtin)")
    parser.add_argument("--student-device", default="cpu", help="the client's device (another GPU: NCCL)")
    parser.add_argument("--rows", type=int, default=1, help="sequences per batch")
    parser.add_argument("--seq", type=int, default=256, help="tokens per sequence")
    parser.add_argument("--batches", type=int, default=4, help="batches per round through the server")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per output through the server (the best counts)")
    parser.add_argument("--inflight", type=int, default=2, help="batches the client keeps in flight")
    parser.add_argument("--k", default="8,32", help="ids scored per position, comma-separated")
    parser.add_argument("--repeats", type=int, default=5, help="derives timed per output (the best counts)")
    parser.add_argument("--out", default="", help="also write the table here")
    args = parser.parse_args()
    ks = [int(k) for k in args.k.split(",") if k]
    tokens = args.rows * args.seq

    dtype_flag = ("--dtype", args.dtype) if args.dtype else ()
    server = ServerProcess("--model", args.model, "--device", args.device, *dtype_flag, "--max-batch-tokens",
                           str(max(tokens, 1024)), "--max-score-ids", str(max(ks, default=1)), "--max-seq-len",
                           str(max(args.seq, 1024)))
    try:
        with TeacherClient(server.address, args.student_device, outputs=(NextTokenLogprobs(),)) as probe:
            info = probe.info
        facts = TeacherFacts(vocab_size=info.vocab_size, hidden_size=info.hidden_size, num_layers=info.num_layers,
                             dtype=getattr(torch, info.dtype), max_score_ids=max(ks, default=1))
        rows_out, baseline = [], None
        for name, outputs in kinds(ks):
            request = OutputRequest.resolve(output_spec(outputs), facts)
            sent = sum(torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
                       for shape, dtype in request.layout(args.rows, args.seq)) / tokens
            derive_s = time_derive(request, args.rows, args.seq, info.vocab_size, args.repeats,
                                   torch.device(args.device))
            served_s = time_served(server.address, outputs, args.rows, args.seq, info.vocab_size, args.batches,
                                   args.inflight, args.student_device, args.rounds)
            baseline = baseline or served_s
            rows_out.append((name, sent, derive_s, served_s))
            print(f"  {name}: {served_s * 1e3:.3f} ms/token served", flush=True)
    finally:
        server.stop()

    lines = [f"teacher {args.model} (vocabulary {info.vocab_size}, {info.dtype}) on {args.device}, student on "
             f"{args.student_device}, batches of {args.rows} x {args.seq} tokens, {args.inflight} in flight",
             "", "| output | bytes/token sent | derive µs/token | served ms/token | served vs full logits |",
             "|---|---:|---:|---:|---:|"]
    for name, sent, derive_s, served_s in rows_out:
        lines.append(f"| {name} | {sent:,.0f} | {derive_s * 1e6:.2f} | {served_s * 1e3:.3f} | "
                     f"{served_s / baseline:.2f}x |")
    emit(lines, args.out)


if __name__ == "__main__":
    main()
