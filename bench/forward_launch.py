"""What one forward of the data-plane bench model costs the teacher's host, on one GPU.

    python -m bench.forward_launch --out forward_launch.md [--profile DIR]

The 256 MiB row of bench/transport_throughput.py is decided by how fast the engine
launches forwards of builtin:wide (bench/transport_trace.py: 3-8 ms per forward in the
server, against the ~5 ms the link takes to carry the 6-7 batches of one forward). This
script times the same launch alone, in one process on one GPU, as the engine does it:
pinned inputs packed from k batches of 1 x 1046 tokens (256 MiB of bf16 logits each),
`ModelRunner.forward`, then each batch's logits sliced out; the outputs of the last
--hold forwards are kept alive, as posted sends keep them, and older ones freed.

For each pack size k it prints the host time per forward (packing, launch, slicing;
median and 90th percentile), the device time per forward, and what the link would need:
k x 0.75 ms. A launch well under the link time here and 3-8 ms in the server means the
server's other threads (or the sends) slow the engine down; a launch near it here means
the forward itself costs that much host time. --profile DIR writes torch.profiler tables
(host and device time per operator, kernel and CUDA call) of --profile-k batches per forward,
for each runner timed.

--cuda-graphs N adds rows for a runner that replays the decoder from CUDA graphs
(teacher_server/cuda_graphs.py), and the largest difference of its logits from the
eager runner's on the same batches.

--model 1.5b times a Llama-shaped 1.5B model (the pipeline bench's student shape, 28
layers, the same 128k vocabulary) instead: a small real teacher, where the forward's own
device time is tens of ms.

--side-threads N adds N Python threads that each hold the interpreter lock for
--side-busy-us in every 0.75 ms (as the server's gRPC, sender, waiter and announcer
threads each do a little Python per batch): how much the launch suffers from sharing the
lock, measured against the same run without them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from collections import deque
from pathlib import Path

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # as the server does
import torch  # noqa: E402

from bench.distill_pipeline import small_teacher_spec  # noqa: E402
from bench.table import emit  # noqa: E402
from bench.transport_throughput import BYTES_PER_TOKEN, VOCAB, batch_shape  # noqa: E402
from teacher_server.engine import pack  # noqa: E402
from teacher_server.model_runner import ModelRunner  # noqa: E402

LINK_GBPS = 358.0  # raw NCCL GPU0 -> GPU1 at 256 MiB (docs/performance.md, ../DESIGN.md)


def one_forward(runner: ModelRunner, batches: list[tuple[torch.Tensor, torch.Tensor]]
                ) -> tuple[list[torch.Tensor], dict[str, float]]:
    """The engine's work for one forward of (ids, mask) batches (teacher_server/engine.py
    `Engine._forward`), timed in parts."""
    t0 = time.perf_counter()
    input_ids, mask = pack(batches, pinned=True)
    t1 = time.perf_counter()
    out = runner.forward(input_ids, mask, hidden=False)
    t2 = time.perf_counter()
    kept, row = [], 0
    for ids, _ in batches:
        kept.append(out.logits[row:row + ids.shape[0], :ids.shape[1]].to(torch.bfloat16).contiguous())
        row += ids.shape[0]
    t3 = time.perf_counter()
    return kept, {"pack": t1 - t0, "launch": t2 - t1, "slice": t3 - t2, "host": t3 - t0}


def measure(runner: ModelRunner, k: int, ids: torch.Tensor, forwards: int, hold: int) -> dict[str, float]:
    batches = [(ids, torch.ones_like(ids))] * k
    held: deque = deque(maxlen=hold)
    for _ in range(3):  # warm-up: kernels of this shape load on first use
        held.append(one_forward(runner, batches)[0])
    torch.cuda.synchronize()
    parts: dict[str, list[float]] = {}
    start = time.perf_counter()
    begin = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(forwards):
        kept, times = one_forward(runner, batches)
        held.append(kept)
        for name, t in times.items():
            parts.setdefault(name, []).append(t * 1e3)
    end.record()
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    held.clear()
    result = {f"{name}_median": statistics.median(v) for name, v in parts.items()}
    result["host_p90"] = sorted(parts["host"])[int(0.9 * (len(parts["host"]) - 1))]
    result["device"] = begin.elapsed_time(end) / forwards
    result["wall"] = wall * 1e3 / forwards
    return result


class SideLoad:
    """Threads that each run Python for `busy_us`, then sleep, every `period_us`."""

    def __init__(self, threads: int, busy_us: float, period_us: float = 750.0):
        self.stop = threading.Event()
        self.busy_s, self.period_s = busy_us / 1e6, period_us / 1e6
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(threads)]

    def _run(self) -> None:
        while not self.stop.is_set():
            start = time.perf_counter()
            while time.perf_counter() - start < self.busy_s:
                pass
            time.sleep(max(0.0, self.period_s - (time.perf_counter() - start)))

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join()


def graphs_check(runners: dict, vocab: int) -> str:
    """The graphed runner's logits against the eager runner's, on new ids of every shape it captured."""
    graphs = runners["graphs"].graphs
    worst = 0.0
    for shape in graphs.captured:
        ids = torch.randint(0, vocab, shape).pin_memory()
        mask = torch.ones_like(ids)
        want = runners["eager"].forward(ids, mask, hidden=False).logits
        got = runners["graphs"].forward(ids, mask, hidden=False).logits
        worst = max(worst, (got.float() - want.float()).abs().max().item())
    off = f" (off: {graphs.off})" if graphs.off else ""
    return (f"CUDA graphs: {graphs.shapes} shapes captured{off}; largest |graphed - eager| logit over new ids of "
            f"each: {worst:.3g}")


def profile(runner: ModelRunner, name: str, k: int, ids: torch.Tensor, folder: str) -> None:
    from torch.profiler import ProfilerActivity, profile as torch_profile

    os.makedirs(folder, exist_ok=True)
    batches = [(ids, torch.ones_like(ids))] * k
    held: deque = deque(maxlen=4)
    for _ in range(3):
        held.append(one_forward(runner, batches)[0])
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            held.append(one_forward(runner, batches)[0])
        torch.cuda.synchronize()
    averages = prof.key_averages()
    for key, side in (("self_cpu_time_total", "host"), ("self_device_time_total", "device")):
        Path(folder, f"forward_{name}_k{k}_{side}.txt").write_text(averages.table(sort_by=key, row_limit=40))
    print(f"{name}, {k} batches per forward, 10 forwards:")
    print(averages.table(sort_by="self_device_time_total", row_limit=12))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mib", type=int, default=256, help="payload per batch")
    p.add_argument("--ks", default="1,2,4,7,8,12,15", help="batches per forward")
    p.add_argument("--forwards", type=int, default=40, help="timed forwards per pack size")
    p.add_argument("--hold", type=int, default=3, help="forwards whose outputs stay alive (posted sends)")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--profile", default="", help="write torch.profiler tables into this folder")
    p.add_argument("--profile-k", type=int, default=7)
    p.add_argument("--side-threads", default="0", help="Python threads sharing the lock; several values compare")
    p.add_argument("--side-busy-us", type=float, default=100.0, help="each side thread's Python time per 0.75 ms")
    p.add_argument("--model", choices=["wide", "1.5b"], default="wide",
                   help="builtin:wide (one layer), or a random Llama-shaped 1.5B model")
    p.add_argument("--cuda-graphs", type=int, default=0,
                   help="also time a runner with --cuda-graphs N (0: the eager runner alone)")
    p.add_argument("--out", default="")
    args = p.parse_args()
    rows, seq = batch_shape(args.size_mib << 20)
    spec = "builtin:wide" if args.model == "wide" else small_teacher_spec()
    runners = {"eager": ModelRunner(spec, args.device, "bfloat16")}
    if args.cuda_graphs:
        runners["graphs"] = ModelRunner(spec, args.device, "bfloat16", cuda_graphs=args.cuda_graphs)
    runner = runners["eager"]
    ids = torch.randint(0, VOCAB, (rows, seq))
    link_ms = rows * seq * BYTES_PER_TOKEN / (LINK_GBPS * 1e9) * 1e3
    lines = [f"{'builtin:wide' if args.model == 'wide' else 'Llama-shaped 1.5B (random)'}, bf16, "
             f"{torch.cuda.get_device_name(runner.device)}, torch {torch.__version__}; "
             f"batches of {rows} x {seq} tokens ({args.size_mib} MiB of logits, {link_ms:.2f} ms on a "
             f"{LINK_GBPS:.0f} GB/s link); {args.forwards} forwards per row, outputs of the last {args.hold} held",
             "| forward | side threads | batches per forward | host ms (median) | host p90 | pack | launch | slice | "
             "device ms | link needs ms | host / link |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for side in (int(x) for x in args.side_threads.split(",")):
        with SideLoad(side, args.side_busy_us):
            for k in (int(x) for x in args.ks.split(",")):
                for name, each in runners.items():
                    r = measure(each, k, ids, args.forwards, args.hold)
                    lines.append(f"| {name} | {side} | {k} | {r['host_median']:.2f} | {r['host_p90']:.2f} | "
                                 f"{r['pack_median']:.2f} | {r['launch_median']:.2f} | {r['slice_median']:.2f} | "
                                 f"{r['device']:.2f} | {k * link_ms:.2f} | {r['host_median'] / (k * link_ms):.2f} |")
    lines.append(f"side threads: each runs Python {args.side_busy_us:.0f} us in every 750 us")
    if "graphs" in runners:
        lines.append(graphs_check(runners, VOCAB))
    emit(lines, args.out)
    if args.profile:
        for name, each in runners.items():
            profile(each, name, args.profile_k, ids, args.profile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
