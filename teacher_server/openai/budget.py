"""The host memory the OpenAI API's requests in flight may hold for their answers.

A request's answer lives in the teacher's memory from its forwards to its last byte sent, and
its size is the caller's to choose within the other limits: one request of 16,384 one-token
prompts with `max_tokens` 1 keeps a whole distribution per prompt to sample from (10 GB at a
152k vocabulary), and one of ~98k scored positions at `prompt_logprobs` 256 is about 2.5 GB of
JSON, held twice (the writer's answer, then the response joined from it). Without a bound a few
such requests at once take the host's memory and the teacher with it.

So each request is charged `answer_bytes` (an upper bound of what it will hold, from its
parameters alone) against `--api-max-answer-bytes` before its first forward, and gives it back
when its response has been sent (or it failed). One whose charge exceeds the budget on its own
is refused (400, `AnswerTooLarge`); one that does not fit beside the requests in flight waits,
at most `timeout_s` (then `AnswerBudgetBusy`, a 503). Between jobs the budget is shared max-min:
the next request to go is the oldest of the waiting job that holds the fewest bytes, so one
job's flood of large requests delays another job's request by one request's worth, not by the
flood. A job's own requests go in the order they came.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from dataclasses import dataclass, field

# Bytes of one `prompt_logprobs` entry besides its id's head and tail (TokenText.entries): the
# separator, the logprob (repr of a float32 widened to float64: at most 24 characters, e.g.
# -1.1754943508222875e-38), and `,"rank":` with the rank's digits or null.
ENTRY_FIXED_BYTES = 1 + 24 + len(',"rank":')
# An entry's bytes held beside its JSON: the float32 value and int64 id the forward returned.
ENTRY_TENSOR_BYTES = 12
# The legacy `logprobs` object of an echoed prompt is built as Python lists and dicts (a float,
# an int and a str object per entry, ~200 bytes) before its JSON: charged as this many entries.
ECHO_ENTRY_FACTOR = 4
# Copies of a response's JSON the teacher holds at once: the writer's answer and the joined body.
JSON_COPIES = 2


class AnswerTooLarge(ValueError):
    """A request whose answer alone needs more than the whole budget."""


class AnswerBudgetBusy(RuntimeError):
    """A request that waited the whole timeout for room beside the requests in flight."""


def entry_bytes(text) -> int:
    """The most bytes one `prompt_logprobs` entry of this teacher's vocabulary takes (`text`: its
    TokenText), its id's head and tail the longest of the vocabulary's."""
    longest = max(len(head) + len(tail) for head, tail in text.entries())
    return longest + ENTRY_FIXED_BYTES + max(len(str(text.vocab_size)), len("null"))


def answer_bytes(params, *, vocab_size: int, entry_size: int) -> int:
    """An upper bound of the bytes request `params` (a parsed CompletionParams, prompts as ids)
    holds for its answer: the last row's distribution per generating prompt (two while a step's
    new rows replace the old), and per scored position its k + 1 entries and the ids asked,
    written (JSON_COPIES) and as the forward's tensors."""
    prompts = params.prompts
    total = 0
    if params.max_tokens > 0:
        total += len(prompts) * vocab_size * 4 * (2 if params.max_tokens > 1 else 1)
    per_entry = JSON_COPIES * entry_size + ENTRY_TENSOR_BYTES
    if params.prompt_logprobs is not None:
        scored = params.prompt_logprob_token_ids
        for index, prompt in enumerate(prompts):
            asked = max((len(row) for row in scored[index]), default=0) if scored else 0
            total += (len(prompt) - 1) * (params.prompt_logprobs + 1 + asked) * per_entry
    if params.logprobs is not None:  # the legacy object: generated tokens, and the prompt's when echoing
        positions = sum(len(p) for p in prompts) * ECHO_ENTRY_FACTOR if params.echo else 0
        positions += len(prompts) * params.max_tokens
        total += positions * (params.logprobs + 1) * per_entry
    # The text of the generated tokens (and of the prompt when echoing): at most an entry's worth a token.
    total += (sum(len(p) for p in prompts) if params.echo else 0) * entry_size
    total += len(prompts) * params.max_tokens * entry_size
    return total


@dataclass
class _Waiter:
    job: str
    size: int
    order: int
    granted: asyncio.Future = field(repr=False)


class Lease:
    """Units held by one request: `release()` gives them back (once; later calls do nothing)."""

    def __init__(self, pool: "FairPool", job: str, size: int):
        self._pool, self.job, self.size = pool, job, size
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._pool._give_back(self.job, self.size)


class FairPool:
    """`limit` units shared between jobs, max-min: when room frees, the next to go is the oldest
    request of the waiting job that holds the fewest units, of those the one served longest ago
    (so jobs take turns where they hold alike: a pool of 1 is a lock passed round-robin). A
    job's own requests go in the order they came; a request that does not fit waits, and those
    behind it wait with it (a large one is not overtaken for ever). Used on one event loop."""

    def __init__(self, limit: int, *, timeout_s: float):
        self.limit = limit
        self.timeout_s = timeout_s
        self.held = 0
        self._held: dict[str, int] = {}  # by job
        self._waiting: dict[str, deque[_Waiter]] = {}  # by job, oldest first
        self._served: dict[str, int] = {}  # by job: the order of its last grant
        self._order = itertools.count()

    @property
    def waiting(self) -> int:
        return sum(len(queue) for queue in self._waiting.values())

    async def acquire(self, job: str, size: int) -> Lease:
        """Holds `size` units for `job` once they fit (TimeoutError after `timeout_s`; a size over
        the limit waits for ever: the caller refuses those)."""
        waiter = _Waiter(job, size, next(self._order), asyncio.get_running_loop().create_future())
        self._waiting.setdefault(job, deque()).append(waiter)
        self._grant()
        try:
            if not waiter.granted.done():
                await asyncio.wait({waiter.granted}, timeout=self.timeout_s)
        except BaseException:  # cancelled while waiting: the units, if they came meanwhile, go back
            self._abandon(waiter)
            raise
        if not waiter.granted.done():
            self._abandon(waiter)
            raise TimeoutError(f"no room for {size} of {self.limit} within {self.timeout_s:g} s")
        return Lease(self, job, size)

    def _abandon(self, waiter: _Waiter) -> None:
        if waiter.granted.done():
            self._give_back(waiter.job, waiter.size)
            return
        waiter.granted.cancel()
        queue = self._waiting[waiter.job]
        queue.remove(waiter)
        if not queue:
            del self._waiting[waiter.job]
        self._grant()  # the head gone, those behind it may fit

    def _give_back(self, job: str, size: int) -> None:
        self.held -= size
        left = self._held.pop(job, 0) - size
        if left > 0:
            self._held[job] = left
        self._grant()

    def _grant(self) -> None:
        while self._waiting:
            job = min(self._waiting, key=lambda j: (self._held.get(j, 0), self._served.get(j, -1),
                                                    self._waiting[j][0].order))
            waiter = self._waiting[job][0]
            if self.held + waiter.size > self.limit:
                return
            self._waiting[job].popleft()
            if not self._waiting[job]:
                del self._waiting[job]
            self.held += waiter.size
            self._held[job] = self._held.get(job, 0) + waiter.size  # popped when it is all given back
            self._served[job] = next(self._order)
            waiter.granted.set_result(None)


class AnswerBudget(FairPool):
    """`limit_bytes` of answers in flight (module docstring)."""

    def __init__(self, limit_bytes: int, *, timeout_s: float = 300.0):
        super().__init__(limit_bytes, timeout_s=timeout_s)

    async def reserve(self, job: str, size: int) -> Lease:
        """Holds `size` bytes for `job`'s request once they fit (AnswerTooLarge when they never
        can, AnswerBudgetBusy after `timeout_s`)."""
        if size > self.limit:
            raise AnswerTooLarge(
                f"this request's answer needs up to {size / 2**20:.1f} MiB of the teacher's memory, more than all "
                f"requests in flight may hold ({self.limit / 2**20:.1f} MiB, the teacher's "
                "--api-max-answer-bytes): send fewer or shorter prompts per request, or ask for fewer prompt_logprobs "
                "or logprobs")
        try:
            return await self.acquire(job, size)
        except TimeoutError:
            raise AnswerBudgetBusy(
                f"the teacher's memory for answers (--api-max-answer-bytes, {self.limit / 2**20:.1f} MiB) was "
                f"held by other requests for {self.timeout_s:g} s: retry later, or send smaller requests") from None
