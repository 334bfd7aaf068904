"""Sequences as the padded tensors a forward takes, in the trainer's layout: prompt and
completion right-padded to the longest, position t predicting token t+1, so a sample's
generated tokens sit at columns p-1 .. p-1+len-1 (p: its prompt's length)."""
from __future__ import annotations

import contextlib
from typing import Callable, Optional, Sequence

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


def generated_forward(pairs: Sequence[tuple[Sequence[int], Sequence[int]]], pad_id: int, device: torch.device,
                      autocast: Optional[torch.dtype], forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                      after: Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = None) -> list[list[float]]:
    """A stage's no-grad forward over (prompt_ids, token_ids) pairs: padded into one batch on
    ``device``, ``forward(ids, attention)`` under the ``autocast`` dtype (None: none), then
    ``after(out, ids)`` outside it; ``out`` holds, at column t, the figure for token t+1. Returns
    each pair's generated tokens' figures."""
    ids, att = (t.to(device) for t in pad_sequences(pairs, pad_id))
    cast = torch.autocast(device_type=device.type, dtype=autocast) if autocast is not None else contextlib.nullcontext()
    with torch.no_grad():
        with cast:
            out = forward(ids, att)
        if after is not None:
            out = after(out, ids)
    out = out.cpu()
    return [out[i, generated_columns(len(p), len(t))].tolist() for i, (p, t) in enumerate(pairs)]


def per_token(pairs: Sequence[tuple[Sequence[int], Sequence[int]]], columns: int,
              values: Sequence[Sequence[float]]) -> torch.Tensor:
    """One value per generated token of each pair, as [n, columns] in the mask's layout."""
    out = torch.zeros((len(pairs), columns))
    for i, ((p, t), v) in enumerate(zip(pairs, values)):
        out[i, generated_columns(len(p), len(t))] = torch.tensor(list(v), dtype=torch.float32)
    return out


def completion_mask(pairs: Sequence[tuple[Sequence[int], Sequence[int]]], columns: int,
                    loss_masks: Optional[Sequence[Optional[Sequence[int]]]] = None) -> torch.Tensor:
    """1 on every trained token's column, 0 elsewhere: [n, columns]. ``loss_masks``: per
    pair, 1 or 0 per token (an episode's observation ids are 0: workers/agents/episode.py);
    None, or a None entry, trains every generated token."""
    masks = loss_masks or [None] * len(pairs)
    values = []
    for (_, t), m in zip(pairs, masks):
        if m is not None and len(m) != len(t):
            raise ValueError(f"a loss mask of {len(m)} entries for {len(t)} tokens")
        values.append([1.0] * len(t) if m is None else [float(bool(x)) for x in m])
    return per_token(pairs, columns, values)


def trained_ids(ids: torch.Tensor, mask: torch.Tensor) -> list[list[int]]:
    """Read back from the padded tensors the ids each row trains on: the target of each
    column where ``mask`` is 1 (column t predicts token t+1), in order. The token-exactness
    check compares these with the engine's ids, so it checks the packing and the masking."""
    targets = ids[:, 1:].detach().cpu()
    on = mask.detach().cpu() > 0
    return [targets[i][on[i]].tolist() for i in range(ids.shape[0])]


def token_exact(pairs: Sequence[tuple[Sequence[int], Sequence[int]]], loss_masks, engine_ids: Sequence[Sequence[int]],
                pad_id: int = 0) -> list[bool]:
    """Whether each sample's trained ids, as ``pad_sequences`` and ``completion_mask`` pack
    them (the trainer's layout), equal ``engine_ids``: the ids the engine generated."""
    ids, _ = pad_sequences(pairs, pad_id)
    mask = completion_mask(pairs, ids.shape[1] - 1, loss_masks)
    return [got == list(want) for got, want in zip(trained_ids(ids, mask), engine_ids)]
