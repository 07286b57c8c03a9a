"""What one POST /v1/completions holds, against the charge `budget.answer_bytes` makes for it.

`python -m bench.investigations.answer_memory [--vocab N]` (CPU, about a minute): for each request
shape that once held more than it was charged (a review's findings), runs the route's own
`Completions.complete`, the JSON writer process included, on an engine stand-in that returns
tensors of the request's exact layout at once (the forward's values do not change what is held).
At every submit, every writer call and around the response's assembly it samples the tensors
alive (weak references to every tensor given to or returned by a submit) plus the Python heap
grown since the request began (tracemalloc), and prints the largest sample beside the charge.
A ratio above 1 is a request that holds more than it is charged: a bound broken.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import tracemalloc
import weakref

import torch

from distill_common.outputs import TeacherFacts
from teacher_server.openai.routes import Completions

# name: the request body (its prompts are ids: no tokenizer here; `_chunk_tokens`: the teacher's
# --api-chunk-tokens, 256 where not given).
SHAPES = {
    "scored ids, one prompt 256 wide": lambda: {
        "prompt": [[1] * 256 for _ in range(250)], "max_tokens": 0, "echo": True,
        "prompt_logprob_token_ids": [[[2] * 256]] + [[[2]] for _ in range(249)]},
    "16,384 one-token prompts, k 256": lambda: {
        "prompt": [[1]] * 16384, "max_tokens": 0, "echo": True, "prompt_logprobs": 256},
    "1,000 prompts, 8 tokens generated": lambda: {"prompt": [[1]] * 1000, "max_tokens": 8, "ignore_eos": True},
    "200 prompts, 64 tokens, logprobs 256": lambda: {
        "prompt": [[1]] * 200, "max_tokens": 64, "logprobs": 256, "ignore_eos": True},
    "16 prompts of 1,000 ids, token ids": lambda: {
        "prompt": [list(range(10000, 11000))] * 16, "max_tokens": 1, "return_token_ids": True},
    "2 prompts of 16,383 in chunks": lambda: {"prompt": [[1] * 16383, [2] * 16383], "max_tokens": 1},
    "1 long and 63 short prompts, unchunked": lambda: {  # one padded batch (--api-chunk-tokens 0)
        "prompt": [[1] * 256] + [[1, 1]] * 63, "max_tokens": 0, "echo": True,
        "prompt_logprob_token_ids": [[[2] * 256]] + [[[2]] for _ in range(63)], "_chunk_tokens": 0},
    "8 prompts of 2,048, k 100, echo": lambda: {
        "prompt": [[(7 * i + j) % 1000 for i in range(2048)] for j in range(8)], "max_tokens": 2, "echo": True,
        "logprobs": 5, "prompt_logprobs": 100},
}


class _Sampler:
    def __init__(self):
        self.live: list[tuple[weakref.ref, int]] = []
        self.base_heap = 0
        self.peak = 0

    def track(self, tensor: torch.Tensor) -> None:
        base = tensor._base if tensor._base is not None else tensor
        self.live.append((weakref.ref(base), base.numel() * base.element_size()))

    def sample(self) -> None:
        seen, tensors = set(), 0
        for ref, size in self.live:
            obj = ref()
            if obj is not None and id(obj) not in seen:
                seen.add(id(obj))
                tensors += size
        self.peak = max(self.peak, tensors + tracemalloc.get_traced_memory()[0] - self.base_heap)


class _Engine:
    """Returns each batch's outputs of the request's layout at once (random values)."""

    def __init__(self, sampler: _Sampler, vocab: int):
        self.sampler, self.vocab = sampler, vocab

    async def submit(self, job_id, request, ids, mask, data=None, **_):
        for tensor in [ids, mask, *(data or {}).values()]:
            self.sampler.track(tensor)
        rows, seq = ids.shape
        out = []
        for spec in request.layout(rows, seq):
            if spec.dtype == torch.int64:
                tensor = torch.randint(0, self.vocab, spec.shape)
            else:
                tensor = torch.log_softmax(-torch.rand(spec.shape) * 20, -1)
            self.sampler.track(tensor)
            out.append(tensor)
        self.sampler.sample()
        await asyncio.sleep(0)
        return out


def measure(body: dict, vocab: int) -> tuple[int, int, int]:
    """(bytes held at most, bytes charged, bytes of the answer) for one request."""
    sampler = _Sampler()
    facts = TeacherFacts(vocab_size=vocab, hidden_size=8, num_layers=1, dtype=torch.float32)
    completions = Completions(_Engine(sampler, vocab), facts, None, model_id="m", max_seq_len=16384,
                              max_batch_tokens=16384, max_logprobs=256, answer_limit_bytes=1 << 50,
                              chunk_tokens=body.pop("_chunk_tokens", 256))
    write, respond = completions.writer.prompt_logprobs, completions._response

    async def writing(*args, **kwargs):
        sampler.sample()
        text = await write(*args, **kwargs)
        sampler.sample()
        return text

    def responding(*args):
        sampler.sample()
        text = respond(*args)
        sampler.sample()
        return text

    completions.writer.prompt_logprobs, completions._response = writing, responding
    params = completions.parse(body)
    gc.collect()
    tracemalloc.start()
    sampler.base_heap = tracemalloc.get_traced_memory()[0]

    async def run() -> bytes:
        try:
            return await completions.complete(params, ("job", 0, ""))
        finally:
            await completions.close()

    try:
        answer = asyncio.run(run())
    finally:
        tracemalloc.stop()
    return sampler.peak, params.answer_bytes, len(answer)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=32000)
    args = parser.parse_args()
    print(f"| request (vocabulary {args.vocab:,}) | answer MB | held MB (at most) | charged MB | held / charged |")
    print("|---|---|---|---|---|")
    for name, body in SHAPES.items():
        held, charged, answer = measure(body(), args.vocab)
        print(f"| {name} | {answer / 1e6:.1f} | {held / 1e6:.1f} | {charged / 1e6:.1f} | {held / charged:.2f} |",
              flush=True)


if __name__ == "__main__":
    main()
