"""The student side of the seed recipe on one GPU (docs/performance.md): a deepseek-coder-6.7b-shaped
student (its config, random weights built on the GPU), LoRA r16, bf16, gradient checkpointing,
loss 0.7 KD + 0.2 attention + 0.1 hidden, trained by the trainer's own step (`train_micro_batch`,
AdamW, clipping) on teacher outputs of a 6.7B teacher's shapes held in memory: full logits, or the
final hidden state with the teacher's head applied on the student. Peak GPU memory and tokens/s
per configuration.

    python -m bench.recipe_student [--shapes 4x4096,4x8192] [--modes full,head] [--out recipe.md]
    python -m bench.recipe_student --tiny      # a tiny shape on CPU: checks that it runs

`--inflight` teacher outputs (default 3: the trainer's --prefetch 2 plus the batch training) are
alive at once, as in a run: each step trains on the next of them. The bar: at most 40 GiB at
4 x 4096 (an A100-40G).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.table import emit

# deepseek-ai/deepseek-coder-6.7b-base's config.json (the fields that shape the model).
DEEPSEEK_CODER_6_7B = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu", vocab_size=32256, hidden_size=4096,
    intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
    max_position_embeddings=16384, rms_norm_eps=1e-6, rope_theta=100000.0,
    rope_scaling={"type": "linear", "factor": 4.0}, tie_word_embeddings=False, bos_token_id=32013, eos_token_id=32014)
TINY = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=512, hidden_size=64,
            intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
            max_position_embeddings=256)
MODES = {"full": "full logits", "head": "head on student"}


def recipe_config(model_spec: str, mode: str, batch: int, seq: int, layers: int, relation_heads: int):
    """The recipe's settings (docs/training.md), as the trainer reads them."""
    from student_trainer.config import TrainConfig

    return TrainConfig(model=model_spec, data="(in memory)", teacher="(in memory)", batch_size=batch, seq_len=seq,
                       lora_r=16, lora_alpha=32, bf16=True, grad_checkpointing=True, kd_weight=0.7, ce_weight=0.0,
                       head_on_student=mode == "head", attention_layers=(layers - 1,), attention_weight=0.2,
                       attention_relation_heads=relation_heads, attention_block_rows=128,
                       hidden_layers=(layers // 2, layers), hidden_weight=0.1)


def fake_teacher_outputs(cfg, config: dict, device: torch.device, seed: int):
    """One batch of a same-shaped teacher's outputs, in bf16 as it would send them, and its head."""
    from distill_common.outputs import OutputHead, TeacherOutput

    batch, seq, hidden, vocab = cfg.batch_size, cfg.seq_len, config["hidden_size"], config["vocab_size"]
    generator = torch.Generator(device).manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=generator, device=device)).to(torch.bfloat16)

    width = config["num_attention_heads"] * (hidden // config["num_attention_heads"])
    kv_width = config["num_key_value_heads"] * (hidden // config["num_attention_heads"])
    out = TeacherOutput(batch_id=seed,
                        hidden_states={layer: randn(batch, seq, hidden) for layer in cfg.hidden_layers},
                        attention_inputs={layer: (randn(batch, seq, width), randn(batch, seq, kv_width),
                                                  randn(batch, seq, kv_width)) for layer in cfg.attention_layers})
    if cfg.head_on_student:
        out.final_hidden = randn(batch, seq, hidden)
    else:
        out.logits = randn(batch, seq, vocab, scale=2.0)
    head = OutputHead(randn(vocab, hidden, scale=hidden ** -0.5)) if cfg.head_on_student else None
    return out, head


def teacher_bytes(cfg, config: dict) -> int:
    """What the teacher sends for one batch (bf16), as the wire layout says."""
    from distill_common.outputs import AttentionFacts, HeadFacts, OutputRequest, TeacherFacts, output_spec
    from student_trainer.train import teacher_outputs as kinds

    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    kv = config["num_key_value_heads"] * hidden // heads
    facts = TeacherFacts(vocab_size=config["vocab_size"], hidden_size=hidden,
                         num_layers=config["num_hidden_layers"], dtype=torch.bfloat16,
                         head=HeadFacts(unavailable=""), attention=AttentionFacts(hidden, kv, kv, unavailable=""))
    request = OutputRequest.resolve(output_spec(kinds(cfg)), facts)
    return sum(torch.Size(shape).numel() * torch.tensor([], dtype=dtype).element_size()
               for shape, dtype in request.layout(cfg.batch_size, cfg.seq_len))


def build_recipe_student(cfg, device: torch.device):
    """The student as the trainer builds it for the recipe: LoRA on a bf16 base, non-reentrant
    gradient checkpointing (the attention capture needs the layers' graphs), training mode."""
    from student_trainer.train import build_student

    model = build_student(cfg, device, None)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model.train()
    return model


class RecipeStep:
    """One optimizer step of the trainer on one micro-batch (`train_micro_batch`, clipping, AdamW, the
    schedule), with the maps (projections, layer maps, attention capture, the teacher's head) of one
    configuration: the trainer's loop without its data and its teacher, so that a bench feeds it
    teacher outputs from memory, a served teacher or a teacher in the same process."""

    def __init__(self, cfg, model, teacher_layers: int, teacher_hidden: int, head, device: torch.device,
                 total_steps: int):
        from student_trainer.train import build_maps, lr_lambda

        self.cfg, self.model, self.device = cfg, model, device
        self.maps, self.capture = build_maps(cfg, model, teacher_layers, teacher_hidden, head, device)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.params += list(self.maps.projections.parameters()) if self.maps.projections is not None else []
        self.optimizer = torch.optim.AdamW(self.params, lr=1e-4)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg, total_steps))
        self.autocast = torch.autocast(device.type, dtype=torch.bfloat16)

    def __call__(self, batch: dict, out) -> dict[str, float]:
        from student_trainer.train import train_micro_batch

        losses = train_micro_batch(self.cfg, self.model, batch, out, self.autocast, self.device, self.maps,
                                   self.capture)
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return losses


def timed_steps(step: RecipeStep, next_pair, steps: int, warmup: int, device: torch.device):
    """Runs `warmup + steps` steps on what `next_pair()` gives ((batch, teacher outputs), drawn inside
    the timed part: a wait for the teacher counts); the timed steps' seconds and the last losses."""
    times, losses = [], {}
    for _ in range(warmup + steps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        batch, out = next_pair()
        losses = step(batch, out)
        del out
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return times[warmup:], losses


def random_batch(vocab: int, batch: int, seq: int, seed: int = 0) -> dict:
    """A batch as the trainer's data gives it: random ids, no padding, every token a target."""
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))
    ones = torch.ones(batch, seq, dtype=torch.int64)
    return {"input_ids": ids, "attention_mask": ones, "loss_mask": ones}


def measure(model_spec: str, config: dict, mode: str, batch: int, seq: int, device: torch.device, *, steps: int,
            warmup: int, inflight: int, relation_heads: int) -> dict:
    cfg = recipe_config(model_spec, mode, batch, seq, config["num_hidden_layers"], relation_heads)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    built = time.perf_counter()
    model = build_recipe_student(cfg, device)
    outputs = [fake_teacher_outputs(cfg, config, device, seed) for seed in range(inflight)]
    step = RecipeStep(cfg, model, config["num_hidden_layers"], config["hidden_size"], outputs[0][1], device,
                      warmup + steps)
    batch_data = random_batch(config["vocab_size"], batch, seq)
    build_s = time.perf_counter() - built
    drawn = iter(range(warmup + steps))

    def next_pair():
        out, head = outputs[next(drawn) % inflight]
        step.maps.head = head
        return batch_data, out

    timed, last_losses = timed_steps(step, next_pair, steps, warmup, device)
    step_s = sum(timed) / len(timed)
    result = {"tokens": f"{batch} x {seq}", "mode": MODES[mode], "step_s": step_s, "tokens_per_s": batch * seq / step_s,
              "teacher_bytes_per_step": teacher_bytes(cfg, config), "build_s": build_s, "last_losses": last_losses}
    if cuda:
        result["peak_allocated_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        result["peak_reserved_gib"] = torch.cuda.max_memory_reserved(device) / 2**30
    del model, outputs, step
    gc.collect()
    return result


def render(results: list[dict]) -> str:
    rows = [["tokens / step", "teacher sends", "bytes / step", "peak allocated GiB", "peak reserved GiB",
             "tokens/s", "step s"]]
    for r in results:
        rows.append([r["tokens"], r["mode"], f"{r['teacher_bytes_per_step'] / 2**20:,.1f} MiB",
                     f"{r['peak_allocated_gib']:.1f}" if "peak_allocated_gib" in r else "n/a",
                     f"{r['peak_reserved_gib']:.1f}" if "peak_reserved_gib" in r else "n/a",
                     f"{r['tokens_per_s']:,.0f}", f"{r['step_s']:.3f}"])
    lines = ["| " + " | ".join(row) + " |" for row in rows]
    lines.insert(1, "|" + "---|" * len(rows[0]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.recipe_student", description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="4x4096,4x8192", help="BATCHxSEQ, comma-separated")
    parser.add_argument("--modes", default="full,head", help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per configuration")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--inflight", type=int, default=3, help="teacher outputs alive at once")
    parser.add_argument("--relation-heads", type=int, default=32, help="--attention-relation-heads")
    parser.add_argument("--tiny", action="store_true", help="a tiny model on CPU, shape 2x32: checks that it runs")
    parser.add_argument("--device", default="", help="default: cuda if available (cpu with --tiny)")
    parser.add_argument("--out", default="", help="also write the table (markdown) here, and the figures as JSON")
    args = parser.parse_args(argv)
    config = TINY if args.tiny else DEEPSEEK_CODER_6_7B
    shapes = [tuple(int(x) for x in shape.split("x")) for shape in ("2x32" if args.tiny else args.shapes).split(",")]
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() and not args.tiny else "cpu"))
    modes = [m for m in args.modes.split(",") if m]
    if set(modes) - MODES.keys():
        parser.error(f"--modes: use {', '.join(MODES)}")
    relation_heads = 4 if args.tiny else args.relation_heads
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        for batch, seq in shapes:
            for mode in modes:
                result = measure(f"random:{tmp}", config, mode, batch, seq, device, steps=args.steps,
                                 warmup=args.warmup, inflight=args.inflight, relation_heads=relation_heads)
                results.append(result)
                print(json.dumps(result), flush=True)
    table = render(results)
    print(f"\nstudent side of the recipe ({'tiny' if args.tiny else 'deepseek-coder-6.7b'}-shaped, LoRA r16, bf16, "
          f"grad ckpt, 0.7 KD + 0.2 attention + 0.1 hidden) on {device}, {args.inflight} teacher outputs in memory\n")
    emit(table.splitlines(), args.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
