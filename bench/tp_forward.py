"""How fast is a tensor-parallel teacher's forward, against one GPU, and why.

    python3 -m torch.distributed.run --standalone --nproc-per-node 2 -m bench.tp_forward --out tp_forward.md

Builds a Llama-3-8B-shaped model (random bfloat16 weights, --layers of them, built on the
GPU), saves it once, and times its forward as the server calls it (no mask, no cache;
without the runner's shortcut past transformers' packed-sequence check, which costs every
variant the same device sync) in one run:

  TP=1               the saved model on cuda:0 alone (rank 1 waits)
  TP=2, torch plan   built from the config and sharded by teacher_server.parallel.apply_plan
  TP=2, HF plan      the saved model loaded with transformers' tp_plan="auto"

With --profile DIR, one forward of each TP=2 variant runs under torch.profiler and rank
0 writes the operator tables (device time, host time) there, to see where the time goes.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from bench.distill_pipeline import TEACHER_SHAPE, VOCAB
from bench.table import emit
from distill_common.models import load_causal_lm
from teacher_server import parallel

# Llama-3-8B-shaped: the teacher shape of the pipeline bench.
LLAMA3_8B = dict(vocab_size=VOCAB, max_position_embeddings=8192, **TEACHER_SHAPE)


def forward_fn(model, ids):
    @torch.inference_mode()
    def forward():
        return model(input_ids=ids, attention_mask=None, use_cache=False, return_dict=True).logits
    return forward


def synchronize() -> None:
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()


def empty_cache() -> None:
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def timed_ms(fn, iters: int, group_barrier: bool) -> float:
    """Median wall time of fn() in ms, the device drained each time."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(iters):
        synchronize()
        if group_barrier:
            dist.barrier()
        start = time.perf_counter()
        fn()
        synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


def profile(fn, path: Path, rank: int) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    fn()
    synchronize()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_initialized() else [])
    with torch_profile(activities=activities) as prof:
        fn()
        synchronize()
    if rank == 0:
        events = prof.key_averages()
        text = ["# by device time", events.table(sort_by="self_cuda_time_total", row_limit=25),
                "# by host time", events.table(sort_by="self_cpu_time_total", row_limit=25)]
        path.write_text("\n".join(text))
        print(f"--- {path.name}: top by device time", flush=True)
        print(events.table(sort_by="self_cuda_time_total", row_limit=12), flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--rows", type=int, default=2)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--profile", default="", help="a directory for the profiler's tables (rank 0)")
    p.add_argument("--out", default="")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="cpu: a smoke run of this script on gloo with a tiny model, no figures")
    args = p.parse_args()

    world = parallel.init_world(args.device, timeout_s=900)
    if world is None or world.size != 2:
        sys.exit("run under torchrun with 2 ranks (one per GPU): see the top of this file")
    rank = world.rank
    from transformers import AutoModelForCausalLM, LlamaConfig

    # One directory both ranks read: rank 0 saves, the other waits (same node).
    shared = [tempfile.mkdtemp(prefix="tp-forward-") if rank == 0 else ""]
    dist.broadcast_object_list(shared, 0)
    model_dir = Path(shared[0]) / "model"
    shape = LLAMA3_8B if args.device == "cuda" else dict(vocab_size=512, hidden_size=64, intermediate_size=128,
                                                           num_attention_heads=4, num_key_value_heads=2)
    config = LlamaConfig(**{**shape, "num_hidden_layers": args.layers})
    if rank == 0:
        with torch.device(world.device):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.save_pretrained(model_dir)
        del model
        empty_cache()
    dist.barrier()
    ids = torch.randint(0, config.vocab_size, (args.rows, args.seq), generator=torch.Generator().manual_seed(0))
    ids = ids.to(world.device)
    profile_dir = Path(args.profile) if args.profile else None
    if profile_dir and rank == 0:
        profile_dir.mkdir(parents=True, exist_ok=True)

    results = {}
    # TP=1 on rank 0's GPU; rank 1 waits at the barrier.
    if rank == 0:
        model = load_causal_lm(str(model_dir), device=world.device, dtype=torch.bfloat16).eval()
        results["TP=1"] = timed_ms(forward_fn(model, ids), args.iters, group_barrier=False)
        if profile_dir:
            profile(forward_fn(model, ids), profile_dir / "tp1.txt", rank)
        del model
        empty_cache()
    dist.barrier()

    variants = {
        "TP=2, torch plan": lambda: parallel.load_model(f"random:{model_dir}", world, dtype=torch.bfloat16),
        "TP=2, HF plan": lambda: parallel.load_model(str(model_dir), world, dtype=torch.bfloat16),
    }
    for name, load in variants.items():
        model = load().eval()
        results[name] = timed_ms(forward_fn(model, ids), args.iters, group_barrier=True)
        if profile_dir:
            profile(forward_fn(model, ids), profile_dir / (name.split(", ")[1].replace(" ", "_") + ".txt"), rank)
        del model
        empty_cache()
        dist.barrier()

    if rank == 0:
        tokens = args.rows * args.seq
        base = results["TP=1"]
        rows = [f"| {name} | {ms:.1f} | {tokens / ms * 1e3:,.0f} | {base / ms:.2f} |" for name, ms in results.items()]
        emit([f"TP forward: Llama-3-8B-shaped, {args.layers} layers, bf16, {args.rows} x {args.seq} tokens, "
              f"{torch.cuda.get_device_name() if args.device == 'cuda' else 'CPU (smoke run, no figures)'}", "",
              "| variant | ms per forward (median) | tok/s | speed vs TP=1 |", "|---|---:|---:|---:|", *rows],
             args.out)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(shared[0], ignore_errors=True)  # the saved model: GBs
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    sys.exit(main())
