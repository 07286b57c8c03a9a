"""vLLM's completions request and response, as this teacher reads and writes them.

Read from vLLM 0.32 (`vllm/entrypoints/openai/completion/protocol.py` and `serving.py`,
`vllm/sampling_params.py`): the field names, defaults, JSON shapes, the rank convention (1 + how
many ids have a log-probability at least the token's), -inf written as -9999.0, the error body
`{"error": {"message", "type", "param", "code"}}`. Where this differs from vLLM, it says so:

- `prompt_logprobs` are computed at temperature 1 whatever the request's `temperature`, as vLLM
  computes them (its `logprobs_mode` does not apply to prompt tokens). A distillation client
  that wants them at its temperature sends `prompt_logprobs_temperature` (an extension).
- `prompt_logprob_token_ids` (and `prompt_logprob_start`), named as vLLM's SamplingParams names
  them (its OpenAI layer does not take them yet): per prompt row i, ids whose log-probabilities
  as the prediction of prompt token start + i + 1 are added to that position's
  `prompt_logprobs` (-1 pads a row).
- The largest `logprobs` and `prompt_logprobs` are --max-logprobs (default 256; vLLM's 20).
- Generation is a few tokens for scoring clients (at most `MAX_NEW_TOKENS`): sampled at the
  request's temperature with its seed (greedy at 0), without top-p/top-k, stop strings, beam
  search, streaming or n > 1, which are refused by name.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import numpy as np

from distill_common.outputs.logprobs import MIN_LOGPROB_TEMPERATURE

# Generated tokens a request may ask for: each one is a forward over the whole sequence (no KV cache).
MAX_NEW_TOKENS = 64
# A logprob of -inf is written as this, as vLLM and OpenAI do.
LOGPROB_FLOOR = -9999.0


class ApiError(Exception):
    """An error with vLLM's body: `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(self, message: str, *, param: str | None = None, code: int = 400, kind: str = "BadRequestError"):
        super().__init__(message)
        self.message, self.param, self.code, self.kind = message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass
class CompletionParams:
    """A checked request: prompts as ids or text (tokenized by the route), what to return."""

    prompts: list  # list[list[int] | str]
    max_tokens: int = 16
    temperature: float = 1.0
    seed: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    prompt_logprobs_temperature: float = 1.0
    prompt_logprob_token_ids: list | None = None  # one [rows, m] list per prompt
    prompt_logprob_start: int = 0
    echo: bool = False
    ignore_eos: bool = False
    add_special_tokens: bool = True
    return_tokens_as_token_ids: bool = False
    return_token_ids: bool = False
    model: str | None = None
    extra: dict = field(default_factory=dict)
    answer_bytes: int = 0  # the route's upper bound of what its answer holds (budget.answer_bytes)


# Fields accepted only at their default: (default values accepted, why not otherwise).
_ONLY_DEFAULT = {
    "n": ((1, None), "n > 1 (score each prompt once; send it again for another sample)"),
    "stream": ((False, None), "streaming"),
    "use_beam_search": ((False, None), "beam search"),
    "best_of": ((1, None), "best_of"),
    "top_p": ((1, 1.0, None), "top_p (sampling is from the whole distribution at `temperature`)"),
    "top_k": ((0, -1, None), "top_k (sampling is from the whole distribution at `temperature`)"),
    "min_p": ((0, 0.0, None), "min_p"),
    "logit_bias": ((None, {}), "logit_bias"),
    "stop": ((None, [], ""), "stop strings (stop at eos, or use max_tokens)"),
    "stop_token_ids": ((None, []), "stop_token_ids"),
    "suffix": ((None, ""), "suffix"),
    "presence_penalty": ((0, 0.0, None), "presence_penalty"),
    "frequency_penalty": ((0, 0.0, None), "frequency_penalty"),
    "repetition_penalty": ((1, 1.0, None), "repetition_penalty"),
    "prompt_embeds": ((None,), "prompt_embeds"),
    "logprob_token_ids": ((None,), "logprob_token_ids for generated tokens (prompt_logprob_token_ids scores prompts)"),
}


def _int(body: dict, name: str, *, low: int | None = None, allow_none: bool = True) -> int | None:
    value = body.get(name)
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(f"`{name}` must be an integer, got {type(value).__name__}", param=name)
    if low is not None and value < low:
        raise ApiError(f"`{name}` must be at least {low}, got {value}", param=name)
    return value


def _bool(body: dict, name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ApiError(f"`{name}` must be true or false, got {type(value).__name__}", param=name)
    return value


def _number(body: dict, name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ApiError(f"`{name}` must be a finite number >= 0, got {value!r}", param=name)
    return float(value)


def _logprob_count(body: dict, name: str, cap: int, vocab: int) -> int | None:
    value = _int(body, name, low=-1)
    if value is None:
        return None
    wanted = vocab if value == -1 else value
    if wanted > cap:
        raise ApiError(f"Requested {name} of {wanted}, which is greater than max allowed: {cap} (the teacher's "
                       f"--max-logprobs: each one is a JSON entry per position; start the teacher with a larger "
                       "one, or ask for fewer)", param=name)
    return wanted


def parse_completion(body, *, vocab_size: int, max_logprobs: int, max_prompts: int) -> CompletionParams:
    """The request's fields, checked; ApiError naming the field otherwise."""
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    for name, (defaults, what) in _ONLY_DEFAULT.items():
        # (true and false only where a default is one: `"n": true` equals 1 in Python, and is not an n)
        if name in body and not any(isinstance(body[name], bool) == isinstance(d, bool) and body[name] == d
                                    for d in defaults):
            raise ApiError(f"this teacher does not support {what}: leave `{name}` out", param=name)
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt)):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        prompts = list(prompt)
    else:
        raise ApiError("`prompt` must be a string, a list of strings, a list of token ids or a list of lists of "
                       "token ids (not empty)", param="prompt")
    if len(prompts) > max_prompts:
        raise ApiError(f"{len(prompts)} prompts in one request, more than this teacher takes ({max_prompts}): send "
                       "fewer per request", param="prompt")
    for index, one in enumerate(prompts):
        if isinstance(one, list):
            if not one or not all(isinstance(t, int) and not isinstance(t, bool) for t in one):
                raise ApiError(f"prompt {index} must be a non-empty list of token ids", param="prompt")
            low, high = min(one), max(one)
            if low < 0 or high >= vocab_size:
                raise ApiError(f"prompt {index} has token ids in [{low}, {high}], outside the teacher's vocabulary "
                               f"[0, {vocab_size})", param="prompt")
        elif not one:
            raise ApiError(f"prompt {index} is empty", param="prompt")
    params = CompletionParams(prompts=prompts)
    params.model = body.get("model")
    params.echo = _bool(body, "echo", False)
    max_tokens = _int(body, "max_tokens", low=0)
    params.max_tokens = 16 if max_tokens is None else max_tokens
    if params.max_tokens == 0 and not params.echo:
        raise ApiError("`max_tokens` 0 asks for nothing: use at least 1, or echo the prompt", param="max_tokens")
    if params.max_tokens > MAX_NEW_TOKENS:
        raise ApiError(f"`max_tokens` {params.max_tokens} is more than this teacher generates ({MAX_NEW_TOKENS}): "
                       "it scores sequences; generate with an inference server", param="max_tokens")
    params.temperature = _number(body, "temperature", 1.0)
    params.seed = _int(body, "seed")
    if params.seed is not None and not -2 ** 63 <= params.seed < 2 ** 64:
        raise ApiError(f"`seed` must fit in 64 bits (-2**63 .. 2**64 - 1), got {params.seed}", param="seed")
    params.logprobs = _logprob_count(body, "logprobs", max_logprobs, vocab_size)
    params.prompt_logprobs = _logprob_count(body, "prompt_logprobs", max_logprobs, vocab_size)
    if params.echo and params.prompt_logprobs is None and params.logprobs is not None:
        params.prompt_logprobs = params.logprobs  # vLLM: echo with logprobs returns the prompt's too
    params.prompt_logprobs_temperature = _number(body, "prompt_logprobs_temperature", 1.0)
    if params.prompt_logprobs_temperature < MIN_LOGPROB_TEMPERATURE:
        raise ApiError(f"`prompt_logprobs_temperature` {params.prompt_logprobs_temperature:g} is too small to compute "
                       f"in float32 (the values would overflow to NaN): use at least {MIN_LOGPROB_TEMPERATURE:g}",
                       param="prompt_logprobs_temperature")
    params.ignore_eos = _bool(body, "ignore_eos", False)
    params.add_special_tokens = _bool(body, "add_special_tokens", True)
    params.return_tokens_as_token_ids = _bool(body, "return_tokens_as_token_ids", False)
    params.return_token_ids = _bool(body, "return_token_ids", False)
    params.prompt_logprob_start = _int(body, "prompt_logprob_start", low=0) or 0
    ids = body.get("prompt_logprob_token_ids")
    if ids is not None:
        params.prompt_logprob_token_ids = _score_ids(ids, len(prompts), max_logprobs, vocab_size)
        if params.prompt_logprobs is None:
            params.prompt_logprobs = 0  # the positions' dicts hold the prompt token and the ids asked
    return params


def _score_ids(ids, prompts: int, cap: int, vocab: int) -> list:
    """prompt_logprob_token_ids: [rows, m] for one prompt, or one such per prompt."""
    name = "prompt_logprob_token_ids"

    def matrix(value, which: str) -> list:
        if not (isinstance(value, list) and value and all(isinstance(row, list) for row in value)):
            raise ApiError(f"{name}{which} must be a non-empty list of lists of token ids [rows, ids]", param=name)
        width = max(map(len, value))
        if not width:
            raise ApiError(f"{name}{which} has no ids", param=name)
        if width > cap:
            raise ApiError(f"Requested {width} token ids per row in {name}, which is greater than max allowed: "
                           f"{cap} (the teacher's --max-logprobs)", param=name)
        flat = [t for row in value for t in row]
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in flat):
            raise ApiError(f"{name}{which} must contain integer token ids", param=name)
        if min(flat) < -1 or max(flat) >= vocab:
            raise ApiError(f"{name} contain out-of-vocab token ids (-1 pads a row). Vocabulary size: {vocab}",
                           param=name)
        return [row + [-1] * (width - len(row)) for row in value]

    if not isinstance(ids, list):
        raise ApiError(f"{name} must be a list: [rows, ids] for one prompt, or one such per prompt", param=name)
    if prompts > 1 or (ids and isinstance(ids[0], list) and ids[0] and isinstance(ids[0][0], list)):
        if len(ids) != prompts:
            raise ApiError(f"{name} must hold one [rows, ids] list per prompt ({prompts})", param=name)
        return [matrix(one, f"[{index}]") for index, one in enumerate(ids)]
    return [matrix(ids, "")]


# ---- writing -----------------------------------------------------------------------------------

class TokenText:
    """Each id's text as the responses show it (`decoded_token`, `tokens`), made once per teacher:
    JSON-encoded, so that a response is written by joining strings."""

    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._decoded: list[str] | None = None
        self._entries: list[tuple[str, str]] | None = None
        self._arrays: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None

    @property
    def decoded(self) -> list[str]:
        if self._decoded is None:
            if self.tokenizer is None:
                self._decoded = [""] * self.vocab_size
            else:
                known = len(self.tokenizer)
                texts = self.tokenizer.batch_decode([[i] for i in range(min(known, self.vocab_size))])
                self._decoded = list(texts) + [""] * (self.vocab_size - len(texts))
        return self._decoded

    @classmethod
    def of_entries(cls, entries: list[tuple[str, str]], vocab_size: int) -> "TokenText":
        """One that has only `entries()` (and `arrays()`): the JSON writer process's."""
        text = cls(None, vocab_size)
        text._entries = entries
        return text

    def entries(self) -> list[tuple[str, str]]:
        """Per id: the start of its prompt-logprobs entry up to its logprob, and its end after the rank."""
        if self._entries is None:
            decoded = self.decoded if self.tokenizer is not None else None
            self._entries = [(f'"{i}":{{"logprob":',
                              f',"decoded_token":{json.dumps(decoded[i]) if decoded is not None else "null"}}}')
                             for i in range(self.vocab_size)]
        return self._entries

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """`entries()` as numpy object arrays (heads, tails) indexed by id, and `,"rank":r` by r
        in [0, vocab]: what `write_prompt_logprobs` picks from with whole index arrays."""
        if self._arrays is None:
            heads, tails = zip(*self.entries())
            self._arrays = (np.array(heads, dtype=object), np.array(tails, dtype=object),
                            np.array([f',"rank":{r}' for r in range(self.vocab_size + 1)], dtype=object))
        return self._arrays

    def token(self, token_id: int, as_id: bool) -> str:
        return f"token_id:{token_id}" if as_id or self.tokenizer is None else self.decoded[token_id]

    def text(self, ids: list[int]) -> str:
        return "" if self.tokenizer is None or not ids else self.tokenizer.decode(ids)


def _lp(value: float) -> str:
    return repr(value) if value > LOGPROB_FLOOR else repr(LOGPROB_FLOOR)


def prompt_logprobs_json(ids: list[int], top: list[list[float]], top_ids: list[list[int]], own: list[float],
                         rank: list[int], scored: list[list[float]] | None, scored_ids: list[list[int]] | None,
                         text: TokenText) -> str:
    """A prompt's `prompt_logprobs`: null, then per position t >= 1 a dict from token id (a
    string) to {logprob, rank, decoded_token}: the prompt token first (its own rank), then the
    k largest (ranks 1..k), then the ids asked (`scored_ids`, by position; rank null), each id
    once. Position t's values are the predictions made at t - 1: every list is indexed by that."""
    entries = text.entries()
    parts = ["[null"]
    for t in range(1, len(ids)):
        p = t - 1
        token = ids[t]
        head, tail = entries[token]
        items = [f"{head}{_lp(own[p])},\"rank\":{rank[p]}{tail}"]
        seen = {token}
        for index, (value, other) in enumerate(zip(top[p], top_ids[p])):
            if other not in seen:
                seen.add(other)
                head, tail = entries[other]
                items.append(f"{head}{_lp(value)},\"rank\":{index + 1}{tail}")
        if scored is not None:
            for value, other in zip(scored[p], scored_ids[p]):
                if other >= 0 and other not in seen:
                    seen.add(other)
                    head, tail = entries[other]
                    items.append(f"{head}{_lp(value)},\"rank\":null{tail}")
        parts.append("{" + ",".join(items) + "}")
    return ",".join(parts) + "]"


# Positions written per step of `write_prompt_logprobs`: each step's numpy calls hold the GIL for
# a few ms at k = 100, so the engine's thread (which needs it between torch's ops) waits no longer.
WRITE_POSITIONS_PER_STEP = 256


def write_prompt_logprobs(ids: list[int], top: np.ndarray, top_ids: np.ndarray, own: np.ndarray, rank: np.ndarray,
                          scored: np.ndarray | None, scored_ids: list[list[int]] | None, text: TokenText) -> str:
    """`prompt_logprobs_json`'s text (the same characters: tests/test_openai_api.py checks it),
    with the k + 1 entries of every position put together by numpy's indexing and one join per
    position rather than an f-string each: [S, k] float32 `top`, int64 `top_ids`, [S] `own`
    and `rank`, [S, m] `scored` (or None) as the route has them.

    Each entry is five strings picked from tables made once per teacher (`TokenText.arrays`):
    the id's head, the value's repr (floored as `_lp` does), the rank's text and the id's tail,
    after a separator; the entry of a top-k id that is the prompt token itself is blanked."""
    positions = len(ids) - 1
    if positions <= 0:
        return "[null]"
    heads, tails, ranks = text.arrays()
    k = top.shape[1]
    parts = []
    for begin in range(0, positions, WRITE_POSITIONS_PER_STEP):
        end = min(positions, begin + WRITE_POSITIONS_PER_STEP)
        n = end - begin
        nxt = np.asarray(ids[begin + 1:end + 1], dtype=np.int64)
        every_id = np.concatenate([nxt[:, None], top_ids[begin:end]], axis=1)  # [n, 1 + k]
        values = np.concatenate([own[begin:end, None], top[begin:end]], axis=1).astype(np.float64)
        values = np.where(values > LOGPROB_FLOOR, values, LOGPROB_FLOOR)
        every_rank = np.concatenate([rank[begin:end, None], np.broadcast_to(np.arange(1, k + 1), (n, k))], axis=1)
        pieces = np.empty((n, 1 + k, 5), dtype=object)
        pieces[:, :, 0] = ","
        pieces[:, 0, 0] = "{"
        pieces[:, :, 1] = heads[every_id]
        pieces[:, :, 2] = np.array(list(map(float.__repr__, values.ravel().tolist())), dtype=object).reshape(n, 1 + k)
        pieces[:, :, 3] = ranks[every_rank]
        pieces[:, :, 4] = tails[every_id]
        pieces[:, 1:][top_ids[begin:end] == nxt[:, None]] = ""  # the prompt token is listed once, first
        rows = ["".join(row) for row in pieces.reshape(n, -1).tolist()]
        if scored is not None:
            for row in range(n):
                p = begin + row
                seen = {int(nxt[row]), *top_ids[p].tolist()}
                extra = []
                for value, other in zip(scored[p].tolist(), scored_ids[p]):
                    if other >= 0 and other not in seen:
                        seen.add(other)
                        head, tail = text.entries()[other]
                        extra.append(f",{head}{_lp(value)},\"rank\":null{tail}")
                rows[row] += "".join(extra)
        parts.append("},".join(rows))
    return "[null," + "},".join(parts) + "}]"
