"""Batched decoding: B prompts in one loop, every row exactly what it would be decoded alone.

``generate_batch(model, prompts, cfg, seeds=...)`` runs any mode (``ar``, ``dynamic``,
``speculative``, ``typical``) with any drafter, chain or candidate trees (``--tree``; each row its
own tree, all verified in one pass: ``batch_tree.py``), over rows of different prompt lengths
that accept different numbers of drafts, back off to different orders and finish at different
times.
``generate(model, prompts, cfg)`` (the package's entry point) takes one prompt or many.

What is shared, what is per row:
- One forward pass per step for all live rows (``model.step`` with per-row lengths): prompts
  are left-padded, each step's tokens right-aligned, so a row's anchor and its rejected drafts
  sit at the end of the step. The KV caches keep one slot axis and mask per row the slots that
  hold none of its tokens (``pipeline/model/ragged.py``; positions count a row's own tokens only,
  so rotary is right per row). Rejected drafts are forgotten per row: the suffix all rows reject
  is cropped, the rest masked; holes are gathered away only when they make the slot axis 1.5x the
  longest row. Why masking over per-step compaction: a compaction gathers every K and V slot of
  every layer (as many bytes as one step's attention reads), while a hole costs only its own
  slot's share of later reads. Measured (``scripts/bench_cache_layout.py``: embedded model and
  heads, B = 8 ragged prompts, 128 tokens): the masked axis reads 1.10x (speculative), 1.01x
  (typical, dynamic) the slots of a compact one, while compacting every step would copy about
  as many slots again as it reads (~2x the cache traffic).
- Everything a row decides is decided by the same functions as batch 1 (proposal, acceptance,
  sampling, DynaMo's ``dynamic_propose``), on that row's slice of the step (``RowView``), with its
  own state: context mask, ``torch.Generator`` and numpy generator seeded with the row's seed.
  Hence the property the tests check: row b of a batch equals ``generate(model, prompt_b, cfg
  with seed = seeds[b])`` token for token, greedy or sampled (up to float rounding of the batched
  matmuls, which a greedy argmax or a seeded draw crosses only at an exact tie).
- Host reads stay one per step for the whole batch: the committed ids of every row in one
  transfer (a greedy ``ar`` step takes the argmax of all rows in one call), every row's verdict
  and drafts in one, and DynaMo's top-k of every row's heads in one (``head_candidates`` over
  [B * n, V]); the grids are then built on the host per row. A tree step reads as often as
  batch 1 does, for all rows together: the guesses, then greedy verdicts in one read, or
  sampled / typical ones in two (every row's walk inputs; every row's token after its path;
  ``batch_tree.py``).
- A finished row (end of sequence or budget) leaves the batch before the next forward pass
  (``DecodeCaches.keep_rows``): it costs nothing afterwards.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from .accept import greedy_accept, speculative_accept
from .batch_steps import HeadWidth, Row, RowView, accept_all, propose_dynamic, propose_speculative
from .batch_tree import BatchTrees, tree_loop
from .config import DecodeConfig, check_context
from .dynamo import always_backs_off, prepare_kernel
from .loop import DecodeResult, RunState, _acceptor, _eos_ids, generate as generate_one, stats_order_cap
from .proposal import joint_drafts, pick_drafter
from .sampling import Sampler
from .text import continuation_text
from .timing import clock_for
from .trace import Trace
from .tree_step import TreeSteps
from multitoken.base.errors import UsageError

__all__ = ["HeadWidth", "Row", "RowView", "generate", "generate_batch", "is_batch", "prompt_rows"]


def prompt_rows(prompts, attention_mask: torch.Tensor | None = None) -> list[list[int]]:
    """Token lists from a list of prompts (lists or 1-D tensors) or a padded [B, T] tensor with
    its attention mask (either padding side)."""
    if isinstance(prompts, torch.Tensor):
        ids = prompts.reshape(-1, prompts.shape[-1]).cpu()
        mask = torch.ones_like(ids, dtype=torch.bool) if attention_mask is None else attention_mask.reshape(ids.shape).bool().cpu()
        return [row[m].tolist() for row, m in zip(ids, mask)]
    return [torch.as_tensor(p, dtype=torch.long).reshape(-1).tolist() for p in prompts]


def is_batch(prompts, attention_mask=None) -> bool:
    """Several prompts (or one given with an attention mask / as a list of lists)."""
    if isinstance(prompts, torch.Tensor):
        return attention_mask is not None or (prompts.dim() == 2 and prompts.shape[0] > 1)
    return len(prompts) > 0 and not isinstance(prompts[0], (int, np.integer)) and not (
        isinstance(prompts[0], torch.Tensor) and prompts[0].dim() == 0)


def generate(model, prompts, cfg: DecodeConfig | None = None, *, seeds=None, attention_mask=None, **kwargs):
    """One prompt (list of ids or [1, T] tensor) -> ``DecodeResult`` (``loop.generate``); several
    (a list of id lists, or a [B, T] tensor with ``attention_mask``) -> a list of them, one per
    row, each equal to that row decoded alone with seed ``seeds[b]`` (default: ``cfg.seed``)."""
    if is_batch(prompts, attention_mask):
        return generate_batch(model, prompts, cfg, seeds=seeds, attention_mask=attention_mask, **kwargs)
    return generate_one(model, prompts, cfg, **kwargs)


def _left_pad(seqs: list[torch.Tensor], width: int, device) -> torch.Tensor:
    """Rows right-aligned in a [B, width] tensor (pads, id 0, first: masked by the caches)."""
    out = torch.zeros(len(seqs), width, dtype=torch.long, device=device)
    for row, seq in enumerate(seqs):
        out[row, width - seq.numel():] = seq
    return out


@torch.inference_mode()
def generate_batch(model, prompts, cfg: DecodeConfig | None = None, *, seeds=None, attention_mask=None, table=None,
                   on_tokens=None, drafter=None, acceptor=None, profile: bool = False,
                   tree_accuracies=None) -> list[DecodeResult]:
    """Decode every prompt (see the module doc). ``on_tokens(row, tokens)`` streams final tokens
    per row; ``seeds[b]`` seeds row b's generators (default ``cfg.seed`` for all);
    ``tree_accuracies`` as for ``loop.generate``."""
    cfg = cfg or DecodeConfig()
    vocab = model.backbone.vocab_size
    cfg.validate(vocab_size=vocab, n_heads=model.n_future, max_order=stats_order_cap(cfg, model.n_future, table, False),
                 table=table)
    cfg = cfg.resolved()
    prompts = prompt_rows(prompts, attention_mask)
    if not prompts:
        raise UsageError("no prompts were given", "pass at least one prompt")
    seeds = [cfg.seed] * len(prompts) if seeds is None else [int(s) for s in seeds]
    if len(seeds) != len(prompts):
        raise UsageError(f"{len(seeds)} seeds for {len(prompts)} prompts", "pass one seed per prompt")
    for seed in seeds:
        replace(cfg, seed=seed).validate()  # the seed's range, as for one prompt
    for ids in prompts:
        if not ids:
            raise UsageError("a prompt is empty", "pass at least one token per prompt")
        check_context(len(ids), cfg.max_new_tokens, model.backbone.config.max_position_embeddings)
    if cfg.tree != "chain" and (drafter is not None or acceptor is not None):
        raise UsageError("--tree static / dynamic build their own candidates and acceptance",
                         "pass --tree chain with a custom drafter or acceptor")
    device = model.backbone.device
    speculative = cfg.mode in ("speculative", "typical")
    chain = cfg.tree == "chain"
    # a dynamic tree ranks its paths by the joint where the drafter would draft from it
    drafter = drafter or (pick_drafter(cfg.drafter, model.heads, table) if speculative and cfg.tree != "static" else None)
    acceptor = acceptor or _acceptor(cfg)
    eos = _eos_ids(model)
    cap = stats_order_cap(cfg, model.n_future, table, drafter is joint_drafts and chain)
    order = cap or cfg.order(model.n_future)
    heads_read = 1 if cfg.mode == "dynamic" and always_backs_off(cfg) else order
    argmax_only = cfg.greedy and acceptor in (greedy_accept, speculative_accept)
    wants_rule = getattr(acceptor, "wants_rule_probs", False) and not cfg.greedy
    draft_cfg = replace(cfg, static_threshold=False, adaptive_threshold=False)
    rows = [_new_row(b, ids, replace(cfg, seed=seed), model, table, vocab, device, draft_cfg, cap, profile, len(prompts))
            for b, (ids, seed) in enumerate(zip(prompts, seeds))]
    unembed_rows = rows[0].trace.unembed_rows
    for row in rows[1:]:
        row.trace.unembed_rows = unembed_rows  # calls serve the whole batch: one count, shared
    clock = clock_for(device, profile)
    batch = list(rows)  # the rows in the caches and in ``out``, in batch order

    def forward(batch: list[Row], new: torch.Tensor, read_from: int, lengths: list[int] | None, **tree):
        start = clock()
        result = model.step(new, caches, heads_upto=heads_read, read_from=read_from, lengths=lengths, **tree)
        result.clock, result.unembed_rows = clock, unembed_rows
        spent = clock() - start
        for row in batch:
            row.trace.model_s += spent
            row.trace.forward_passes += 1
        return result

    def finish(row: Row) -> None:
        row.trace.wall_s = clock() - t0

    if cfg.mode == "dynamic" or drafter is joint_drafts:
        prepare_kernel(cfg, table, order)
    # trees: one shape / budget for every row (auto times the verify step here, off the clock)
    trees = None if chain else BatchTrees(TreeSteps(model, cfg, rows[0].run, order, rows[0].trace, tree_accuracies), rows, order)
    t0 = clock()
    caches = model.new_caches()
    width = max(len(p) for p in prompts)
    lengths = [len(p) for p in prompts]
    ids = _left_pad([torch.tensor(p) for p in prompts], width, "cpu").to(device)
    out = forward(batch, ids, width - 1, lengths if min(lengths) < width else None)
    for row in rows:
        row.trace.prefill_s, row.anchor = row.trace.model_s, width - 1
    if trees is not None:  # one tree per row, all verified in one pass per step (batch_tree.py)
        tree_loop(trees, out, batch, caches, forward, finish, eos, on_tokens, device)
    while chain:
        live = [j for j, row in enumerate(batch) if not row.done]
        if not live:  # the last verification finished every row
            break
        anchors = tuple(row.anchor for row in batch)
        if cfg.mode == "dynamic":
            propose_dynamic(out, batch, live, anchors, order, cfg, table, vocab)
        else:
            propose_speculative(out, batch, live, anchors, order, speculative, drafter, device)
        for j in live:
            row = batch[j]
            row.trace.model_s += out.model_s
        out.model_s = 0.0
        for j in live:
            if batch[j].emit(batch[j].commit, eos, on_tokens):
                finish(batch[j])
        keep = [j for j in live if not batch[j].done]
        if not keep:
            break
        if len(keep) < len(batch):
            caches.keep_rows(keep)  # finished rows leave before the next pass
            batch = [batch[j] for j in keep]
        caches.compact_if_sparse()
        out, new = _step(forward, batch, device)
        with_drafts = [j for j, row in enumerate(batch) if row.drafts.tokens.numel()]
        if with_drafts:
            accept_all(out, batch, with_drafts, caches, acceptor, cfg, argmax_only, wants_rule, eos, on_tokens, finish, new)
    results = []
    tok = model.backbone.tokenizer
    for row in rows:
        row.trace.new_tokens = len(row.out_ids)
        row.trace.dynamic_kernel = row.run.kernels
        text = continuation_text(tok, row.prompt, row.out_ids) if tok is not None else ""
        results.append(DecodeResult(row.out_ids, text, row.trace, row.prompt))
    return results


def _new_row(index, ids, cfg, model, table, vocab, device, draft_cfg, cap, profile, batch_size) -> Row:
    sampler = Sampler(cfg.greedy, cfg.temperature, cfg.top_k, cfg.seed, penalty=cfg.penalty, device=device)
    seen = torch.zeros(vocab, dtype=torch.bool, device=device)
    seen[torch.tensor(ids, device=device)] = True
    run = RunState(model, cfg, sampler, table, seen, None if cfg.greedy else np.random.default_rng(cfg.seed), vocab)
    run.draft_cfg = draft_cfg
    run.seen_host = np.zeros(vocab, dtype=bool)  # its host mirror from the host ids: no device read
    run.seen_host[ids] = True
    trace = Trace(mode=cfg.mode, prompt_tokens=len(ids), repetition_penalty=cfg.penalty, stats_order_cap=cap or 0,
                  device=str(device), synchronised=profile, batch_size=batch_size)
    return Row(index, list(ids), run, trace)


def _step(forward, batch, device):
    """One pass over every row's committed tokens and drafts, right-aligned; anchors move to
    each row's last committed token."""
    seqs = [torch.cat([torch.tensor(row.commit, dtype=torch.long, device=device), row.drafts.tokens]) for row in batch]
    lengths = [s.numel() for s in seqs]
    width = max(lengths)
    if all(not row.drafts.tokens.numel() for row in batch):  # host ids only: one copy to the device
        new = _left_pad([torch.tensor(row.commit) for row in batch], width, "cpu").to(device)
    else:
        new = _left_pad(seqs, width, device)
    for row, n in zip(batch, lengths):
        row.anchor = width - n + len(row.commit) - 1
    return forward(batch, new, min(row.anchor for row in batch), lengths if min(lengths) < width else None), new


