"""Loads the teacher's model for the model runner: its weights on one process or sharded over
the tensor-parallel world, in FP8 where asked (--quantize fp8) or published so, its
mixture-of-experts layers and attention sinks on the teacher's own kernels, and its tokenizer.

What the runner does with the model once loaded (the forward, the start-up probe of its head
and attention inputs) is teacher_server/model_runner.py's; what FP8 is (the layers, the
quantization, the self-check) is teacher_server/fp8.py's; the experts' forward and their load,
teacher_server/moe.py's; attention with sinks, teacher_server/sink_attention.py's.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import logging
import os
from dataclasses import dataclass

import torch

from distill_common.models import load_causal_lm
from distill_common.wire import parse_output_dtype
from teacher_server import fp8, fp8_calibration, fp8_experts, fp8_rows, moe, parallel, routing, sink_attention
from teacher_server.parallel import World

log = logging.getLogger(__name__)

# What a model directory's tokenizer is stored as (fast, slow, sentencepiece and tiktoken layouts).
_TOKENIZER_FILES = ("tokenizer*", "vocab*", "merges.txt", "*.model", "*.spm", "*.tiktoken")


@dataclass
class LoadedModel:
    model: torch.nn.Module
    quantization: fp8.Quantization  # what the decoder's linears run in
    expert_load: moe.ExpertLoad | None = None  # tokens per expert per MoE layer; None for a dense model
    kernels: str = ""  # the teacher's own kernels the model runs through ("" : transformers' as they are)


def load_model(model_name: str, device: torch.device, world: World | None, dtype: str, trust_remote_code: bool,
               quantize: fp8.Fp8Plan | None) -> LoadedModel:
    """The model on `device` (sharded over `world` when there is one), what its decoder's
    linears run in, and its experts' load. Raises ValueError naming the flag to change
    (fp8.FP8Unsupported for a device or checkpoint FP8 cannot run on)."""
    torch_dtype = parse_output_dtype(dtype) if dtype else None
    published = _published_fp8(model_name, device, world, trust_remote_code, quantize)
    try:
        if world is not None:
            model = parallel.load_model(model_name, world, dtype=torch_dtype, trust_remote_code=trust_remote_code,
                                        own_plan=quantize is not None, published_fp8=published)
        elif published:
            with fp8.loaded_as_stored():
                model = load_causal_lm(model_name, device=device, dtype=torch_dtype,
                                       trust_remote_code=trust_remote_code)
        else:
            model = load_causal_lm(model_name, device=device, dtype=torch_dtype, trust_remote_code=trust_remote_code)
    except ValueError as e:
        raise ValueError(f"--model: {e}") from e
    if published:
        try:
            adopted = fp8_experts.adopt_published(model)
        except ValueError as e:
            raise fp8.FP8Unsupported(f"--model {model_name}: {e}") from e
        if adopted:
            log.info("%d MoE expert weights served as the checkpoint stores them (e4m3, 128 x 128 block scales)",
                     adopted)
    # The teacher's own kernels first: the FP8 calibration's forwards run through them, and FP8
    # experts run only through them.
    expert_load, kernels = _own_kernels(model, device, world, compile_layers=not (published or quantize))
    quantization = fp8.Quantization()
    if published:
        fp8.adopt_published(model)
        quantization = fp8.Quantization(fp8.FP8_E4M3, "block", "checkpoint",
                                        fp8_flop_share=fp8_calibration.fp8_flop_share(model))
    elif quantize is not None:
        problem = fp8.fp8_device_problem(device, quantize.scaling)
        if problem:
            raise fp8.FP8Unsupported(f"--quantize fp8: {problem}. Serve the model in its dtype (leave --quantize "
                                     "out) or on such a GPU" + (" (--fp8-scaling row runs on CPU)"
                                                                if quantize.scaling == "block" else ""))
        quantization = _quantize_at_load(model, model_name, quantize, world)
    if quantization.format:
        dtype = next(p.dtype for p in model.parameters() if p.dtype != fp8.FP8)
        try:
            checked = fp8.verify(model, dtype) + fp8_experts.verify(model, dtype)
        except fp8.FP8Unsupported as e:
            if not published:
                raise
            raise fp8.FP8Unsupported(f"--model {model_name}: {e}. To serve this FP8 checkpoint, dequantize it "
                                     "(transformers' FineGrainedFP8Config(dequantize=True), save_pretrained) and "
                                     "serve that directory") from e
        log.info("FP8 self-check: %d layer shapes match the dequantize-then-multiply reference", checked)
    if fp8_rows.served(model):
        kernels = ", ".join(filter(None, (kernels, f"FP8 activation rows {fp8_rows.IMPLEMENTATION}")))
    if quantization.format:
        _compile_fp8(model, quantize.compile if quantize is not None else "auto", device, world)
    return LoadedModel(model, quantization, expert_load, kernels)


def _own_kernels(model, device: torch.device, world: World | None, compile_layers: bool):
    """The experts of MoE layers through one grouped GEMM per product and attention with sinks
    through FlexAttention; on one GPU, each decoder layer compiled so that what runs between the
    products (norms, rotary embedding, routing, the experts' gather, gate and combine, the sinks'
    rescaling) fuses (FP8 compiles the layers its own way)."""
    try:
        # Under tensor parallelism every rank routes every token: they take the router kernel together.
        expert_load = moe.install(model, group=None if world is None else torch.distributed.group.WORLD)
    except moe.MoeUnsupported as e:
        raise ValueError(f"--model: {e}") from e
    sinks = sink_attention.install(model)
    routed = routing.served(model)
    kernels = ", ".join(name for name, used in ((f"experts {moe.IMPLEMENTATION}", expert_load is not None),
                                                (f"routers {routing.IMPLEMENTATION}", routed),
                                                (f"attention {sink_attention.IMPLEMENTATION}", sinks)) if used)
    if kernels and compile_layers and device.type == "cuda" and world is None:
        for layer in fp8.decoder_layers(model):
            layer.compile(dynamic=True)
        kernels += ", decoder layers compiled"
    return expert_load, kernels


def _quantize_at_load(model, model_name: str, plan: fp8.Fp8Plan, world: World | None) -> fp8.Quantization:
    """Quantizes the decoder's linears as `plan` says; on one process, measured against the model
    in its dtype on the calibration batch first (and linears kept for --fp8-max-kl)."""
    layers = fp8.decoder_layers(model)
    calibrated = None
    if world is not None or not plan.calibration_rows:
        if plan.max_kl:
            raise ValueError("--fp8-max-kl needs the start-up calibration, which runs on one process with "
                             "--fp8-calibration-rows above 0: under tensor parallelism keep layers by hand "
                             "(--fp8-keep-layers) and measure them with bench/fp8_teacher.py")
        if world is not None and plan.calibration_rows:
            log.info("FP8 under tensor parallelism: the start-up calibration (KL to the model's dtype, bias "
                     "correction) runs on one process only; not measured")
        plan = dataclasses.replace(plan, bias_correction=False)
        fp8.quantize_model(model, plan)
        _quantize_experts(model, plan)
    else:
        tokenizer = load_tokenizer(model_name)
        texts = fp8_calibration.calibration_texts(plan.calibration)
        ids = fp8_calibration.calibration_batch(tokenizer, texts, plan.calibration_rows, plan.calibration_seq,
                                                model.get_input_embeddings().num_embeddings)
        calibrated = fp8_calibration.quantize_and_measure(model, plan, ids,
                                                          also=lambda m: _quantize_experts(m, plan))
        plan = calibrated.plan
    quantization = fp8.Quantization(
        fp8.FP8_E4M3, plan.scaling, "quantized at load", tuple(sorted({i % len(layers) for i in plan.keep_layers})),
        plan.fast_accum, plan.keep_linears, plan.bias_correction, fp8_calibration.fp8_flop_share(model))
    if calibrated is not None:
        cost = calibrated.cost
        quantization = dataclasses.replace(quantization, calibration_tokens=cost.tokens, kl_mean=cost.kl_mean,
                                           kl_p99=cost.kl_p99, top1_agreement=cost.top1_agreement, max_kl=plan.max_kl)
        log.info("FP8 cost measured in %.1f s on %d tokens of %s: %s; %.0f%% of the decoder's linear FLOPs in FP8",
                 calibrated.seconds, cost.tokens, plan.calibration or "the built-in sample (prose and Python)",
                 quantization.cost(), 100 * quantization.fp8_flop_share)
    return quantization


def _quantize_experts(model, plan: fp8.Fp8Plan) -> None:
    """A MoE model's expert weights in FP8 too (teacher_server/fp8_experts.py); not kept for
    --fp8-max-kl, and not counted in the FP8 share of the decoder's linear FLOPs."""
    experts = fp8_experts.quantize_experts(model, plan.scaling, plan.keep_layers, plan.fast_accum)
    if experts:
        log.info("%d MoE expert weights in FP8 (%s scales per expert%s)", experts, plan.scaling,
                 ", fast accumulation" if plan.fast_accum else "")


def _published_fp8(model_name: str, device: torch.device, world: World | None, trust_remote_code: bool,
                   quantize: fp8.Fp8Plan | None) -> bool:
    """Whether `model_name` is a published FP8 checkpoint (transformers' fine-grained FP8 in its
    config.json); refuses one this teacher cannot serve, before anything is loaded."""
    from distill_common.models import BUILTIN_PREFIX, RANDOM_PREFIX, model_config

    if model_name.startswith((BUILTIN_PREFIX, RANDOM_PREFIX)):
        return False
    try:
        config = model_config(model_name, trust_remote_code)
    except ValueError:
        return False  # the load that follows says why
    declared = fp8.checkpoint_quantization(config)
    if declared is None:
        return False
    if quantize is not None:
        raise ValueError(f"--quantize fp8: {model_name} is an FP8 checkpoint already (its config.json has a "
                         "quantization_config); leave --quantize out")
    block = declared.get("weight_block_size")
    if list(block or ()) != [fp8.BLOCK, fp8.BLOCK]:
        raise fp8.FP8Unsupported(f"--model {model_name}: FP8 weights with blocks {block}; the teacher serves "
                                 "128 x 128 blocks (transformers' FineGrainedFP8Config default)")
    problem = fp8.fp8_device_problem(device, "block")
    if problem:
        raise fp8.FP8Unsupported(
            f"--model {model_name} is an FP8 checkpoint (128 x 128 block scales) and {problem}. Serve it on a "
            "GPU of compute capability 9.0 (H100, H200), or dequantize it first: load it with transformers' "
            "FineGrainedFP8Config(dequantize=True), save_pretrained, and serve that directory")
    return True


def _compile_fp8(model, mode: str, device: torch.device, world: World | None) -> None:
    """Fuses each activation's quantization into the kernel that produces it (the layers
    compiled), or at least into one kernel (the quantization compiled) under tensor parallelism,
    whose collectives run between the linears. Eager quantization is slower than bf16."""
    if mode == "auto":  # on a CPU, FP8 is for tests: compiling costs more than it saves
        mode = "off" if device.type != "cuda" else "layers" if world is None else "quantize"
    if mode == "layers" and world is not None:
        raise ValueError("--fp8-compile layers: under tensor parallelism the layers' collectives run in hooks "
                         "that a compiled layer would not keep; use --fp8-compile quantize (or auto)")
    if mode == "layers":
        fp8.compile_layers(model)
    elif mode == "quantize":
        fp8.compile_quantization(model)


def load_tokenizer(model_name: str):
    """The model directory's tokenizer; None for builtin:, random: and hub ids without a local
    copy, or a directory without one (then no student's vocabulary can be checked)."""
    if not os.path.isdir(model_name):
        return None
    if not any(fnmatch.fnmatch(name, pattern) for name in os.listdir(model_name) for pattern in _TOKENIZER_FILES):
        # transformers (5.25) builds a tokenizer from config.json alone, with no vocabulary: every
        # text would encode to no tokens.
        log.warning("no tokenizer files in %s: students' vocabularies cannot be checked, and students with "
                    "another tokenizer cannot be served", model_name)
        return None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model_name)
    except Exception as e:  # a model directory without a tokenizer: no check possible
        log.warning("no tokenizer in %s (%s): students' vocabularies cannot be checked, and students with "
                    "another tokenizer cannot be served", model_name, e)
        return None
