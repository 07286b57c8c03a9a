"""Tokenizer fingerprints: logit distillation needs the same vocabulary on both sides."""

from __future__ import annotations

import hashlib


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 over the tokenizer's (token, id) pairs sorted by id, plus its length.

    Two tokenizers with the same fingerprint map every token string to the same id,
    which is what makes the teacher's logit at index i mean the student's token i.
    """
    vocab = tokenizer.get_vocab()
    digest = hashlib.sha256()
    digest.update(str(len(tokenizer)).encode())
    for token, index in sorted(vocab.items(), key=lambda item: item[1]):
        digest.update(f"\x00{index}\x00{token}".encode("utf-8", "surrogatepass"))
    return digest.hexdigest()
