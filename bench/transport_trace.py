"""Where the time of one batch goes on the data plane: a per-batch timeline.

Wraps the client's steps (Submit RPC, announcement seen, receives posted, transfer
done) with timestamps, runs --batches batches of --size-mib through builtin:wide, and
prints each batch's milestones in ms from its submit(), plus the teacher's forward count.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from collections import defaultdict, deque
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import requests  # noqa: E402
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # as the programs do
import torch  # noqa: E402

from bench.transport_throughput import VOCAB, batch_shape  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--size-mib", type=int, default=256)
    p.add_argument("--batches", type=int, default=16)
    p.add_argument("--inflight", type=int, default=8)
    p.add_argument("--device", default="cuda:1")
    p.add_argument("--teacher-device", default="cuda:0")
    p.add_argument("--profile", default="", help="write a py-spy profile of the teacher here")
    args = p.parse_args()
    from student_trainer import TeacherClient
    from tests.helpers import ServerProcess

    rows, seq = batch_shape(args.size_mib << 20)
    gc.collect()
    gc.freeze()  # as the trainer does: the client lives in a training process
    server = ServerProcess("--model", "builtin:wide", "--device", args.teacher_device, "--dtype", "bfloat16",
                           "--max-batch-tokens", "16384", "--max-seq-len", "4096", "--max-inflight", str(args.inflight), "--log-level", "DEBUG")
    marks: dict[int, dict[str, float]] = defaultdict(dict)
    try:
        teacher = TeacherClient(server.address, args.device, logits=True, max_inflight=args.inflight)
        group = teacher._group
        original = {"call": teacher._call, "announced": group.await_announced, "post": teacher._post_receives,
                    "assemble": teacher._assemble}

        def call(method, request):
            if method == "Submit":
                marks[request.batch_id]["rpc_start"] = time.perf_counter()
            result = original["call"](method, request)
            if method == "Submit":
                marks[request.batch_id]["rpc_done"] = time.perf_counter()
            return result

        def announced(batch_id, timeout_s):
            original["announced"](batch_id, timeout_s)
            marks[batch_id]["announced"] = time.perf_counter()

        def post(pending):
            original["post"](pending)
            marks[pending.batch_id]["posted"] = time.perf_counter()

        def assemble(pending):
            marks[pending.batch_id]["received"] = time.perf_counter()
            return original["assemble"](pending)

        teacher._call, group.await_announced, teacher._post_receives, teacher._assemble = call, announced, post, assemble
        ids = torch.randint(0, VOCAB, (rows, seq))
        for fut in [teacher.submit(ids) for _ in range(args.inflight)]:  # warm-up
            fut.result(timeout=120)
        marks.clear()
        futures: deque = deque()
        start = time.perf_counter()
        spy = None
        if args.profile:  # py-spy (carried as a wheel) samples the teacher during the timed batches
            import subprocess
            spy = subprocess.Popen(["py-spy", "record", "--idle", "--threads", "--format", "raw", "-r", "500", "-d", "3",
                                    "-p", str(server.proc.pid), "-o", args.profile])
            time.sleep(1.0)
        base = teacher._next_batch_id
        for i in range(base, base + args.batches):
            marks[i]["submit"] = time.perf_counter()
            futures.append(teacher.submit(ids))
            while futures and futures[0].done():
                futures.popleft().result()
        while futures:
            futures.popleft().result(timeout=120)
        elapsed = time.perf_counter() - start
        if spy is not None:
            spy.wait(30)
        teacher.close()
        metrics = requests.get(f"{server.http}/metrics", timeout=10).text
    finally:
        server.stop()
    print("".join(line for line in server.log_lines if "forward" in line and "DEBUG" in line)[-3000:])
    print(f"{args.batches} x {args.size_mib} MiB in {elapsed * 1000:.0f} ms: "
          f"{args.batches * rows * seq * VOCAB * 2 / elapsed / 1e9:.1f} GB/s")
    keys = ["rpc_start", "rpc_done", "announced", "posted", "received"]
    print("| batch | " + " | ".join(keys) + " | (ms after submit) |")
    for i in sorted(marks):
        t0 = marks[i]["submit"]
        print(f"| {i} | " + " | ".join(f"{(marks[i].get(k, float('nan')) - t0) * 1000:.1f}" for k in keys) + " |")
    print("\n".join(line for line in metrics.splitlines() if line.startswith(("teacher_forward_seconds_count",
                                                                               "teacher_forward_seconds_sum",
                                                                               "teacher_forward_tokens_total"))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
