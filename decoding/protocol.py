"""What decoding reads of a model: the methods and attributes ``generate`` and the proposals use.

Decoding stands below the pipeline (DESIGN.md floors), so it never imports the model class; any
object with this shape decodes. ``multitoken.pipeline.MultiTokenModel`` is the one the package
ships (its ``step`` lives in ``pipeline/model/incremental.py``).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class Caches(Protocol):
    """KV caches of one decoding run (backbone + head layers)."""

    def crop(self, remove: int) -> None:
        """Forget the last ``remove`` positions (rejected drafts)."""

    def keep(self, start: int, rows: list[int]) -> None:
        """Keep positions [0, start) and ``start + rows`` (an accepted tree path), in order."""

    def keep_paths(self, start: int, paths: list[list[int]]) -> None:
        """Batched trees: row b keeps the step's slots ``start + paths[b]`` (its accepted path),
        in order; its other slots of the step are forgotten."""

    def crop_rows(self, remove: list[int]) -> None:
        """Batched rows: forget row b's last ``remove[b]`` positions (right after the step)."""

    def keep_rows(self, rows: list[int]) -> None:
        """Batched rows: keep only these batch rows (finished rows leave)."""

    def compact_if_sparse(self) -> None:
        """Batched rows: drop masked slots when they dominate (an optimisation, never required)."""


@runtime_checkable
class StepResult(Protocol):
    """One forward pass over the new tokens; distributions are computed on demand."""

    first: int  # the first position with logits
    model_s: float  # seconds spent in model computations (counted as model time)

    def base_logits(self) -> torch.Tensor:
        """Base (head 1) logits after positions first..T-1 # [B, T - first, V]."""

    def base_log_probs(self) -> torch.Tensor:
        """Base log-distribution # [B, T - first, V] float32."""

    def head_log_probs(self, index: int, pos: int) -> torch.Tensor:
        """Head ``index``'s log-distribution at position ``pos`` # [B, V] float32."""

    def anchor_hidden(self, pos: int) -> torch.Tensor:
        """The heads' input at ``pos`` # [B, H] (CP's sequential drafts condition on it)."""


@runtime_checkable
class Backbone(Protocol):
    tokenizer: Any  # decode ids to text, eos
    config: Any  # transformers config: max_position_embeddings, eos_token_id
    causal_lm: Any  # its generation_config supplies sampling defaults

    @property
    def device(self) -> torch.device: ...

    @property
    def vocab_size(self) -> int: ...


@runtime_checkable
class DecodingModel(Protocol):
    """A base model with multi-token heads, as ``generate`` drives it."""

    backbone: Backbone
    heads: Any  # a HeadAdapter: ``config.head_type``, ``supports_sequential_drafts`` (then ``conditional_log_probs``)

    @property
    def n_future(self) -> int: ...

    def new_caches(self) -> Caches:
        """Empty caches for one run."""

    def step(self, new_ids: torch.Tensor, caches: Caches, heads_upto: int | None = None,
             read_from: int = 0, lengths: list[int] | None = None,
             attend: torch.Tensor | None = None, offsets: torch.Tensor | None = None) -> StepResult:
        """Feed ``new_ids`` # [B, T_new] (row b's last ``lengths[b]`` are its tokens, the rest
        pads; None: all); extend ``caches``; return the pass's outputs. ``attend`` [T_new, T_new]
        bool / ``offsets`` [T_new]: tree mask and depths (None: causal); [B, T_new, T_new] /
        [B, T_new]: one tree per row, its nodes its last ``lengths[b]`` slots."""
