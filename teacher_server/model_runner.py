"""Loads the teacher model and runs one forward over a packed batch.

The runner knows nothing of sessions or the network: it takes token ids and a mask
and returns the tensors the engine asked for.

Under tensor parallelism (teacher_server/parallel.py) the TP world stays inside the
runner: on rank 0, `forward` first broadcasts the ids and mask to the other ranks, then
all ranks run the same sharded forward and rank 0 gets the logits gathered; the other
ranks run `follow`, which does the same forwards and discards their outputs. The engine
sees a runner like any other.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass

import torch

from distill_common.models import load_causal_lm
from distill_common.session_group import nccl_version
from distill_common.vocab import tokenizer_fingerprint
from distill_common.wire import dtype_name, parse_output_dtype
from teacher_server import parallel
from teacher_server.cuda_graphs import ForwardGraphs
from teacher_server.parallel import TensorParallelError, World

log = logging.getLogger(__name__)

# Set while this process's runner calls the model without a mask: every row of the pack
# is one sequence from position 0 (the engine right-pads rows, never packs two sequences
# into one), so transformers' packed-sequence check need not run.
_ONE_SEQUENCE_PER_ROW = threading.local()


def _skip_packed_sequence_check() -> None:
    """Without a mask and a cache, transformers looks for several sequences packed into one
    row (`masking_utils.find_packed_sequence_indices`) and branches on the answer in
    Python: a device-to-host sync in every forward, which made the engine wait for the
    device to finish the previous forward before it could launch the next (5 ms per
    forward of a one-layer model on an H200, bench/transport_trace.py). Inside the runner's
    forward the answer is known, "none"; everywhere else transformers runs its check."""
    try:
        from transformers import masking_utils
    except ImportError:
        return
    check = getattr(masking_utils, "find_packed_sequence_indices", None)
    if check is None or getattr(check, "one_sequence_per_row", False):
        return

    def find_packed_sequence_indices(position_ids, *args, **kwargs):
        if getattr(_ONE_SEQUENCE_PER_ROW, "active", False):
            return None
        return check(position_ids, *args, **kwargs)

    find_packed_sequence_indices.one_sequence_per_row = True
    masking_utils.find_packed_sequence_indices = find_packed_sequence_indices

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


@dataclass
class ForwardOutputs:
    logits: torch.Tensor  # [N, S, V]
    hidden_states: tuple[torch.Tensor, ...] | None  # num_layers + 1 of [N, S, H], or None


def output_width(model) -> int:
    """The logits' width: the full vocabulary, also when the lm_head is sharded (a sharded
    Linear keeps its out_features; a DTensor weight has the global shape)."""
    head = model.get_output_embeddings()
    return int(getattr(head, "out_features", None) or head.weight.shape[0])


class ModelRunner:
    def __init__(self, model_name: str, device: str, dtype: str = "", trust_remote_code: bool = False,
                 world: World | None = None, cuda_graphs: int = 0):
        """`world`: this process's place in the TP world (None: one process, the plain path).
        `cuda_graphs`: capture the forward as CUDA graphs for up to this many pack shapes
        (teacher_server/cuda_graphs.py; 0: off)."""
        self.world = world
        _skip_packed_sequence_check()
        self.device = world.device if world is not None else torch.device(device)
        if cuda_graphs and world is not None:
            raise ValueError("--cuda-graphs is for a teacher on one GPU: a tensor-parallel forward's collectives "
                             "would have to be captured on every rank in step; leave it out under torchrun")
        if cuda_graphs and self.device.type != "cuda":
            raise ValueError(f"--cuda-graphs needs a CUDA device, not --device {device}")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.model = self._load(model_name, dtype, trust_remote_code)
        self.model.eval().requires_grad_(False)
        config = self.model.config
        text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        self.info = ModelInfo(
            model_name=model_name,
            architecture=(config.architectures or [type(self.model).__name__])[0],
            vocab_size=output_width(self.model),
            hidden_size=int(text_config.hidden_size),
            num_layers=int(text_config.num_hidden_layers),
            dtype=next(self.model.parameters()).dtype,
            device=self.device,
            tokenizer_fingerprint=self._fingerprint(model_name) if world is None or world.leader else "",
            tp_size=world.size if world is not None else 1,
            nccl_version=nccl_version() if self.device.type == "cuda" else "",
        )
        log.info("loaded %s (%s) on %s in %s: vocab %d, hidden %d, %d layers%s", model_name, self.info.architecture,
                 self.device, dtype_name(self.info.dtype), self.info.vocab_size, self.info.hidden_size,
                 self.info.num_layers, f", tensor parallel rank {world.rank} of {world.size}" if world else "")
        if world is not None and world.leader:
            world.start_keepalive()
        self.graphs = ForwardGraphs(self.model, self.device, cuda_graphs) if cuda_graphs else None

    def _load(self, model_name: str, dtype: str, trust_remote_code: bool):
        torch_dtype = parse_output_dtype(dtype) if dtype else None
        try:
            if self.world is not None:
                return parallel.load_model(model_name, self.world, dtype=torch_dtype,
                                           trust_remote_code=trust_remote_code)
            return load_causal_lm(model_name, device=self.device, dtype=torch_dtype,
                                  trust_remote_code=trust_remote_code)
        except ValueError as e:
            raise ValueError(f"--model: {e}") from e

    @property
    def healthy(self) -> bool:
        """False once the TP world broke: no forward can run again (always True for one process)."""
        return self.world is None or not self.world.error

    @staticmethod
    def _fingerprint(model_name: str) -> str:
        if not os.path.isdir(model_name):  # builtin:, random: and hub ids without a local copy
            return ""
        try:
            from transformers import AutoTokenizer

            return tokenizer_fingerprint(AutoTokenizer.from_pretrained(model_name))
        except Exception as e:  # a model directory without a tokenizer: no check possible
            log.warning("no tokenizer in %s (%s): students' vocabularies cannot be checked", model_name, e)
            return ""

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, hidden: bool) -> ForwardOutputs:
        if self.world is None:
            return self._forward(input_ids, attention_mask, hidden)
        self.world.broadcast_forward(input_ids, attention_mask, hidden)  # the followers start the same forward
        try:
            return self._forward(input_ids, attention_mask, hidden)
        except Exception as e:
            # One rank out of a forward leaves the others waiting in its collectives: the
            # world cannot be trusted again (an out-of-memory included).
            raise self.world.fail("rank 0's forward failed", e) from e

    def follow(self) -> None:
        """Ranks other than 0: run every forward rank 0 broadcasts, until it says stop."""
        assert self.world is not None and not self.world.leader
        for request in self.world.requests():
            try:
                self._forward(request.input_ids, request.attention_mask, request.hidden)
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

    @torch.inference_mode()
    def _forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, hidden: bool) -> ForwardOutputs:
        # Without padding, no mask: transformers then takes the causal-only path. Given a
        # mask on the device, it checks it for padding with a device-to-host sync, which
        # would stall this thread until the device finished everything queued before.
        mask = None if attention_mask.all() else attention_mask.to(self.device, non_blocking=True)
        _ONE_SEQUENCE_PER_ROW.active = mask is None
        try:
            if self.graphs is not None and mask is None and not hidden:
                logits = self.graphs.logits(input_ids)  # None: this one runs eagerly
                if logits is not None:
                    return ForwardOutputs(logits=logits, hidden_states=None)
            out = self.model(input_ids=input_ids.to(self.device, non_blocking=True), attention_mask=mask,
                             output_hidden_states=hidden, use_cache=False, return_dict=True)
        finally:
            _ONE_SEQUENCE_PER_ROW.active = False
        return ForwardOutputs(logits=out.logits, hidden_states=out.hidden_states if hidden else None)
