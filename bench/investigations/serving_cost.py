"""CPU time the teacher process spends per batch, by thread, on this machine (no GPU needed).

    python -m bench.investigations.serving_cost --batches 2000 --seq 1046

A teacher server on the CPU serving builtin:tiny (its forward is cheap) and one
TeacherClient streaming batches of 1 x --seq tokens with 16 in flight, asking for top-1
only (small outputs). Reads each teacher thread's CPU time from /proc before and after the
timed pass. The serving thread (gRPC, the main thread) is what matters for the data plane
at high batch rates: on a GPU its work per batch has to fit in the time the link takes to
carry one batch (0.75 ms for 256 MiB on NVLink). Linux only.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

from bench.table import emit
from bench.transport_throughput import stream_batches


def thread_cpu_s(pid: int) -> dict[int, float]:
    ticks = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:  # the thread ended
            continue
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / ticks
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=int, default=2000)
    p.add_argument("--seq", type=int, default=1046, help="tokens per batch (1046: a 256 MiB batch of builtin:wide)")
    p.add_argument("--out", default="")
    args = p.parse_args()
    from student_trainer import TeacherClient, TopK
    from teacher_server.launcher import ServerProcess

    server = ServerProcess("--model", "builtin:tiny", "--device", "cpu", "--max-batch-tokens", "16384",
                           "--max-seq-len", "4096", "--max-inflight", "16")
    pid = server.proc.pid
    try:
        with TeacherClient(server.address, "cpu", outputs=(TopK(1),), max_inflight=16) as teacher:
            ids = torch.randint(0, teacher.info.vocab_size, (1, args.seq))

            stream_batches(teacher, ids, 100)  # warm-up
            before = thread_cpu_s(pid)
            wall = stream_batches(teacher, ids, args.batches)
            after = thread_cpu_s(pid)
    finally:
        server.stop()
    per_batch = {tid: (cpu - before.get(tid, 0.0)) / args.batches * 1e3 for tid, cpu in after.items()}
    rows = [f"| {'serving (main)' if tid == pid else f'thread {tid}'} | {ms:.3f} |"
            for tid, ms in sorted(per_batch.items(), key=lambda kv: -kv[1]) if ms >= 0.005]
    emit([f"teacher CPU per batch: builtin:tiny on CPU, {args.batches} batches of 1 x {args.seq} tokens, 16 in flight, "
          f"{wall / args.batches * 1e3:.2f} ms per batch wall", "", "| teacher thread | CPU ms per batch |",
          "|---|---:|", *rows, f"| all | {sum(per_batch.values()):.3f} |"], args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
