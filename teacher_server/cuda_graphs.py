"""CUDA graphs of the teacher's forward (`--cuda-graphs N`), for teachers whose forward
costs the host more than the device.

A forward through transformers is some fifty kernel launches from Python: 1.8 ms of
host time per forward of the one-layer builtin:wide on an H200 whatever the pack size,
3.2 ms once three other threads share the interpreter lock (bench/forward_launch.py).
Against hundreds of ms of device work in a large teacher that is nothing; with a small
one, or a wide vocabulary on a thin body, the engine cannot launch forwards as fast as
the link carries their outputs. With graphs, the model's decoder (everything up to the
last hidden state) is captured once per pack shape and then replayed: one launch.

Only the decoder is a graph. The model's own forward still runs in Python around it and
applies its output head (and whatever the model does after it: a soft cap, a scale)
into a fresh tensor, so the logits are never a graph's static buffer that the next
replay would overwrite while they are still being sent. All graphs share one memory
pool: replays run one at a time on one stream, and each replay's output is read by the
head right after it, before any other replay.

What runs eagerly instead: the first forward of each shape (it loads the kernels and
picks the algorithms the capture then records), shapes past the cap N, packs with padding
(transformers checks a padding mask on the host) and forwards that return hidden states
(with --cache-bytes, every forward while any live session asks for hidden states). A
capture that fails (a model that syncs with the host in its forward, or passes its decoder
tensors other than the ids) stops further captures, with a warning and the reason on
/v1/status; shapes captured before keep replaying. One GPU only: a tensor-parallel
forward's collectives would have to be captured on every rank in step. One caller at a
time: the engine thread (graphs share their static inputs and their pool).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_leaves

from teacher_server.transformers_overrides import CAPTURE_UNSEEN

log = logging.getLogger(__name__)


@dataclass
class _Graph:
    input_ids: torch.Tensor  # the static input on the device, written before each replay
    graph: torch.cuda.CUDAGraph | None = None
    output: object = None  # what the decoder returned at capture: its tensors are the graph's outputs


class _CaptureFailed(RuntimeError):
    """The decoder could not be captured: graphs stop here, the forward runs eagerly."""


# Arguments a graph may take as they are: anything else (a tensor other than the static ids,
# a cache object) would be read at its capture-time address on every replay.
_PLAIN = (type(None), bool, int, float, str)
_SEEN_LIMIT = 4096  # shapes remembered as seen once, before the memory starts over


class ForwardGraphs:
    """Runs the model's forward with its decoder replayed from a CUDA graph per input shape."""

    def __init__(self, model, device: torch.device, max_shapes: int):
        self.model = model
        self.device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        self.max_shapes = max_shapes
        self.off = ""  # why no further shape is captured, once that is so
        self._graphs: dict[tuple[int, ...], _Graph] = {}
        self._seen: set[tuple[int, ...]] = set()
        self._active = threading.local()  # the graph the decoder stands in for, during a forward
        self._pool = torch.cuda.graph_pool_handle()
        self._stream = torch.cuda.Stream(device)  # captures run here, off the engine's stream
        try:
            decoder = model.get_decoder()
        except Exception as e:  # remote code may not implement it
            decoder, why = None, f"get_decoder() failed: {e}"
        else:
            why = "get_decoder() returns the model itself"
        if decoder is None or decoder is model:
            self._turn_off(f"the model has no decoder of its own to capture ({why})")
            return
        self._decoder_forward = decoder.forward
        decoder.forward = self._stand_in  # an instance attribute: Module.__call__ finds it first
        CAPTURE_UNSEEN.install()

    @property
    def captured(self) -> tuple[tuple[int, ...], ...]:
        """The pack shapes replayed from a graph."""
        return tuple(self._graphs)

    @property
    def shapes(self) -> int:
        return len(self._graphs)

    def status(self) -> dict:
        return {"max_shapes": self.max_shapes, "shapes": self.shapes, "off": self.off}

    def logits(self, input_ids: torch.Tensor) -> torch.Tensor | None:
        """The logits of `input_ids` (pinned host memory, no padding) with the decoder
        replayed; None when this forward should run eagerly."""
        shape = tuple(input_ids.shape)
        entry = self._graphs.get(shape)
        capturing = entry is None
        if capturing:
            if self.off or len(self._graphs) >= self.max_shapes:
                return None
            if shape not in self._seen:  # a shape's first forward runs eagerly and warms it up
                if len(self._seen) >= _SEEN_LIMIT:
                    self._seen.clear()
                self._seen.add(shape)
                return None
            entry = _Graph(torch.empty(shape, dtype=input_ids.dtype, device=self.device))
        entry.input_ids.copy_(input_ids, non_blocking=True)
        self._active.entry, self._active.failed = entry, None
        try:
            # The arguments of ModelRunner's own forward, no other: a compiled decoder layer
            # (--quantize fp8) would compile again for another set of keyword arguments.
            out = self.model(input_ids=entry.input_ids, attention_mask=None, output_hidden_states=False,
                             use_cache=False, return_dict=True)
        except Exception:
            failed = self._active.failed
            if failed is None:  # not the capture (out of memory in the head, say): the engine reports it
                raise
            log.debug("the capture's error, whole", exc_info=failed)
            self._turn_off(f"capturing a forward of {shape[0]} x {shape[1]} failed: {_reason(failed)}")
            return None
        finally:
            self._active.entry = None
        if capturing:
            if entry.graph is None:  # the model's forward never called its decoder
                self._turn_off("the model's forward does not call the module get_decoder() returns")
                return None
            self._graphs[shape] = entry
            log.info("captured the decoder's CUDA graph for %d x %d tokens (%d of at most %d shapes)", shape[0],
                     shape[1], len(self._graphs), self.max_shapes)
        return out.logits

    def _turn_off(self, why: str) -> None:
        self.off = why
        kept = f"; the {len(self._graphs)} shapes captured before keep replaying" if self._graphs else ""
        log.warning("CUDA graphs: no further shape is captured, they run eagerly%s. %s. This model cannot be "
                    "captured as it is: run without --cuda-graphs to silence this", kept, why)

    def _stand_in(self, *args, **kwargs):
        """The decoder's forward: the plain one outside `logits`, a capture or a replay inside."""
        entry = getattr(self._active, "entry", None)
        if entry is None:
            return self._decoder_forward(*args, **kwargs)
        if entry.graph is None:
            try:
                self._capture(entry, args, kwargs)
            except _CaptureFailed as e:  # noted here too: the model's code might wrap the exception
                self._active.failed = e
                raise
        entry.graph.replay()
        return entry.output

    def _capture(self, entry: _Graph, args: tuple, kwargs: dict) -> None:
        """Captures the decoder called with `args`/`kwargs` into `entry`; _CaptureFailed if it cannot be."""
        # A graph reads its inputs at the addresses it was captured with: any tensor the
        # model made for its decoder in this call (position ids, say), or an object holding
        # some, would be stale later.
        for leaf in tree_leaves((args, kwargs)):
            if isinstance(leaf, torch.Tensor) and leaf is not entry.input_ids:
                raise _CaptureFailed(f"the model passes its decoder a tensor besides the input ids "
                                     f"({tuple(leaf.shape)} {leaf.dtype})")
            if not isinstance(leaf, (torch.Tensor, *_PLAIN)):
                raise _CaptureFailed(f"the model passes its decoder a {type(leaf).__name__}")
        current = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(current)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(self._stream):
            try:
                self._decoder_forward(*args, **kwargs)  # lazy initialisations happen here, not in the capture
            except Exception as e:
                raise _CaptureFailed(f"the decoder's warm-up forward failed: {e}") from e
            # thread_local: the announcer and sender threads keep using CUDA meanwhile. No
            # device-wide sync either (torch.cuda.graph makes one): a send to a dead student
            # would never let it finish.
            try:
                graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
                with CAPTURE_UNSEEN.active():  # no causal mask built for the capture alone
                    output = self._decoder_forward(*args, **kwargs)
            except Exception as e:
                self._abandon(graph)
                raise _CaptureFailed(str(e)) from e
            try:
                graph.capture_end()
            except Exception as e:
                self._abandon(graph)
                raise _CaptureFailed(str(e)) from e
        current.wait_stream(self._stream)
        entry.graph, entry.output = graph, output

    def _abandon(self, graph: torch.cuda.CUDAGraph) -> None:
        """Ends a capture that failed, leaving the allocator as it was.

        capture_end checks the capture's status before it tells the caching allocator that
        the capture is over, so after an invalidated capture the allocator would think one
        still runs, for good: memory freed on another stream (every NCCL send's) would never
        be reused, and it would not free its cache before giving up with out of memory.
        """
        try:
            graph.capture_end()
        except Exception:  # the capture is already invalid; the caller reports why
            pass
        try:
            torch._C._cuda_endAllocateToPool(self.device.index, self._pool)
        except Exception as e:  # ended already (capture_end got that far), or a torch without it
            log.debug("ending the allocator's capture after a failed one: %s", e)
        # capture_end raises before it tells the device's random generator that the capture is
        # over, so every later random op on the device would fail ("Offset increment outside
        # graph capture encountered unexpectedly"): the generator gets a fresh copy of its state
        # (same seed and offset), not marked as capturing.
        try:
            generator = torch.cuda.default_generators[self.device.index]
            generator.graphsafe_set_state(generator.clone_state())
        except Exception as e:  # a torch without graph-safe generator states
            log.warning("the device's random generator may be left unusable by the failed capture: %s", e)


def _reason(failed: BaseException) -> str:
    """What made a capture fail, in a line: the first line of its message (CUDA's go on with generic
    debugging advice), and that of the innermost exception it was raised from where that says more
    (a compiler's error says which compiler raised on its first line, and what it raised on the next)."""
    def first_line(error: BaseException) -> str:
        return next((line.strip() for line in str(error).splitlines() if line.strip()), "")

    inner = failed
    while inner.__cause__ is not None:
        inner = inner.__cause__
    outer = first_line(failed) or type(failed).__name__
    said = first_line(inner)
    if inner is failed or said in outer:
        return outer
    return f"{outer} ({type(inner).__name__}: {said})" if said else f"{outer} ({type(inner).__name__})"
