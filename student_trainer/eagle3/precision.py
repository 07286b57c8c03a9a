"""bfloat16 weights for the step, float32 master weights for the optimizer.

The draft computes with bfloat16 parameters: no cast of a float32 weight at each use (under
autocast, every linear layer of the seven unroll steps casts its weight, and the backward casts
each gradient back). The optimizer updates float32 copies: an update of lr 1e-4 is below
bfloat16's resolution for most weights, so applying it to bfloat16 directly would lose it.
After each backward the bfloat16 gradients are copied into the masters' `.grad` (float32),
the optimizer steps the masters, and the masters are copied back (rounded) into the parameters.
"""

from __future__ import annotations

import torch


class MasterWeights:
    """Float32 copies of `params` (bfloat16), the ones an optimizer is given."""

    def __init__(self, params: list[torch.Tensor]):
        self.params = list(params)
        self.master = [p.detach().float().clone() for p in self.params]

    def grads_to_master(self) -> None:
        """Each parameter's gradient, in float32, as its master's (None stays None)."""
        for param, master in zip(self.params, self.master):
            master.grad = None if param.grad is None else param.grad.float()

    @torch.no_grad()
    def master_to_params(self) -> None:
        torch._foreach_copy_(self.params, self.master)

    def zero_grad(self) -> None:
        for param, master in zip(self.params, self.master):
            param.grad = master.grad = None
