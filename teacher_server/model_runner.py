"""Runs the teacher model's forward over a packed batch (teacher_server/model_loading.py loads it).

The runner knows nothing of sessions or the network: it takes token ids and a mask
and returns the tensors the engine asked for (`ForwardNeeds`): logits, hidden states,
the attention inputs of some layers (distill_common/attention_inputs.py), the output
head's input. A forward that needs no logits runs the decoder alone, without the output
head: no [B, S, V] tensor exists on the teacher for sessions that apply the head themselves.

At start-up a probe forward of a few tokens finds what the model can give besides logits:
whether its logits are its output head (weight, bias, soft cap, scale: what a student
is sent to apply it) of the decoder's last hidden state, and the widths of its attention
inputs. What it cannot give is refused at join with the reason (TeacherInfo.head,
TeacherInfo.attention).

Under tensor parallelism (teacher_server/parallel.py) the TP world stays inside the
runner: on rank 0, `forward` first broadcasts the ids and mask to the other ranks, then
all ranks run the same sharded forward and rank 0 gets the logits gathered; the other
ranks run `follow`, which does the same forwards and discards their outputs. The engine
sees a runner like any other.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import logging
from dataclasses import dataclass, field

import torch

from distill_common.attention_inputs import AttentionCapture, AttentionCaptureError
from distill_common.outputs import AttentionFacts, ForwardNeeds, HeadFacts, JoinData, OutputHead
from distill_common.session_group import nccl_version
from distill_common.vocab import tokenizer_fingerprint
from distill_common.wire import dtype_name
from teacher_server import fp8, parallel
from teacher_server.cuda_graphs import ForwardGraphs
from teacher_server.model_loading import LoadedModel, load_model, load_tokenizer
from teacher_server.parallel import TensorParallelError, World
from teacher_server.transformers_overrides import ONE_SEQUENCE_PER_ROW

log = logging.getLogger(__name__)

# Values of each parameter the weights fingerprint reads: evenly spaced, the first included.
FINGERPRINT_SAMPLES = 4096


def weights_fingerprint(model: torch.nn.Module) -> str:
    """sha256 over each parameter's and buffer's name, shape and dtype and FINGERPRINT_SAMPLES of
    its values, evenly spaced (their bytes as stored: FP8 weights and their scales included).

    Cheap on a large model (a few KiB read per tensor), and equal on every replica loaded from
    the same checkpoint the same way; two checkpoints that differ only in values it does not
    read (a fine-tune touches every weight) would pass for one."""
    digest = hashlib.sha256()
    tensors = sorted([*model.named_parameters(), *model.named_buffers()], key=lambda item: item[0])
    for name, tensor in tensors:
        tensor = tensor.detach()
        if hasattr(tensor, "to_local"):  # a tensor-parallel shard (DTensor): this rank's part, as served
            tensor = tensor.to_local()
        flat = tensor.reshape(-1)
        sample = flat[::max(1, flat.numel() // FINGERPRINT_SAMPLES)][:FINGERPRINT_SAMPLES].contiguous()
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype};".encode())
        digest.update(sample.view(torch.uint8).cpu().numpy().tobytes())
    return digest.hexdigest()


@dataclass
class ModelInfo:
    model_name: str
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    dtype: torch.dtype
    device: torch.device
    tokenizer_fingerprint: str
    tp_size: int = 1  # ranks the model is sharded over (tensor parallelism)
    torch_version: str = torch.__version__
    nccl_version: str = ""
    head: HeadFacts = HeadFacts()  # what a student needs to apply the output head (probed at start-up)
    attention: AttentionFacts = AttentionFacts()  # the attention inputs' widths (probed at start-up)
    quantization: fp8.Quantization = fp8.Quantization()  # what the decoder's linears run in
    kernels: str = ""  # the teacher's own kernels it runs through (MoE experts, attention sinks); "": none
    weights_fingerprint: str = ""  # the weights as served (`weights_fingerprint`): the same on every replica of a pool


@dataclass
class Prefix:
    """One sequence run a chunk at a time (the HTTP API's long prompts, so that another job's
    batch waits for a chunk, not the whole prompt): the model's KV cache of the `length`
    positions run so far. A chunk is run only right after the one before it (`begin` ==
    `length`): after a failed chunk, the ones that follow fail too rather than run on a cache
    that lacks it. One process only (no tensor parallelism: the other ranks hold no cache)."""

    cache: object = None  # transformers' Cache, made by the first chunk's forward
    length: int = 0


@dataclass(frozen=True)
class Chunk:
    """A batch that is positions `begin` on of the sequence `prefix` holds the start of."""

    prefix: Prefix
    begin: int


@dataclass
class ForwardOutputs:
    logits: torch.Tensor | None  # [N, S, V]; None when not needed
    hidden_states: tuple[torch.Tensor, ...] | None  # num_layers + 1 of [N, S, H], or None
    attention: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    final_hidden: torch.Tensor | None = None  # [N, S, H]: the output head's input


# The probe's tolerance between the model's logits and its head applied outside it, relative
# to the largest logit: float32 agrees to rounding; bf16/fp16 differ by a rounding of the
# logits (2^-8 relative) and of the product's order.
_PROBE_RTOL = {torch.float32: 1e-4, torch.float64: 1e-6}
_PROBE_RTOL_HALF = 2e-2
_PROBE_TOKENS = 8


def output_width(model) -> int:
    """The logits' width: the full vocabulary, also when the lm_head is sharded (a sharded
    Linear keeps its out_features; a DTensor weight has the global shape)."""
    head = model.get_output_embeddings()
    return int(getattr(head, "out_features", None) or head.weight.shape[0])


class ModelRunner:
    def __init__(self, model_name: str, device: str, dtype: str = "", trust_remote_code: bool = False,
                 world: World | None = None, cuda_graphs: int = 0, model=None, outputs_for_autograd: bool = False,
                 quantize: fp8.Fp8Plan | None = None):
        """`world`: this process's place in the TP world (None: one process, the plain path).
        `cuda_graphs`: capture the forward as CUDA graphs for up to this many pack shapes
        (teacher_server/cuda_graphs.py; 0: off). `model`: one already built on `device` (the
        teacher in a trainer's process, student_trainer/local_teacher.py), used instead of
        loading `model_name`, which then only names it. `outputs_for_autograd`: forwards run under
        no_grad instead of inference mode, for outputs that a training loop's losses use (autograd
        refuses to save an inference tensor for backward, and the closed-form KD and attention losses
        save the teacher's side). `quantize`: the decoder's linears in FP8, quantized at load
        (--quantize fp8, teacher_server/fp8.py); a published FP8 checkpoint is served in FP8 without it."""
        self.world = world
        self._grad_free = torch.no_grad if outputs_for_autograd else torch.inference_mode
        ONE_SEQUENCE_PER_ROW.install()
        self.device = world.device if world is not None else torch.device(device)
        if cuda_graphs and world is not None:
            raise ValueError("--cuda-graphs is for a teacher on one GPU: a tensor-parallel forward's collectives "
                             "would have to be captured on every rank in step; leave it out under torchrun")
        if cuda_graphs and self.device.type != "cuda":
            raise ValueError(f"--cuda-graphs needs a CUDA device, not --device {device}")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        if model is not None and world is not None:
            raise ValueError("a model built by the caller runs on one process: leave `world` out")
        if model is not None:
            loaded = LoadedModel(model, fp8.Quantization())
        else:
            loaded = load_model(model_name, self.device, world, dtype, trust_remote_code, quantize)
        self.model, self.quantization = loaded.model, loaded.quantization
        # Tokens per expert per MoE layer (None: a dense model, or one built by the caller).
        self.expert_load = loaded.expert_load
        self.model.eval().requires_grad_(False)
        # The model directory's tokenizer (None without one): fingerprinted for students, and what
        # cross-tokenizer sessions' rows are re-tokenized with (rank 0 only).
        self.tokenizer = load_tokenizer(model_name) if world is None or world.leader else None
        config = self.model.config
        text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        self.info = ModelInfo(
            model_name=model_name,
            architecture=(config.architectures or [type(self.model).__name__])[0],
            vocab_size=output_width(self.model),
            hidden_size=int(text_config.hidden_size),
            num_layers=int(text_config.num_hidden_layers),
            dtype=next(p.dtype for p in self.model.parameters() if p.dtype != fp8.FP8),
            device=self.device,
            tokenizer_fingerprint=tokenizer_fingerprint(self.tokenizer) if self.tokenizer is not None else "",
            tp_size=world.size if world is not None else 1,
            nccl_version=nccl_version() if self.device.type == "cuda" else "",
            quantization=self.quantization,
            kernels=loaded.kernels,
            weights_fingerprint=weights_fingerprint(self.model),
        )
        log.info("loaded %s (%s) on %s in %s: vocab %d, hidden %d, %d layers%s", model_name, self.info.architecture,
                 self.device, dtype_name(self.info.dtype), self.info.vocab_size, self.info.hidden_size,
                 self.info.num_layers, f", tensor parallel rank {world.rank} of {world.size}" if world else "")
        if self.quantization.format:
            log.info("decoder linears in FP8: %s", self.quantization)
        if loaded.kernels:
            log.info("own kernels: %s", loaded.kernels)
        self.graphs = None
        self._captures: dict[frozenset[int], AttentionCapture] = {}
        # Every rank takes part (the head's gather and the probe forward are collective under TP).
        self.join_data = JoinData(head=self._output_head())
        self.info.head, self.info.attention = self._probe()
        if world is not None and not world.leader:
            self.join_data = JoinData()  # only rank 0 sends
        if self.expert_load is not None:
            self.expert_load.reset()  # the probe's tokens are not served
        if world is not None and world.leader:
            world.start_keepalive()
        self.graphs = ForwardGraphs(self.model, self.device, cuda_graphs) if cuda_graphs else None

    @property
    def healthy(self) -> bool:
        """False once the TP world broke: no forward can run again (always True for one process)."""
        return self.world is None or not self.world.error

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, needs: ForwardNeeds | None = None, *,
                hidden: bool = False, chunk: Chunk | None = None) -> ForwardOutputs:
        """The forward of a pack, producing what `needs` asks; without `needs`, the logits and
        (`hidden`) every hidden state. With `chunk`: one row without padding, the positions from
        `chunk.begin` on of a sequence whose earlier positions `chunk.prefix` holds (logits only)."""
        if needs is None:
            needs = ForwardNeeds(logits=True, hidden_layers=frozenset(range(self.info.num_layers + 1)) if hidden
                                 else frozenset())
        # The caller's thread (the engine's, the API's) may not have the model's GPU current, and a
        # Triton kernel of ours launches on the current one (a compiled layer sets it for its own).
        with torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext():
            if chunk is not None:
                return self._forward_chunk(input_ids, attention_mask, needs, chunk.prefix, chunk.begin)
            if self.world is None:
                return self._forward(input_ids, attention_mask, needs)
            # The followers start the same forward: with or without the hidden states and the
            # output head (its gather is a collective), the rest is rank 0's alone.
            self.world.broadcast_forward(input_ids, attention_mask, needs.hidden_states, logits=needs.logits)
            try:
                return self._forward(input_ids, attention_mask, needs)
            except Exception as e:
                # One rank out of a forward leaves the others waiting in its collectives: the
                # world cannot be trusted again (an out-of-memory included).
                raise self.world.fail("rank 0's forward failed", e) from e

    def follow(self) -> None:
        """Ranks other than 0: run every forward rank 0 broadcasts, until it says stop."""
        assert self.world is not None and not self.world.leader
        for request in self.world.requests():
            needs = ForwardNeeds(logits=request.logits,
                                 hidden_layers=frozenset((0,)) if request.hidden else frozenset())
            try:
                self._forward(request.input_ids, request.attention_mask, needs)
            except Exception as e:
                raise TensorParallelError(f"rank {self.world.rank}: forward of {tuple(request.input_ids.shape)} "
                                          f"failed: {e}") from e
            # The outputs are dropped here: rank 0 has the same, gathered, and sends them.

    def close(self) -> None:
        """Rank 0: tells the followers to stop. Every rank: leaves the TP world."""
        if self.world is None:
            return
        if self.world.leader:
            try:
                self.world.broadcast_stop()
            except TensorParallelError as e:
                log.warning("could not tell the other ranks to stop: %s", e)
        self.world.close()

    def _forward_chunk(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, needs: ForwardNeeds,
                       prefix: Prefix, begin: int) -> ForwardOutputs:
        if self.world is not None:
            raise ValueError("a sequence runs a chunk at a time on one process only: under tensor parallelism "
                             "the other ranks hold no KV cache")
        if needs != ForwardNeeds(logits=True):
            raise ValueError(f"a chunk of a sequence gives its logits only, not {needs}")
        if input_ids.shape[0] != 1 or not attention_mask.all():
            raise ValueError(f"a chunk of a sequence is one row without padding, not {tuple(input_ids.shape)}")
        if begin != prefix.length:
            raise ValueError(f"this chunk starts at position {begin}, but the positions run so far end at "
                             f"{prefix.length}: a chunk before it failed")
        # transformers 5.2x names the cache `cache` (`past_key_values` before, deprecated since).
        name = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
        with self._grad_free(), ONE_SEQUENCE_PER_ROW.active(True):
            out = self.model(input_ids=input_ids.to(self.device, non_blocking=True), use_cache=True, return_dict=True,
                             **{name: prefix.cache})
            if self.expert_load is not None:
                self.expert_load.accumulate()
        prefix.cache, prefix.length = out.get(name), begin + input_ids.shape[1]
        return ForwardOutputs(logits=out.logits, hidden_states=None)

    def _forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, needs: ForwardNeeds) -> ForwardOutputs:
        with self._grad_free():
            outputs = self._forward_grad_free(input_ids, attention_mask, needs)
            if self.expert_load is not None:
                self.expert_load.accumulate()
            return outputs

    def _forward_grad_free(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                           needs: ForwardNeeds) -> ForwardOutputs:
        # Without padding, no mask: transformers then takes the causal-only path. Given a
        # mask on the device, it checks it for padding with a device-to-host sync, which
        # would stall this thread until the device finished everything queued before.
        mask = None if attention_mask.all() else attention_mask.to(self.device, non_blocking=True)
        hidden = needs.hidden_states
        with ONE_SEQUENCE_PER_ROW.active(mask is None):
            if self.graphs is not None and mask is None and needs == ForwardNeeds(logits=True):
                logits = self.graphs.logits(input_ids)  # None: this one runs eagerly
                if logits is not None:
                    return ForwardOutputs(logits=logits, hidden_states=None)
            ids = input_ids.to(self.device, non_blocking=True)
            capture = self._capture(needs.attention_layers)
            head_input: list[torch.Tensor] = []
            with capture if capture is not None else contextlib.nullcontext():
                if needs.logits:
                    with self._head_input(head_input) if needs.final_hidden else contextlib.nullcontext():
                        out = self.model(input_ids=ids, attention_mask=mask, output_hidden_states=hidden,
                                         use_cache=False, return_dict=True)
                    logits, final_hidden = out.logits, (head_input[0] if head_input else None)
                else:  # the decoder alone: no output head, no logits
                    out = self.model.get_decoder()(input_ids=ids, attention_mask=mask, output_hidden_states=hidden,
                                                   use_cache=False, return_dict=True)
                    logits, final_hidden = None, out.last_hidden_state if needs.final_hidden else None
        return ForwardOutputs(logits=logits, hidden_states=out.hidden_states if hidden else None,
                              attention=capture.take() if capture is not None else {}, final_hidden=final_hidden)

    def _capture(self, layers: frozenset[int]) -> AttentionCapture | None:
        if not layers:
            return None
        if layers not in self._captures:
            self._captures[layers] = AttentionCapture(self.model, layers)
        return self._captures[layers]

    @contextlib.contextmanager
    def _head_input(self, into: list):
        """Records the output head's input while the model runs (its final hidden state)."""
        def record(module, args):
            (hidden,) = args[:1]
            into.append(hidden.full_tensor() if hasattr(hidden, "full_tensor") else hidden)

        handle = self.model.get_output_embeddings().register_forward_pre_hook(record)
        try:
            yield
        finally:
            handle.remove()

    # ---- what the model offers besides logits: found at start-up --------------------------

    def _output_head(self) -> OutputHead | None:
        """The output head, whole (gathered from the ranks' shards under tensor parallelism: a
        collective), with the soft cap and scale its config declares; None when there is none."""
        head = self.model.get_output_embeddings()
        weight = getattr(head, "weight", None)
        if weight is None:
            return None
        weight = fp8.dense_weight(head, self.info.dtype)  # sent in the output dtype, never as FP8
        bias = getattr(head, "bias", None)
        if self.world is not None:
            weight, bias = parallel.gather_rows(weight, self.info.vocab_size), (
                None if bias is None else parallel.gather_rows(bias, self.info.vocab_size))
            # Kept on the host: it is sent only at join, and the device holds the model.
            weight, bias = weight.cpu(), (None if bias is None else bias.cpu())
        config = self.model.config
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        scale = float(getattr(text, "logit_scale", None) or 1.0)  # Cohere multiplies the logits
        if getattr(text, "logits_scaling", None):  # Granite divides them
            scale /= float(text.logits_scaling)
        return OutputHead(weight.detach(), None if bias is None else bias.detach(),
                          final_logit_softcapping=float(getattr(text, "final_logit_softcapping", None) or 0.0),
                          logit_scale=scale)

    def _probe(self) -> tuple[HeadFacts, AttentionFacts]:
        """One forward of a few tokens: whether the logits are `_output_head()` of the decoder's
        last hidden state, and the attention inputs' widths. Every rank runs it (the forward is
        collective under tensor parallelism); rank 0's answer is the one served."""
        ids = (torch.arange(_PROBE_TOKENS) % self.info.vocab_size).unsqueeze(0)
        mask = torch.ones_like(ids)
        layers = frozenset(range(self.info.num_layers))
        attention = AttentionFacts(unavailable="")
        if self.world is not None:
            layers = frozenset()
            attention = AttentionFacts(unavailable=(
                f"the teacher runs tensor parallel over {self.world.size} ranks, and attention inputs are captured "
                "on one process (each rank holds only its heads): serve it on one GPU, or distil without "
                "--attention-layers"))
        try:
            self._capture(layers)
        except AttentionCaptureError as e:
            layers, attention = frozenset(), AttentionFacts(unavailable=str(e))
        try:
            full = self._forward(ids, mask, ForwardNeeds(logits=True, final_hidden=True, attention_layers=layers))
            decoder = self._forward(ids, mask, ForwardNeeds(final_hidden=True))
        except AttentionCaptureError as e:
            layers, attention = frozenset(), AttentionFacts(unavailable=str(e))
            self._captures.clear()
            full = self._forward(ids, mask, ForwardNeeds(logits=True, final_hidden=True))
            decoder = self._forward(ids, mask, ForwardNeeds(final_hidden=True))
        if layers:
            widths = {tuple(t.shape[-1] for t in qkv) for qkv in full.attention.values()}
            if len(widths) == 1:
                (query, key, value), = widths
                attention = AttentionFacts(query, key, value, unavailable="")
            else:
                attention = AttentionFacts(unavailable=f"its layers' attention inputs differ in width ({sorted(widths)}); "
                                                       "the wire format needs one width per part")
        self._captures.clear()  # made again on demand; the probe's need not stay
        return self._check_head(full, decoder), attention

    def _check_head(self, full: ForwardOutputs, decoder: ForwardOutputs) -> HeadFacts:
        head = self.join_data.head
        if head is None:
            return HeadFacts(unavailable=f"{self.info.architecture} has no output embedding with a weight")
        if full.final_hidden is None or full.final_hidden.shape[-1] != self.info.hidden_size:
            return HeadFacts(unavailable=f"the input of {self.info.architecture}'s output head is not a "
                                         f"[batch, seq, {self.info.hidden_size}] hidden state")
        if head.weight.shape != (self.info.vocab_size, self.info.hidden_size):
            return HeadFacts(unavailable=f"its output head's weight is {tuple(head.weight.shape)}, not "
                                         f"[vocab {self.info.vocab_size}, hidden {self.info.hidden_size}]")
        logits = full.logits.float()
        tolerance = _PROBE_RTOL.get(self.info.dtype, _PROBE_RTOL_HALF) * max(1.0, logits.abs().max().item())
        device_head = OutputHead(head.weight.to(self.device), None if head.bias is None else head.bias.to(self.device),
                                 head.final_logit_softcapping, head.logit_scale)
        with torch.inference_mode():
            applied = device_head.logits(full.final_hidden, torch.float32)
        off = (applied - logits).abs().max().item()
        if off > tolerance:
            return HeadFacts(unavailable=(
                f"{self.info.architecture}'s logits are not its output head (weight, bias, final_logit_softcapping "
                f"{head.final_logit_softcapping:g}, logit scale {head.logit_scale:g}) applied to its final hidden "
                f"state: they differ by up to {off:.3g} on a probe; the model does something after its head that "
                "this project does not reproduce"))
        # The decoder alone must give the head's input: it is what a session without logits is sent.
        apart = (decoder.final_hidden.float() - full.final_hidden.float()).abs().max().item()
        if apart > tolerance:
            return HeadFacts(unavailable=(
                f"{self.info.architecture}'s decoder output is not its output head's input (they differ by up to "
                f"{apart:.3g}): the model transforms the hidden state between them"))
        return head.facts
