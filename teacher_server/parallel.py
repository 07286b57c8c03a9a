"""Tensor parallelism of the teacher: the TP world, the plan, and rank 0's forward broadcast.

Under `torchrun --nproc-per-node N [--nnodes M] -m teacher_server`, the default process
group is the TP world: NCCL over cuda:LOCAL_RANK (`--device cuda`), or gloo on CPU. Rank 0
runs the whole server (gRPC, HTTP, the sessions' rendezvous, the engine); every other rank is a
*follower*: it loads its shard of the model and runs each forward rank 0 announces, until
rank 0 says stop. At world size 1 none of this exists (`init_world` returns None) and the
server is the plain one-process program.

What rank 0 broadcasts, and what it does not. Rank 0 could broadcast every engine event
(join, batch, leave) so that all ranks also build the same session communicators. Only the forwards are broadcast: the logits come out of the forward
gathered (the lm_head's all-gather) and rank 0 alone sends them to the students, so the
followers take no part in any session group and need to hear of no join or leave. That
choice (gathered outputs from rank 0 vs. every rank sending its vocabulary shard) is
measured by bench/investigations/tp_send_choice.py; docs/performance.md has the figures.

Control messages (a 4-number header, then the token ids and mask) travel on a gloo group
of their own, also on GPUs: a follower waits for the next message on the CPU with a real
timeout (an NCCL receive would be a kernel spinning on its GPU, bounded only by the
watchdog, which tears the process down), and the header has to reach the CPU anyway to
size the buffers. The ids are small: 4 x 4096 tokens of ids and mask as int32 are 128 KiB.

Liveness. A follower waits at most `timeout_s` (--tp-timeout-s) for a message, and rank 0
sends a keep-alive when it has sent nothing for min(10 s, timeout_s / 4), so a follower
notices a dead rank 0 (and exits non-zero) at once when its connection closes, and within
`timeout_s` when it hangs. Rank 0 notices a dead follower at its next message
(gloo's connection closes) or in the forward's collectives (their timeout); the world is
then *broken*: forwards fail at once, the server's health turns 503 and, through
`World.on_broken`, the server shuts down and exits non-zero. A broken TP world cannot be
mended in place; the orchestrator restarts the deployment.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import math
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from torch.distributed.tensor.parallel import ParallelStyle

log = logging.getLogger(__name__)

CONTROL_RANK = 0  # the rank that serves and that every control message comes from

OP_FORWARD, OP_STOP, OP_KEEPALIVE = 1, 2, 3


class TensorParallelError(RuntimeError):
    """The TP world is broken (a rank died, hung or failed a forward); nothing can run on it again."""


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


# ---- the plan ------------------------------------------------------------------------

def allowed_sizes(num_heads: int, num_kv_heads: int) -> list[int]:
    """TP sizes that split both the attention heads and the key/value heads evenly."""
    g = math.gcd(num_heads, num_kv_heads)
    return [n for n in range(1, g + 1) if g % n == 0]


def check_heads(config, size: int) -> None:
    """Refuses a TP size that does not divide the model's attention and key/value heads."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_attention_heads", None)
    if heads is None:
        raise ValueError(f"{type(config).__name__} has no num_attention_heads: this server cannot plan tensor "
                         "parallelism for it; run one process (--nproc-per-node 1)")
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    if heads % size or kv_heads % size:
        sizes = allowed_sizes(heads, kv_heads)
        raise ValueError(f"tensor parallelism over {size} ranks needs the attention heads ({heads}) and key/value "
                         f"heads ({kv_heads}) divisible by {size}: run {' or '.join(map(str, sizes))} ranks in all "
                         "(torchrun --nproc-per-node times --nnodes)")


def check_experts(config, size: int) -> None:
    """Refuses an expert-parallel size that does not divide the model's experts (before it is loaded)."""
    total = _declares_experts(config)
    if total and total % size:
        sizes = [n for n in allowed_sizes(*_heads(config)) if total % n == 0]
        raise ValueError(f"expert parallelism over {size} ranks needs the experts ({total}) divisible by {size}: run "
                         f"{' or '.join(map(str, sizes))} ranks in all (torchrun --nproc-per-node times --nnodes)")


def _heads(config) -> tuple[int, int]:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    return heads, getattr(text, "num_key_value_heads", None) or heads


# The teacher's own plan. Megatron's split, as in gpt-fast: q/k/v and gate/up column-wise (each
# rank computes its heads and its slice of the MLP, no communication), o and down row-wise (one
# all-reduce each per layer), the lm_head column-wise with its output all-gathered so that every
# rank ends with the full logits. Embeddings and norms stay whole on every rank. Multi-head latent
# attention (DeepSeek-V3) splits the same way by heads: q_b_proj and kv_b_proj column-wise, the
# latent projections before them whole (they are small and every head reads them).
#
# Mixture-of-experts layers are expert parallel over the same ranks (ExpertShard): each rank
# holds E / N whole experts. Every rank holds the whole batch already (the attention's all-reduce
# leaves the hidden states replicated) and computes the same routing (the router stays whole), so
# the dispatch is a local selection: each rank runs the (token, expert) pairs of its own experts,
# and one all-reduce of [tokens, hidden] sums the ranks' partial outputs, as the dense MLP's
# row-wise product does. No all-to-all: with the batch replicated, an all-to-all dispatch would
# move k x tokens x hidden each way (k = 8 for Qwen3) where the all-reduce moves 2 x tokens x hidden,
# and gloo has no all_to_all_single. (transformers 5.25's AllReduceEP, which its AutoEP picks for
# inference when the expert group is the TP group, is the same scheme; this one runs the experts
# through teacher_server/moe.py's grouped products and counts their load.) A shared expert
# (DeepSeek-V3) is a dense MLP: split like one.
#
# The styles below are torch ParallelStyles that parallelize_module applies, but they keep
# plain tensors (each rank's shard) and put the collectives in forward hooks, as
# transformers' own plan does. torch's stock ColwiseParallel/RowwiseParallel make every
# weight a DTensor, and the host cost of DTensor's dispatch (about 0.7 ms per sharded op)
# made the TP=2 forward of an 8B-shaped model three times *slower* than one GPU
# (bench/tp_forward.py: 213 ms against 71 ms for 8 layers, 2 x 4096 tokens; the
# transformers plan on plain tensors: 50 ms).
_COLWISE = ("q_proj", "k_proj", "v_proj", "q_b_proj", "kv_b_proj", "gate_proj", "up_proj")
_ROWWISE = ("o_proj", "down_proj")
_WHOLE = ("q_a_proj", "kv_a_proj_with_mqa")  # MLA's latent projections
# Per-head parameters of an attention module (gpt-oss's sinks): each rank keeps its heads'.
_PER_HEAD = ("sinks",)


# The tile of a published FP8 checkpoint's block scales (transformers' FineGrainedFP8Config).
BLOCK = 128


def block_scales(module) -> torch.Tensor | None:
    """A linear's 128 x 128 tile scales where its weight is stored in e4m3 so (a published FP8
    checkpoint as transformers loads it), else None."""
    scale = getattr(module, "weight_scale_inv", None)
    if scale is None or module.weight.dtype != torch.float8_e4m3fn or scale.dim() != 2:
        return None
    return scale


class _Shard(ParallelStyle):
    """Keeps this rank's slice of a Linear as plain tensors; subclasses add the collective."""

    def _apply(self, module, device_mesh):
        if not isinstance(module, torch.nn.Linear):
            raise ValueError(f"tensor-parallel plan: {type(module).__name__} is not a Linear")
        self.group, self.rank, self.size = device_mesh.get_group(), device_mesh.get_local_rank(), device_mesh.size()
        self.shard(module)
        return module

    def slice(self, tensor: torch.Tensor, dim: int, pad: bool = False) -> torch.Tensor:
        """This rank's part of `tensor` along `dim` (zero-padded to equal parts when `pad`)."""
        length = tensor.shape[dim]
        if length % self.size and not pad:
            raise ValueError(f"tensor parallelism over {self.size} ranks: a dimension of {length} does not split "
                             f"evenly; run {' or '.join(str(n) for n in range(1, self.size) if length % n == 0)} "
                             "ranks, or load a saved model that transformers can shard itself")
        part = -(-length // self.size)
        piece = tensor.narrow(dim, self.rank * part, max(0, min(part, length - self.rank * part)))
        if piece.shape[dim] < part:
            shape = list(piece.shape)
            shape[dim] = part - piece.shape[dim]
            piece = torch.cat([piece, piece.new_zeros(shape)], dim)
        return piece.clone()  # the whole tensor goes with the old Parameter (unless tied elsewhere)

    @staticmethod
    def replace(module, name: str, tensor: torch.Tensor | None) -> None:
        if tensor is None:
            setattr(module, name, None)
        else:
            setattr(module, name, torch.nn.Parameter(tensor, requires_grad=False))

    def slice_block_scales(self, module, dim: int) -> None:
        """A published FP8 linear's (transformers' FP8Linear: an e4m3 weight and `weight_scale_inv`,
        one scale per 128 x 128 tile) tile scales, sliced as its weight is along `dim` (0: output
        rows, 1: input columns): this rank's tiles, which need its part to hold whole tiles. Call it
        before the weight is sliced. A linear without tile scales is left alone."""
        scale = block_scales(module)
        if scale is None:
            return
        length = module.weight.shape[dim]
        if scale.shape[dim] != -(-length // BLOCK):
            raise ValueError(f"tensor parallelism: an FP8 checkpoint's linear of {tuple(module.weight.shape)} has "
                             f"weight scales of {tuple(scale.shape)}, not one per {BLOCK} x {BLOCK} tile; serve it "
                             "on one process")
        if length % self.size or (length // self.size) % BLOCK:
            sizes = [n for n in range(1, self.size) if length % n == 0 and (length // n) % BLOCK == 0]
            raise ValueError(f"tensor parallelism over {self.size} ranks: an FP8 checkpoint's linear of "
                             f"{tuple(module.weight.shape)} with {BLOCK} x {BLOCK} weight blocks splits its "
                             f"{length} {'rows' if dim == 0 else 'columns'} into parts of whole blocks only; run "
                             f"{' or '.join(map(str, sizes)) or 'one'} rank(s), or serve a dequantized copy")
        blocks = length // self.size // BLOCK
        self.replace(module, "weight_scale_inv", scale.detach().narrow(dim, self.rank * blocks, blocks).clone())


class ColwiseShard(_Shard):
    """Output features split across ranks; with `gather`, the outputs are all-gathered
    (the full, unpadded width on every rank), else each rank keeps its slice."""

    def __init__(self, gather: bool = False):
        self.gather = gather

    def shard(self, module) -> None:
        self.features = module.out_features
        if self.gather and block_scales(module) is not None:
            raise ValueError("tensor parallelism: the output head of this FP8 checkpoint is stored in FP8, which the "
                             "teacher's plan does not split; serve it on one process")
        self.slice_block_scales(module, 0)
        self.replace(module, "weight", self.slice(module.weight, 0, pad=self.gather))
        self.replace(module, "bias", None if module.bias is None else self.slice(module.bias, 0, pad=self.gather))
        if self.gather:
            module.register_forward_hook(self._all_gather)

    def _all_gather(self, module, args, output: torch.Tensor) -> torch.Tensor:
        # One buffer [ranks, ..., part], then one copy into [..., ranks * part]: the logits
        # are the largest tensor of the forward, so no list of parts and no torch.cat.
        output = output.contiguous()
        gathered = output.new_empty((self.size * output.shape[0], *output.shape[1:]))  # gloo wants dim 0 stacked
        dist.all_gather_into_tensor(gathered, output, group=self.group)
        joined = gathered.view(self.size, *output.shape).movedim(0, -2).reshape(*output.shape[:-1], self.size * output.shape[-1])
        return joined if joined.shape[-1] == self.features else joined[..., :self.features]


class RowwiseShard(_Shard):
    """Input features split across ranks (the input arrives split, from a column-wise layer);
    the partial outputs are summed by an all-reduce. Only rank 0 keeps the bias, so the sum
    adds it once."""

    def shard(self, module) -> None:
        self.slice_block_scales(module, 1)
        self.replace(module, "weight", self.slice(module.weight, 1))
        if self.rank != 0:
            module.bias = None
        module.register_forward_hook(self._all_reduce)

    def _all_reduce(self, module, args, output: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(output, group=self.group)
        return output


class ExpertShard(ParallelStyle):
    """An experts module (transformers' 3-D expert weights) expert parallel: rank r keeps experts
    r x E / N .. (r + 1) x E / N - 1 whole, teacher_server/moe.py's forward runs the pairs routed
    to them (zeros for the others), and an all-reduce sums the ranks' outputs."""

    def _apply(self, module, device_mesh):
        from teacher_server.moe import ExpertRange

        self.group, rank, size = device_mesh.get_group(), device_mesh.get_local_rank(), device_mesh.size()
        module.register_forward_hook(self._all_reduce)
        loaded = getattr(module, "expert_range", None)
        if loaded is not None:  # read a rank at a time from the checkpoint (teacher_server/expert_loading.py)
            if (loaded.first, loaded.count) != (rank * loaded.total // size, loaded.total // size):
                raise ValueError(f"expert parallelism: {type(module).__name__} holds experts {loaded.first} to "
                                 f"{loaded.first + loaded.count - 1} of {loaded.total}, not rank {rank}'s of {size}")
            return module
        total = int(module.num_experts)
        if total % size:
            sizes = [n for n in range(1, size) if total % n == 0]
            raise ValueError(f"expert parallelism over {size} ranks: {type(module).__name__} has {total} experts, "
                             f"not divisible by {size}; run {' or '.join(map(str, sizes))} ranks")
        count = total // size
        for name, tensor in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            if tensor.dim() == 0 or tensor.shape[0] != total:
                raise ValueError(f"expert parallelism: {type(module).__name__}.{name} {tuple(tensor.shape)} is not "
                                 f"per expert (first dimension {total}); run one process (--nproc-per-node 1)")
            piece = tensor.narrow(0, rank * count, count).clone()
            if name in module._parameters:
                _Shard.replace(module, name, piece)
            else:
                module._buffers[name] = piece
        module.num_experts = count
        module.expert_range = ExpertRange(rank * count, count, total)
        return module

    def _all_reduce(self, module, args, output: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(output, group=self.group)
        return output


def layer_plan(layer) -> dict[str, ParallelStyle]:
    """The styles of one decoder layer's modules, by their dotted names; ValueError for a layer the
    plan does not know how to split (a linear of an unknown name, no attention output projection)."""
    from teacher_server.moe import experts_modules

    experts = {id(m) for m in experts_modules(layer)}
    plan: dict[str, ParallelStyle] = {}
    unknown = []
    for name, module in layer.named_modules():
        last = name.rpartition(".")[2]
        if id(module) in experts:
            plan[name] = ExpertShard()
        elif isinstance(module, torch.nn.Linear):
            if last in _COLWISE:
                plan[name] = ColwiseShard()
            elif last in _ROWWISE:
                plan[name] = RowwiseShard()
            elif last not in _WHOLE and not _is_router(name, module):
                unknown.append(name)
    if unknown or "self_attn.o_proj" not in plan:
        raise ValueError(f"no tensor-parallel plan for this decoder layer ({type(layer).__name__}): "
                         + (f"it has linears the plan does not know ({', '.join(unknown)}); " if unknown else
                            "it has no self_attn.o_proj; ")
                         + f"the plan splits {', '.join(_COLWISE)} column-wise, {', '.join(_ROWWISE)} row-wise and "
                         "experts by expert. Load it from a saved directory (transformers' own plan) or run one "
                         "process (--nproc-per-node 1)")
    return plan


def _is_router(name: str, module) -> bool:
    """An MoE router that is a Linear (hidden -> experts): kept whole, so every rank routes alike."""
    return name.endswith("mlp.gate") or name.endswith("block_sparse_moe.gate")


def _shard_per_head(layer, rank: int, size: int) -> None:
    for module in layer.modules():
        for name in _PER_HEAD:
            tensor = module._parameters.get(name)
            if tensor is None:
                continue
            if tensor.shape[0] % size:
                raise ValueError(f"tensor parallelism over {size} ranks: {name} of {tuple(tensor.shape)} per head "
                                 "does not split evenly")
            part = tensor.shape[0] // size
            _Shard.replace(module, name, tensor.detach().narrow(0, rank * part, part).clone())


def is_moe(model) -> bool:
    from teacher_server.moe import experts_modules

    return bool(experts_modules(model))


def apply_plan(model, mesh, *, gather_logits: bool = True) -> None:
    """Shards a decoder-only model over `mesh` through torch's parallelize_module: attention and
    dense MLPs tensor parallel, experts expert parallel.

    gather_logits=False leaves each rank its vocabulary shard of the logits (the
    alternative bench/investigations/tp_send_choice.py measures; the server always gathers)."""
    from torch.distributed.tensor.parallel import parallelize_module

    base = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = getattr(base, "layers", None)
    if layers is None:
        raise ValueError(f"no tensor-parallel plan for {type(model).__name__}: it has no decoder.layers. Load it "
                         "from a saved directory (transformers' own plan) or run one process (--nproc-per-node 1)")
    plans = [layer_plan(layer) for layer in layers]  # every layer checked before any is changed
    for layer, plan in zip(layers, plans):
        parallelize_module(layer, mesh, plan)
        _shard_per_head(layer, mesh.get_local_rank(), mesh.size())
    parallelize_module(model, mesh, {"lm_head": ColwiseShard(gather=gather_logits)})


def gather_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """The whole of a tensor split by rows across the TP world (an output head's weight or bias),
    on every rank: a DTensor's full tensor, or the ranks' equal, zero-padded shards joined and
    cut to `rows` (ColwiseShard). Collective: every rank calls it."""
    if hasattr(tensor, "full_tensor"):  # transformers' own plan keeps DTensors of the global shape
        return tensor.full_tensor()
    if tensor.shape[0] == rows:  # not sharded (a replicated head)
        return tensor
    shard = tensor.contiguous()
    gathered = shard.new_empty((dist.get_world_size() * shard.shape[0], *shard.shape[1:]))
    dist.all_gather_into_tensor(gathered, shard)
    return gathered[:rows]


def _has(module, dotted: str) -> bool:
    for part in dotted.split("."):
        module = getattr(module, part, None)
        if module is None:
            return False
    return True


def load_model(spec: str, world: "World", *, dtype: torch.dtype | None, trust_remote_code: bool = False,
               own_plan: bool = False, published_fp8: bool = False):
    """The model named by `spec`, sharded over the TP world; every rank calls it (it is collective).

    Saved models whose architecture declares a plan load through transformers' own
    (`distributed_config=DistributedConfig(tp_plan="auto")`: each rank reads only its
    shard); models built from a config, or without a declared plan, or with `own_plan` (the
    FP8 quantization at load replaces plain-tensor Linears, not transformers' DTensors), are
    built whole on each rank and sharded with `apply_plan`, except a saved MoE model's experts:
    each rank reads only its own where the checkpoint stores them one tensor per expert
    (teacher_server/expert_loading.py). `published_fp8`: a published FP8 checkpoint (128 x 128
    block scales), loaded as stored (fp8.loaded_as_stored) and sharded by the teacher's plan, each
    linear's tile scales with its weight (whole tiles a rank) and each expert's with the expert.
    """
    from distill_common.models import BUILTIN_PREFIX, RANDOM_PREFIX, load_causal_lm, model_config

    config = model_config(spec, trust_remote_code)
    check_heads(config, world.size)
    check_experts(config, world.size)
    built_from_config = spec.startswith((BUILTIN_PREFIX, RANDOM_PREFIX))
    # MoE models take the teacher's own plan: transformers' expert parallelism runs its own experts
    # forward (and differs between its versions), not teacher_server/moe.py's.
    own_plan = own_plan or published_fp8 or bool(_declares_experts(config))
    # transformers places the shards on the machine's accelerator (cuda:LOCAL_RANK), whatever --device says.
    accelerator = torch.accelerator.current_accelerator() if hasattr(torch, "accelerator") else None
    on_its_device = world.device.type == (accelerator.type if accelerator is not None else "cpu")
    if not built_from_config and on_its_device and not own_plan and getattr(config, "base_model_tp_plan", None):
        from transformers import AutoModelForCausalLM
        from transformers.distributed import DistributedConfig

        log.info("tensor parallel over %d ranks with transformers' plan of %s", world.size, type(config).__name__)
        return AutoModelForCausalLM.from_pretrained(spec, dtype=dtype or "auto", trust_remote_code=trust_remote_code,
                                                    distributed_config=DistributedConfig(tp_plan="auto"))
    from torch.distributed.device_mesh import init_device_mesh

    model = None
    if not built_from_config and _declares_experts(config):
        model = _load_local_experts(spec, config, world, dtype=dtype, trust_remote_code=trust_remote_code,
                                    published_fp8=published_fp8)
    if model is None:
        from teacher_server import fp8

        with fp8.loaded_as_stored() if published_fp8 else contextlib.nullcontext():
            model = load_causal_lm(spec, device=world.device, dtype=dtype, trust_remote_code=trust_remote_code)
    moe = is_moe(model)
    log.info("tensor parallel over %d ranks with torch's parallelize_module (q/k/v/gate/up colwise, o/down rowwise, "
             "lm_head colwise gathered; plain-tensor shards%s)", world.size,
             "; experts expert parallel, one all-reduce per MoE layer" if moe else "")
    apply_plan(model, init_device_mesh(world.device.type, (world.size,)))
    return model


def _load_local_experts(spec: str, config, world: "World", *, dtype: torch.dtype | None, trust_remote_code: bool,
                        published_fp8: bool = False):
    """A saved MoE model whose ranks each read only their experts (teacher_server/expert_loading.py),
    or None (said why) where its checkpoint's layout asks for the whole model on every rank."""
    from transformers.utils import logging as transformers_logging

    from distill_common.models import load_causal_lm
    from teacher_server import expert_loading, fp8

    total = _declares_experts(config)
    expert_plan, why = expert_loading.plan(spec, config, world.rank, world.size, total, trust_remote_code)
    if expert_plan is None:
        log.warning("expert parallelism: each rank builds the whole model before keeping its %d of %d experts per "
                    "layer, as %s; a model larger than one device cannot load so", total // world.size, total, why)
        return None
    verbosity = transformers_logging.get_verbosity()
    transformers_logging.set_verbosity_error()  # its report of the expert keys left to read here, as unexpected
    loading_info: dict = {}
    try:
        with expert_loading.local_experts(expert_plan) as key_mapping, \
                (fp8.loaded_as_stored() if published_fp8 else contextlib.nullcontext()):
            model = load_causal_lm(spec, device=world.device, dtype=dtype, trust_remote_code=trust_remote_code,
                                   key_mapping=key_mapping, loading_info=loading_info)
    finally:
        transformers_logging.set_verbosity(verbosity)
    unplanned = expert_loading.loaded_as_planned(expert_plan, loading_info)
    if unplanned:
        log.warning("expert parallelism: each rank builds the whole model before keeping its experts: loaded with "
                    "the experts left to read a rank at a time, transformers left %s", unplanned)
        return None
    expert_loading.read_experts(model, expert_plan)
    log.info("expert parallelism: rank %d read its experts %d to %d of %d per layer from the checkpoint "
             "(%.2f GiB), nothing of the others", world.rank, expert_plan.first,
             expert_plan.first + expert_plan.count - 1, total, expert_plan.nbytes(model) / 2**30)
    return model


def _declares_experts(config) -> int:
    """The routed experts per MoE layer a config declares (0: a dense model)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return next((int(n) for name in ("num_experts", "num_local_experts", "n_routed_experts")
                 if (n := getattr(text, name, None))), 0)


# ---- the world and its control channel ------------------------------------------------

@dataclass
class ForwardRequest:
    input_ids: torch.Tensor  # [rows, seq] int64, CPU
    attention_mask: torch.Tensor  # [rows, seq] int64, CPU
    hidden: bool
    logits: bool = True  # False: the decoder alone (the output head and its gather are skipped)


# The header's flags: what the forward returns, where it changes the collectives every rank runs.
_HIDDEN, _NO_LOGITS = 1, 2


@dataclass
class World:
    """This process's place in the TP world, and the gloo channel rank 0 commands the others on."""

    rank: int
    size: int
    device: torch.device
    timeout_s: float
    control: object = field(repr=False)  # the gloo ProcessGroup of control messages
    # Rank 0: called once (from whichever thread found out) when the world breaks.
    on_broken: Callable[[], None] | None = field(default=None, repr=False)
    error: str = ""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _last_sent_s: float = field(default_factory=time.monotonic, repr=False)
    _closed: threading.Event = field(default_factory=threading.Event, repr=False)

    @property
    def leader(self) -> bool:
        return self.rank == CONTROL_RANK

    @property
    def keepalive_s(self) -> float:
        return min(10.0, self.timeout_s / 4)

    # -- rank 0 --------------------------------------------------------------------

    def start_keepalive(self) -> None:
        threading.Thread(target=self._keepalive, name="tp-keepalive", daemon=True).start()

    def broadcast_forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, hidden: bool,
                          logits: bool = True) -> None:
        rows, seq = input_ids.shape
        payload = torch.stack([input_ids, attention_mask]).to(torch.int32)
        self._send(OP_FORWARD, rows, seq, (_HIDDEN if hidden else 0) | (0 if logits else _NO_LOGITS), payload=payload)

    def broadcast_stop(self) -> None:
        """Tells the followers to exit; the last message rank 0 sends."""
        if not self.error and not self._closed.is_set():
            self._send(OP_STOP)
        self._closed.set()

    def fail(self, what: str, cause: BaseException | str) -> TensorParallelError:
        """Marks the world broken (once) and returns the error to raise."""
        first = not self.error
        if first:
            self.error = f"{what}: {cause}"
            log.error("tensor-parallel world broken, the teacher cannot serve: %s. Restart the deployment "
                      "(all ranks); a rank's own log says why it failed", self.error)
        if first and self.on_broken is not None:
            self.on_broken()
        return TensorParallelError(f"the tensor-parallel world is broken ({self.error}); the teacher is stopping")

    def _send(self, op: int, rows: int = 0, seq: int = 0, flags: int = 0, payload: torch.Tensor | None = None):
        if self.error:
            raise TensorParallelError(f"the tensor-parallel world is broken ({self.error}); the teacher is stopping")
        header = torch.tensor([op, rows, seq, flags], dtype=torch.int64)
        with self._lock:
            try:
                dist.broadcast(header, CONTROL_RANK, group=self.control)
                if payload is not None:
                    dist.broadcast(payload, CONTROL_RANK, group=self.control)
            except Exception as e:  # a follower died (connection closed) or stopped reading (timeout)
                raise self.fail("a follower rank did not take a control message", e) from e
            finally:
                self._last_sent_s = time.monotonic()

    def _keepalive(self) -> None:
        while not self._closed.wait(self.keepalive_s / 2):
            if self.error:
                return
            if time.monotonic() - self._last_sent_s < self.keepalive_s or self._lock.locked():
                continue
            try:
                self._send(OP_KEEPALIVE)
            except TensorParallelError:
                return

    # -- followers -----------------------------------------------------------------

    def requests(self) -> Iterator[ForwardRequest]:
        """The forwards rank 0 asks for, in order, until it says stop.

        Raises TensorParallelError when rank 0 is gone (nothing, not even a keep-alive,
        within timeout_s)."""
        header = torch.zeros(4, dtype=torch.int64)
        while True:
            try:
                dist.broadcast(header, CONTROL_RANK, group=self.control)
                op, rows, seq, flags = header.tolist()
                if op == OP_KEEPALIVE:
                    continue
                if op == OP_STOP:
                    return
                if op != OP_FORWARD:
                    raise TensorParallelError(f"unknown control message {op} from rank 0 (a version mismatch?)")
                payload = torch.empty(2, rows, seq, dtype=torch.int32)
                dist.broadcast(payload, CONTROL_RANK, group=self.control)
            except TensorParallelError:
                raise
            except Exception as e:
                raise TensorParallelError(f"rank {self.rank}: no message from rank 0 within {self.timeout_s:.0f}s "
                                          f"(--tp-timeout-s) or its connection closed: {e}") from e
            ids, mask = payload.long()
            yield ForwardRequest(ids, mask, hidden=bool(flags & _HIDDEN), logits=not flags & _NO_LOGITS)

    def close(self) -> None:
        self._closed.set()
        if not self.error and dist.is_initialized():
            dist.destroy_process_group()


def init_world(device: str, timeout_s: float) -> World | None:
    """Joins the TP world torchrun set up (None at world size 1: the plain, one-process server).

    `--device cuda` means cuda:LOCAL_RANK on each rank; `--device cpu` runs the world on gloo.
    """
    size = world_size_from_env()
    if size == 1:
        return None
    if device not in ("cpu", "cuda"):
        raise ValueError(f"--device {device}: with tensor parallelism give --device cuda (each rank takes "
                         "cuda:LOCAL_RANK; choose the GPUs with CUDA_VISIBLE_DEVICES) or --device cpu")
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    timeout = datetime.timedelta(seconds=timeout_s)
    if device == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise ValueError(f"rank {rank} has LOCAL_RANK {local_rank} but this node shows "
                             f"{torch.cuda.device_count()} GPUs: --nproc-per-node must not exceed the GPUs per node")
        dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)
        dist.init_process_group("nccl", timeout=timeout, device_id=dev)
    else:
        dev = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timeout)
    control = dist.new_group(backend="gloo", timeout=timeout)
    world = World(rank=rank, size=size, device=dev, timeout_s=timeout_s, control=control)
    log.info("tensor-parallel rank %d of %d on %s (%s)", rank, size, dev, "nccl" if dev.type == "cuda" else "gloo")
    return world
