"""Where the time of one batch goes on the data plane: a per-batch timeline.

Runs --batches batches of --size-mib of full bf16 logits through builtin:wide with
tracing on (distill_common/tracing.py) in the teacher and in this student process,
merges their marks on the shared monotonic clock and prints, per milestone, the
median and 90th percentile time after submit(), the median gap between consecutive
milestones, and the achieved throughput. Optionally samples both processes with
py-spy (--profile DIR).

    python -m bench.transport_trace --size-mib 256 --batches 64
"""

from __future__ import annotations

import argparse
import gc
import glob
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

TRACE_DIR = tempfile.mkdtemp(prefix="distill-trace-")
os.environ["DISTILL_TRACE"] = os.path.join(TRACE_DIR, "trace")  # read at import, here and in the teacher
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # as the programs do
import torch  # noqa: E402

from bench.transport_throughput import VOCAB, batch_shape, stream_batches  # noqa: E402
from distill_common import tracing  # noqa: E402

# In the order a batch passes them: s_ = this student process, t_ = the teacher.
MILESTONES = ["s_submit", "s_yield", "t_recv", "t_pick", "t_forward", "t_announced", "s_announced",
              "s_posted", "s_received", "t_sent", "s_resolved"]


def load_events(paths: list[str]) -> list[tuple[float, str, int]]:
    events = []
    for path in paths:
        for line in Path(path).read_text().splitlines():
            t, event, batch_id = line.split("\t")
            events.append((float(t), event, int(batch_id)))
    return sorted(events)


def by_batch(events) -> dict[int, dict[str, float]]:
    marks: dict[int, dict[str, float]] = defaultdict(dict)
    for t, event, batch_id in events:
        marks[batch_id].setdefault(event, t)
    return marks


def worst_stall(events, first_time: float, window_ms: float = 3.0) -> list[str]:
    """Every mark, in time order, around the longest quiet time on the timeline."""
    timed = [e for e in events if e[0] >= first_time and e[1] not in ("e_wait", "e_wake")]
    if len(timed) < 2:
        return []
    gap, i = max((b[0] - a[0], i) for i, (a, b) in enumerate(zip(timed, timed[1:])))
    lo, hi = timed[i][0] - window_ms / 1e3, timed[i + 1][0] + window_ms / 1e3
    lines = [f"longest quiet time: {gap * 1e3:.1f} ms; all marks around it (ms from its start):"]
    lines += [f"  {(t - timed[i][0]) * 1e3:9.2f}  {event:12s} {batch_id}" for t, event, batch_id in events
              if lo <= t <= hi]
    return lines


def summarize(marks: dict[int, dict[str, float]], first: int) -> list[str]:
    ids = [i for i in sorted(marks) if i >= first and all(m in marks[i] for m in MILESTONES)]
    if not ids:
        return ["no complete batch in the trace"]
    lines = [f"{len(ids)} batches traced; ms after submit() (median, p90), and median gap from the previous milestone",
             "| milestone | median ms | p90 ms | gap ms |", "|---|---|---|---|"]
    previous = None
    for m in MILESTONES:
        after = sorted((marks[i][m] - marks[i]["s_submit"]) * 1e3 for i in ids)
        gap = statistics.median((marks[i][m] - marks[i][previous]) * 1e3 for i in ids) if previous else 0.0
        lines.append(f"| {m} | {statistics.median(after):.2f} | {after[int(0.9 * (len(after) - 1))]:.2f} | "
                     f"{gap:.2f} |")
        previous = m
    for m in ("s_submit", "t_recv", "t_pick", "t_announced", "s_resolved"):
        times = sorted(marks[i][m] for i in ids)
        gaps = [(b - a) * 1e3 for a, b in zip(times, times[1:])]
        lines.append(f"interval between consecutive {m}: median {statistics.median(gaps):.2f} ms, "
                     f"max {max(gaps):.2f} ms")
    firsts = [i for i in ids if "t_launched" in marks[i]]  # the first batch of each forward
    for a, b in (("t_pick", "t_inputs"), ("t_inputs", "t_launched"), ("t_launched", "t_forward")):
        gaps = sorted((marks[i][b] - marks[i][a]) * 1e3 for i in firsts if a in marks[i] and b in marks[i])
        if gaps:
            lines.append(f"per forward, {a} -> {b}: median {statistics.median(gaps):.2f} ms, max {gaps[-1]:.2f} ms")
    picks = sorted({round(marks[i]["t_pick"], 6) for i in ids})
    lines.append(f"forwards: {len(picks)} for {len(ids)} batches")
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mib", type=int, default=256)
    p.add_argument("--batches", type=int, default=64)
    p.add_argument("--inflight", type=int, default=8)
    p.add_argument("--device", default="cuda:1")
    p.add_argument("--teacher-device", default="cuda:0")
    p.add_argument("--switch-interval-s", type=float, default=0.0,
                   help="sys.setswitchinterval in this (student) process; 0 keeps Python's default")
    p.add_argument("--cuda-graphs", type=int, default=0, help="the teacher's --cuda-graphs (0: eager forwards)")
    p.add_argument("--keep", default="", help="copy the raw trace files into this folder")
    p.add_argument("--profile", default="", help="write py-spy profiles of both processes into this folder")
    args = p.parse_args()
    from student_trainer import TeacherClient
    from teacher_server.launcher import ServerProcess

    if args.switch_interval_s:
        sys.setswitchinterval(args.switch_interval_s)
    rows, seq = batch_shape(args.size_mib << 20)
    gc.collect()
    gc.freeze()  # as the trainer does: the client lives in a training process
    server = ServerProcess("--model", "builtin:wide", "--device", args.teacher_device, "--dtype", "bfloat16",
                           "--max-batch-tokens", "16384", "--max-seq-len", "4096", "--max-inflight",
                           str(args.inflight), "--cuda-graphs", str(args.cuda_graphs))
    spies = []
    try:
        with TeacherClient(server.address, args.device, max_inflight=args.inflight) as teacher:
            ids = torch.randint(0, VOCAB, (rows, seq))
            # Warm-up, a whole untimed pass: every packing of 1..inflight batches per
            # forward loads its CUDA kernels on first use (tens of ms each on a cold host).
            stream_batches(teacher, ids, args.batches)
            first = teacher._next_batch_id
            if args.profile:
                os.makedirs(args.profile, exist_ok=True)
                for name, pid in (("teacher", server.proc.pid), ("student", os.getpid())):
                    for mode in ("--idle", "--gil"):  # every thread's state; who holds the GIL
                        spies.append(subprocess.Popen(
                            ["py-spy", "record", mode, "--threads", "--format", "raw", "-r", "500", "-d", "2",
                             "-p", str(pid), "-o", os.path.join(args.profile, f"{name}{mode[1:]}.txt")]))
                time.sleep(0.5)
            elapsed = stream_batches(teacher, ids, args.batches)
        for spy in spies:
            spy.wait(60)
    finally:
        server.stop()
    tracing.dump()
    paths = glob.glob(os.path.join(TRACE_DIR, "trace.*.tsv"))
    if args.keep:
        for path in paths:
            shutil.copy(path, args.keep)
    events = load_events(paths)
    marks = by_batch(events)
    print(f"{args.batches} x {args.size_mib} MiB ({rows} x {seq} tokens) with {args.inflight} in flight: "
          f"{args.batches * rows * seq * VOCAB * 2 / elapsed / 1e9:.1f} GB/s, "
          f"{elapsed / args.batches * 1e3:.2f} ms per batch")
    print("\n".join(summarize(marks, first)))
    print("\n".join(worst_stall(events, marks[first]["s_submit"])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
