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
at most `timeout_s` (then `AnswerBudgetBusy`, a 503). Between jobs the budget is shared max-min
(FairPool): the next request to go is the oldest of the waiting job that holds the fewest bytes,
or one that has let MAX_PASSES others go before it, so one job's flood of requests delays
another job's request by a few requests, not by the flood. A job's own requests go in the order
they came.
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
# Entries of the legacy `logprobs` object (an echoed prompt's, the generated tokens') are Python
# lists, tuples and dicts (a float, an int and a str or tuple object each, ~120-200 bytes) before
# their JSON: charged as this many JSON entries each.
OBJECT_ENTRY_FACTOR = 4
# Copies of a response's JSON the teacher holds at once: the writer's answer and the joined body.
JSON_COPIES = 2
# Bytes of one prompt token besides its entries: a Python int in the parsed request (8 for the
# list's slot, 28 for the int) and its text in `prompt_token_ids`; and of one position of a
# batch (padding included): its int64 id and mask.
TOKEN_BYTES = 36 + 8
POSITION_BYTES = 16
# Bytes of one prompt besides its tokens and entries: its tensors' objects (up to 6, a few
# hundred bytes each outside their data), its lists and strings.
PROMPT_BYTES = 2048


class AnswerTooLarge(ValueError):
    """A request whose answer alone needs more than the whole budget."""


class AnswerBudgetBusy(RuntimeError):
    """A request that waited the whole timeout for room beside the requests in flight."""


def entry_bytes(text) -> int:
    """The most bytes one `prompt_logprobs` entry of this teacher's vocabulary takes (`text`: its
    TokenText), its id's head and tail the longest of the vocabulary's."""
    longest = max(len(head) + len(tail) for head, tail in text.entries())
    return longest + ENTRY_FIXED_BYTES + max(len(str(text.vocab_size)), len("null"))


def answer_bytes(params, *, vocab_size: int, entry_size: int, padded_positions: int = 0) -> int:
    """An upper bound of the bytes request `params` (a parsed CompletionParams, prompts as ids)
    holds for its answer (routes.Completions.complete): its prompts' tokens; the last row's
    distribution per generating prompt (two while a step's new rows replace the old); per
    position its k + 1 entries and the ids asked as the forward's tensors (as wide as the
    request's widest: 8 bytes an id sent, 4 a value back) and, but for a prompt's first
    position, as JSON (JSON_COPIES, the prompt's own ids asked); the legacy `logprobs` entries
    as Python objects and JSON; the text. `padded_positions`: the positions of the batches the
    prompts run in, padding included (0: the prompts' own), which the batches' tensors have."""
    prompts = params.prompts
    positions = sum(len(p) for p in prompts)
    scored = params.prompt_logprob_token_ids
    width = max((len(row) for rows in scored for row in rows), default=0) if scored else 0
    padded = max(padded_positions, positions)
    total = len(prompts) * PROMPT_BYTES + positions * TOKEN_BYTES + padded * (POSITION_BYTES + 12 * width)
    if params.max_tokens > 0:
        total += len(prompts) * vocab_size * 4 * (2 if params.max_tokens > 1 else 1)
    if params.prompt_logprobs is not None:
        total += padded * (params.prompt_logprobs + 1 + width) * ENTRY_TENSOR_BYTES
        for index, prompt in enumerate(prompts):  # its JSON lists the ids it asked, not the widest's
            asked = max((len(row) for row in scored[index]), default=0) if scored else 0
            total += (len(prompt) - 1) * (params.prompt_logprobs + 1 + asked) * JSON_COPIES * entry_size
    if params.logprobs is not None:  # the legacy object: generated tokens, and the prompt's when echoing
        listed = (positions if params.echo else 0) + len(prompts) * params.max_tokens
        total += listed * (params.logprobs + 1) * (OBJECT_ENTRY_FACTOR + JSON_COPIES) * entry_size
    # The text of the generated tokens (and of the prompt when echoing): at most an entry's worth a token.
    total += ((positions if params.echo else 0) + len(prompts) * params.max_tokens) * JSON_COPIES * entry_size
    return total


# Grants to other requests a request at the head of its job's queue lets pass before it goes
# next (waiting for room if it does not fit): max-min alone would let a job that drops to
# nothing between its requests overtake a job that holds something for ever. Where several
# are due at once the oldest goes first, so one may let up to MAX_PASSES + jobs - 1 pass.
MAX_PASSES = 4


@dataclass
class _Waiter:
    job: str
    size: int
    order: int
    granted: asyncio.Future = field(repr=False)
    passed: int = 0  # grants to others while it headed its job's queue


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
    (so jobs take turns where they hold alike: a pool of 1 is a lock passed round-robin), unless
    a request has let MAX_PASSES others go while heading its job's queue: then the oldest such
    goes next. A job's own requests go in the order they came; a request that does not fit
    waits, and those behind it wait with it (a large one is not overtaken for ever). Used on one
    event loop."""

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
            heads = [queue[0] for queue in self._waiting.values()]
            overdue = [w for w in heads if w.passed >= MAX_PASSES]
            if overdue:
                waiter = min(overdue, key=lambda w: w.order)
            else:
                waiter = min(heads, key=lambda w: (self._held.get(w.job, 0), self._served.get(w.job, -1), w.order))
            if self.held + waiter.size > self.limit:
                return
            job = waiter.job
            for other in heads:
                if other is not waiter:
                    other.passed += 1
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
