"""The decoding engine: one loop for every mode, always batched (one prompt is a batch of one).

Each step: propose -> emit the committed tokens -> one forward pass -> verify -> keep the
accepted KV slots -> emit the accepted tokens. The proposer (``proposal.py``: a chain or DynaMo's
in ``drafts.py``, a tree in ``tree_proposer.py``) gives every row its final tokens for the next
positions and the candidates to verify after them; the verifier (``verify.py``) keeps a path of
them and decides the token after it; the caches keep each row's kept slots (``DecodingModel`` in
``protocol.py`` declares all the engine reads). Which proposer, drafter and rule, and what a step
reads, is decided once per call (``plan.py``); the time accounting is the trace's (``trace.py``).

What is shared, what is per row: one forward pass per step for all live rows, prompts
left-padded and each step's tokens right-aligned, so a row's candidates sit at the end of the
step (``pipeline/runtime/ragged.py``: positions count a row's own tokens, holes are masked).
Everything a row decides it decides alone, with its own context mask, ``torch.Generator`` and
numpy generator seeded with its seed, so every row equals its run alone; the host reads are
made once per step for the whole batch (the committed ids, the verdicts, DynaMo's top-k). A
finished row leaves the batch before the next pass, the batch's last rows taking the places left.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import torch

from .config import DecodeConfig, check_context, check_seed, stats_order_cap
from .drafts import Eagle3Chains, chain, dynamo
from .dynamo.step import prepare_kernel
from .plan import DecodePlan, resolve
from .proposal import Drafts, left_pad
from .sampling import Sampler
from .text import continuation_text
from .trace import Timer, Trace, clock_for
from .tree_proposer import Eagle3Trees, Trees
from .trees import adapt_lookup, looked_up
from .verify import TreeVerdict, Verifier
from multitoken.base.boundary import check_call, check_prompt_ids, check_seeds, check_vocab
from multitoken.base.errors import UsageError


@dataclass
class DecodeResult:
    token_ids: list[int]  # the generated tokens (prompt excluded)
    text: str
    trace: Trace
    prompt_ids: list[int] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"token_ids": self.token_ids, "text": self.text, "trace": self.trace.as_dict()}


@dataclass
class Run:
    """What every row of one call shares: the model, the settings and their plan, the stats, the clock."""

    model: object
    cfg: DecodeConfig
    plan: DecodePlan
    table: object  # co-occurrence stats (``.mask``), or None
    vocab: int
    device: torch.device
    clock: object
    no_drafts: Drafts
    draft_cfg: DecodeConfig  # the joint drafter's grid: no thresholds


@dataclass
class Row:
    """One sequence: its prompt, its decoding state and its trace."""

    index: int  # in the caller's list
    prompt: list[int]
    cfg: DecodeConfig  # with the row's seed
    sampler: Sampler
    seen: torch.Tensor  # [V] bool on the device: tokens in the context (repetition penalty)
    rng: np.random.Generator | None  # grid sampling; None = greedy
    trace: Trace
    out_ids: list[int] = field(default_factory=list)
    anchor: int = 0  # its position in the last pass whose heads predict its next tokens
    forced: int | None = None  # its next token, when the last verification decided it
    lookup_k: int = 0  # --lookup: the branch's length this step (adapted to what was kept)
    lookup_len: int = 0  # the lookup branch proposed at the last step (0: none)
    done: bool = False
    _seen_host: np.ndarray | None = None

    @property
    def budget(self) -> int:
        return self.cfg.max_new_tokens - len(self.out_ids)

    @property
    def seen_host(self) -> np.ndarray:
        """``seen`` on the host [V] bool, for DynaMo's grids: built from the host ids on first
        use (no device read), then kept in step by ``emit``."""
        if self._seen_host is None:
            self._seen_host = np.zeros(self.seen.shape[0], dtype=bool)
            self._seen_host[self.prompt + self.out_ids] = True
        return self._seen_host

    def emit(self, tokens: list[int], eos: set[int], on_tokens) -> bool:
        """Commit final tokens; True when the row is over (budget or end of sequence)."""
        tokens = tokens[: self.budget]
        if self.cfg.stop_at_eos:
            stop = next((i for i, t in enumerate(tokens) if t in eos), None)
            tokens = tokens if stop is None else tokens[: stop + 1]
        self.out_ids.extend(tokens)
        if tokens:
            self.seen[tokens] = True
            if self._seen_host is not None:
                self._seen_host[tokens] = True
        if on_tokens and tokens:
            on_tokens(self.index, tokens)
        self.done = self.budget <= 0 or (self.cfg.stop_at_eos and bool(tokens) and tokens[-1] in eos)
        return self.done

    def judged(self, verdict: TreeVerdict, tree, plan: DecodePlan) -> None:
        """A verification's verdict on this row's candidates (``tree``: its tree, None for a
        chain): the trace's counts, the next lookup branch's length, the anchor moved to the last
        kept node, the token after it forced. Its tokens are emitted after."""
        self.trace.accepted_lengths[len(verdict.path) - 1] += 1
        if plan.proposer == "tree":
            self.trace.tree_sibling_ranks.update(verdict.sibling_ranks)
        if self.lookup_len:
            self.trace.lookup_tokens += looked_up(tree, verdict.path)
            self.lookup_k = adapt_lookup(self.lookup_k, self.lookup_len, len(verdict.path) - 1, plan.lookup)
        self.anchor += verdict.path[-1]
        self.forced = verdict.next_token


def eos_ids(model) -> set[int]:
    eos = getattr(model.backbone.causal_lm.generation_config, "eos_token_id", None)
    if eos is None:
        eos = model.backbone.config.eos_token_id
    return set(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])


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


def generate(model, prompts, cfg: DecodeConfig | None = None, *, seeds=None, attention_mask=None, on_tokens=None, **kwargs):
    """One prompt (list of ids or [1, T] tensor) -> ``DecodeResult``, streaming
    ``on_tokens(tokens)``; several (a list of id lists, or a [B, T] tensor with
    ``attention_mask``) -> one per row, each equal to that row decoded alone with seed
    ``seeds[b]`` (default: ``cfg.sampling.seed``), streaming ``on_tokens(row, tokens)``."""
    check_prompt_ids(prompts, attention_mask)  # before is_batch reads them
    if is_batch(prompts, attention_mask):
        return generate_batch(model, prompts, cfg, seeds=seeds, attention_mask=attention_mask, on_tokens=on_tokens, **kwargs)
    stream = None if on_tokens is None else (lambda row, tokens: on_tokens(tokens))
    return generate_batch(model, [prompts], cfg, seeds=seeds, on_tokens=stream, **kwargs)[0]


def _prompts(model, prompts, cfg: DecodeConfig, seeds, attention_mask) -> tuple[list[list[int]], list[int]]:
    prompts = prompt_rows(prompts, attention_mask)
    if not prompts:
        raise UsageError("no prompts were given", "pass at least one prompt")
    seeds = [cfg.sampling.seed] * len(prompts) if seeds is None else [int(s) for s in seeds]
    if len(seeds) != len(prompts):
        raise UsageError(f"{len(seeds)} seeds for {len(prompts)} prompts", "pass one seed per prompt")
    for seed in seeds:
        check_seed(seed)
    for ids in prompts:
        if not ids:
            raise UsageError("the prompt is empty" if len(prompts) == 1 else "a prompt is empty",
                             "pass at least one token per prompt")
        check_context(len(ids), cfg.max_new_tokens, model.backbone.config.max_position_embeddings)
    return prompts, seeds


def _row(run: Run, index: int, ids: list[int], seed: int, profile: bool, batch_size: int) -> Row:
    cfg = replace(run.cfg, seed=seed)
    seen = torch.zeros(run.vocab, dtype=torch.bool, device=run.device)
    seen[torch.tensor(ids, device=run.device)] = True
    s = cfg.sampling
    sampler = Sampler(s.greedy, s.temperature, s.top_k, seed, penalty=s.penalty, device=run.device)
    trace = Trace(mode=cfg.mode, prompt_tokens=len(ids), repetition_penalty=cfg.sampling.penalty,
                  stats_order_cap=run.plan.stats_cap or 0, device=str(run.device), synchronised=profile, batch_size=batch_size,
                  plan=run.plan.describe())
    return Row(index, list(ids), cfg, sampler, seen, None if run.plan.greedy else np.random.default_rng(seed), trace)


@torch.inference_mode()  # cheaper than no_grad per op: a small model's step is mostly op overhead
def generate_batch(model, prompts, cfg: DecodeConfig | None = None, *, seeds=None, attention_mask=None, table=None,
                   on_tokens=None, drafter=None, acceptor=None, profile: bool = False,
                   tree_accuracies=None) -> list[DecodeResult]:
    """Decode every prompt (see the module doc) -> one ``DecodeResult`` per row.

    ``table``: co-occurrence stats (DynaMo's mask, the joint drafter); ``on_tokens(row, tokens)``
    streams final tokens per row; ``seeds[b]`` seeds row b's generators (default ``cfg.sampling.seed``);
    ``drafter`` / ``acceptor``: a chain drafter / chain rule of one's own (the signatures of
    ``drafts.independent_drafts`` / ``rules.greedy_accept``); ``profile``: make the trace's model
    / logic split exact on an accelerator (synchronise at every clock reading: the waits cost
    time); ``tree_accuracies``: a ``trees.Accuracies`` for ``--tree static`` (default: the file
    beside the heads, else the fallback prior).
    """
    check_call(model, cfg, table, DecodeConfig)
    check_prompt_ids(prompts, attention_mask)
    check_seeds(seeds)
    cfg = cfg or DecodeConfig()
    vocab, n_heads = model.backbone.vocab_size, model.n_future
    cfg.validate(vocab_size=vocab, n_heads=n_heads, max_order=stats_order_cap(cfg, n_heads, table, False), table=table)
    cfg = cfg.resolved()  # the repetition penalty's default depends on --greedy
    prompts, seeds = _prompts(model, prompts, cfg, seeds, attention_mask)
    check_vocab(prompts, vocab)
    plan = resolve(cfg, model, table, drafter, acceptor)
    device = model.backbone.device
    run = Run(model, cfg, plan, table, vocab, device, clock_for(device, profile), Drafts.empty(device),
              replace(cfg, static_threshold=False, adaptive_threshold=False))
    rows = [_row(run, b, ids, seed, profile, len(prompts)) for b, (ids, seed) in enumerate(zip(prompts, seeds))]
    if plan.grids:
        prepare_kernel(cfg, table, plan.order)  # numba compiles / loads its cache here, off the clock
    if plan.proposer == "dynamo":
        propose = dynamo(run)
    elif plan.proposer == "tree":  # the static / dynamic heads' trees time the verify step here (auto), off the clock
        propose = Eagle3Trees(run, Eagle3Chains(run)) if plan.drafter == "eagle3" else Trees(run, tree_accuracies)
        for row in rows:
            propose.label(row.trace)
    else:
        propose = chain(run, drafter)
    _loop(run, rows, propose, Verifier(run, acceptor), eos_ids(model), on_tokens)
    tok = model.backbone.tokenizer
    return [DecodeResult(row.out_ids, continuation_text(tok, row.prompt, row.out_ids) if tok is not None else "",
                         row.trace, row.prompt) for row in rows]


def _fill_places(kept: list[int]) -> list[int]:
    """The batch positions ``kept`` (ascending) in their order after the others leave: each row
    before len(kept) stays where it is, and the last rows fill the places left, so a cache moves
    as many rows as ended rather than every row after the first that ended."""
    n, stay = len(kept), set(kept)
    order, tail = list(range(n)), iter(j for j in kept if j >= n)
    for place in range(n):
        if place not in stay:
            order[place] = next(tail)
    return order


def _loop(run: Run, rows: list[Row], propose, verify, eos: set[int], on_tokens) -> None:
    """Decode every row to its end (see the module doc)."""
    model, plan, timer = run.model, run.plan, Timer(run.clock, [row.trace for row in rows])
    model.prepare_linears()  # the CPU linear setting, applied where decoding starts (docs/kernels.md)
    caches = model.new_caches(plan.draft_vocab)
    timer.prepared()
    batch = list(rows)  # the rows in the caches and in ``out``, in batch order

    def forward(ids: torch.Tensor, read_from: int, lengths: list[int], attend=None, offsets=None):
        if len(lengths) == 1 and caches.valid is None and attend is not None:
            attend, offsets = attend[0], offsets[0]  # one row: the unpadded tree context
        ragged = lengths if min(lengths) < ids.shape[1] else None
        return timer.forward([row.trace for row in batch], lambda: model.step(
            ids, caches, heads_upto=plan.heads_read, read_from=read_from, lengths=ragged, attend=attend,
            offsets=offsets, clock=run.clock, defer_heads=plan.defer_heads))

    def emit(row: Row, tokens: list[int]) -> bool:
        if row.emit(tokens, eos, on_tokens):
            timer.finish(row.trace, len(row.out_ids))
        return row.done

    width = max(len(row.prompt) for row in rows)
    out = forward(left_pad([torch.tensor(row.prompt) for row in rows], width, "cpu").to(run.device), width - 1,
                  [len(row.prompt) for row in rows])
    timer.prefilled()
    for row in rows:
        row.anchor = width - 1
    while live := [j for j, row in enumerate(batch) if not row.done]:
        proposal = propose(out, batch, tuple(row.anchor for row in batch), live)
        timer.read([batch[j].trace for j in live], out)  # head distributions and drafts: model time
        keep = [s for s, j in enumerate(live) if not emit(batch[j], proposal.commits[s])]
        if not keep:
            break
        if len(keep) < len(batch):
            order = _fill_places([live[s] for s in keep])
            caches.keep_rows(order)  # finished rows leave before the next pass
            batch = [batch[j] for j in order]
            at = {j: s for s, j in enumerate(live)}
            slots = [at[j] for j in order]  # the proposal's rows are the live rows'
            if slots != list(range(len(live))):
                proposal = proposal.select(slots)
        start, width = caches.length, proposal.width
        for row, n, commit in zip(batch, proposal.lengths, proposal.commits):
            row.anchor = width - n + len(commit) - 1  # its last committed token: the root of its candidates
        timer.unembedded(out)
        # a tree's verification reads every node; a chain's from each row's root on
        read_from = 0 if proposal.attend is not None else min(row.anchor for row in batch)
        out = forward(proposal.ids, read_from, proposal.lengths, proposal.attend, proposal.offsets)
        verdicts = verify(out, proposal, batch)
        if any(v is not None for v in verdicts):  # each row keeps its committed tokens and its kept path
            caches.keep(start, [list(range(width - n, width)) if v is None else
                                list(range(width - n, row.anchor)) + [row.anchor + i for i in v.path]
                                for row, n, v in zip(batch, proposal.lengths, verdicts)])
        for slot, (row, v) in enumerate(zip(batch, verdicts)):
            if v is not None:  # else no drafts: the next token comes from the base at the next step
                row.judged(v, None if proposal.trees is None else proposal.trees[slot], plan)
                emit(row, v.tokens)
    timer.unembedded(out)
