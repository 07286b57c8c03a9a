"""A verifiable task the project builds itself: arithmetic, scored by exact match.

A problem is a prompt such as "57+68=" and its answer "125"; a completion is right when its
characters before the end token are the answer. Problems come from a seeded generator (train
and held-out sets are disjoint); the tokenizer has one token per character, so the answer's
digits are the tokens a model must produce, and a chat template (with `{% generation %}`
markers) makes the same problems usable as {"messages"} records.

    0 <pad>   1 <eos>   2 <user>   3 <assistant>   then one token per character of CHARACTERS
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD, EOS, USER, ASSISTANT = "<pad>", "<eos>", "<user>", "<assistant>"
SPECIAL = [PAD, EOS, USER, ASSISTANT]
CHARACTERS = "0123456789+-*=\n"
# user turn, then the assistant's answer closed by <eos> (inside the generation block: trained).
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{{ '<assistant>' }}{% generation %}{{ message['content'] + '<eos>' }}{% endgeneration %}"
    "{%- else -%}{{ '<user>' + message['content'] }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<assistant>' }}{%- endif -%}"
)


def make_tokenizer(save_dir: str | Path | None = None) -> PreTrainedTokenizerFast:
    """One token per character (and the four special tokens); saved to `save_dir` when given."""
    vocab = {token: index for index, token in enumerate([*SPECIAL, *CHARACTERS])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token=PAD))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()  # characters back to back, no spaces between
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=EOS, pad_token=PAD,
                                        additional_special_tokens=[USER, ASSISTANT],
                                        clean_up_tokenization_spaces=False)
    tokenizer.chat_template = CHAT_TEMPLATE
    if save_dir is not None:
        tokenizer.save_pretrained(str(save_dir))
    return tokenizer


def problem(rng: random.Random, digits: int) -> tuple[str, str]:
    """A random sum of two numbers of up to `digits` digits: (prompt, answer)."""
    a, b = rng.randrange(10 ** digits), rng.randrange(10 ** digits)
    return f"{a}+{b}=", str(a + b)


def careless_answer(prompt: str, rng: random.Random, slip: float) -> str:
    """The sum in `prompt` as a careless solver writes it: it drops the carry out of the units
    digit with probability `slip` (1: always, a systematic mistake; 0: the right answer)."""
    a, b = (int(x) for x in prompt.rstrip("=").split("+"))
    digits, carry, position = [], 0, 0
    while a or b or carry:
        total = a % 10 + b % 10 + carry
        digits.append(total % 10)
        carry = 0 if position == 0 and rng.random() < slip else total // 10
        a, b, position = a // 10, b // 10, position + 1
    return "".join(map(str, reversed(digits))) or "0"


def problems(count: int, seed: int, digits: int, exclude: set[str] = frozenset()) -> list[tuple[str, str]]:
    """`count` distinct problems (none of whose prompts is in `exclude`), the same for the same seed."""
    rng, seen, found = random.Random(seed), set(exclude), []
    while len(found) < count:
        prompt, answer = problem(rng, digits)
        if prompt not in seen:
            seen.add(prompt)
            found.append((prompt, answer))
    return found


def write_jsonl(path: str | Path, pairs: list[tuple[str, str]], shape: str = "prompt_completion") -> Path:
    """The problems as {"prompt", "completion"} records, or as {"messages"} (`shape="messages"`)."""
    path = Path(path)
    with open(path, "w") as handle:
        for prompt, answer in pairs:
            if shape == "messages":
                record = {"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]}
            else:
                record = {"prompt": prompt, "completion": answer}
            handle.write(json.dumps(record) + "\n")
    return path


def is_correct(completion: str, answer: str) -> bool:
    """Exact match: the completion's text before its end token is the answer."""
    return completion.split(EOS, 1)[0] == answer
