"""Ragged rows in one set of KV caches (batched decoding): which slots hold a real token, per row.

Batched decoding feeds B rows whose step lengths differ (prompts of different lengths, different
numbers of committed tokens and drafts) and forgets different numbers of rejected drafts per row.
The caches keep one physical slot axis for all rows (``kv_cache.GrowingCache`` on the CPU's lean
path, else transformers' ``DynamicCache``): a row's new tokens are right-aligned in the step (pads first), so its anchor is the
last slot and its rejected drafts are its trailing slots. Slots that hold no token of a row (left
pads, step pads, rejected drafts) are *holes*: masked out of every attention read, never copied.
The suffix every row rejects is cropped physically; a row's logical length (its positions) is the
count of its valid slots. Holes are compacted away (one gather per cache layer) only when they
make the slot axis much longer than the longest row (``COMPACT_SLACK``): a gather costs about one
step's read of the caches, a hole costs its share of every later step's attention read.

Positions: a row's tokens take positions 0, 1, ... whatever slots they sit in (rotary is applied
when a key is written, so moving keys never changes them); pads get position 0 and attend only to
themselves (an all-masked attention row would be NaN, and NaN values poison even masked reads).
"""

from __future__ import annotations

import numpy as np
import torch

from multitoken.pipeline.model.attention import takes_sdpa_masks
from multitoken.pipeline.model.backbone import LayerContext

# Compact when holes make the slot axis longer than the longest row by this share of it (and by
# at least COMPACT_MIN slots): attention then reads at most 1.5x the slots it needs, and each
# gather (about one step's cache read) is amortised over many steps.
COMPACT_SLACK = 0.5
COMPACT_MIN = 16


def map_layers(cache, fn) -> None:
    """Apply ``fn`` to the keys and values of every initialised layer of a cache (a head layer's
    cache fills only its replica's slot); a ``GrowingCache`` layer takes the result in as a crop
    or as new contents (kv_cache.py)."""
    for layer in cache.layers:
        if getattr(layer, "is_initialized", False) and layer.keys is not None and layer.keys.numel():
            layer.keys, layer.values = fn(layer.keys), fn(layer.values)


def trailing_holes(valid: np.ndarray) -> int:
    """Slots at the end that are holes in every row # [B, S] bool -> int."""
    filled = valid.any(0)  # [S]
    return int(valid.shape[1] - (np.flatnonzero(filled)[-1] + 1)) if filled.any() else valid.shape[1]


def leading_holes(valid: np.ndarray) -> int:
    """Slots at the start that are holes in every row."""
    filled = valid.any(0)
    return int(np.flatnonzero(filled)[0]) if filled.any() else valid.shape[1]


def step_valid(lengths: list[int], t: int) -> np.ndarray:
    """Which of a step's ``t`` slots hold a row's token: its last ``lengths[b]`` # -> [B, T] bool."""
    return np.arange(t)[None, :] >= (t - np.asarray(lengths))[:, None]


def ragged_context(bb, hidden: torch.Tensor, past_valid: np.ndarray | None, past: int,
                   new_valid: np.ndarray) -> LayerContext:
    """Mask [B, 1, T, past + T] and per-row positions [B, T] for a ragged step: a key slot is read
    iff it holds a token of the row and is not after the query; each query also reads its own
    slot. Boolean for SDPA, additive float for the other kernels (their mask convention)."""
    b, t = new_valid.shape
    if past_valid is None:
        past_valid = np.ones((b, past), dtype=bool)
    valid = np.concatenate([past_valid, new_valid], axis=1)  # [B, past + T]
    before = past_valid.sum(1)  # [B] the row's logical length
    positions = np.maximum(before[:, None] + np.cumsum(new_valid, 1) - 1, 0)  # [B, T] pads: 0
    device = hidden.device
    keys = torch.arange(past + t, device=device)
    causal = keys[None, :] <= (past + torch.arange(t, device=device))[:, None]  # [T, past + T]
    own = keys[None, :] == (past + torch.arange(t, device=device))[:, None]
    mask = (torch.from_numpy(valid).to(device)[:, None, :] & causal) | own  # [B, T, past + T]
    mask = mask[:, None]
    if not takes_sdpa_masks(bb.config):
        mask = torch.zeros(mask.shape, dtype=hidden.dtype, device=device).masked_fill_(~mask, torch.finfo(hidden.dtype).min)
    position_ids = torch.from_numpy(positions).to(device)
    return LayerContext(mask=mask, position_ids=position_ids, position_embeddings=bb.rotary_emb(hidden, position_ids=position_ids))


def tree_context(bb, hidden: torch.Tensor, past_valid: np.ndarray | None, past: int, new_valid: np.ndarray,
                 attend: torch.Tensor, offsets: torch.Tensor) -> LayerContext:
    """Mask [B, 1, T, past + T] and positions [B, T] for a step of per-row candidate trees
    (batched tree verification): row b's nodes are its last ``new_valid[b]`` slots. A node reads
    the row's valid past slots and, among the new slots, the ones ``attend`` [B, T, T] marks
    (its ancestors and itself); it sits at the row's logical length + ``offsets`` [B, T] (its
    depth). Pads read only themselves at position 0 (an all-masked row would be NaN). Boolean
    for SDPA, additive float for the other kernels, as ``ragged_context``."""
    b, t = new_valid.shape
    device = hidden.device
    if past_valid is None:
        past_valid = np.ones((b, past), dtype=bool)
    real = torch.from_numpy(new_valid).to(device)  # [B, T]
    seen_past = torch.from_numpy(past_valid).to(device)[:, None, :] & real[:, :, None]  # [B, T, past]
    own = torch.eye(t, dtype=torch.bool, device=device)
    among = (attend.to(device) & real[:, :, None] & real[:, None, :]) | own  # [B, T, T]
    mask = torch.cat([seen_past, among], dim=2)[:, None]  # [B, 1, T, past + T]
    if not takes_sdpa_masks(bb.config):
        mask = torch.zeros(mask.shape, dtype=hidden.dtype, device=device).masked_fill_(~mask, torch.finfo(hidden.dtype).min)
    before = torch.from_numpy(past_valid.sum(1)).to(device)  # [B] the row's logical length
    position_ids = torch.where(real, before[:, None] + offsets.to(device), 0)  # [B, T]
    return LayerContext(mask=mask, position_ids=position_ids, position_embeddings=bb.rotary_emb(hidden, position_ids=position_ids))


def path_index(paths: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Gather index [B, M] (M = the longest path) moving each row's kept slots ``paths[b]`` (of
    a step's slots) to the front of the step, in order (the rest: any slot, masked), and the
    new validity of those M slots [B, M]."""
    counts = np.array([len(p) for p in paths])
    width = int(counts.max())
    index = np.tile(np.arange(width, dtype=np.int64), (len(paths), 1))
    for row, path in enumerate(paths):
        index[row, :len(path)] = path
    return index, np.arange(width)[None, :] < counts[:, None]


def compact_index(valid: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Gather index [B, S'] moving each row's valid slots to the end of a slot axis as long as
    the longest row (order kept), and the new validity [B, S'] (pads first)."""
    counts = valid.sum(1)
    width = int(counts.max())
    index = np.zeros((valid.shape[0], width), dtype=np.int64)
    new_valid = np.arange(width)[None, :] >= (width - counts)[:, None]
    for row in range(valid.shape[0]):
        index[row, width - counts[row]:] = np.flatnonzero(valid[row])
    return index, new_valid


def should_compact(valid: np.ndarray) -> bool:
    longest = int(valid.sum(1).max())
    return valid.shape[1] - longest > max(COMPACT_MIN, COMPACT_SLACK * longest)


def gather_slots(index: torch.Tensor):
    """``fn`` for ``map_layers``: keys/values [B, heads, S, d] -> [B, heads, S', d] at ``index`` [B, S']."""
    def fn(x: torch.Tensor) -> torch.Tensor:
        idx = index[:, None, :, None].expand(x.shape[0], x.shape[1], index.shape[1], x.shape[3])
        return x.gather(2, idx)
    return fn
