"""The student trainer's data pipeline: JSONL records -> token ids and loss masks ->
fixed-length examples -> shuffled, rank-sharded, resumable batches.

Input format, one JSON object per line, in one of three shapes:

    {"text": str}                                   every token is trained on
    {"prompt": str, "completion": str}              only the completion is trained on
    {"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}
                                                    only assistant turns are trained on

Other keys (ids, sources) are allowed and ignored; blank lines are skipped. A line
that fits no shape is a `DataError` naming the file and line, or, with
`skip_bad_lines=True`, a warning and a count in `ReadStats.skipped_bad_lines`.

Mask convention, used by every tensor here: `loss_mask[t] == 1` means the token *at*
position t is a training target. The trainer scores the logits at position t against
`input_ids[t + 1]` weighted by `loss_mask[t + 1]`, i.e.
`logits[:, :-1]` vs `input_ids[:, 1:]` with weights `loss_mask[:, 1:]`. Position 0
of an example is therefore never a target.

Each document begins with the special tokens the tokenizer's own convention puts before
a text (`tokenizer(text)`: a bos for Llama- and Gemma-style tokenizers, nothing for GPT-2-
and Qwen-style ones), never trained on, and ends with the tokenizer's eos token, which
separates documents (a model trained with a bos scores text without one far worse:
docs/training.md). Everything else is encoded with
`add_special_tokens=False`, so a tokenizer whose post-processor adds bos/eos cannot slip them
between a prompt and its completion; a chat template writes its own.

Everything is tokenized once, up front, and held in memory as int64 tensors: the
demo and test datasets are a few MB of text. A corpus too large for that needs a
streaming reader, which this module is not.

Glossary: *rank* and *world_size* here are the student's data-parallel rank and size
(the group that splits the batch), not ranks of any group shared with the teacher.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import typing
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from distill_common.alignment import leading_special_ids

logger = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant")
EXPECTED_SHAPES = (
    'expected one of {"text": str}, {"prompt": str, "completion": str}, '
    '{"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}'
)
PackMode = Literal["pack", "truncate"]
PACK_MODES = typing.get_args(PackMode)


class DataError(ValueError):
    """A dataset line, or a whole dataset, that cannot be trained on."""


class TokenizerSetupError(ValueError):
    """The tokenizer lacks something the pipeline needs (an eos token, generation markers)."""


class ResumeStateError(ValueError):
    """A saved BatchIterator state does not belong to this dataset or configuration."""


# ---------------------------------------------------------------------------------------
# Reading and validating JSONL


@dataclass
class ReadStats:
    """Counts from one pass of `read_jsonl`, filled in while it is iterated."""

    records: int = 0
    blank_lines: int = 0
    skipped_bad_lines: int = 0


def record_shape(record: Any) -> str:
    """Which shape a parsed line has: "text", "prompt_completion" or "messages".

    Raises `DataError` (without file and line; `read_jsonl` adds them) saying what is
    wrong when the record fits no shape.
    """
    if not isinstance(record, dict):
        raise DataError(f"line is a JSON {_json_type(record)}, not an object")
    shapes = [
        shape
        for shape, keys in (("text", ("text",)), ("prompt_completion", ("prompt", "completion")), ("messages", ("messages",)))
        if any(key in record for key in keys)
    ]
    if not shapes:
        raise DataError(f"object has keys {sorted(record)} but none of text, prompt/completion, messages")
    if len(shapes) > 1:
        raise DataError(f"object mixes the keys of several shapes ({', '.join(shapes)}); use one shape per line")
    shape = shapes[0]
    if shape == "text":
        _check_string(record, "text", allow_empty=False)
    elif shape == "prompt_completion":
        for key in ("prompt", "completion"):
            if key not in record:
                raise DataError(f'"prompt" and "completion" come together, but "{key}" is missing')
        # An empty prompt is an unconditional completion; an empty completion trains on nothing.
        _check_string(record, "prompt", allow_empty=True)
        _check_string(record, "completion", allow_empty=False)
    else:
        messages = record["messages"]
        if not isinstance(messages, list):
            raise DataError(f'"messages" is a {_json_type(messages)}, not a list')
        if not messages:
            raise DataError('"messages" is empty')
        for index, message in enumerate(messages):
            if not isinstance(message, dict):
                raise DataError(f"messages[{index}] is a {_json_type(message)}, not an object")
            role = message.get("role")
            if role not in ROLES:
                raise DataError(f"messages[{index}] has role {role!r}; roles are {', '.join(ROLES)}")
            if not isinstance(message.get("content"), str):
                raise DataError(f'messages[{index}] "content" is a {_json_type(message.get("content"))}, not a string')
    return shape


def _check_string(record: dict, key: str, *, allow_empty: bool) -> None:
    value = record[key]
    if not isinstance(value, str):
        raise DataError(f'"{key}" is a {_json_type(value)}, not a string')
    if not allow_empty and not value:
        raise DataError(f'"{key}" is empty')


def _json_type(value: Any) -> str:
    names = {dict: "object", list: "list", str: "string", bool: "boolean", int: "number", float: "number"}
    return "null or missing value" if value is None else names.get(type(value), type(value).__name__)


def read_jsonl(
    path: str | Path, *, skip_bad_lines: bool = False, stats: ReadStats | None = None
) -> Iterator[tuple[int, dict]]:
    """Yields (line_number, record) for every valid line of a JSONL file; lines count from 1.

    A bad line (invalid UTF-8 or JSON, not an object, no shape or a malformed one)
    raises `DataError("path:LINE: what is wrong; expected one of ...")`. With
    `skip_bad_lines=True` it is logged as a warning with its line number and counted
    in `stats.skipped_bad_lines` instead. Pass a `ReadStats` to read the counts; they
    are final once the generator is exhausted.
    """
    stats = stats if stats is not None else ReadStats()
    path = Path(path)
    # Bytes, decoded per line, so one line of bad UTF-8 is reported as that line.
    with open(path, "rb") as handle:
        for line_number, raw in enumerate(handle, start=1):
            if not raw.strip():
                stats.blank_lines += 1
                continue
            try:
                try:
                    record = json.loads(raw.decode("utf-8"))
                except UnicodeDecodeError as e:
                    raise DataError(f"line is not valid UTF-8 ({e.reason} at byte {e.start})") from e
                except json.JSONDecodeError as e:
                    raise DataError(f"invalid JSON ({e.msg.removesuffix(' at')}, column {e.colno})") from e
                record_shape(record)
            except DataError as e:
                message = f"{path}:{line_number}: {e}; {EXPECTED_SHAPES}"
                if not skip_bad_lines:
                    raise DataError(message) from e
                stats.skipped_bad_lines += 1
                logger.warning("skipped bad line %s", message)
                continue
            stats.records += 1
            yield line_number, record


# ---------------------------------------------------------------------------------------
# Tokenizing


def tokenize_record(record: dict, tokenizer) -> tuple[list[int], list[int]]:
    """Token ids and loss mask (1 = trained on) for one validated record.

    Every shape but a chat template's begins with the tokenizer's leading special tokens
    (its bos, if its convention has one), not trained on.

    - text: all tokens, then eos; every token counts, eos included.
    - prompt/completion: prompt and completion are tokenized separately and
      concatenated (so the boundary is exact even where BPE would merge across it),
      then eos; only completion tokens and that eos count.
    - messages, tokenizer with a chat_template: `apply_chat_template(...,
      return_assistant_tokens_mask=True)`; only tokens inside the template's
      `{% generation %}` blocks count. If the rendering does not end with eos, an eos
      is appended as the document separator and does not count.
    - messages, tokenizer without a chat_template: a plain rendering, one
      "role: content\\n" per message, each piece tokenized separately; only assistant
      contents count; then eos, which counts when the last message is the assistant's
      (so the student learns to stop after answering).
    """
    return tokenize_records([record], tokenizer)[0]


def tokenize_records(
    records: Sequence[dict], tokenizer, *, labels: Sequence[str] | None = None
) -> list[tuple[list[int], list[int]]]:
    """`tokenize_record` for many records; text fields are encoded in one batched call.

    `labels` (e.g. "path:LINE", one per record) name a record in the DataError raised
    when the chat template rejects its conversation.
    """
    eos_id = _eos_id(tokenizer)
    lead = leading_special_ids(tokenizer)
    shapes = [record_shape(record) for record in records]
    # Gather every plain string to encode, so the Rust tokenizer sees one batch.
    strings: list[str] = []
    for record, shape in zip(records, shapes):
        if shape == "text":
            strings.append(record["text"])
        elif shape == "prompt_completion":
            strings.extend((record["prompt"], record["completion"]))
        elif not _has_chat_template(tokenizer):
            for message in record["messages"]:
                strings.extend((f"{message['role']}: ", message["content"], "\n"))
    encoded = iter(_encode(tokenizer, strings))

    results: list[tuple[list[int], list[int]]] = []
    for index, (record, shape) in enumerate(zip(records, shapes)):
        if shape == "text":
            text_ids = next(encoded) + [eos_id]
            ids = lead + text_ids
            mask = [0] * len(lead) + [1] * len(text_ids)
        elif shape == "prompt_completion":
            prompt_ids, completion_ids = lead + next(encoded), next(encoded)
            ids = prompt_ids + completion_ids + [eos_id]
            mask = [0] * len(prompt_ids) + [1] * (len(completion_ids) + 1)
        elif _has_chat_template(tokenizer):
            label = labels[index] if labels is not None else f"record {index}"
            ids, mask = _tokenize_chat(record["messages"], tokenizer, eos_id, label)
        else:
            ids, mask = list(lead), [0] * len(lead)
            for message in record["messages"]:
                head, content, tail = next(encoded), next(encoded), next(encoded)
                trained = 1 if message["role"] == "assistant" else 0
                ids += head + content + tail
                mask += [0] * len(head) + [trained] * len(content) + [0] * len(tail)
            ids.append(eos_id)
            mask.append(1 if record["messages"][-1]["role"] == "assistant" else 0)
        results.append((ids, mask))
    return results


def _encode(tokenizer, strings: list[str]) -> list[list[int]]:
    if not strings:
        return []
    return [list(ids) for ids in tokenizer(strings, add_special_tokens=False)["input_ids"]]


def _has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


# The pattern transformers looks for before it can fill `assistant_masks`.
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


def _tokenize_chat(messages: list[dict], tokenizer, eos_id: int, label: str) -> tuple[list[int], list[int]]:
    import jinja2  # needed by apply_chat_template itself, so present whenever a template is

    template = tokenizer.chat_template
    if not isinstance(template, str) or not _GENERATION_TAG.search(template):
        # Without the markers transformers returns an all-zero mask and only logs a
        # warning; training on that would silently train on nothing.
        raise TokenizerSetupError(
            "The tokenizer's chat_template has no {% generation %} ... {% endgeneration %} markers, so "
            "assistant tokens cannot be told apart. Add the markers around assistant content in the "
            "template, or set tokenizer.chat_template = None to use the plain 'role: content' rendering."
        )
    try:
        out = tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
    except jinja2.TemplateError as e:
        # Templates enforce their own rules (e.g. strict user/assistant alternation).
        raise DataError(f"{label}: the tokenizer's chat template rejected this conversation: {e}") from e
    ids, mask = list(out["input_ids"]), list(out["assistant_masks"])
    if not ids or ids[-1] != eos_id:
        ids.append(eos_id)
        mask.append(0)
    return ids, mask


def _eos_id(tokenizer) -> int:
    eos_id = getattr(tokenizer, "eos_token_id", None)
    if eos_id is None:
        raise TokenizerSetupError(
            "The tokenizer has no eos token, which the data pipeline uses to end and separate "
            "documents; set tokenizer.eos_token (e.g. to the model's end-of-text token)."
        )
    return int(eos_id)


# ---------------------------------------------------------------------------------------
# Fixed-length examples


@dataclass
class DatasetStats:
    """What went into a PackedDataset; logged once when it is built."""

    records: int = 0
    skipped_bad_lines: int = 0
    examples: int = 0
    document_tokens: int = 0  # tokens of all documents before packing or truncation
    loss_tokens: int = 0  # positions with loss_mask 1 in the examples
    pad_tokens: int = 0  # positions with attention_mask 0 in the examples
    truncated_documents: int = 0  # "truncate" mode only
    dropped_tokens: int = 0  # cut off by truncation


class PackedDataset(torch.utils.data.Dataset):
    """Fixed-length examples of `seq_len` tokens built from a JSONL file.

    mode="pack" (default): all documents, each ending in eos, are concatenated and cut
    into consecutive seq_len chunks, so no compute is spent on padding. Attention
    crosses document boundaries inside a chunk (eos marks them); a document cut by a
    chunk boundary continues in the next chunk, and the token at a chunk's position 0
    is not a target (see the module docstring). The last, partial chunk is padded.

    mode="truncate": one document per example, cut to seq_len and padded.

    Padding uses the pad token (the eos token when the tokenizer has none) with
    attention_mask 0 and loss_mask 0. `self[i]` is a dict of int64 tensors
    `input_ids`, `attention_mask`, `loss_mask`, each [seq_len]; the same as [N,
    seq_len] tensors are attributes. `fingerprint` is a hash of the examples, used to
    refuse resuming a BatchIterator on different data.
    """

    def __init__(
        self,
        path: str | Path,
        tokenizer,
        seq_len: int,
        *,
        mode: PackMode = "pack",
        skip_bad_lines: bool = False,
        route_field: str = "",
        route_names: Sequence[str] = (),
    ) -> None:
        read_stats = ReadStats()
        numbered = list(read_jsonl(path, skip_bad_lines=skip_bad_lines, stats=read_stats))
        self._build(
            [record for _, record in numbered],
            tokenizer,
            seq_len,
            mode,
            source=str(path),
            read_stats=read_stats,
            labels=[f"{path}:{line_number}" for line_number, _ in numbered],
            route_field=route_field,
            route_names=route_names,
        )

    @classmethod
    def from_records(
        cls, records: Iterable[dict], tokenizer, seq_len: int, *, mode: PackMode = "pack", route_field: str = "",
        route_names: Sequence[str] = (),
    ) -> PackedDataset:
        """The same from records in memory; a malformed record raises DataError naming its index."""
        records = list(records)
        for index, record in enumerate(records):
            try:
                record_shape(record)
            except DataError as e:
                raise DataError(f"<records>[{index}]: {e}; {EXPECTED_SHAPES}") from e
        dataset = cls.__new__(cls)
        dataset._build(
            records,
            tokenizer,
            seq_len,
            mode,
            source="<records>",
            read_stats=ReadStats(records=len(records)),
            labels=[f"<records>[{index}]" for index in range(len(records))],
            route_field=route_field,
            route_names=route_names,
        )
        return dataset

    def _build(
        self,
        records: list[dict],
        tokenizer,
        seq_len: int,
        mode: str,
        *,
        source: str,
        read_stats: ReadStats,
        labels: list[str] | None = None,
        route_field: str = "",
        route_names: Sequence[str] = (),
    ) -> None:
        if mode not in PACK_MODES:
            raise ValueError(f"mode={mode!r} is not one of {PACK_MODES}; use 'pack' or 'truncate'.")
        if seq_len < 2:
            raise ValueError(f"seq_len={seq_len} leaves nothing to predict; use seq_len >= 2.")
        if not records:
            raise DataError(
                f"{source}: no usable records ({read_stats.skipped_bad_lines} bad lines skipped); "
                f"{EXPECTED_SHAPES}"
            )
        self.seq_len = seq_len
        self.mode = mode
        self.source = source
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else _eos_id(tokenizer)
        documents = tokenize_records(records, tokenizer, labels=labels)
        routes = _routes(records, route_field, route_names, labels) if route_field else None
        stats = DatasetStats(records=len(records), skipped_bad_lines=read_stats.skipped_bad_lines)
        stats.document_tokens = sum(len(ids) for ids, _ in documents)

        if mode == "pack":
            stream_ids = [token for ids, _ in documents for token in ids]
            stream_mask = [flag for _, mask in documents for flag in mask]
            num_examples = -(-len(stream_ids) // seq_len)
            length = num_examples * seq_len
            input_ids = torch.full((length,), pad_id, dtype=torch.int64)
            loss_mask = torch.zeros(length, dtype=torch.int64)
            attention_mask = torch.zeros(length, dtype=torch.int64)
            input_ids[: len(stream_ids)] = torch.tensor(stream_ids, dtype=torch.int64)
            loss_mask[: len(stream_mask)] = torch.tensor(stream_mask, dtype=torch.int64)
            attention_mask[: len(stream_ids)] = 1
            input_ids, loss_mask, attention_mask = (
                t.view(num_examples, seq_len) for t in (input_ids, loss_mask, attention_mask)
            )
            if routes is not None:
                route = torch.full((length,), -1, dtype=torch.int64)
                route[: len(stream_ids)] = torch.tensor(
                    [index for (ids, _), index in zip(documents, routes) for _ in ids], dtype=torch.int64)
                route = route.view(num_examples, seq_len)
        else:
            input_ids = torch.full((len(documents), seq_len), pad_id, dtype=torch.int64)
            loss_mask = torch.zeros((len(documents), seq_len), dtype=torch.int64)
            attention_mask = torch.zeros((len(documents), seq_len), dtype=torch.int64)
            route = torch.full((len(documents), seq_len), -1, dtype=torch.int64) if routes is not None else None
            for row, (ids, mask) in enumerate(documents):
                kept = min(len(ids), seq_len)
                if kept < len(ids):
                    stats.truncated_documents += 1
                    stats.dropped_tokens += len(ids) - kept
                input_ids[row, :kept] = torch.tensor(ids[:kept], dtype=torch.int64)
                loss_mask[row, :kept] = torch.tensor(mask[:kept], dtype=torch.int64)
                attention_mask[row, :kept] = 1
                if route is not None:
                    route[row, :kept] = routes[row]

        self.input_ids = input_ids.contiguous()
        self.attention_mask = attention_mask.contiguous()
        self.loss_mask = loss_mask.contiguous()
        stats.examples = self.input_ids.shape[0]
        stats.loss_tokens = int(self.loss_mask.sum())
        stats.pad_tokens = int((self.attention_mask == 0).sum())
        self.stats = stats
        digest = hashlib.sha256(f"{mode}:{seq_len}".encode())
        for tensor in (self.input_ids, self.attention_mask, self.loss_mask):
            digest.update(tensor.numpy().tobytes())
        self.fingerprint = digest.hexdigest()
        # Which teacher each token belongs to (several teachers, --teacher-route field:NAME): -1 for
        # padding. Kept out of `fingerprint`, which a store of one teacher's outputs checks.
        self.route = route.contiguous() if routes is not None else None
        self.route_fingerprint = (hashlib.sha256(f"{route_field}:{list(route_names)}".encode()
                                                 + self.route.numpy().tobytes()).hexdigest()
                                  if routes is not None else None)
        logger.info("dataset %s (%s, seq_len=%d): %s", source, mode, seq_len, stats)

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        item = {
            "input_ids": self.input_ids[index],
            "attention_mask": self.attention_mask[index],
            "loss_mask": self.loss_mask[index],
        }
        if self.route is not None:
            item["route"] = self.route[index]
        return item


def _routes(records: list[dict], route_field: str, names: Sequence[str], labels: list[str] | None) -> list[int]:
    """Each record's teacher: the index in `names` of its field `route_field` (a DataError naming
    the record when it has none, or one that names no teacher)."""
    routes = []
    for index, record in enumerate(records):
        value = record.get(route_field)
        if value not in names:
            label = labels[index] if labels is not None else f"record {index}"
            found = "has no field" if route_field not in record else f"has {value!r} in"
            raise DataError(f'{label}: {found} "{route_field}", which must name its teacher (--teacher-route '
                            f"field:{route_field}): one of {', '.join(names)}")
        routes.append(names.index(value))
    return routes


# ---------------------------------------------------------------------------------------
# Prompts, for on-policy training


def split_prompt(record: dict, tokenizer, label: str = "record") -> tuple[list[int], list[int], int]:
    """A record as (ids, loss mask, prompt length): the prompt is ids[:prompt length], the
    reference completion what follows, and the mask marks the completion's trained tokens.

    - prompt/completion: the prompt's tokens, then the completion and eos (as `tokenize_record`).
    - messages: the conversation through its last assistant message, rendered as
      `tokenize_record` does; the prompt is everything before that message's content (its role
      header included: what a chat template's generation prompt adds), the completion that
      message and what closes it. Earlier assistant turns are part of the prompt, not trained on.
    - text: has no prompt, a DataError.
    """
    shape = record_shape(record)
    if shape == "text":
        raise DataError('{"text"} records have no prompt: on-policy training needs {"prompt", "completion"} or '
                        '{"messages"} records')
    if shape == "prompt_completion":
        ids, mask = tokenize_record(record, tokenizer)
        return ids, mask, mask.index(1)
    messages = record["messages"]
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
    if last is None:
        raise DataError('"messages" has no assistant message: the last one is the reference completion of the '
                        "prompt made of the others")
    ids, mask = tokenize_records([{"messages": messages[:last + 1]}], tokenizer, labels=[label])[0]
    # The trained tokens before the last assistant message: where the completion starts is the next one.
    before = sum(tokenize_records([{"messages": messages[:last]}], tokenizer, labels=[label])[0][1]) if last else 0
    trained = [position for position, flag in enumerate(mask) if flag]
    if len(trained) <= before:
        raise DataError(f"{label}: the last assistant message has no trained tokens (is its content empty?)")
    start = trained[before]
    return ids, [0] * start + mask[start:], start


class PromptDataset(torch.utils.data.Dataset):
    """Prompts and their reference completions, one per example, for on-policy training.

    The tensors are those of a PackedDataset in "truncate" mode (so `BatchIterator` reads it
    alike): [N, seq_len] right-padded prompt + reference completion, the loss mask on the
    completion, whose first token is always kept and trained: a row's prompt length is the
    position of its loss mask's first 1 (`prompt_lengths`). A prompt must leave `min_new_tokens` of the `seq_len`
    for what is generated after it, or the line is a DataError (with `skip_bad_lines`, skipped
    and counted); a reference completion longer than the rest is cut.
    """

    def __init__(self, path: str | Path, tokenizer, seq_len: int, *, min_new_tokens: int = 1,
                 skip_bad_lines: bool = False) -> None:
        read_stats = ReadStats()
        numbered = list(read_jsonl(path, skip_bad_lines=skip_bad_lines, stats=read_stats))
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else _eos_id(tokenizer)
        rows: list[tuple[list[int], list[int], int]] = []
        self.stats = DatasetStats(records=len(numbered), skipped_bad_lines=read_stats.skipped_bad_lines)
        for line_number, record in numbered:
            label = f"{path}:{line_number}"
            try:
                ids, mask, prompt_length = split_prompt(record, tokenizer, label)
                if prompt_length > seq_len - min_new_tokens:
                    raise DataError(f"its prompt has {prompt_length} tokens, which leaves fewer than {min_new_tokens} "
                                    f"of --seq-len {seq_len} to generate: raise --seq-len or lower --max-new-tokens")
            except DataError as e:
                if not skip_bad_lines:
                    raise DataError(f"{label}: {e}") from e
                self.stats.skipped_bad_lines += 1
                logger.warning("skipped bad line %s: %s", label, e)
                continue
            rows.append((ids, mask, prompt_length))
        if not rows:
            raise DataError(f"{path}: no usable prompts ({self.stats.skipped_bad_lines} bad lines skipped)")
        self.seq_len, self.mode, self.source = seq_len, "truncate", str(path)
        self.input_ids = torch.full((len(rows), seq_len), pad_id, dtype=torch.int64)
        self.attention_mask = torch.zeros(len(rows), seq_len, dtype=torch.int64)
        self.loss_mask = torch.zeros(len(rows), seq_len, dtype=torch.int64)
        for row, (ids, mask, _) in enumerate(rows):
            kept = min(len(ids), seq_len)
            self.stats.truncated_documents += kept < len(ids)
            self.stats.dropped_tokens += len(ids) - kept
            self.input_ids[row, :kept] = torch.tensor(ids[:kept])
            self.attention_mask[row, :kept] = 1
            self.loss_mask[row, :kept] = torch.tensor(mask[:kept])
        self.stats.examples = len(rows)
        self.stats.document_tokens = sum(len(ids) for ids, _, _ in rows)
        self.stats.loss_tokens = int(self.loss_mask.sum())
        self.stats.pad_tokens = int((self.attention_mask == 0).sum())
        digest = hashlib.sha256(f"prompts:{seq_len}".encode())
        for tensor in (self.input_ids, self.loss_mask):
            digest.update(tensor.numpy().tobytes())
        self.fingerprint = digest.hexdigest()
        logger.info("prompts %s (seq_len=%d): %s", path, seq_len, self.stats)

    def __len__(self) -> int:
        return self.input_ids.shape[0]


def prompt_lengths(loss_mask: torch.Tensor) -> torch.Tensor:
    """[B] prompt lengths of a PromptDataset batch: where each row's loss mask first is 1."""
    return loss_mask.argmax(dim=1)


# ---------------------------------------------------------------------------------------
# Batches


class BatchIterator:
    """Shuffled, rank-sharded, exactly resumable batches of a PackedDataset.

    Each epoch has its own permutation of the examples, fixed by (seed, epoch) and the
    same on every rank. The permutation is read in global batches of
    batch_size * world_size examples; rank r takes the r-th slice of batch_size. So
    the ranks' batches in one step are disjoint, and together they cover every example
    of the epoch except the `len(dataset) % (batch_size * world_size)` left at the end,
    which are dropped so that every rank takes the same number of steps (an uneven
    count would leave one rank waiting in a collective). A new epoch reshuffles, so
    different examples are dropped each time.

    `next(it)` returns {"input_ids", "attention_mask", "loss_mask"}: int64 [batch_size,
    seq_len]. `epoch` and `position` name the *next* batch: `position` batches of
    `epoch` have been returned. Iteration is endless unless `num_epochs` is given.

    `state_dict()` is identical on every rank, so one rank's saved state resumes all of
    them; after `load_state_dict(state)` the next batch is exactly the one an
    uninterrupted run would have produced next.
    """

    def __init__(
        self,
        dataset: PackedDataset,
        batch_size: int,
        *,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        num_epochs: int | None = None,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1.")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} must be in [0, world_size={world_size}); pass the data-parallel rank.")
        if num_epochs is not None and num_epochs < 1:
            raise ValueError(f"num_epochs={num_epochs} must be >= 1, or None to iterate endlessly.")
        global_batch = batch_size * world_size
        if len(dataset) < global_batch:
            raise DataError(
                f"{dataset.source} has {len(dataset)} examples of {dataset.seq_len} tokens, fewer than one "
                f"global batch of batch_size * world_size = {global_batch}; lower batch_size or seq_len, "
                f"or add data."
            )
        self.dataset = dataset
        self.batch_size = batch_size
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.num_epochs = num_epochs
        self.steps_per_epoch = len(dataset) // global_batch
        self.epoch = 0
        self.position = 0
        self._permutation_epoch: int | None = None
        self._permutation: torch.Tensor | None = None

    def permutation(self, epoch: int) -> torch.Tensor:
        """The order of the examples in `epoch`, the same on every rank."""
        if self._permutation_epoch != epoch:
            # A hash mixes seed and epoch, so (seed, epoch + 1) and (seed + 1, epoch)
            # give unrelated orders.
            digest = hashlib.sha256(f"{self.seed}:{epoch}".encode()).digest()
            generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "big") >> 1)
            self._permutation = torch.randperm(len(self.dataset), generator=generator)
            self._permutation_epoch = epoch
        return self._permutation

    def batch_indices(self, epoch: int, position: int, rank: int | None = None) -> torch.Tensor:
        """Dataset indices of the batch at (epoch, position) for `rank` (default: this rank)."""
        rank = self.rank if rank is None else rank
        start = (position * self.world_size + rank) * self.batch_size
        return self.permutation(epoch)[start : start + self.batch_size]

    def __iter__(self) -> BatchIterator:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        if self.num_epochs is not None and self.epoch >= self.num_epochs:
            raise StopIteration
        indices = self.batch_indices(self.epoch, self.position)
        batch = {
            "input_ids": self.dataset.input_ids[indices],
            "attention_mask": self.dataset.attention_mask[indices],
            "loss_mask": self.dataset.loss_mask[indices],
        }
        route = getattr(self.dataset, "route", None)
        if route is not None:
            batch["route"] = route[indices]
        self.position += 1
        if self.position == self.steps_per_epoch:
            self.epoch += 1
            self.position = 0
        return batch

    def state_dict(self) -> dict[str, Any]:
        state = {
            "epoch": self.epoch,
            "position": self.position,
            # The rest is checked on load: any difference would change the order.
            "seed": self.seed,
            "batch_size": self.batch_size,
            "world_size": self.world_size,
            "num_examples": len(self.dataset),
            "data_fingerprint": self.dataset.fingerprint,
        }
        route_fingerprint = getattr(self.dataset, "route_fingerprint", None)
        if route_fingerprint is not None:
            state["route_fingerprint"] = route_fingerprint
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = {"epoch", "position"} - set(state)
        if missing:
            raise ResumeStateError(f"data state lacks {sorted(missing)}; pass a BatchIterator.state_dict().")
        current = self.state_dict()
        fixes = {
            "seed": "pass the seed of the interrupted run",
            "batch_size": "resume with the same per-rank batch size",
            "world_size": "resume with the same number of data-parallel ranks",
            "num_examples": "resume on the same data file, seq_len and mode",
            "data_fingerprint": "resume on the same data file, tokenizer, seq_len and mode",
            "route_fingerprint": "resume with the same teachers and --teacher-route",
        }
        for key, fix in fixes.items():
            if key in state and state[key] != current.get(key):
                raise ResumeStateError(
                    f"saved data state has {key}={state[key]!r} but this run has {current[key]!r}; {fix} "
                    f"(the batch order depends on it)."
                )
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position < self.steps_per_epoch:
            raise ResumeStateError(
                f"saved data state epoch={epoch}, position={position} is outside this run's "
                f"{self.steps_per_epoch} steps per epoch; it belongs to a different configuration."
            )
        self.epoch, self.position = epoch, position
