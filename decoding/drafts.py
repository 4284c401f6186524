"""Proposers: what each row feeds the next forward pass. One signature for every kind:

``proposer(out, rows, anchors) -> Proposal``: for every row, the tokens already final for its
next positions (``commit``: the base's next token, or DynaMo's 1..n tokens) and the candidates
to verify after them (a chain of drafts, or a tree under the committed token; none in ``ar`` and
``dynamic`` modes), padded into one [B, T] step. ``out`` is the last pass (``StepOutput``), row b
reading its heads at position ``anchors[b]``.

The chain drafters share one signature too: ``draft(heads, first, g, row, run) -> Drafts`` (up to
``g`` drafts after the committed token ``first``, with the distributions they were drawn from);
``heads`` are row's head scores at its anchor (``RowHeads``). A tree proposer reads every row's
top guesses in one top-k call and one host read (a static tree under greedy verification none:
its tokens are gathered on the device and read with the verdict).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .dynamo.step import Candidates, dynamic_propose, head_candidates, heads_needed, joint_cells, sample_index
from .sampling import penalised_logits, with_tokens
from .trees import (MAX_RANKS, Shape, Tree, attend_rows, auto_budget, best_first, joint_tree, parse_nodes,
                    read_accuracies, right_aligned, with_lookup)
from multitoken.base.errors import UsageError


@dataclass
class Drafts:
    tokens: torch.Tensor  # [g] int64 on the target's device
    probs: torch.Tensor | None  # [g, V] the q each draft was drawn from (None: greedy drafts)

    @staticmethod
    def empty(device: torch.device | str = "cpu") -> "Drafts":
        return Drafts(torch.zeros(0, dtype=torch.long, device=device), None)


@dataclass
class Proposal:
    """One step for the rows of the batch, right-aligned after left pads."""

    ids: torch.Tensor  # [B, T] on the device
    lengths: list[int]  # tokens per row (the rest of its T are pads)
    commits: list[list[int]]  # per row: its final tokens (host), fed first
    drafts: list[Drafts]  # per row: chain drafts after its commit (empty for trees)
    trees: list[Tree | None] | None = None  # per row: its tree (node 0 = its committed token)
    attend: torch.Tensor | None = None  # [B, T, T] trees: each node sees its ancestors
    offsets: torch.Tensor | None = None  # [B, T] trees: each node's depth
    static: Shape | None = None  # a static tree whose tokens are still on the device (greedy)
    static_at: dict | None = None  # its index tensors on the device (``Trees.shape_tensors``)

    @property
    def width(self) -> int:
        return self.ids.shape[1]

    def select(self, keep: list[int]) -> "Proposal":
        """The rows ``keep`` (the others finished with their committed tokens)."""
        index = torch.tensor(keep, dtype=torch.long, device=self.ids.device)
        pick = lambda x: None if x is None else x.index_select(0, index)  # noqa: E731
        trees = None if self.trees is None else [self.trees[j] for j in keep]
        lengths = [self.lengths[j] for j in keep]
        width = max(lengths)  # a longer row may have left: its extra pad columns go
        cut = lambda x: None if x is None else x[..., self.width - width:]  # noqa: E731
        attend = None if self.attend is None else pick(self.attend)[:, self.width - width:, self.width - width:]
        return Proposal(cut(pick(self.ids)), lengths, [self.commits[j] for j in keep], [self.drafts[j] for j in keep],
                        trees, attend, cut(pick(self.offsets)), self.static, self.static_at)


def left_pad(seqs: list[torch.Tensor], width: int, device) -> torch.Tensor:
    """Rows right-aligned in a [B, width] tensor (pads, id 0, first: masked by the caches)."""
    out = torch.zeros(len(seqs), width, dtype=torch.long, device=device)
    for row, seq in enumerate(seqs):
        out[row, width - seq.numel():] = seq
    return out


def _chain_step(commits: list[list[int]], drafts: list[Drafts], device) -> Proposal:
    """Each row's committed tokens then its drafts, right-aligned."""
    lengths = [len(c) + d.tokens.numel() for c, d in zip(commits, drafts)]
    width = max(lengths)
    if len(commits) == 1:  # one row: no pads
        ids = torch.tensor(commits[0], dtype=torch.long, device=device)
        ids = torch.cat([ids, drafts[0].tokens]) if drafts[0].tokens.numel() else ids
        return Proposal(ids[None], lengths, commits, drafts)
    if all(not d.tokens.numel() for d in drafts):  # host ids only: one copy to the device
        ids = left_pad([torch.tensor(c) for c in commits], width, "cpu").to(device)
    else:
        seqs = [torch.cat([torch.tensor(c, dtype=torch.long, device=device), d.tokens]) for c, d in zip(commits, drafts)]
        ids = left_pad(seqs, width, device)
    return Proposal(ids, lengths, commits, drafts)


# Scores at the anchors ------------------------------------------------------------------------
def anchor_scores(out, i: int, anchors: tuple[int, ...]) -> torch.Tensor:
    """Head i's scores at every row's anchor # [B, V]: raw logits for the base and layer heads
    (their top-k or argmax is all most readers need: no log-softmax over V), log-probs from
    one-position heads (Medusa, CP), which make them so."""
    if i in out.hiddens:
        return out.anchor_head_logits(i, anchors)
    if i == 0:
        return out.at(out.base_logits(), tuple(a - out.first for a in anchors))[:, 0]
    return out.anchor_head_log_probs(i, anchors)


def anchor_argmax(out, i: int, anchors: tuple[int, ...]) -> torch.Tensor:
    """Head i's argmax at every row's anchor # [B] long (layer heads: without their logits where
    the model can)."""
    if i in out.hiddens:
        return out.anchor_head_argmax(i, anchors)
    return anchor_scores(out, i, anchors).argmax(-1)


class RowHeads:
    """Row ``row``'s head scores at its anchor, each read on first use # i -> [V] (the heads of
    every row are computed together, in one call per head)."""

    def __init__(self, out, row: int, anchors: tuple[int, ...], n: int, cands: list[Candidates] | None = None):
        self.out, self.row, self.anchors, self.n = out, row, anchors, n
        self.cands = cands  # heads 1..n-1's top-k, when the proposer read every row's at once

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return anchor_scores(self.out, i, self.anchors)[self.row]

    def hidden(self) -> torch.Tensor:
        """The heads' input at the anchor # [1, H] (CP's sequential drafts condition on it)."""
        return self.out.at(self.out.feats.base, self.anchors)[self.row:self.row + 1, 0]


def at_anchors(out, x: torch.Tensor, need: list[int], anchors: tuple[int, ...]) -> torch.Tensor:
    """Rows ``need`` of ``x`` [B, T - first, ...] (a pass's base outputs), each at its anchor # [R, ...]."""
    if len(anchors) == 1:  # one row: a plain slice
        return x[:, anchors[0] - out.first]
    picked = out.at(x, tuple(a - out.first for a in anchors))[:, 0]  # [B, ...]
    if len(need) < len(anchors):
        picked = picked.index_select(0, torch.tensor(need, dtype=torch.long, device=picked.device))
    return picked


def next_tokens(out, rows, need: list[int], anchors: tuple[int, ...]) -> list[int]:
    """A token from the base's target after each row's anchor: greedy takes every row's argmax
    in one call; sampling draws per row from its own generator. One host read either way."""
    sampler = rows[need[0]].sampler
    if sampler.greedy and sampler.penalty == 1:  # the argmax alone (no logits where the model screens it)
        return at_anchors(out, out.base_argmax(), need, anchors).tolist()
    scores = at_anchors(out, out.base_logits(), need, anchors)  # the base's own (not a WHS head 1) # [R, V]
    if sampler.greedy:
        seen = torch.stack([rows[j].seen for j in need]) if sampler.penalty != 1 else None
        return penalised_logits(scores, seen, sampler.penalty).argmax(-1).tolist()
    return torch.stack([rows[j].sampler.sample(scores[s], rows[j].seen) for s, j in enumerate(need)]).tolist()


def candidates_of(out, rows: list[int], anchors, heads: range, k: int, temperature: float) -> list[list[Candidates]]:
    """Top-k of ``heads`` at each of ``rows``'s anchors, for all rows in one top-k call and one
    host transfer # -> per row, one ``Candidates`` per head."""
    scores = torch.stack([anchor_scores(out, i, anchors) for i in heads], dim=1)  # [B, m, V]
    index = torch.tensor(rows, dtype=torch.long, device=scores.device)
    m = len(heads)
    flat = head_candidates(scores.index_select(0, index).reshape(len(rows) * m, -1), k, temperature)
    return [flat[s * m:(s + 1) * m] for s in range(len(rows))]


# DynaMo ------------------------------------------------------------------------------------
def dynamo(run):
    """DynaMo's step (Alg. 1): each row's 1..n final tokens from its heads' joint, no drafts."""
    cfg = run.cfg
    m = heads_needed(cfg, run.order)
    k, temperature = min(cfg.sampling.top_k, run.vocab), cfg.sampling.grid_temperature

    def propose(out, rows, anchors, live) -> Proposal:
        commits = []
        for j, cand in zip(live, candidates_of(out, live, anchors, range(m), k, temperature)):
            row = rows[j]
            choice = dynamic_propose(cand, run.order, cfg, run.table, row.seen_host, row.rng)
            commits.append(choice.tokens)
            row.trace.orders[choice.order] += 1
            row.trace.backoffs.update(choice.backed_off)
            row.trace.dynamic_kernel.update(choice.kernels)
        return _chain_step(commits, [run.no_drafts] * len(live), run.device)
    return propose


# Chains ------------------------------------------------------------------------------------
def _draw(scores: torch.Tensor, row, context: torch.Tensor):
    """A draft from a head's scores (raw logits or log-probs: the same distribution), processed
    like the target # [V] -> (id [], q [V] | None). ``context`` [j]: the tokens between the
    committed context and this draft, penalised like the context, as the verification row
    judging it does. Greedy drafts have no q: greedy verification compares tokens only."""
    seen = with_tokens(row.seen, context) if row.sampler.penalty != 1 else row.seen
    return row.sampler.draft(scores, seen)


def _pack(tokens: list[torch.Tensor], probs: list[torch.Tensor | None], device) -> Drafts:
    """Drafts from 0-d device ids (stacked where they are: no host round trip)."""
    if not tokens:
        return Drafts.empty(device)
    probs = [q for q in probs if q is not None]
    return Drafts(torch.stack(tokens), torch.stack(probs) if probs else None)


def independent_drafts(heads: RowHeads, first: int, g: int, row, run) -> Drafts:
    """Head i+1 drafts token t+i+1 on its own (the heads ignore ``first``)."""
    context = torch.tensor([first], dtype=torch.long, device=row.seen.device)  # [1 + i]
    tokens, probs = [], []
    for i in range(1, g + 1):
        tok, q = _draw(heads[i], row, context)
        tokens.append(tok)
        probs.append(q)
        context = torch.cat([context, tok.reshape(1)])
    return _pack(tokens, probs, row.seen.device)


def cp_drafts(heads: RowHeads, first: int, g: int, row, run) -> Drafts:
    """CP experts, sequentially (the CP-heads paper, eqs. 11-13): the expert weights are updated
    by every token already chosen, ``first`` included, before the next token is drawn."""
    e = heads.hidden()  # [1, H]
    prefix = torch.tensor([[first]], dtype=torch.long, device=e.device)  # [1, 1 + i]
    tokens, probs = [], []
    for _ in range(g):
        start = run.clock()
        logp = run.model.heads.conditional_log_probs(e, prefix)[0]  # [V]
        heads.out.model_s += run.clock() - start
        tok, q = _draw(logp, row, prefix[0])
        tokens.append(tok)
        probs.append(q)
        prefix = torch.cat([prefix, tok.reshape(1, 1)], 1)
    return _pack(tokens, probs, e.device)


def joint_drafts(heads: RowHeads, first: int, g: int, row, run) -> Drafts:
    """Drafts from DynaMo's co-occurrence-masked joint (eq. 6) conditioned on ``first``:
    J(x2..x_{g+1} | first) ~ prod_i p_i(x_i) * ratio(first, x2, ...)^alpha_c over the heads'
    top-k, with the repetition penalty, drawn axis by axis (each draft's q is its conditional).
    No thresholds: they exist to back off, and here the verifier already guards the output.
    Without a table this is the independent drafter."""
    cfg = run.cfg
    top = heads.cands
    if top is None:  # a draft outside the target's top-k is always rejected: k <= top_k
        rows = torch.stack([heads[i] for i in range(1, g + 1)])  # [g, V] raw logits: only their top-k is read
        top = head_candidates(rows, min(cfg.speculation.draft_k, cfg.sampling.top_k, run.vocab), cfg.sampling.grid_temperature)
    cands = [Candidates(np.array([first]), np.ones(1, dtype=np.float32))] + list(top[:g])
    cells = joint_cells(cands, run.draft_cfg, run.table, row.seen_host)
    row.trace.dynamic_kernel[cells.kernel] += 1
    grid = cells.dense()[0]  # [k]*g: the marginals below sum it whole
    tokens, marginals = [], []
    for axis in range(1, g + 1):
        marginal = grid.reshape(grid.shape[0], -1).sum(-1, dtype=np.float64)  # [k]
        if not marginal.sum() > 0:
            break
        if row.sampler.greedy:  # greedy verification reads the drafts only, not their q
            i = int(marginal.argmax())
        else:  # drawn on the host from the host grid (seeded numpy): no device read per axis
            i = sample_index(marginal, row.rng)
            marginals.append(marginal / marginal.sum())
        tokens.append(int(cands[axis].ids[i]))
        grid = grid[i]
    q = None
    if marginals:  # each axis's [k] marginal scattered to its candidate ids (one copy each)
        ids = torch.from_numpy(np.stack([c.ids for c in cands[1:len(marginals) + 1]])).to(run.device)  # [j, k]
        q = torch.zeros(len(marginals), run.vocab, dtype=torch.float64, device=run.device)
        q = q.scatter_(1, ids, torch.from_numpy(np.stack(marginals)).to(run.device)).float()
    return Drafts(torch.tensor(tokens, dtype=torch.long, device=run.device), q)


DRAFTERS = {"independent": independent_drafts, "cp": cp_drafts, "joint": joint_drafts}


def pick_drafter(name: str, heads, table=None):
    """``auto``: CP heads draft sequentially; other heads from the masked joint when a
    co-occurrence table is at hand (it raises acceptance), else independently."""
    sequential = getattr(heads, "supports_sequential_drafts", False)
    if name == "auto":
        name = "cp" if sequential else "joint" if table is not None else "independent"
    if name == "cp" and not sequential:
        raise UsageError(f"--drafter cp needs cp heads, these are {heads.config.head_type!r}", "use --drafter independent or joint")
    return DRAFTERS[name]


def chain(run, drafter):
    """The base's next token (or the one the last verification decided) and a chain of drafts
    after it; ``ar`` drafts nothing."""
    cfg = run.cfg
    speculative = cfg.mode in ("speculative", "typical")

    def propose(out, rows, anchors, live) -> Proposal:
        need = [j for j in live if rows[j].forced is None]
        if need:
            for j, token in zip(need, next_tokens(out, rows, need, anchors)):
                rows[j].forced = token
        firsts = [rows[j].forced for j in live]
        gs = [min(run.order - 1, rows[j].budget - 1) if speculative else 0 for j in live]
        drafts = [run.no_drafts] * len(live)
        drafting = [s for s, g in enumerate(gs) if g > 0]
        if drafting and drafter is joint_drafts:  # every drafting row's top-k in one read
            k, t = min(cfg.speculation.draft_k, cfg.sampling.top_k, run.vocab), cfg.sampling.grid_temperature
            cands = candidates_of(out, [live[s] for s in drafting], anchors, range(1, max(gs) + 1), k, t)
            for s, cand in zip(drafting, cands):
                j = live[s]
                drafts[s] = drafter(RowHeads(out, j, anchors, gs[s] + 1, cand), firsts[s], gs[s], rows[j], run)
        elif drafting and drafter is independent_drafts and cfg.sampling.greedy and cfg.sampling.penalty == 1:
            # greedy drafts without a penalty are each head's argmax at the anchor: all rows per head at once
            best = torch.stack([anchor_argmax(out, i, anchors) for i in range(1, max(gs) + 1)], 1)  # [B, g]
            for s in drafting:
                drafts[s] = Drafts(best[live[s], :gs[s]], None)
        else:
            for s in drafting:
                j = live[s]
                d = drafter(RowHeads(out, j, anchors, gs[s] + 1), firsts[s], gs[s], rows[j], run)
                if d.tokens.device != run.device:  # a custom drafter's host tensors: moved once
                    d = Drafts(d.tokens.to(run.device), None if d.probs is None else d.probs.to(run.device))
                drafts[s] = d
        for j in live:
            rows[j].forced = None
        return _chain_step([[f] for f in firsts], drafts, run.device)
    return propose


# Trees -------------------------------------------------------------------------------------
def joint_scored(cfg, heads, table) -> bool:
    """Whether a dynamic tree ranks its paths by DynaMo's co-occurrence-masked joint: where the
    drafter (``--drafter``, ``auto``: with stats) would draft a chain from it."""
    return (cfg.trees.tree == "dynamic" and table is not None and cfg.mode in ("speculative", "typical")
            and pick_drafter(cfg.speculation.drafter, heads, table) is joint_drafts and getattr(table, "max_order", 2) >= 2)


class Trees:
    """Candidate trees (``--tree static|dynamic``): one shape (static: Medusa's, from the heads'
    measured per-rank accuracies) or budget (dynamic: EAGLE-2's, from the step's own head
    probabilities, or their co-occurrence-masked joint) for the run, a tree per row per step."""

    def __init__(self, run, accuracies=None):
        cfg, model = run.cfg, run.model
        self.run, self.cfg = run, cfg
        self.depth = run.order - 1  # draft heads read: head d guesses the token d after the root
        self.accuracy = accuracies or read_accuracies(getattr(model, "heads_dir", None), self.depth)
        if cfg.trees.tree == "chain":  # --lookup on a chain: the heads' top guesses as a one-path tree
            self.budget, self.shape = self.depth, Shape(tuple(range(-1, self.depth)), tuple(range(self.depth + 1)), (0,) * (self.depth + 1))
        else:
            nodes = parse_nodes(cfg.trees.tree_nodes)
            argmax = cfg.sampling.greedy and cfg.sampling.penalty == 1  # greedy verification then reads no logits
            self.budget = nodes if nodes is not None else auto_budget(model, self.accuracy, self.depth, argmax)
            self.shape = best_first(self.accuracy.log_scores(self.depth), self.budget) if cfg.trees.tree == "static" else None
        self.joint = joint_scored(cfg, model.heads, run.table)
        # the joint ranks paths over the joint drafter's candidates (draft_k per head)
        joint_k = min(cfg.speculation.draft_k, cfg.sampling.top_k)
        self.ranks = min(joint_k if self.joint else min(MAX_RANKS, self.budget), run.vocab)
        self.lookup = cfg.speculation.lookup  # a branch copied from the context (greedy: host trees)
        self.on_device = self.shape is not None and cfg.mode == "speculative" and cfg.sampling.greedy and not self.lookup
        self._at: dict = {}  # each static shape's index tensors on the device

    def label(self, trace) -> None:
        trace.tree, trace.tree_nodes, trace.lookup = self.cfg.trees.tree, self.budget, self.lookup
        scores = "step probabilities x co-occurrence mask" if self.joint else "step probabilities"
        trace.tree_accuracies = self.accuracy.source if self.cfg.trees.tree == "static" else scores

    def ranks_for(self, depth: int) -> int:
        if self.shape is None:
            return self.ranks
        shape = self.shape.within(depth)
        return max(shape.max_rank(d) for d in range(1, depth + 1))

    def guesses(self, out, rows, roots: dict[int, int], keep: list[int], anchors, depth: int) -> torch.Tensor:
        """Rows ``keep``'s heads' top guesses at their anchors, on the device, packed for one
        read # -> ids [R, depth, ranks] (static) or ids and scores [R, 2, depth, ranks] as
        float64 (dynamic: this step's probabilities score the paths). With a penalty they rank
        as the verification will judge: the context and the committed token penalised."""
        logp = torch.stack([out.anchor_head_log_probs(i, anchors) for i in range(1, depth + 1)], dim=1)  # [B, D, V]
        logp = logp.index_select(0, torch.tensor(keep, dtype=torch.long, device=logp.device))
        if self.cfg.sampling.penalty != 1:
            seen = torch.stack([with_tokens(rows[j].seen, [roots[j]]) for j in keep])[:, None]  # [R, 1, V]
            logp = penalised_logits(logp, seen, self.cfg.sampling.penalty)
        vals, ids = torch.topk(logp.float(), self.ranks_for(depth), dim=-1)  # [R, D, ranks]
        return ids if self.shape is not None else torch.stack([ids.double(), vals.double()], dim=-3)

    def tree(self, host, root: int, depth: int, row) -> Tree:
        """A row's tree from its ``guesses`` read on the host (its first ``depth`` levels)."""
        if self.shape is not None:
            return self.shape.within(depth).fill(root, host[:depth])
        ids, scores = (np.asarray(part[:depth]) for part in host)
        if not self.joint:
            return best_first(list(scores), self.budget).fill(root, ids.astype(np.int64).tolist())
        t = self.cfg.sampling.grid_temperature
        p = np.exp((scores - scores.max(axis=1, keepdims=True)) / t)
        probs = p / p.sum(axis=1, keepdims=True)  # [depth, k] the top-k at the temperature (float64)
        covered = min(depth, getattr(self.run.table, "max_order", depth + 1) - 1)
        cands = [Candidates(np.array([root]), np.ones(1, dtype=np.float32))]
        cands += [Candidates(i, q.astype(np.float32)) for i, q in zip(ids[:covered].astype(np.int64), probs[:covered])]
        cells = joint_cells(cands, self.run.draft_cfg, self.run.table, None)
        row.trace.dynamic_kernel[cells.kernel] += 1
        return joint_tree(ids.astype(np.int64), probs, root, self.budget, cells.dense()[0])

    def shape_tensors(self, shape: Shape, device) -> dict[str, torch.Tensor]:
        """A static shape's index tensors on ``device``, built once per shape: the guess each
        non-root node takes (head, rank), ``Tree.judging``'s parents, depth + 1 and root flag,
        the ancestor mask and the depths."""
        key = (shape, str(device))
        if key not in self._at:
            tree = Tree([0] * len(shape), list(shape.parents), list(shape.depths), list(shape.ranks))
            _, parents, level, root = torch.from_numpy(tree.judging()).to(device)
            self._at[key] = {"heads": torch.tensor([d - 1 for d in shape.depths[1:]], device=device),
                             "ranks": torch.tensor(list(shape.ranks[1:]), device=device),
                             "parents": parents, "level": level, "root": root > 0,
                             "attend": tree.attend(device), "offsets": tree.offsets(device)}
        return self._at[key]

    def __call__(self, out, rows, anchors, live) -> Proposal:
        need = [j for j in live if rows[j].forced is None]  # after the prompt or a lone root
        if need:
            for j, token in zip(need, next_tokens(out, rows, need, anchors)):
                rows[j].forced = token
        roots = {j: rows[j].forced for j in live}
        depths = [min(self.depth, rows[j].budget - 1) for j in live]
        keep = [j for j, d in zip(live, depths) if d > 0]
        for j in live:
            rows[j].forced = None
        commits = [[roots[j]] for j in live]
        no = [self.run.no_drafts] * len(live)
        if self.on_device and min(depths) == self.depth:
            # one shape for every row: tokens gathered and judged on the device, read with the verdict
            at = self.shape_tensors(self.shape, self.run.device)
            guesses = self.guesses(out, rows, roots, keep, anchors, self.depth)  # [B, D, ranks]
            first = torch.tensor([[roots[j]] for j in live], dtype=torch.long, device=guesses.device)  # [B, 1]
            ids = torch.cat([first, guesses[:, at["heads"], at["ranks"]]], -1)  # [B, N]
            b, n = ids.shape
            return Proposal(ids, [n] * b, commits, no, None, at["attend"].expand(b, n, n), at["offsets"].expand(b, n),
                            self.shape, at)
        host = self.guesses(out, rows, roots, keep, anchors, max(depths)).tolist() if keep else []
        trees = {j: Tree([roots[j]], [-1], [0], [0]) for j in live}
        for slot, j in enumerate(keep):
            trees[j] = self.tree(host[slot], roots[j], depths[live.index(j)], rows[j])
        if self.lookup:  # each row's context is on the host already: no device read
            for j in live:
                rows[j].lookup_len = 0
            for j in keep:
                context = rows[j].prompt + rows[j].out_ids + [roots[j]]
                trees[j], rows[j].lookup_len = with_lookup(trees[j], context, min(rows[j].lookup_k or self.lookup, rows[j].budget - 1))
        trees = [trees[j] for j in live]
        width = max(len(t) for t in trees)
        ids = torch.from_numpy(right_aligned([t.tokens for t in trees], width)).to(self.run.device)
        attend = torch.from_numpy(attend_rows(trees, width)).to(self.run.device)
        offsets = torch.from_numpy(right_aligned([t.depths for t in trees], width)).to(self.run.device)
        return Proposal(ids, [len(t) for t in trees], commits, no, trees, attend, offsets)

