"""What a session's transport process costs a gloo session: outputs received per second with
the teacher's end of the group in a process of its own (--session-transport process, the
default) against in the teacher's process (inline), in one run, alternating.

A student on the CPU receives full logits of fixed-shape batches, --inflight in flight. With a
transport process the outputs cross one more copy (the teacher's pipe to that process) before
gloo sends them; the forward and gloo's own send are the same either way.

    python -m bench.session_transport                                       # CPU teacher, builtin:tiny
    python -m bench.session_transport --model builtin:wide --device cuda:0 --shape 1x2048 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import time
from collections import deque

import torch

from bench.table import emit
from student_trainer import TeacherClient
from teacher_server.launcher import ServerProcess, child_env, multicast_off


def measure(args, transport: str) -> dict:
    rows, seq = map(int, args.shape.split("x"))
    env = child_env()
    multicast_off(env)
    extra = ["--dtype", args.dtype] if args.dtype else []
    with ServerProcess("--model", args.model, "--device", args.device, "--session-transport", transport,
                       "--max-batch-tokens", str(rows * seq), "--max-seq-len", str(seq),
                       "--max-output-bytes", "64GiB", *extra, env=env) as server:
        with TeacherClient(server.address, "cpu", job_id="bench", max_inflight=args.inflight) as client:
            vocab = client.info.vocab_size
            ids = [torch.randint(0, vocab, (rows, seq)) for _ in range(4)]
            for i in range(args.warmup):
                client.submit(ids[i % 4]).result(timeout=300)
            pending: deque = deque()
            received_bytes = 0
            start = time.perf_counter()
            for i in range(args.batches):
                if len(pending) >= args.inflight:
                    out = pending.popleft().result(timeout=300)
                    received_bytes += out.logits.numel() * out.logits.element_size()
                pending.append(client.submit(ids[i % 4]))
            while pending:
                out = pending.popleft().result(timeout=300)
                received_bytes += out.logits.numel() * out.logits.element_size()
            seconds = time.perf_counter() - start
    return {"batches_per_s": args.batches / seconds, "gb_per_s": received_bytes / seconds / 1e9}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="builtin:tiny")
    p.add_argument("--device", default="cpu", help="the teacher's device (the student is on the CPU)")
    p.add_argument("--dtype", default="")
    p.add_argument("--shape", default="4x2048", help="rows x tokens of each batch")
    p.add_argument("--batches", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--inflight", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2, help="each transport measured this many times, alternating")
    p.add_argument("--out", default="")
    args = p.parse_args()
    results: dict[str, list[dict]] = {"process": [], "inline": []}
    for _ in range(args.rounds):
        for transport in results:
            results[transport].append(measure(args, transport))
    lines = [f"Full logits to a CPU student over gloo, {args.model} on {args.device}, batches {args.shape}, "
             f"{args.inflight} in flight, {args.batches} batches a run (`python -m bench.session_transport`):", "",
             "| session transport | round | batches/s | GB/s received | against inline, same round |",
             "|---|---|---|---|---|"]
    for round_ in range(args.rounds):
        inline = results["inline"][round_]["gb_per_s"]
        for transport, runs in results.items():
            run = runs[round_]
            lines.append(f"| {transport} | {round_ + 1} | {run['batches_per_s']:.1f} | {run['gb_per_s']:.2f} | "
                         f"{run['gb_per_s'] / inline:.2f}x |")
    emit(lines, args.out)


if __name__ == "__main__":
    main()
