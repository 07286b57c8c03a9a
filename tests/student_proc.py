"""A student process for the multi-process tests: receives outputs, checks them locally.

It joins the teacher, submits batches of varied lengths with padding (several in
flight), runs the same model locally on each batch and records the largest
difference per output kind. The report (JSON) is what the test asserts on.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from student_trainer import AttentionInputs, FinalHidden, HiddenStates, Logits, TeacherClient, TopK  # noqa: E402


def attention_inputs_reference(model, hidden_states, layer: int):
    """A Llama layer's q, k, v after the rotary embedding, [B, S, width], computed the plain way
    from the layer's input (hidden_states[layer]): norm, projections, rotary embedding."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    block = model.model.layers[layer]
    attention = block.self_attn
    x = block.input_layernorm(hidden_states[layer])
    batch, seq, _ = x.shape
    heads = (batch, seq, -1, attention.head_dim)
    q = attention.q_proj(x).view(heads).transpose(1, 2)
    k = attention.k_proj(x).view(heads).transpose(1, 2)
    cos, sin = model.model.rotary_emb(x, torch.arange(seq, device=x.device).unsqueeze(0).expand(batch, -1))
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    return q.transpose(1, 2).reshape(batch, seq, -1), k.transpose(1, 2).reshape(batch, seq, -1), attention.v_proj(x)


def random_batch(generator: torch.Generator, vocab: int, max_len: int, shape: tuple[int, int] | None = None,
                 padding: bool = True):
    rows = int(torch.randint(1, 4, (1,), generator=generator))
    seq = int(torch.randint(4, max_len + 1, (1,), generator=generator))
    if shape is not None:  # a fixed shape: no padding added when batches are packed together
        rows, seq = shape
    ids = torch.randint(0, vocab, (rows, seq), generator=generator)
    mask = torch.ones(rows, seq, dtype=torch.int64)
    for row in range(rows if padding else 0):  # right padding of random length, at least one real token
        real = int(torch.randint(1, seq + 1, (1,), generator=generator))
        mask[row, real:] = 0
    return ids, mask


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--address", required=True)
    p.add_argument("--model-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--batches", type=int, default=8)
    p.add_argument("--inflight", type=int, default=3)
    p.add_argument("--max-len", type=int, default=40)
    p.add_argument("--topk", type=int, default=5)
    p.add_argument("--hidden-layers", default="0,2")
    p.add_argument("--no-logits", action="store_true")
    p.add_argument("--final-hidden", action="store_true",
                   help="also ask for the final hidden state (and the output head, once at join)")
    p.add_argument("--attention-layers", default="", help="also ask for these layers' attention inputs")
    p.add_argument("--pause-s", type=float, default=0.0, help="sleep between batches")
    p.add_argument("--job-id", default="test-job")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--job-rank", type=int, default=0)
    p.add_argument("--weight", type=float, default=1.0, help="the job's share weight, given at join")
    p.add_argument("--shape", default="", help="ROWSxSEQ: every batch of this shape (default: random shapes)")
    p.add_argument("--no-padding", action="store_true", help="every token real: masks of ones")
    p.add_argument("--join-file", default="", help="wait for this file before joining (start now, join later)")
    p.add_argument("--start-file", default="", help="after joining, wait for this file before submitting")
    p.add_argument("--saturate-until-file", default="",
                   help="after the checked batches, submit unchecked batches back to back until this file exists")
    p.add_argument("--wait-s", type=float, default=120.0, help="deadline of each wait for a file")
    p.add_argument("--stop-file", default="",
                   help="stop submitting once this file exists (with --batches 0: submit until then)")
    p.add_argument("--check-every", type=int, default=1,
                   help="compare every Nth batch with the local model (the others: order and shape only)")
    args = p.parse_args()
    shape = tuple(int(x) for x in args.shape.split("x")) if args.shape else None

    from transformers import AutoModelForCausalLM

    device = torch.device(args.device)
    layers = tuple(int(x) for x in args.hidden_layers.split(",") if x)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32).to(device).eval()
    generator = torch.Generator().manual_seed(args.seed)
    attention_layers = tuple(int(x) for x in args.attention_layers.split(",") if x)
    worst = {"logits": 0.0, "topk_values": 0.0, "topk_gather": 0.0, "hidden": 0.0}
    if args.final_hidden:
        worst.update(final_hidden=0.0, head_weight=0.0, head_logits=0.0)
    if attention_layers:
        worst.update(attention=0.0)
    received = []
    received_at = []  # time.time() of each result, for timelines across processes
    checked = 0
    tokens = 0
    saturated = 0

    def wait_for_file(path: str) -> None:
        deadline = time.monotonic() + args.wait_s
        while not Path(path).exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{path} did not appear within {args.wait_s}s")
            time.sleep(0.02)

    if args.join_file:
        print("LOADED", flush=True)
        wait_for_file(args.join_file)
    start = time.monotonic()
    outputs = [] if args.no_logits else [Logits()]
    outputs += [TopK(args.topk)] if args.topk else []
    outputs += [HiddenStates(layers)] if layers else []
    outputs += [FinalHidden()] if args.final_hidden else []
    outputs += [AttentionInputs(attention_layers)] if attention_layers else []
    with TeacherClient(args.address, device, outputs=outputs, dtype="float32", max_inflight=args.inflight,
                       job_id=args.job_id, job_rank=args.job_rank, weight=args.weight) as teacher:
        # The secret too, for tests that act on this session from outside (the client keeps it private).
        print(f"JOINED {teacher.session_id} {teacher._connection.session.joined.session_secret}", flush=True)
        if args.final_hidden:  # received once, right after the group formed
            head = teacher.joined.head
            worst["head_weight"] = (head.weight - model.get_output_embeddings().weight).abs().max().item()
        if args.start_file:
            wait_for_file(args.start_file)
        in_flight = []

        def check(fut, ids, mask):
            nonlocal checked
            out = fut.result(timeout=120)
            received_at.append(time.time())
            if len(received) % args.check_every:  # not sampled: its order and shape only
                got = next((t for t in (out.logits, out.topk_values, out.final_hidden) if t is not None), None)
                assert got is None or tuple(got.shape[:2]) == tuple(ids.shape), (got.shape, ids.shape)
                received.append(out.batch_id)
                return
            checked += 1
            with torch.no_grad():
                ref = model(input_ids=ids.to(device), attention_mask=mask.to(device), output_hidden_states=True)
            valid = mask.to(device).bool()
            if out.logits is not None:
                assert out.logits.shape == ref.logits.shape, (out.logits.shape, ref.logits.shape)
                worst["logits"] = max(worst["logits"], (out.logits - ref.logits)[valid].abs().max().item())
            if args.topk:
                ref_logprobs = torch.log_softmax(ref.logits.float(), dim=-1)  # what TopK sends
                ref_values = ref_logprobs.topk(args.topk, dim=-1).values
                worst["topk_values"] = max(worst["topk_values"],
                                           (out.topk_values - ref_values)[valid].abs().max().item())
                gathered = ref_logprobs.gather(-1, out.topk_indices.long())
                worst["topk_gather"] = max(worst["topk_gather"], (out.topk_values - gathered)[valid].abs().max().item())
            for layer in layers:
                diff = (out.hidden_states[layer] - ref.hidden_states[layer])[valid].abs().max().item()
                worst["hidden"] = max(worst["hidden"], diff)
            if args.final_hidden:
                # Llama's last hidden state is after the final norm: the output head's input.
                worst["final_hidden"] = max(worst["final_hidden"], (out.final_hidden - ref.hidden_states[-1])[valid]
                                            .abs().max().item())
                worst["head_logits"] = max(worst["head_logits"], (teacher.joined.head.logits(out.final_hidden)
                                                                  - ref.logits)[valid].abs().max().item())
            for layer in attention_layers:
                with torch.no_grad():
                    want = attention_inputs_reference(model, ref.hidden_states, layer)
                for got, expected in zip(out.attention_inputs[layer], want):
                    assert got.shape == expected.shape, (got.shape, expected.shape)
                    worst["attention"] = max(worst["attention"], (got - expected)[valid].abs().max().item())
            received.append(out.batch_id)

        while len(received) + len(in_flight) < args.batches or (args.stop_file and not args.batches):
            if args.stop_file and Path(args.stop_file).exists():
                break
            ids, mask = random_batch(generator, teacher.info.vocab_size, args.max_len, shape, not args.no_padding)
            tokens += ids.numel()
            in_flight.append((teacher.submit(ids, mask), ids, mask))
            if len(in_flight) >= args.inflight:
                check(*in_flight.pop(0))
            if args.pause_s:
                time.sleep(args.pause_s)
        for item in in_flight:
            check(*item)
        if args.saturate_until_file:
            # The teacher is the bottleneck: always max_inflight batches outstanding,
            # outputs received and dropped (no local check, which would slow this side).
            print("SATURATING", flush=True)
            deadline = time.monotonic() + args.wait_s
            futures = []
            while not Path(args.saturate_until_file).exists():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{args.saturate_until_file} did not appear within {args.wait_s}s")
                ids, mask = random_batch(generator, teacher.info.vocab_size, args.max_len, shape, not args.no_padding)
                futures.append(teacher.submit(ids, mask))
                if len(futures) >= args.inflight:
                    futures.pop(0).result(timeout=120)
                    saturated += 1
            for fut in futures:
                fut.result(timeout=120)
                saturated += 1
        backend = teacher.backend
        reconnects, session_id = teacher.reconnects, teacher.session_id
    report = {"reconnects": reconnects, "session_id": session_id, "received": received, "worst": worst, "seconds": time.monotonic() - start, "backend": backend,
              "tokens": tokens, "saturated_batches": saturated, "received_at": received_at, "checked": checked}
    Path(args.out).write_text(json.dumps(report))
    print(f"DONE {json.dumps(report)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
