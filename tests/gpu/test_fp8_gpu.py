"""The FP8 teacher on a GPU of compute capability 9.0: a published-format FP8 checkpoint (written by
transformers' FineGrainedFP8Config in the test) and --quantize fp8, against straightforward
references: the checkpoint's weights dequantized by hand, and the dequantize-then-matmul product.
The student runs on the CPU (gloo): one GPU is enough.
"""

from __future__ import annotations

import pytest
import torch

from student_trainer import (AttentionInputs, AuxHiddenStates, FinalHidden, HiddenStates, Logits, NextTokenLogprobs,
                             TeacherClient, TopK)
from teacher_server import fp8
from teacher_server.launcher import ServerProcess
from teacher_server.model_runner import ModelRunner
from tests.helpers import build_tiny_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
    reason="needs a GPU of compute capability 9.0 (block-wise FP8 scales)")]

VOCAB, HIDDEN = 384, 256  # 256 in-features: two 128-blocks, a count cuBLAS reads padded to four
# Each FP8 layer of a served model, on the activations a forward gives it, against its product
# computed the straightforward way (`FP8Linear.reference`: the activation quantized the same
# way, both operands dequantized, multiplied in float32): only the sums' order and the bf16
# rounding of the output differ. A scale read from the wrong place gives ~1. (Whole models are
# not compared this way: a layer's last-bit difference moves some of the next layer's
# activations across an e4m3 rounding boundary, 6% each; on this random model that compounds
# to 3.3% at the logits, on an H200, for either scaling.)
GEMM_RTOL = 1e-2
# FP8 against the model in bf16: the activations' quantization (e4m3 keeps 3 mantissa bits),
# compounded over the layers of a random tiny model; measured on an H200 at 4.6% (1 x 128
# activation blocks) and 6.9% (one scale per row). Whole models are held to it, each against
# another way of computing the same FP8 model too (eager against compiled, in process against
# served): the compounding above makes their distance of the same order. The tight check is
# GEMM_RTOL, layer by layer.
FP8_RTOL = 0.1


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float().cpu(), b.float().cpu()  # served outputs arrive on the student's device, the CPU
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("fp8gpu") / "bf16", vocab_size=VOCAB, hidden_size=HIDDEN,
                            dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def fp8_dir(bf16_dir, tmp_path_factory):
    """The bf16 model quantized by transformers' own FineGrainedFP8Config and saved: the format of
    the published FP8 checkpoints (e4m3 weights, a weight_scale_inv per 128 x 128 tile)."""
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    path = tmp_path_factory.mktemp("fp8gpu") / "fp8"
    model = AutoModelForCausalLM.from_pretrained(bf16_dir, dtype=torch.bfloat16, device_map="cuda:0",
                                                 quantization_config=FineGrainedFP8Config(weight_block_size=[128, 128]))
    model.save_pretrained(path)
    del model
    return path


def _dequantized_weights(fp8_dir) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors, its FP8 weights dequantized by hand (value x its tile's scale) in float32."""
    from safetensors.torch import load_file

    stored = {}
    for file in sorted(fp8_dir.glob("*.safetensors")):
        stored.update(load_file(file))
    assert any(v.dtype == torch.float8_e4m3fn for v in stored.values())  # it is an FP8 checkpoint
    dense = {}
    for name, value in stored.items():
        if name.endswith("_scale_inv"):
            continue
        if value.dtype == torch.float8_e4m3fn:
            scale = stored[name + "_scale_inv"].float()
            rows, cols = value.shape
            tiles = scale.repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]
            value = value.float() * tiles
        dense[name] = value
    return dense


def _dequantized(fp8_dir, bf16_dir) -> torch.nn.Module:
    """The bf16 model with the checkpoint's weights, dequantized by hand."""
    from transformers import AutoModelForCausalLM

    dense = {name: value.to(torch.bfloat16) for name, value in _dequantized_weights(fp8_dir).items()}
    model = AutoModelForCausalLM.from_pretrained(bf16_dir, dtype=torch.bfloat16).to("cuda:0").eval()
    missing, unexpected = model.load_state_dict(dense, strict=False)
    assert not unexpected and not [m for m in missing if "rotary" not in m], (missing, unexpected)
    return model


def _check_each_product(model: torch.nn.Module, ids: torch.Tensor) -> int:
    """Runs `model` on `ids`; each FP8 layer's output on its input there equals the straightforward
    product (fp8.reference_linear) within GEMM_RTOL. Returns how many layers were checked."""
    seen = []
    hooks = [m.register_forward_hook(lambda module, args, out: seen.append((module, args[0], out)))
             for m in model.modules() if isinstance(m, fp8.FP8Linear)]
    try:
        with torch.inference_mode():
            model(input_ids=ids.cuda())
    finally:
        for hook in hooks:
            hook.remove()
    assert seen, "no FP8 layer ran"
    for index, (module, x, out) in enumerate(seen):
        assert _rel(out, module.reference(x)) < GEMM_RTOL, (index, module)
    return len(seen)


def test_fp8_block_linear_on_the_gpu_equals_dequantize_then_matmul():
    torch.manual_seed(0)
    for k in (256, 768, 1024):  # 2, 6 and 8 K-blocks: padded and unpadded scale rows
        linear = torch.nn.Linear(k, 384, bias=False, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(37, k, device="cuda", dtype=torch.bfloat16).pow(3)
        for scaling in fp8.SCALINGS:
            layer = fp8.FP8Linear.from_linear(linear, scaling)
            got = layer(x)
            expected = layer.reference(x)  # dequantize, then multiply in float32
            assert _rel(got, expected) < 1e-2, (k, scaling)  # bf16 output, float32 sums in another order
        fast = fp8.FP8Linear.from_linear(linear, "row", fast_accum=True)  # partial sums not promoted to float32
        assert _rel(fast(x), fast.reference(x)) < 1e-2, k


def test_published_fp8_checkpoint_serves_the_dequantized_model(fp8_dir, bf16_dir):
    from distill_common.models import load_causal_lm

    # The checkpoint as the teacher adopts it: its weights exactly the checkpoint's dequantized by
    # hand, each product the straightforward one.
    adopted = load_causal_lm(str(fp8_dir), device=torch.device("cuda:0")).eval()
    assert fp8.adopt_published(adopted) > 0
    by_hand = _dequantized_weights(fp8_dir)
    for name, module in adopted.named_modules():
        if isinstance(module, fp8.FP8Linear):
            assert torch.equal(fp8.dequantize(*module.stored()).cpu(), by_hand[name + ".weight"]), name
    reference = _dequantized(fp8_dir, bf16_dir)
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    assert _check_each_product(adopted, ids) == 2 * 7  # two layers of q, k, v, o, gate, up, down
    with torch.inference_mode():
        ref = reference(input_ids=ids.cuda(), output_hidden_states=True)
        fp8_ref = adopted(input_ids=ids.cuda(), output_hidden_states=True)
    kinds = (Logits(), TopK(4), HiddenStates((0, 1, 2)), FinalHidden(), AttentionInputs((0,)),
             AuxHiddenStates((0, 1, 2)), NextTokenLogprobs())
    with ServerProcess("--model", str(fp8_dir), "--device", "cuda:0", "--max-batch-tokens", "256",
                       "--max-seq-len", "64") as server:
        assert "decoder linears in FP8: fp8_e4m3 linears (1x128 activation, 128x128 weight scales; checkpoint)" \
            in server.log, server.log
        with TeacherClient(server.address, "cpu", outputs=kinds) as client:
            assert client.info.quantization.source == "checkpoint"
            out = client.submit(ids).result(timeout=120)
            head = client.joined.head
    logits = fp8_ref.logits.float().cpu()
    print(f"published FP8, served logits against: the adopted model in process {_rel(out.logits, logits):.2e}, "
          f"the model dequantized {_rel(out.logits, ref.logits.float().cpu()):.2e}")
    assert _rel(out.logits, logits) < FP8_RTOL
    assert _rel(out.logits, ref.logits.float().cpu()) < FP8_RTOL
    assert (out.logits.argmax(-1) == logits.argmax(-1)).float().mean() > 0.8  # a layout error: ~1 / VOCAB
    assert (out.topk_indices[..., 0] == out.logits.argmax(-1)).all()
    for layer in (0, 1, 2):
        assert _rel(out.hidden_states[layer], fp8_ref.hidden_states[layer].cpu()) < FP8_RTOL, layer
        assert _rel(out.hidden_states[layer], ref.hidden_states[layer].cpu()) < FP8_RTOL, layer
    # The head crosses in the output dtype, dequantized where stored quantized, and gives the logits.
    assert head.weight.dtype == torch.bfloat16
    assert torch.equal(head.weight, reference.lm_head.weight.cpu())
    assert _rel(head.logits(out.final_hidden, torch.float32), out.logits) < 1e-2
    q, k, v = out.attention_inputs[0]
    assert q.shape[:2] == k.shape[:2] == v.shape[:2] == ids.shape and torch.isfinite(q).all()
    assert out.aux_hidden_states.shape == (2, 24, 3 * HIDDEN)
    want = logits.log_softmax(-1)[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    assert (out.next_token_logprobs[:, :-1] - want).abs().mean() < 0.05


def test_quantize_fp8_serves_within_fp8_of_bf16_and_replays_from_cuda_graphs(bf16_dir):
    plan = fp8.Fp8Plan("row")
    eager = ModelRunner(str(bf16_dir), "cuda:0", quantize=fp8.Fp8Plan("row", compile="off"))
    compiled = ModelRunner(str(bf16_dir), "cuda:0", quantize=plan)
    graphed = ModelRunner(str(bf16_dir), "cuda:0", quantize=plan, cuda_graphs=2)
    plain = ModelRunner(str(bf16_dir), "cuda:0")
    ids = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    exact = plain.forward(ids, mask).logits.float()
    base = eager.forward(ids, mask).logits.float()
    _check_each_product(eager.model, ids)
    assert 0 < _rel(base, exact) < FP8_RTOL
    fused = _rel(compiled.forward(ids, mask).logits, base)  # fused kernels round once less, or once more
    print(f"--quantize fp8 logits: eager against bf16 {_rel(base, exact):.2e}, compiled against eager {fused:.2e}")
    assert fused < FP8_RTOL
    first = graphed.forward(ids, mask).logits.float()  # the shape's first forward runs eagerly
    replays = [graphed.forward(ids, mask).logits.float() for _ in range(3)]  # captured, then replayed
    assert graphed.graphs.captured, graphed.graphs.status()
    assert all(torch.equal(replay, replays[0]) for replay in replays)
    print(f"--quantize fp8 with CUDA graphs: replay against the eager forward {_rel(replays[0], first):.2e} "
          f"(bit-equal: {torch.equal(replays[0], first)})")
    assert _rel(replays[0], first) < FP8_RTOL
    # Other ids of the captured shape: the graph reads its input, and computes what the model does.
    other = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(3))
    replayed, want = graphed.forward(other, mask).logits.float(), compiled.forward(other, mask).logits.float()
    assert graphed.graphs.shapes == 1 and _rel(replayed, want) < FP8_RTOL < _rel(replayed, replays[0])
    # Served, with fast accumulation (what differs from `base` besides it: the compiled layers).
    with ServerProcess("--model", str(bf16_dir), "--device", "cuda:0", "--quantize", "fp8", "--fp8-fast-accum",
                       "--max-batch-tokens", "256", "--max-seq-len", "64") as server:
        with TeacherClient(server.address, "cpu", outputs=(Logits(),), refuse_quantized=False) as client:
            assert client.info.quantization.format == "fp8_e4m3" and client.info.quantization.fast_accumulation
            served = client.submit(ids).result(timeout=120).logits.float()
    print(f"--quantize fp8 --fp8-fast-accum served against eager in process: {_rel(served, base):.2e}")
    assert _rel(served, base) < FP8_RTOL
