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
picks the algorithms the capture then records), shapes past the cap N, packs with
padding (transformers checks a padding mask on the host) and forwards that return hidden
states. A capture that fails (a model that syncs with the host in its forward, or passes
its decoder tensors other than the ids) turns graphs off for the process, with a warning.
One GPU only: a tensor-parallel forward's collectives would have to be captured on every
rank in step.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)


@dataclass
class _Graph:
    input_ids: torch.Tensor  # the static input on the device, written before each replay
    graph: torch.cuda.CUDAGraph | None = None
    output: object = None  # what the decoder returned at capture: its tensors are the graph's outputs


class ForwardGraphs:
    """Runs the model's forward with its decoder replayed from a CUDA graph per input shape."""

    def __init__(self, model, device: torch.device, max_shapes: int):
        self.model = model
        self.device = device
        self.max_shapes = max_shapes
        self.off = ""  # why graphs are off for this model, once they are
        self._graphs: dict[tuple[int, ...], _Graph] = {}
        self._seen: set[tuple[int, ...]] = set()
        self._active = threading.local()  # the graph the decoder stands in for, during a forward
        self._pool = torch.cuda.graph_pool_handle()
        self._stream = torch.cuda.Stream(device)  # captures run here, off the engine's stream
        decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
        if decoder is None or decoder is model:
            self.off = "the model has no decoder of its own (get_decoder())"
            return
        self._decoder_forward = decoder.forward
        decoder.forward = self._stand_in  # an instance attribute: Module.__call__ finds it first

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
                self._seen.add(shape)
                return None
            entry = _Graph(torch.empty(shape, dtype=input_ids.dtype, device=self.device))
        entry.input_ids.copy_(input_ids, non_blocking=True)
        self._active.entry = entry
        try:
            out = self.model(input_ids=entry.input_ids, attention_mask=None, use_cache=False, return_dict=True)
        except Exception as e:
            if not capturing:
                raise
            self.off = f"capturing a forward of {shape[0]} x {shape[1]} failed: {e}"
            log.warning("CUDA graphs are off, every forward runs eagerly: %s", self.off)
            return None
        finally:
            self._active.entry = None
        if capturing:
            self._graphs[shape] = entry
            log.info("captured the decoder's CUDA graph for %d x %d tokens (%d of at most %d shapes)", shape[0],
                     shape[1], len(self._graphs), self.max_shapes)
        return out.logits

    def _stand_in(self, *args, **kwargs):
        """The decoder's forward: the plain one outside `logits`, a capture or a replay inside."""
        entry = getattr(self._active, "entry", None)
        if entry is None:
            return self._decoder_forward(*args, **kwargs)
        if entry.graph is None:
            self._capture(entry, args, kwargs)
        entry.graph.replay()
        return entry.output

    def _capture(self, entry: _Graph, args: tuple, kwargs: dict) -> None:
        # A graph reads its inputs at the addresses it was captured with: any tensor the
        # model made for its decoder in this call (position ids, say) would be stale later.
        stray = [name for name, value in list(enumerate(args)) + list(kwargs.items())
                 if isinstance(value, torch.Tensor) and value is not entry.input_ids]
        if stray:
            raise RuntimeError(f"the model passes its decoder tensors other than the input ids ({stray})")
        current = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(current)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(self._stream):
            self._decoder_forward(*args, **kwargs)  # lazy initialisations happen here, not in the capture
            # thread_local: the announcer and sender threads keep using CUDA meanwhile. No
            # device-wide sync either (torch.cuda.graph makes one): a send to a dead student
            # would never let it finish.
            graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
            try:
                output = self._decoder_forward(*args, **kwargs)
            except BaseException:
                try:
                    graph.capture_end()
                except Exception:  # the capture is already invalid; the first error says why
                    pass
                raise
            graph.capture_end()
        current.wait_stream(self._stream)
        entry.graph, entry.output = graph, output
