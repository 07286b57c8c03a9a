"""The attention inputs of chosen layers, as each layer hands them to its attention function.

Hugging Face models compute a layer's queries, keys and values (projections, per-head norms
where the model has them, the rotary embedding), then call the attention function their
config names through transformers' `AttentionInterface` (`sdpa`, `flash_attention_2`,
`flex_attention`, ...) as ``fn(module, query, key, value, attention_mask, ...)``, with
query ``[B, heads, S, D]`` and key/value ``[B, kv_heads, S, D]`` (grouped heads not yet
repeated). Wrapping those functions is the one place where q, k and v are seen exactly as
the layer computed them, for any model that dispatches through the interface. Forward hooks
see the layer's input and output only, and recomputing q/k/v from the input would have to
know each architecture's norms and rotary variant.

`install()` wraps every function registered in the interface, once per process. A wrapper
does nothing but one attribute lookup unless its module is being captured: a capture marks
the attention modules of its layers for the duration of a `with` block, so other models in
the process (a student next to a teacher in a test) run as before, and a backward pass that
recomputes a checkpointed layer after the block records nothing.

Records are ``[B, S, heads * D]``: every head's vector of a token side by side, the layout
MiniLMv2's relation heads split again (student_trainer/losses.py). On a student in training
they keep their autograd graph (checkpointing must be non-reentrant: a reentrant checkpoint
runs the layer without a graph).

``attn_implementation="eager"`` (Gemma 2's default) is not an entry of the interface: the
model passes its modeling file's own ``eager_attention_forward`` as the fallback of the
lookup. For the duration of a capture of such a model, an ``eager`` entry is registered that
calls the calling module's modeling file's ``eager_attention_forward`` (the function the
fallback is, by transformers' convention), so that eager models pass through a wrapper too;
it is removed when the last such capture ends.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterable

import torch

# The attribute a module being captured carries: the capture recording it.
_MARK = "_distill_attention_capture"
_WRAPPED = "_distill_captures_attention_inputs"
_EAGER = "eager"
_eager_lock = threading.Lock()
_eager_users = 0  # captures of eager models under way: the "eager" entry stays while > 0


class AttentionCaptureError(ValueError):
    """The model's attention inputs cannot be captured; the message says why and what to do."""


def install() -> None:
    """Wraps every attention function registered in transformers' AttentionInterface (idempotent;
    functions registered later are wrapped at the next call)."""
    from transformers.modeling_utils import AttentionInterface

    mapping = AttentionInterface._global_mapping
    for name, function in list(mapping.items()):
        if not getattr(function, _WRAPPED, False):
            mapping[name] = _wrap(function)


def _wrap(function):
    def attention_with_capture(module, query, key, value, *args, **kwargs):
        capture = module.__dict__.get(_MARK)
        if capture is not None:
            capture.record(module, query, key, value)
        return function(module, query, key, value, *args, **kwargs)

    setattr(attention_with_capture, _WRAPPED, True)
    attention_with_capture.__wrapped__ = function
    return attention_with_capture


def _modeling_eager(module, query, key, value, *args, **kwargs):
    """The attention of an eager model: its modeling file's eager_attention_forward."""
    function = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if function is None:
        raise AttentionCaptureError(f"{type(module).__module__} has no eager_attention_forward, the function "
                                    "transformers' eager models call: its attention inputs cannot be captured; load "
                                    "the model with attn_implementation='sdpa'")
    return function(module, query, key, value, *args, **kwargs)


def _use_eager_entry(delta: int) -> None:
    """Counts the captures of eager models; registers the "eager" entry while there are any."""
    global _eager_users
    from transformers.modeling_utils import AttentionInterface

    with _eager_lock:
        _eager_users += delta
        mapping = AttentionInterface._global_mapping
        if _eager_users > 0 and _EAGER not in mapping:
            mapping[_EAGER] = _wrap(_modeling_eager)
        elif _eager_users == 0:
            mapping.pop(_EAGER, None)


def attention_modules(model: torch.nn.Module, layers: Iterable[int]) -> dict[int, torch.nn.Module]:
    """The attention module of each decoder layer in `layers` (0-based), found by its `layer_idx`."""
    wanted = set(layers)
    found: dict[int, torch.nn.Module] = {}
    for module in model.modules():
        layer = getattr(module, "layer_idx", None)
        if not isinstance(layer, int) or layer not in wanted or not _is_attention(module):
            continue
        if layer in found:
            raise AttentionCaptureError(f"{type(model).__name__} has more than one attention module in layer {layer} "
                                        f"({type(found[layer]).__name__}, {type(module).__name__}): attention inputs "
                                        "are captured for decoder-only models with one self-attention per layer")
        found[layer] = module
    missing = sorted(wanted - found.keys())
    if missing:
        raise AttentionCaptureError(f"{type(model).__name__} has no attention module for layers {missing} "
                                    "(none with that layer_idx): give layers 0 .. num_layers - 1")
    return found


def _is_attention(module: torch.nn.Module) -> bool:
    return "attention" in type(module).__name__.lower() and hasattr(module, "config")


class AttentionCapture:
    """``with AttentionCapture(model, layers) as capture: model(...)``; then ``capture.inputs[layer]``
    is ``(q, k, v)``, each ``[B, S, width]``.

    Each layer asked must call its attention function exactly once in the block; `inputs`
    raises AttentionCaptureError otherwise (a model that does not dispatch through the
    interface, an eager model, a forward that skipped the layer).
    """

    def __init__(self, model: torch.nn.Module, layers: Iterable[int]):
        self.layers = tuple(sorted(set(layers)))
        self.model = model
        self._modules = attention_modules(model, self.layers) if self.layers else {}
        self._layer_of = {id(module): layer for layer, module in self._modules.items()}
        self._records: dict[int, list] = {}
        self._eager = False
        if self._modules:
            implementation = getattr(next(iter(self._modules.values())).config, "_attn_implementation", None)
            if implementation is None:
                raise AttentionCaptureError(f"{type(model).__name__} names no attention implementation "
                                            "(config._attn_implementation is None): load it through from_pretrained "
                                            "or from_config")
            self._eager = implementation == _EAGER
            install()

    def __enter__(self) -> "AttentionCapture":
        self._records = {layer: [] for layer in self.layers}
        for module in self._modules.values():
            if _MARK in module.__dict__:
                raise AttentionCaptureError(f"layer {module.layer_idx} is already being captured (nested captures)")
            module.__dict__[_MARK] = self
        if self._eager:
            _use_eager_entry(+1)
        return self

    def __exit__(self, *exc) -> None:
        for module in self._modules.values():
            module.__dict__.pop(_MARK, None)
        if self._eager:
            _use_eager_entry(-1)

    # Not traced by torch.compile: a compiled layer (an FP8 teacher's) that traced the lookup by
    # id(module) would guard on that module's identity, one compilation per layer, and past
    # dynamo's recompile limit (8) every layer would run uncompiled, with or without a capture.
    # A capture costs a compiled layer a graph break instead.
    @torch.compiler.disable
    def record(self, module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        self._records[self._layer_of[id(module)]].append(tuple(_tokens_major(t) for t in (query, key, value)))

    def take(self) -> dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """`inputs`, which the capture then forgets: it holds no tensor between forwards (on a
        student, an autograd graph that needs them keeps them)."""
        inputs = self.inputs
        self._records = {}
        return inputs

    @property
    def inputs(self) -> dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        result = {}
        for layer in self.layers:
            calls = self._records.get(layer, [])
            if len(calls) != 1:
                raise AttentionCaptureError(
                    f"layer {layer}'s attention function ran {len(calls)} times in one forward, not once: "
                    f"{type(self.model).__name__} does not dispatch its attention through transformers' "
                    "AttentionInterface the usual way (or overrides it locally); its attention inputs cannot be "
                    "captured")
            result[layer] = calls[0]
        return result


def _tokens_major(states: torch.Tensor) -> torch.Tensor:
    """[B, heads, S, D] -> [B, S, heads * D]."""
    batch, heads, seq, dim = states.shape
    return states.transpose(1, 2).reshape(batch, seq, heads * dim)
