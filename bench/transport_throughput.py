"""Teacher -> student payload throughput through the project vs raw NCCL send/recv.

Both are measured in this one run between the same two GPUs:
  raw      two processes, init_process_group("nccl"), back-to-back isend/irecv of
           one payload size;
  project  a teacher server on --teacher-gpu serving builtin:wide (a Llama-3-sized
           vocabulary on a one-layer body: full bf16 logits of a batch are the
           payload) and a TeacherClient on --student-gpu keeping --inflight batches
           in flight.
Prints a table (and writes it to --out): size, raw GB/s, project GB/s, ratio.
--cuda-graphs N serves with the teacher's --cuda-graphs N (the decoder replayed from
CUDA graphs: a forward of builtin:wide then costs the engine ~0.6 ms of host time
instead of ~3, bench/forward_launch.py).

    python -m bench.transport_throughput --sizes-mib 64,256,1024,2048 [--cuda-graphs 64]
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import sys
import time
from collections import deque

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # as the programs do
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from bench.table import emit  # noqa: E402
from teacher_server.launcher import multicast_off  # noqa: E402

VOCAB = 128256  # builtin:wide
BYTES_PER_TOKEN = VOCAB * 2  # bf16 logits


def batch_shape(size_bytes: int, max_seq: int = 4096) -> tuple[int, int]:
    tokens = max(1, round(size_bytes / BYTES_PER_TOKEN))
    rows = max(1, math.ceil(tokens / max_seq))
    return rows, max(1, round(tokens / rows))


def _raw_worker(rank: int, port: int, sizes: list[int], iters: int, gpus: list[int], results) -> None:
    torch.cuda.set_device(gpus[rank])
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    for size in sizes:
        rows, seq = batch_shape(size)
        buffers = [torch.empty(rows, seq, VOCAB, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
        for step in range(iters + 3):
            if step == 3:  # after warm-up
                torch.cuda.synchronize()
                dist.barrier(device_ids=[gpus[rank]])
                start = time.perf_counter()
            buf = buffers[step % 2]
            work = dist.isend(buf, 1) if rank == 0 else dist.irecv(buf, 0)
            if step % 2:
                work.wait()
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        if rank == 1:
            results[size] = rows * seq * BYTES_PER_TOKEN * iters / elapsed
    dist.destroy_process_group()


def measure_raw(sizes: list[int], iters: int, gpus: list[int]) -> dict[int, float]:
    manager = mp.Manager()
    results = manager.dict()
    mp.spawn(_raw_worker, args=(29731, sizes, iters, gpus, results), nprocs=2, join=True)
    return dict(results)


def stream_batches(teacher, ids: torch.Tensor, count: int) -> float:
    """Submits `count` batches keeping the client's window full; returns the seconds taken.

    Like a training loop, each batch's outputs are used and dropped, so its receive
    buffers return to the allocator.
    """
    start = time.perf_counter()
    futures: deque = deque()
    for _ in range(count):
        futures.append(teacher.submit(ids))
        while futures and futures[0].done():
            futures.popleft().result()
    while futures:
        futures.popleft().result(timeout=300)
    return time.perf_counter() - start


def measure_project(sizes: list[int], iters: int, teacher_gpu: int, student_gpu: int, inflight: int,
                    warmup: int, cuda_graphs: int = 0) -> dict[int, float]:
    from student_trainer import TeacherClient
    from teacher_server.launcher import ServerProcess

    # Small batches pack into one forward up to 16k tokens (4 GiB of logits); a
    # 2 GiB batch is a forward of its own.
    max_tokens = max(16384, max(r * s for r, s in map(batch_shape, sizes)))
    gc.collect()
    gc.freeze()  # as the trainer does: the client lives in a training process
    server = ServerProcess("--model", "builtin:wide", "--device", f"cuda:{teacher_gpu}", "--dtype", "bfloat16",
                           "--max-batch-tokens", str(max_tokens), "--max-seq-len", "4096",
                           "--max-inflight", str(inflight), "--cuda-graphs", str(cuda_graphs))
    results = {}
    try:
        for size in sizes:
            rows, seq = batch_shape(size)
            ids = torch.randint(0, VOCAB, (rows, seq))
            with TeacherClient(server.address, f"cuda:{student_gpu}", max_inflight=inflight,
                               job_id="bench") as teacher:
                # Warm-up first: the teacher packs 1 to `inflight` batches per forward, and
                # each new shape loads its CUDA kernels on first use (tens of ms each on a
                # cold host); a pass of `iters` batches does not meet every packing.
                stream_batches(teacher, ids, max(iters, warmup))
                elapsed = stream_batches(teacher, ids, iters)
            results[size] = rows * seq * BYTES_PER_TOKEN * iters / elapsed
    finally:
        server.stop()
    return results


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes-mib", default="64,256,1024,2048")
    p.add_argument("--iters", type=int, default=100, help="batches timed per size (after the warm-up)")
    p.add_argument("--warmup", type=int, default=200, help="untimed batches per size first")
    p.add_argument("--inflight", default="8,16", help="batches in flight per student; several values compare")
    p.add_argument("--cuda-graphs", type=int, default=0, help="the teacher's --cuda-graphs (0: eager forwards)")
    p.add_argument("--teacher-gpu", type=int, default=0)
    p.add_argument("--student-gpu", type=int, default=1)
    p.add_argument("--out", default="")
    args = p.parse_args()
    multicast_off(os.environ)
    sizes = [int(s) << 20 for s in args.sizes_mib.split(",")]
    raw = measure_raw(sizes, args.iters, [args.teacher_gpu, args.student_gpu])
    inflights = [int(x) for x in args.inflight.split(",")]
    project = {k: measure_project(sizes, args.iters, args.teacher_gpu, args.student_gpu, k, args.warmup,
                                  args.cuda_graphs) for k in inflights}
    lines = [f"teacher GPU {args.teacher_gpu} -> student GPU {args.student_gpu}, {args.iters} batches per size, "
             f"{torch.cuda.get_device_name(args.teacher_gpu)}, torch {torch.__version__}, teacher "
             f"{f'--cuda-graphs {args.cuda_graphs}' if args.cuda_graphs else 'eager (no --cuda-graphs)'}",
             "| payload per batch | raw NCCL GB/s | " + " | ".join(f"project GB/s ({k} in flight) | project / raw"
                                                          for k in inflights) + " |",
             "|---|---|" + "---|---|" * len(inflights)]
    for size in sizes:
        cells = " | ".join(f"{project[k][size] / 1e9:.1f} | {project[k][size] / raw[size]:.1%}" for k in inflights)
        lines.append(f"| {size >> 20} MiB | {raw[size] / 1e9:.1f} | {cells} |")
    emit(lines, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
