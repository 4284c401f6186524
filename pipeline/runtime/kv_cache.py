"""A KV cache written in place: transformers' ``DynamicCache`` interface, without its copy per step.

``DynamicCache`` appends a step's keys and values by ``torch.cat``: every layer copies its whole
cache at every step, a cost that grows with the context. ``GrowingCache`` keeps per layer one
buffer [B, heads, capacity, d] for keys and one for values, writes a step's slots into them by
slice assignment and hands attention views of the filled prefix [B, heads, length, d]. The
capacity doubles when a step would overflow it (one copy of the filled prefix, rarely), so the
cost of a step no longer grows with the context.

Bits: the cached values are the same numbers (a copy is exact) and attention reads them through a
view whose slot and head strides are the buffer's; torch's CPU attention kernels and matmuls walk
a tensor by its strides, so each output is the contiguous tensor's, bit for bit
(tests/pipeline/test_kv_cache.py checks logits against ``DynamicCache`` over many steps, with
crops, kept paths and row selection).

Everything else that handles a cache keeps working unchanged: a layer's ``keys`` / ``values`` read
as the filled views, and assigning a tensor to them (``crop``, ``ragged.map_layers``, the kept
paths of ``incremental.DecodeCaches``) either moves the length (a prefix view of the buffer: a
crop) or copies the tensor into a buffer of its own (a gather: new values). The rows still
decoding are kept in place (``GrowingLayer.keep_rows``): the last rows move into the places of those that left.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

MIN_CAPACITY = 64  # slots a first buffer holds at least: a short prompt's first steps need no regrowth


def capacity_for(length: int) -> int:
    """The buffer size for ``length`` slots: the next power of two, at least ``MIN_CAPACITY``."""
    return max(MIN_CAPACITY, 1 << max(length - 1, 0).bit_length())


class _Filled:
    """A layer's keys or values: the filled prefix view of its buffer (None: nothing cached);
    assigning one is a crop (a prefix view of the buffer) or new contents (``_adopt``). Keys and
    values each keep their own length: transformers assigns keys then values from views read before."""

    def __init__(self, buffer: str, length: str):
        self.buffer, self.length = buffer, length

    def __get__(self, layer, owner=None):
        if layer is None:
            return self
        buffer = getattr(layer, self.buffer)
        return None if buffer is None else buffer[:, :, :getattr(layer, self.length)]

    def __set__(self, layer, x: torch.Tensor | None) -> None:
        buffer, length = _adopt(getattr(layer, self.buffer), x)
        setattr(layer, self.buffer, buffer)
        setattr(layer, self.length, length)


class GrowingLayer(DynamicLayer):
    """One layer's keys and values as filled prefixes of buffers that grow by doubling."""

    def __init__(self, **kwargs):
        self._k = self._v = None  # [B, heads, capacity, d] buffers (None: nothing cached)
        self._nk = self._nv = 0  # filled slots of each (equal between calls)
        super().__init__(**kwargs)

    keys = _Filled("_k", "_nk")
    values = _Filled("_v", "_nv")

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def _reserve(self, length: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Buffers of room for ``length`` slots of ``key_states``' rows, the filled prefix kept."""
        n = self._nk
        if self._k is not None and n and key_states.shape[0] != self._k.shape[0]:
            raise ValueError(f"a step of {key_states.shape[0]} rows on a cache of {self._k.shape[0]}")
        self._k = _room(key_states, length, self._k[:, :, :n] if self._k is not None and n else None)
        self._v = _room(value_states, length, self._v[:, :, :n] if self._v is not None and n else None)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write a step's keys / values [B, heads, T, d] after the filled slots # -> the filled
        views [B, heads, length + T, d]."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = self._nk
        end = n + key_states.shape[2]
        k = self._k
        if k is None or end > k.shape[2] or key_states.shape[0] != k.shape[0]:
            self._reserve(end, key_states, value_states)
            k = self._k
        v = self._v
        k.narrow(2, n, end - n).copy_(key_states)  # narrow: fewer arguments to parse than a slice
        v.narrow(2, n, end - n).copy_(value_states)
        self._nk = self._nv = end
        return k.narrow(2, 0, end), v.narrow(2, 0, end)

    def row_slot(self, rows: int = 1) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """The buffers [1, heads, capacity, d] and their filled length n, grown first where a
        step's ``rows`` keys and values (batch 1) do not fit in slots n.. (a layer step written
        elsewhere, then ``filled(n + rows)``); None before the first ``update`` (a prompt's)."""
        k, n = self._k, self._nk
        if k is None or k.shape[0] != 1 or self._nv != n:
            return None
        if n + rows > k.shape[2]:  # here, not in ``update``: a step's path must not depend on the room left
            self._reserve(n + rows, k, self._v)
        return self._k, self._v, n

    def filled(self, length: int) -> None:
        """The buffers' first ``length`` slots now hold keys and values (after ``row_slot``)."""
        self._nk = self._nv = length

    def get_seq_length(self) -> int:
        return self._nk

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last ``-tokens_to_remove`` slots (transformers 5's negative count): the
        length moves, the buffers stay (the next step overwrites those slots)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of slots to remove, not {tokens_to_remove}")
        self._nk = self._nv = max(self._nk + tokens_to_remove, 0)

    def keep_rows(self, rows: list[int]) -> None:
        """Keep batch rows ``rows`` (distinct) in place, in that order: row rows[i] moves to row i of
        the same buffers, which then show their first len(rows) rows. Only the rows not already
        in their place move, and only their filled slots; no buffer is made (a batch whose rows
        end one by one would otherwise copy its whole cache, into fresh memory, at every end)."""
        if len(set(rows)) != len(rows):
            raise ValueError(f"keep_rows takes distinct rows, not {rows}")
        if self._k is None:
            return
        moved = [i for i, r in enumerate(rows) if r != i]
        if moved:
            to = torch.tensor(moved, dtype=torch.long, device=self._k.device)
            fro = torch.tensor([rows[i] for i in moved], dtype=torch.long, device=self._k.device)
        for name, n in (("_k", self._nk), ("_v", self._nv)):
            buffer = getattr(self, name)
            if moved and n:  # gathered first: a row may move into a place another leaves
                buffer[:, :, :n].index_copy_(0, to, buffer[:, :, :n].index_select(0, fro))
            setattr(self, name, buffer[:len(rows)])

    def reset(self) -> None:
        self._k = self._v = None
        self._nk = self._nv = 0
        self.is_initialized = False


def _adopt(buffer: torch.Tensor | None, x: torch.Tensor | None) -> tuple[torch.Tensor | None, int]:
    """The buffer that holds ``x`` [B, heads, n, d] as its prefix, and n: ``buffer`` itself when
    ``x`` is a prefix view of it (a crop), else a new one with ``x`` copied in."""
    if x is None or x.dim() != 4:  # reset, or transformers' empty placeholder before a first update
        return None, 0
    n = x.shape[2]
    if (buffer is not None and x.data_ptr() == buffer.data_ptr() and x.stride() == buffer.stride()
            and x.shape[:2] == buffer.shape[:2] and x.shape[3] == buffer.shape[3] and n <= buffer.shape[2]):
        return buffer, n
    return _room(x, n, x), n


def _room(like: torch.Tensor, length: int, prefix: torch.Tensor | None) -> torch.Tensor:
    """A buffer [B, heads, capacity_for(length), d] shaped as ``like`` [B, heads, *, d], with
    ``prefix`` [B, heads, n, d] copied into its first slots."""
    fresh = like.new_empty(like.shape[0], like.shape[1], capacity_for(length), like.shape[3])
    if prefix is not None:
        fresh[:, :, :prefix.shape[2]] = prefix
    return fresh


class GrowingCache(DynamicCache):
    """A ``DynamicCache`` whose layers are ``GrowingLayer``s (created on first use, as its own)."""

    def __init__(self):
        Cache.__init__(self, layer_class_to_replicate=GrowingLayer)
