"""Teacher busy fraction while two student jobs saturate it (the bar: >= 90%).

A Llama-3-8B-shaped teacher (random weights, bf16) is served on --teacher-gpu. Two
student jobs, each a process of its own on --student-gpu, keep --inflight batches of
--rows x --seq tokens in flight and drop the outputs (full bf16 logits), as a
training loop that outpaces the teacher would. After --warmup-s, /metrics is read
every --sample-s for --window-s: `teacher_busy_fraction` (time in forward over wall
time, last 10 s), the forward time and each job's tokens/s. Prints a table (and
writes it to --out).

    python -m bench.busy_fraction --out busy.md
    python -m bench.busy_fraction --model builtin:tiny --teacher-device cpu --student-device cpu \
        --seq 64 --warmup-s 2 --window-s 4     # a smoke run of the script itself, on CPU
"""

from __future__ import annotations

import argparse
import contextlib
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # as the programs do
import torch  # noqa: E402

from bench.table import emit  # noqa: E402
from teacher_server.launcher import multicast_off  # noqa: E402

JOBS = ("busy-a", "busy-b")


def student(args) -> int:
    """One student job: submit back to back until the stop file appears."""
    from student_trainer import TeacherClient

    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    generator = torch.Generator().manual_seed(JOBS.index(args.job_id))
    deadline = time.monotonic() + args.max_s
    with TeacherClient(args.address, device, max_inflight=args.inflight, job_id=args.job_id,
                       join_timeout_s=300) as teacher:
        futures = []
        first = True
        while not Path(args.stop_file).exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"no stop file {args.stop_file} within {args.max_s}s")
            ids = torch.randint(0, teacher.info.vocab_size, (args.rows, args.seq), generator=generator)
            futures.append(teacher.submit(ids))
            if len(futures) >= args.inflight:
                futures.pop(0).result(timeout=600)  # outputs dropped
                if first:
                    print("SATURATING", flush=True)
                    first = False
        for future in futures:
            future.result(timeout=600)
    return 0


def _job_tokens(samples: dict) -> dict[str, float]:
    tokens: dict[str, float] = defaultdict(float)
    for (name, labels), value in samples.items():
        if name == "teacher_tokens_total":
            tokens[dict(labels)["job"]] += value
    return tokens


class _Student:
    """A student process whose output is read (and kept) by a thread, so it never blocks on a full pipe."""

    def __init__(self, command: list[str], env: dict):
        self.proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.lines: queue.Queue = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.seen.append(line)
            self.lines.put(line)
        self.lines.put(None)

    def wait_for_line(self, prefix: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"student did not print {prefix} within {timeout_s}s:\n"
                                   f"{''.join(self.seen[-40:])}") from None
            if line is None:
                raise RuntimeError(f"student exited ({self.proc.wait()}) before {prefix}:\n{''.join(self.seen[-40:])}")
            if line.startswith(prefix):
                return

    def finish(self, timeout_s: float) -> None:
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)
        if self.proc.returncode:
            print(f"a student exited with {self.proc.returncode}:\n{''.join(self.seen[-40:])}", file=sys.stderr)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=2)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--inflight", type=int, default=3, help="batches each student keeps in flight")
    p.add_argument("--model", default="", help="the teacher (default: a Llama-3-8B-shaped random model)")
    p.add_argument("--teacher-device", default="cuda:0")
    p.add_argument("--student-device", default="cuda:1")
    p.add_argument("--warmup-s", type=float, default=20.0)
    p.add_argument("--window-s", type=float, default=12.0)
    p.add_argument("--sample-s", type=float, default=2.0)
    p.add_argument("--out", default="")
    # Student mode (this script runs itself once per job).
    p.add_argument("--student", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--address", default="", help=argparse.SUPPRESS)
    p.add_argument("--job-id", default="", help=argparse.SUPPRESS)
    p.add_argument("--device", default="", help=argparse.SUPPRESS)
    p.add_argument("--stop-file", default="", help=argparse.SUPPRESS)
    p.add_argument("--max-s", type=float, default=900.0, help=argparse.SUPPRESS)
    args = p.parse_args()
    multicast_off(os.environ)
    if args.student:
        return student(args)

    from bench.distill_pipeline import TEACHER_SHAPE, write_config
    from teacher_server.launcher import ServerProcess, child_env, metrics_samples

    tmp = Path(tempfile.mkdtemp())
    teacher_spec = args.model or write_config(tmp / "teacher", TEACHER_SHAPE)
    dtype = ["--dtype", "bfloat16"] if args.teacher_device.startswith("cuda") else []
    stop = tmp / "stop"
    batch_tokens = args.rows * args.seq
    # Room for one batch of each job in a forward: the two are packed together.
    server = ServerProcess("--model", teacher_spec, "--device", args.teacher_device, *dtype,
                           "--max-batch-tokens", str(2 * batch_tokens), "--max-seq-len", str(args.seq),
                           "--max-inflight", str(max(8, args.inflight)), startup_timeout_s=300)
    students = []
    rows = []
    try:
        for job in JOBS:
            students.append(_Student(
                [sys.executable, "-m", "bench.busy_fraction", "--student", "--address", server.address,
                 "--job-id", job, "--device", args.student_device, "--stop-file", str(stop),
                 "--rows", str(args.rows), "--seq", str(args.seq), "--inflight", str(args.inflight)], child_env()))
        for s in students:
            s.wait_for_line("SATURATING", 300)
        time.sleep(args.warmup_s)  # the busy fraction's 10 s window holds only saturated time
        first = previous = metrics_samples(server.http)
        start = last = time.monotonic()
        while last - start < args.window_s:
            time.sleep(args.sample_s)
            now, samples = time.monotonic(), metrics_samples(server.http)
            forwards = samples[("teacher_forward_seconds_count", ())] - previous[("teacher_forward_seconds_count", ())]
            forward_s = samples[("teacher_forward_seconds_sum", ())] - previous[("teacher_forward_seconds_sum", ())]
            tokens = samples[("teacher_forward_tokens_total", ())] - previous[("teacher_forward_tokens_total", ())]
            rows.append((now - start, samples[("teacher_busy_fraction", ())], tokens / (now - last),
                         forward_s / forwards * 1e3 if forwards else float("nan"), samples[("teacher_queue_depth", ())]))
            previous, last = samples, now
        end = previous
    finally:
        stop.touch()
        for s in students:
            s.finish(120)
        server.stop()

    elapsed = last - start
    served = {job: (_job_tokens(end)[job] - _job_tokens(first)[job]) / elapsed for job in JOBS}
    busy = [row[1] for row in rows]
    device = torch.device(args.teacher_device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    lines = [f"teacher {args.model or '8B-shaped (bf16)'} on {args.teacher_device}, {len(JOBS)} student jobs on "
             f"{args.student_device}, each {args.rows} x {args.seq} tokens a batch, {args.inflight} in flight, "
             f"full logits; {args.warmup_s:.0f} s warm-up, {name}",
             "| t (s) | teacher_busy_fraction | forward tokens/s | forward ms | queue depth |", "|---|---|---|---|---|"]
    lines += [f"| {t:.1f} | {b:.3f} | {tok:,.0f} | {ms:.0f} | {depth:.0f} |" for t, b, tok, ms, depth in rows]
    lines.append("\n| job | tokens/s served | share |\n|---|---|---|")
    total = sum(served.values()) or 1.0
    lines += [f"| {job} | {rate:,.0f} | {rate / total:.1%} |" for job, rate in served.items()]
    verdict = "meets" if min(busy) >= 0.90 else "MISSES"
    lines.append(f"\nbusy fraction min {min(busy):.3f}, mean {sum(busy) / len(busy):.3f}: {verdict} the bar of 0.90")
    emit(lines, args.out)
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
