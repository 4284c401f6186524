"""What decoding reads of a model: every method and attribute the engine, the proposers and the
verifiers use, and nothing else.

Decoding stands below the pipeline (DESIGN.md floors), so it never imports the model class; any
object with this shape decodes. ``multitoken.pipeline.MultiTokenModel`` is the one the package
ships (its ``step`` lives in ``pipeline/runtime/incremental.py``).
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable, Protocol, runtime_checkable

import numpy as np
import torch


@runtime_checkable
class Caches(Protocol):
    """KV caches of one decoding run (backbone + head layers), rows on one slot axis."""

    length: int  # slots held (a step's tokens go after them)
    valid: np.ndarray | None  # [B, length] bool: slot holds a token of the row (None: every slot, every row)

    def keep(self, start: int, slots: list[list[int]]) -> None:
        """After a step fed from slot ``start``: row b keeps the step's slots ``start + slots[b]``
        (its committed tokens and kept path, in order, from its first slot of the step), the
        others of the step are forgotten."""

    def keep_rows(self, rows: list[int]) -> None:
        """Keep only these batch rows, in this order (finished rows leave)."""


@runtime_checkable
class StepResult(Protocol):
    """One forward pass over the new tokens [B, T]; distributions are computed on demand."""

    first: int  # the first position with logits
    model_s: float  # seconds spent in model computations since the pass (lazy unembeddings, heads)
    unembed_rows: Counter  # rows per unembedding call made for this pass -> calls
    hiddens: dict[int, torch.Tensor]  # layer heads' states [B, T, H] (their logits come unembedded on demand)
    feats: Any  # ``.base`` [B, T, H]: the heads' input (CP's sequential drafts condition on it); ``.layer_states``
    # (L-1) x [B, T, H]: the trunk layers' outputs, kept for heads with ``needs_layer_states`` (the eagle3 drafter fuses three)

    def base_logits(self) -> torch.Tensor:
        """Base (head 1) logits after positions first..T-1 # [B, T - first, V]."""

    def base_argmax(self) -> torch.Tensor:
        """Their argmax # [B, T - first] long (computed without the logits where the model can)."""

    def at(self, x: torch.Tensor, anchors: tuple[int, ...]) -> torch.Tensor:
        """Row b of ``x`` [B, T, ...] at position anchors[b] # -> [B, 1, ...]."""

    def anchor_head_logits(self, index: int, anchors: tuple[int, ...]) -> torch.Tensor:
        """Layer head ``index``'s logits at each row's anchor # [B, V]."""

    def anchor_head_log_probs(self, index: int, anchors: tuple[int, ...]) -> torch.Tensor:
        """Head ``index``'s log-distribution at each row's anchor # [B, V] float32."""

    def anchor_head_argmax(self, index: int, anchors: tuple[int, ...]) -> torch.Tensor:
        """Layer head ``index``'s argmax at each row's anchor # [B] long (computed without the
        logits where the model can)."""

    def condition(self, tokens: torch.Tensor) -> None:
        """For a pass with ``defer_heads``: run the heads that read token t+1 with ``tokens`` [B]
        as the token after each row's last position (extending their caches), once, before
        reading them (DynaMo over conditional drafts)."""


@runtime_checkable
class Backbone(Protocol):
    tokenizer: Any  # decode ids to text, eos
    config: Any  # transformers config: max_position_embeddings, eos_token_id
    causal_lm: Any  # its generation_config supplies the end-of-sequence ids

    @property
    def device(self) -> torch.device: ...

    @property
    def vocab_size(self) -> int: ...


@runtime_checkable
class DecodingModel(Protocol):
    """A base model with multi-token heads, as the engine drives it."""

    backbone: Backbone
    heads: Any  # a HeadAdapter: ``config.head_type``, ``supports_sequential_drafts`` (then ``conditional_log_probs``),
    # ``drafts_autoregressively`` (then ``fuse``, ``new_cache``, ``step``, ``to_target``, ``target_log_probs``: eagle3)
    heads_dir: Any  # where the heads came from (a static tree reads its per-rank accuracies there), or None

    @property
    def n_future(self) -> int: ...

    def prepare_linears(self) -> int:
        """Apply the model's CPU linear setting (once per model and setting): the engine calls it
        where a run starts, before ``new_caches``."""

    def new_caches(self, draft_vocab: int | None = None) -> Caches:
        """Empty caches for one run; its steps' head rows score ``draft_vocab`` tokens (0: the
        whole vocabulary; None: the heads' recorded size, DecodeConfig's ``--draft-vocab``)."""

    def step(self, new_ids: torch.Tensor, caches: Caches, heads_upto: int | None = None,
             read_from: int = 0, lengths: list[int] | None = None,
             attend: torch.Tensor | None = None, offsets: torch.Tensor | None = None,
             clock: Callable[[], float] | None = None, defer_heads: bool = False) -> StepResult:
        """Feed ``new_ids`` # [B, T_new] (row b's last ``lengths[b]`` are its tokens, the rest
        pads; None: all); extend ``caches``; return the pass's outputs. ``attend`` [T_new, T_new]
        bool / ``offsets`` [T_new]: tree mask and depths (None: causal); [B, T_new, T_new] /
        [B, T_new]: one tree per row, its nodes its last ``lengths[b]`` slots. ``clock`` times
        the output's lazy computations (model time). ``defer_heads``: heads that read token
        t+1 (``heads.needs_next_tokens``) wait for ``StepResult.condition``."""
