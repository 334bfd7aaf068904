"""Sequences as the padded tensors a forward takes, in the trainer's layout: prompt and
completion right-padded to the longest, position t predicting token t+1, so a sample's
generated tokens sit at columns p-1 .. p-1+len-1 (p: its prompt's length)."""
from __future__ import annotations

from typing import Sequence

import torch


def pad_sequences(pairs: Sequence[tuple[Sequence[int], Sequence[int]]], pad_id: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, attention mask)`` [n, width] for (prompt_ids, token_ids) pairs."""
    width = max(len(p) + len(t) for p, t in pairs)
    ids = torch.full((len(pairs), width), pad_id, dtype=torch.long)
    att = torch.zeros((len(pairs), width), dtype=torch.long)
    for i, (p, t) in enumerate(pairs):
        ids[i, : len(p) + len(t)] = torch.tensor(list(p) + list(t), dtype=torch.long)
        att[i, : len(p) + len(t)] = 1
    return ids, att


def generated_columns(prompt_length: int, length: int) -> slice:
    """The columns of a [n, width-1] per-token tensor that hold a sample's generated tokens."""
    return slice(prompt_length - 1, prompt_length - 1 + length)


def per_token(pairs: Sequence[tuple[Sequence[int], Sequence[int]]], columns: int,
              values: Sequence[Sequence[float]]) -> torch.Tensor:
    """One value per generated token of each pair, as [n, columns] in the mask's layout."""
    out = torch.zeros((len(pairs), columns))
    for i, ((p, t), v) in enumerate(zip(pairs, values)):
        out[i, generated_columns(len(p), len(t))] = torch.tensor(list(v), dtype=torch.float32)
    return out


def completion_mask(pairs: Sequence[tuple[Sequence[int], Sequence[int]]], columns: int) -> torch.Tensor:
    """1 on every generated token's column, 0 elsewhere: [n, columns]."""
    return per_token(pairs, columns, [[1.0] * len(t) for _, t in pairs])
