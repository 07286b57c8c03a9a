"""The draft vocabulary: the N target tokens the training data trains on most, with d2t / t2d.

As the EAGLE-3 reference (eagle/traineagle3/cnets.py) and SpecForge
(`process_token_dict_to_mappings`) build it: count the tokens under the loss mask, keep the N
most frequent (ties: the lower id; ids never seen fill up from the lowest id when the data
has fewer than N distinct tokens), sort them by id, then

    d2t[i] = used[i] - i      (draft id i is target id i + d2t[i])
    t2d[j] = j in used        (target id j has a draft id)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DraftVocabulary:
    d2t: torch.Tensor  # int64 [N]
    t2d: torch.Tensor  # bool [V]
    coverage: float  # share of the counted tokens whose id is in the vocabulary

    @property
    def target_ids(self) -> torch.Tensor:
        return torch.arange(len(self.d2t)) + self.d2t


def draft_vocabulary(input_ids: torch.Tensor, loss_mask: torch.Tensor, target_vocab_size: int,
                     size: int) -> DraftVocabulary:
    """The `size` most frequent ids of `input_ids` where `loss_mask` is 1 (any shapes, equal)."""
    if not 0 < size <= target_vocab_size:
        raise ValueError(f"a draft vocabulary of {size} ids: use 1 .. {target_vocab_size} (the target's vocabulary)")
    counted = input_ids[loss_mask.bool()].long()
    if counted.numel() and (counted.min() < 0 or counted.max() >= target_vocab_size):
        raise ValueError(f"token ids outside the target's vocabulary [0, {target_vocab_size}) in the data: is it "
                         "tokenized with the target's tokenizer?")
    counts = torch.bincount(counted, minlength=target_vocab_size)
    # A stable sort of -count keeps equal counts in id order: the lower id wins a tie.
    order = torch.sort(-counts, stable=True).indices
    used = order[:size].sort().values
    t2d = torch.zeros(target_vocab_size, dtype=torch.bool)
    t2d[used] = True
    coverage = counts[used].sum().item() / max(1, counted.numel())
    return DraftVocabulary(d2t=used - torch.arange(size), t2d=t2d, coverage=coverage)
