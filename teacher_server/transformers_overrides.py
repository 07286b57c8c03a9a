"""What the teacher's engine thread knows and transformers cannot: a transformers function answered
with a fixed value on one thread while the runner says so, the original everywhere else (other
threads, other models in the process, the same thread outside the block)."""

from __future__ import annotations

import contextlib
import importlib
import threading
from collections.abc import Iterator


class ThreadOverride:
    """`module.name` answers `value` on a thread inside `active(True)`; `install()` replaces it once
    per process (a transformers without that function is left as it is)."""

    def __init__(self, module: str, name: str, value):
        self.module, self.name, self.value = module, name, value
        self._state = threading.local()

    def install(self) -> None:
        try:
            module = importlib.import_module(self.module)
        except ImportError:
            return
        original = getattr(module, self.name, None)
        if original is None or getattr(original, "thread_override", None) is self:
            return

        def override(*args, **kwargs):
            return self.value if getattr(self._state, "active", False) else original(*args, **kwargs)

        override.thread_override = self
        setattr(module, self.name, override)

    @contextlib.contextmanager
    def active(self, on: bool = True) -> Iterator[None]:
        before, self._state.active = getattr(self._state, "active", False), on
        try:
            yield
        finally:
            self._state.active = before


# Without a mask and a cache, transformers looks for several sequences packed into one row
# (`masking_utils.find_packed_sequence_indices`) and branches on the answer in Python: a
# device-to-host sync in every forward, which made the engine wait for the device to finish the
# previous forward before it could launch the next (5 ms per forward of a one-layer model on an
# H200, bench/transport_trace.py). When the runner calls the model without a mask, every row of
# the pack is one sequence from position 0 (the engine right-pads rows, never packs two
# sequences into one): the answer is known, "none".
ONE_SEQUENCE_PER_ROW = ThreadOverride("transformers.masking_utils", "find_packed_sequence_indices", None)

# Transformers (before 5.2x) builds a causal mask tensor instead of letting SDPA apply causality
# whenever it sees a CUDA stream capture (`is_tracing()`), to spare tracers a data-dependent
# branch. Under the engine's captures (teacher_server/cuda_graphs.py) that branch is not
# data-dependent (packs without padding, no cache: the runner's rule), and the mask would make the
# graph differ from the warm-up forward: another attention kernel (the masked one, slower), and a
# compiled decoder layer (--quantize fp8) that saw no mask at warm-up compiling again inside the
# capture, which fails it. So, on the thread that captures and while it does, transformers'
# capture probe says no. A model that then reads a value back to the host inside the capture
# fails it as before, and runs eagerly.
CAPTURE_UNSEEN = ThreadOverride("transformers.utils.import_utils", "is_cuda_stream_capturing", False)
