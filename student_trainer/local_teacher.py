"""The teacher in the training process: what a served teacher sends, computed here.

The colocated baseline that the served teacher is measured against (bench/eagle3_colocated.py):
the target model runs in the student's process, on its GPU, and each batch's outputs are derived
and assembled by the same output kinds (distill_common/outputs.py) a teacher server uses, so a
training loop reads the same `TeacherOutput` either way. `submit` computes at once and returns a
resolved future: there is nothing to overlap with.
"""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import Future

import torch

from distill_common.outputs import BatchOutputs, Output, OutputRequest, TeacherFacts, output_spec
from distill_common.wire import dtype_name


class LocalTeacher:
    def __init__(self, model, outputs: Iterable[Output], dtype: torch.dtype | None = None):
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        model_dtype = next(model.parameters()).dtype
        facts = TeacherFacts(vocab_size=model.get_output_embeddings().weight.shape[0], hidden_size=config.hidden_size,
                             num_layers=config.num_hidden_layers, dtype=model_dtype)
        self.model = model.eval()
        self.outputs = OutputRequest.resolve(output_spec(outputs, dtype_name(dtype) if dtype else None), facts)
        self._next_batch_id = 0

    @torch.no_grad()
    def submit(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> Future:
        device = next(self.model.parameters()).device
        needs = self.outputs.needs
        forward = self.model(input_ids=input_ids.to(device),
                             attention_mask=attention_mask.to(device) if attention_mask is not None else None,
                             output_hidden_states=needs.hidden_states, use_cache=False)
        produced = BatchOutputs(forward.logits, {layer: forward.hidden_states[layer] for layer in needs.hidden_layers})
        del forward  # the other layers' states
        future: Future = Future()
        future.set_result(self.outputs.assemble(self._next_batch_id, self.outputs.derive(produced, None)))
        self._next_batch_id += 1
        return future
