"""Does a tensor-parallel teacher send gathered logits from rank 0, or does
each rank send its own vocabulary shard straight to the student?

    python3 -m torch.distributed.run --standalone --nproc-per-node 2 -m bench.investigations.tp_send_choice \
        --out tp_send.md

On two GPUs the teacher (TP=2) takes both, so there is no third GPU for a student; what
each design costs is measured piece by piece instead, on a Llama-3-8B-shaped teacher
(random weights, bfloat16) built twice with the server's own plan (teacher_server/parallel.py):

  forward, shards    the TP=2 forward, each rank left with its vocabulary shard of the logits
  forward, gathered  the same with the lm_head's output all-gathered (what the server runs)
  send, full         the gathered logits of one batch, rank 0 -> the other GPU (NCCL p2p)
  send, one shard    one rank's shard over the same link
  join shards        the student's torch.cat of the shards along the vocabulary (one GPU)
  control            rank 0's header + token ids to the other ranks (gloo; both designs pay it)

Per batch, a teacher is limited by the slower of its forward and its outgoing link (sends
are asynchronous and overlap the next forward): gathered = max(forward gathered, send
full); shards = max(forward shards, send one shard), the shards travelling in parallel
from the N ranks if the student's link takes them at once (NVSwitch: yes, up to its
ingress bandwidth), plus the student's join. The rule printed at the end: keep the
gathered path unless the shard path is at least 10% faster per batch, since shards cost
more than time: every TP rank in every session group (N+1-rank communicators, joins and
leaves broadcast to all ranks), a top-k that needs a second step across shards, and a
student that must join them.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from bench.distill_pipeline import TEACHER_SHAPE, write_config
from bench.table import emit
from distill_common.models import load_causal_lm, model_config
from teacher_server import parallel
from teacher_server.model_runner import output_width


def synchronize() -> None:
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()


def timed_ms(fn, iters: int, warmup: int = 2) -> float:
    """Mean wall time of fn() in ms, every rank in step (barrier), the GPU drained each time."""
    for _ in range(warmup):
        fn()
    total = 0.0
    for _ in range(iters):
        synchronize()
        dist.barrier()
        start = time.perf_counter()
        fn()
        synchronize()
        total += time.perf_counter() - start
    return total / iters * 1e3


def build(spec: str, world, gather_logits: bool):
    from torch.distributed.device_mesh import init_device_mesh

    dtype = torch.bfloat16 if world.device.type == "cuda" else torch.float32
    model = load_causal_lm(spec, device=world.device, dtype=dtype).eval().requires_grad_(False)
    parallel.apply_plan(model, init_device_mesh(world.device.type, (world.size,)), gather_logits=gather_logits)
    return model


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="", help="a model spec (builtin:wide, random:DIR, ...); default: Llama-3-8B-shaped")
    p.add_argument("--rows", type=int, default=2)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--out", default="", help="also write the table (markdown) here")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="cpu: a smoke run of this script on gloo (e.g. --model builtin:tiny), no figures")
    args = p.parse_args()

    world = parallel.init_world(args.device, timeout_s=600)
    if world is None:
        sys.exit("run under torchrun with 2 ranks (one per GPU): see the top of this file")
    rank, size = world.rank, world.size
    spec = args.model
    if not spec:
        spec = write_config(Path(tempfile.mkdtemp(prefix=f"tp-bench-{rank}-")), TEACHER_SHAPE)
    parallel.check_heads(model_config(spec), size)

    gathered_model = build(spec, world, gather_logits=True)
    shard_model = build(spec, world, gather_logits=False)
    vocab = output_width(gathered_model)
    ids = torch.randint(0, vocab, (args.rows, args.seq), generator=torch.Generator().manual_seed(0)).to(world.device)
    mask = torch.ones_like(ids)

    def forward(model):
        with torch.inference_mode():
            return model(input_ids=ids, attention_mask=mask, use_cache=False).logits

    # The premise of the comparison: the gathered logits are the shards side by side.
    full, shard = forward(gathered_model), forward(shard_model)
    shards = [torch.empty_like(shard) for _ in range(size)]
    dist.all_gather(shards, shard.contiguous())
    joined = torch.cat(shards, dim=-1)
    diff = (full.float() - joined.float()).abs().max().item()
    assert full.shape[-1] == vocab and diff <= 1e-2 * full.float().abs().max().item(), f"gathered != shards: {diff}"
    del joined

    fwd_gathered_ms = timed_ms(lambda: forward(gathered_model), args.iters)
    fwd_shards_ms = timed_ms(lambda: forward(shard_model), args.iters)

    # Point to point over the link a student would use (here: the other GPU stands in for it).
    def send(tensor):
        if rank == 0:
            dist.send(tensor, 1)
        elif rank == 1:
            dist.recv(tensor, 0)

    send_full_ms = timed_ms(lambda: send(full), args.iters)
    shard_buffer = shard.contiguous()
    send_shard_ms = timed_ms(lambda: send(shard_buffer), args.iters)
    join_ms = timed_ms(lambda: torch.cat(shards, dim=-1), args.iters)

    # Rank 0's control message for one forward (teacher_server/parallel.py: header, then ids + mask).
    header = torch.zeros(4, dtype=torch.int64)
    payload = torch.zeros(2, args.rows, args.seq, dtype=torch.int32)

    def control():
        dist.broadcast(header, 0, group=world.control)
        dist.broadcast(payload, 0, group=world.control)

    control_ms = timed_ms(control, args.iters * 4)

    if rank == 0:
        device_name = torch.cuda.get_device_name() if world.device.type == "cuda" else "CPU"
        tokens = args.rows * args.seq
        full_bytes = full.numel() * full.element_size()
        gathered_bound = max(fwd_gathered_ms, send_full_ms)
        shards_bound = max(fwd_shards_ms, send_shard_ms)
        rows = [
            ("forward, shards (TP=%d)" % size, fwd_shards_ms, ""),
            ("forward, gathered (TP=%d)" % size, fwd_gathered_ms,
             f"all-gather adds {fwd_gathered_ms - fwd_shards_ms:.2f} ms"),
            ("send, full logits", send_full_ms, f"{full_bytes / 2**20:.1f} MiB, {full_bytes / send_full_ms / 1e6:.0f} GB/s"),
            ("send, one shard", send_shard_ms, f"{full_bytes / size / 2**20:.1f} MiB"),
            ("join shards (student)", join_ms, "torch.cat along the vocabulary"),
            ("control (gloo)", control_ms, f"header + {payload.numel() * 4 / 2**10:.0f} KiB of ids and mask"),
            ("per batch, gathered", gathered_bound, f"{tokens / gathered_bound * 1e3:,.0f} tok/s"),
            ("per batch, shards", shards_bound, f"{tokens / shards_bound * 1e3:,.0f} tok/s, student +{join_ms:.2f} ms"),
        ]
        table = [f"TP send choice: {spec if args.model else 'Llama-3-8B-shaped (random, bf16)'}, "
                 f"{args.rows} x {args.seq} tokens, {size} x {device_name}", "",
                 "| step | ms | note |", "|---|---:|---|"]
        table += [f"| {name} | {ms:.2f} | {note} |" for name, ms, note in rows]
        faster = (gathered_bound - shards_bound) / gathered_bound
        choice = "shards" if faster >= 0.10 else "gathered"
        table += ["", f"per batch, shards save {faster:+.1%} of the gathered path's time; rule: shards only when they "
                  f"save >= 10% (they cost N-rank session groups, a cross-shard top-k and a join on the student). "
                  f"Decision: {choice}."]
        emit(table, args.out)
    del gathered_model, shard_model
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    sys.exit(main())
