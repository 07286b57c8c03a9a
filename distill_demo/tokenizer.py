"""A small byte-level BPE tokenizer trained locally, so the demo needs no model hub.

The teacher and the students must share one vocabulary (logit distillation compares
the teacher's logit at index i with the student's logit at index i), so the demo
trains this tokenizer once, caches it in a directory, and both programs load it from
there (`load_or_train_tokenizer`).

Token layout (fixed ids, the BPE trainer places special tokens first):

    0 <|pad|>   1 <|bos|>   2 <|eos|>   3 <|system|>   4 <|user|>   5 <|assistant|>

then the 256 byte symbols, then the learned merges.

Chat format (`CHAT_TEMPLATE`): every message is `<|role|>\\n{content}<|eos|>`, messages
are joined by `\\n`, and `add_generation_prompt=True` appends `\\n<|assistant|>\\n`.
Assistant content *and its closing <|eos|>* sit inside `{% generation %}` so that
`apply_chat_template(..., return_assistant_tokens_mask=True, return_dict=True)` marks
them: the student learns to answer and to stop. A rendered conversation ends with
<|eos|>, the same document separator plain text gets in the data pipeline.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

logger = logging.getLogger(__name__)

PAD_TOKEN = "<|pad|>"
BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
ROLE_TOKENS = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>"}
# Order fixes the ids listed in the module docstring.
SPECIAL_TOKENS = [PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, *ROLE_TOKENS.values()]

# Every byte is a symbol of the base alphabet, so no text is ever out of vocabulary.
_BYTE_ALPHABET_SIZE = 256
MIN_VOCAB_SIZE = _BYTE_ALPHABET_SIZE + len(SPECIAL_TOKENS)

# Written next to the tokenizer files; records what the cache was trained for.
_CACHE_MARKER = "distill_demo_tokenizer.json"
_CACHE_FORMAT_VERSION = 1

# Jinja, rendered by transformers' apply_chat_template. `{%- -%}` strips only the
# template's own layout whitespace, never whitespace inside message contents.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] -%}"
    "{{ raise_exception('Unknown chat role ' + message['role'] + '; expected system, user or assistant') }}"
    "{%- endif -%}"
    "{%- if not loop.first -%}{{ '\\n' }}{%- endif -%}"
    "{{ '<|' + message['role'] + '|>\\n' }}"
    "{%- if message['role'] == 'assistant' -%}"
    "{% generation %}{{ message['content'] + '<|eos|>' }}{% endgeneration %}"
    "{%- else -%}"
    "{{ message['content'] + '<|eos|>' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{%- if messages -%}{{ '\\n' }}{%- endif -%}"
    "{{ '<|assistant|>\\n' }}"
    "{%- endif -%}"
)


class TokenizerCacheError(ValueError):
    """The tokenizer cache directory holds something other than what was asked for."""


def train_tokenizer(
    texts: Iterable[str], vocab_size: int = 2048, save_dir: str | Path | None = None
) -> PreTrainedTokenizerFast:
    """Trains a byte-level BPE tokenizer on `texts` and wraps it for transformers.

    Deterministic: the same texts in the same order give the same vocabulary and
    merges (the `tokenizers` BPE trainer breaks count ties by pair, not by hash order).
    The result may hold fewer than `vocab_size` tokens when the texts are too small
    to support that many merges. A few MB of text trains in about a second.

    With `save_dir`, the tokenizer is also written there with `save_pretrained`
    (tokenizer.json, tokenizer_config.json, chat_template.jinja).
    """
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(
            f"vocab_size={vocab_size} is below the {MIN_VOCAB_SIZE} tokens that the 256 byte symbols "
            f"and {len(SPECIAL_TOKENS)} special tokens need; pass vocab_size >= {MIN_VOCAB_SIZE}."
        )
    backend = Tokenizer(models.BPE())
    # add_prefix_space=False: a leading space would be invented on encode and kept on
    # decode, which breaks the exact round trip the data pipeline relies on.
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        # Seeding all 256 bytes (not just those seen) keeps any text encodable.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer=trainer)

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=list(ROLE_TOKENS.values()),
        # The default cleanup rewrites " ," as "," on decode; byte-level BPE already
        # reproduces the exact text, so cleanup would only corrupt it.
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    if save_dir is not None:
        tokenizer.save_pretrained(str(save_dir))
    return tokenizer


def load_or_train_tokenizer(
    cache_dir: str | Path, texts_fn: Callable[[], Iterable[str]], vocab_size: int = 2048
) -> PreTrainedTokenizerFast:
    """Loads the tokenizer cached in `cache_dir`, training and caching it on first use.

    `texts_fn` is only called when the cache is missing, so a warm start reads no corpus.
    Safe when several processes (a teacher and its students) start at once: each trains
    into a private temporary directory and renames it into place; a process that loses
    the race discards its copy and loads the winner's, so all of them share one
    vocabulary. A cache trained for a different `vocab_size` is an error, not silently
    retrained, because a running teacher may still be serving with it.
    """
    cache_dir = Path(cache_dir)
    if not _cache_is_populated(cache_dir):
        cache_dir.parent.mkdir(parents=True, exist_ok=True)
        staging_dir = cache_dir.parent / f".{cache_dir.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            train_tokenizer(texts_fn(), vocab_size=vocab_size, save_dir=staging_dir)
            marker = {"format_version": _CACHE_FORMAT_VERSION, "vocab_size": vocab_size}
            (staging_dir / _CACHE_MARKER).write_text(json.dumps(marker, indent=2) + "\n")
            try:
                # Atomic on POSIX; succeeds onto a missing or empty directory only.
                os.rename(staging_dir, cache_dir)
                logger.info("Trained a %d-token tokenizer and cached it in %s", vocab_size, cache_dir)
            except OSError:
                if not _cache_is_populated(cache_dir):
                    raise
                logger.info("Another process cached a tokenizer in %s first; using that one", cache_dir)
        finally:
            shutil.rmtree(staging_dir, ignore_errors=True)
    return _load_cached(cache_dir, vocab_size)


def _cache_is_populated(cache_dir: Path) -> bool:
    if not cache_dir.exists():
        return False
    if (cache_dir / _CACHE_MARKER).is_file():
        return True
    if cache_dir.is_dir() and not any(cache_dir.iterdir()):
        return False
    raise TokenizerCacheError(
        f"{cache_dir} exists but holds no {_CACHE_MARKER}, so it is not a tokenizer cache written by "
        f"load_or_train_tokenizer; delete it or pass a different cache_dir."
    )


def _load_cached(cache_dir: Path, vocab_size: int) -> PreTrainedTokenizerFast:
    marker = json.loads((cache_dir / _CACHE_MARKER).read_text())
    if marker.get("format_version") != _CACHE_FORMAT_VERSION or marker.get("vocab_size") != vocab_size:
        raise TokenizerCacheError(
            f"{cache_dir} caches a tokenizer trained with {marker}, but vocab_size={vocab_size} "
            f"(format_version={_CACHE_FORMAT_VERSION}) was asked for; delete {cache_dir} to retrain "
            f"(stop any teacher using it first) or pass a different cache_dir."
        )
    return PreTrainedTokenizerFast.from_pretrained(str(cache_dir))
