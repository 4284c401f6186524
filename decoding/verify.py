"""Verifiers: which of a row's candidates the base model keeps, and the token after them.

One signature for every rule, chains and trees alike: ``verify(out, proposal, rows) -> verdicts``
(one per row; None where a row has nothing to verify), reading the device once per step for every
row (sampled and typical trees twice). A chain is a tree with one path: row b's candidates are its
committed token (the root) and the drafts after it; a verdict is the kept path from the root,
the tokens it accepts and the token that follows them, which is final.

Rules:
- greedy: keep drafts while each equals the base's (penalised) argmax after the one before;
- sampled (lossless): Leviathan et al. for a chain of drafts drawn from q (keep draft i with
  probability min(1, p_i(d)/q_i(d)); at the first rejection draw from norm(max(0, p_i - q_i))),
  and recursive rejection sampling over a tree's siblings (SpecInfer / SpecTr: the tree's
  candidates are the heads' top guesses, a deterministic function of the context, so each
  sibling is a draft from a point mass: kept with probability p(x) under the current residual
  p; a rejection zeroes x in p and renormalises); either way the emitted tokens are distributed
  exactly as the target;
- typical (Medusa, lossy): the longest path whose every node passes
  p(x) > min(eps, delta * exp(-H(p))), the token after it drawn from the target.
The chain rules keep a per-row signature, ``accept(drafts, draft_probs, target_probs, sampler)
-> Verdict`` (drafts [g]; q [g, V] or None; target [g + 1, V]: row i judges draft i, row g gives
the bonus token), so a caller may pass its own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from .sampling import penalised_logits, rows_seen
from .trees import Tree


@dataclass
class TreeVerdict:
    path: list[int]  # node indices, the root first: the kept tokens are path[1:]
    next_token: int  # the token after the path (final)
    sibling_ranks: list[int] = field(default_factory=list)  # per kept node: its index among its siblings
    tokens: list[int] = field(default_factory=list)  # the kept tokens (path[1:]'s)


# Chains: one rule per function, on the device -------------------------------------------------
@dataclass
class Verdict:
    """How many drafts are kept and the token after them, as 0-d long tensors on the target's
    device: deciding them never waits for the device."""

    accepted_t: torch.Tensor  # [] long
    next_token_t: torch.Tensor  # [] long

    @property
    def packed(self) -> torch.Tensor:
        """[accepted, next_token] # [2] long on the device."""
        return torch.stack([self.accepted_t, self.next_token_t])

    def host(self) -> tuple[int, int]:
        accepted, next_token = self.packed.tolist()
        return accepted, next_token

    @property
    def accepted(self) -> int:
        return self.host()[0]

    @property
    def next_token(self) -> int:
        return self.host()[1]


def _leading_true(ok: torch.Tensor) -> torch.Tensor:
    """Length of the run of True at the start of ``ok`` [g] # -> [] long, on ``ok``'s device."""
    return ok.long().cumprod(0).sum()


def _row(x: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
    """x[i] for a 0-d device index # [R, V] -> [V] (index_select: no host read of ``i``)."""
    return x.index_select(0, i.reshape(1))[0]


def greedy_accept(drafts, draft_probs, target_probs, sampler) -> Verdict:
    """Keep drafts while they equal the base model's argmax; then the base argmax."""
    best = target_probs.argmax(-1)  # [g + 1]
    m = _leading_true(drafts == best[: drafts.numel()])
    return Verdict(m, _row(best[:, None], m)[0])


def speculative_accept(drafts, draft_probs, target_probs, sampler) -> Verdict:
    """Leviathan et al., branch-free on the device: the residual of every row is formed, row m
    is drawn from (the bonus row when every draft is kept)."""
    if sampler.greedy:
        return greedy_accept(drafts, draft_probs, target_probs, sampler)
    g = drafts.numel()
    rows = torch.arange(g, device=drafts.device)
    p = target_probs[rows, drafts].double()  # [g]
    q = draft_probs[rows, drafts].double()  # [g] > 0: each draft was drawn from its q
    m = _leading_true(sampler.uniform(g) * q < p)  # u < p/q without dividing
    target = target_probs.double()  # [g + 1, V]
    residual = (target[:g] - draft_probs.double()).clamp_(min=0)  # [g, V]
    mass = residual.sum(-1, keepdim=True)  # [g, 1]
    # p == q up to rounding: rejection had probability ~0, draw from p
    residual = torch.where(mass > 0, residual / mass.clamp_min(1e-300), target[:g])
    return Verdict(m, sampler.draw(_row(torch.cat([residual, target[g:]]), m)))


def _typical_bound(p: torch.Tensor, eps: float, delta: float) -> torch.Tensor:
    """Medusa's acceptance bound min(eps, delta * exp(-H(p))) per row # [..., V] -> [...]."""
    entropy = -(p * torch.log(p.clamp_min(1e-30))).sum(-1)
    return torch.clamp(delta * torch.exp(-entropy), max=eps)


def typical_accept(drafts, draft_probs, target_probs, sampler, eps: float = 0.09, delta: float = 0.3,
                   rule_probs=None) -> Verdict:
    """Medusa's typical acceptance: keep draft i if p_i(d) > min(eps, delta * exp(-H(p_i)));
    the token after the kept drafts is drawn from the target (argmax when greedy). Medusa's p
    is softmax(logits / T) over the whole vocabulary (its sampling has no top-k):
    ``rule_probs`` [g(+1), V] is that distribution (with the repetition penalty, as every
    target here); it defaults to ``target_probs``."""
    g = drafts.numel()
    p = (target_probs if rule_probs is None else rule_probs)[:g].double()  # [g, V]
    m = _leading_true(p[torch.arange(g, device=drafts.device), drafts] > _typical_bound(p, eps, delta))
    return Verdict(m, sampler.draw(_row(target_probs, m)))


def typical_rule(eps: float, delta: float):
    """``typical_accept`` with its thresholds bound, in the common signature (plus the
    whole-vocabulary distribution its rule reads: ``wants_rule_probs``)."""
    if not (0 < eps <= 1 and delta > 0 and math.isfinite(delta)):
        raise ValueError("typical acceptance needs 0 < eps <= 1 and delta > 0")

    def accept(d, q, p, s, rule_probs=None):
        return typical_accept(d, q, p, s, eps=eps, delta=delta, rule_probs=rule_probs)

    accept.wants_rule_probs = True
    return accept


# Trees: each rule in pieces, so that a batch reads every row at once -------------------------


def tree_seen(seen: torch.Tensor, tokens: torch.Tensor, attend: torch.Tensor) -> torch.Tensor:
    """Row u's context: ``seen`` [V] plus the tokens of u's path (u included) # -> [N, V] bool
    (the repetition penalty of the row judging u's children)."""
    n = tokens.numel()
    index = tokens.to(seen.device)[None, :].expand(n, n)
    hits = torch.zeros(n, seen.shape[-1], dtype=torch.long, device=seen.device)
    return seen | (hits.scatter_add_(1, index, attend.to(seen.device).long()) > 0)


def greedy_kept(tokens: torch.Tensor, best: torch.Tensor, parents: torch.Tensor, level: torch.Tensor,
                root: torch.Tensor, depth: int) -> torch.Tensor:
    """Greedy verification on the device # tokens, best [..., N] (the base's argmax after each
    node), parents [..., N] or [N] (the root's: itself), depth + 1 and root flag (as
    ``Tree.judging``) -> [..., 2]: the deepest kept node (its index in its tree: pads, depth + 1
    = 0, not counted) and the token after it. A node is kept when its token is its parent's
    argmax and its parent is kept: the longest matching path, one at most, as siblings differ."""
    parents = parents.expand(best.shape)
    hit = (tokens == best.gather(-1, parents)) | root  # [..., N]
    kept = hit
    for _ in range(depth):
        kept = hit & kept.gather(-1, parents)
    last = (kept * level).argmax(-1, keepdim=True)  # [..., 1] its slot (a 0-d index would be read)
    return torch.cat([last - (level == 0).sum(-1, keepdim=True), best.gather(-1, last)], -1)


def verdict_of(tree: Tree, last: int, after: int) -> TreeVerdict:
    """The verdict of a path ending at node ``last``, ``after`` the token that follows it."""
    path = tree.path(last)
    return TreeVerdict(path, after, [tree.children[tree.parents[n]].index(n) for n in path[1:]],
                       [tree.tokens[n] for n in path[1:]])


def _children_at(tree: Tree, rows: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Each node's row of ``rows`` [N, V] read at its children's tokens # -> [N, W] (W = the most
    children of a node; missing children read column 0 and are never looked at), and W."""
    width = max(len(k) for k in tree.children)
    index = [[tree.tokens[c] for c in kids] + [0] * (width - len(kids)) for kids in tree.children]
    return rows.gather(1, torch.tensor(index, dtype=torch.long, device=rows.device)), width


# Each rule in three pieces, so that a batch reads every row's walk inputs in one transfer and
# every row's final token in another: ``*_inputs`` (device: what the walk reads, [N, C] of one
# dtype per rule, rows concatenable), ``*_walk`` (host: the path) and ``*_draw`` (device: the
# token after the path, from the row's own generator). A row draws its uniforms in ``*_inputs``
# and its final token in ``*_draw``, in that order, batched or not: same seed, same tokens.

def read_walks(inputs: list[torch.Tensor]) -> list[list[list]]:
    """Every row's walk inputs ``inputs`` (each [N_b, C_b], one dtype) in one host read # ->
    per row, N_b lists of C_b values."""
    flat = torch.cat([x.reshape(-1) for x in inputs]).tolist()  # the one read
    out, at = [], 0
    for x in inputs:
        n, c = x.shape
        out.append([flat[at + i * c: at + (i + 1) * c] for i in range(n)])
        at += n * c
    return out


def sampled_inputs(tree: Tree, target: torch.Tensor, sampler) -> torch.Tensor:
    """What the rejection walk reads # -> [N, 2W + 1] float64 on the device: per node its
    children's probabilities [W], one uniform per child slot [W] (drawn here, from ``sampler``),
    and its row's mass."""
    p = target.double()  # [N, V]
    probs, width = _children_at(tree, p)  # [N, W]
    uniforms = sampler.uniform(len(tree) * width).reshape(len(tree), width).to(p.device)
    return torch.cat([probs, uniforms, p.sum(-1, keepdim=True)], dim=1)


def sampled_walk(tree: Tree, host: list[list[float]]) -> tuple[list[int], list[int]]:
    """The kept path and its sibling ranks from ``sampled_inputs`` read on the host; the token
    after it is drawn from the last node's residual (``sampled_draw``)."""
    width = (len(host[0]) - 1) // 2
    path, ranks, node = [0], [], 0
    while True:
        probs, uniforms, mass = host[node][:width], host[node][width:2 * width], host[node][-1]
        kept, rejected = None, 0.0  # mass of the siblings rejected so far: the residual is p minus them
        for i in range(len(tree.children[node])):
            left = mass - rejected
            if not left > 0:  # only rejected tokens had mass: cannot happen (p(x) = 1 keeps x)
                break
            if uniforms[i] < probs[i] / left:
                kept = i
                break
            rejected += probs[i]
        if kept is None:  # every sibling rejected (or a leaf): the residual without them
            return path, ranks
        node = tree.children[node][kept]
        path.append(node)
        ranks.append(kept)


def sampled_draw(tree: Tree, target: torch.Tensor, node: int, sampler) -> torch.Tensor:
    """The token after a path ending at ``node``: drawn from its row of ``target`` [N, V]
    without its children (all rejected) # -> [] long on the device."""
    residual = target[node].double().clone()
    residual[[tree.tokens[c] for c in tree.children[node]]] = 0.0
    return sampler.draw(residual)


def typical_inputs(tree: Tree, rule_probs: torch.Tensor, eps: float, delta: float) -> torch.Tensor:
    """Whether each node's children pass the rule # -> [N, W] bool on the device (``rule_probs``
    [N, V]: the whole-vocabulary distribution the rule reads, Medusa's)."""
    p = rule_probs.double()
    bound = _typical_bound(p, eps, delta)  # [N]
    probs, _ = _children_at(tree, p)  # [N, W]
    return probs > bound[:, None]


def typical_walk(tree: Tree, passes: list[list[bool]]) -> tuple[list[int], list[int]]:
    """The longest path of passing nodes (the first sibling on ties) and its sibling ranks, from
    ``typical_inputs`` read on the host; the token after it is drawn from the target at its last node."""
    ok = [False] * len(tree)
    for node, kids in enumerate(tree.children):
        for i, c in enumerate(kids):
            ok[c] = bool(passes[node][i])
    longest = [0] * len(tree)  # passing nodes on the best path below (and including) each node
    for c in range(len(tree) - 1, 0, -1):  # children follow their parents: reverse order is bottom-up
        if ok[c]:
            longest[c] = 1 + max([longest[k] for k in tree.children[c] if ok[k]], default=0)
    path, ranks, node = [0], [], 0
    while True:
        kids = [(i, c) for i, c in enumerate(tree.children[node]) if ok[c]]
        if not kids:
            return path, ranks
        i, node = max(kids, key=lambda ic: (longest[ic[1]], -ic[0]))
        path.append(node)
        ranks.append(i)


# The verifier --------------------------------------------------------------------------------
class Verifier:
    """The rule of a run, chosen once from its settings (``acceptor``: a caller's own chain rule)."""

    def __init__(self, run, acceptor=None):
        cfg = run.cfg
        self.run, self.cfg = run, cfg
        if acceptor is None:
            acceptor = typical_rule(cfg.speculation.typical_eps, cfg.speculation.typical_delta) if cfg.mode == "typical" else (
                greedy_accept if cfg.sampling.greedy else speculative_accept)
        self.acceptor = acceptor
        # greedy verification reads only the base argmax: raw logits, no softmax over V
        self.argmax_only = cfg.sampling.greedy and acceptor in (greedy_accept, speculative_accept)
        self.wants_rule = getattr(acceptor, "wants_rule_probs", False) and not cfg.sampling.greedy
        self.greedy_tree = cfg.mode == "speculative" and cfg.sampling.greedy

    def __call__(self, out, proposal, rows) -> list[TreeVerdict | None]:
        if proposal.static is not None:
            return self._static(out, proposal, rows)
        if proposal.trees is not None:
            return self._trees(out, proposal, rows)
        return self._chains(out, proposal, rows)

    # chains ------------------------------------------------------------------------------
    def _chains(self, out, p, rows) -> list[TreeVerdict | None]:
        """Every row's verdict and drafts in one host read."""
        judged = [j for j, d in enumerate(p.drafts) if d.tokens.numel()]
        verdicts: list[TreeVerdict | None] = [None] * len(rows)
        if not judged:
            return verdicts
        if self.argmax_only and self.cfg.sampling.penalty == 1:
            packs = self._greedy_chains(out, p, judged)
        else:
            packs = []
            for j in judged:
                drafts = p.drafts[j]
                target, rule = self._targets(out, j, rows[j], drafts.tokens)
                verdict = self.acceptor(drafts.tokens, drafts.probs, target, rows[j].sampler, **rule)
                packs.append(torch.cat([verdict.packed, drafts.tokens]))
        host = torch.cat(packs).tolist()  # the step's one read
        start = 0
        for j, pack in zip(judged, packs):
            accepted, after, *drafted = host[start:start + pack.numel()]
            start += pack.numel()
            verdicts[j] = TreeVerdict(list(range(accepted + 1)), after, [0] * accepted, drafted[:accepted])
        return verdicts

    def _targets(self, out, j: int, row, drafts: torch.Tensor):
        """The base's targets after the row's anchor and after each draft # [g + 1, V] (greedy:
        penalised logits), row i seeing drafts[:i] as context too; plus typical's
        whole-vocabulary rows."""
        cfg, sampler = self.cfg, row.sampler
        logits = out.base_logits()[j, row.anchor - out.first:]  # [g + 1, V]
        seen = rows_seen(row.seen, drafts, logits.shape[0]) if cfg.sampling.penalty != 1 else row.seen
        if self.argmax_only:
            return penalised_logits(logits, seen, cfg.sampling.penalty), {}
        rule = {"rule_probs": sampler.full(logits[:-1], seen[:-1] if seen.dim() == 2 else seen)} if self.wants_rule else {}
        return sampler.target(logits, seen), rule

    @staticmethod
    def _greedy_chains(out, p, judged: list[int]) -> list[torch.Tensor]:
        """``greedy_accept`` for every row at once (no repetition penalty): the base argmax after
        every slot of the step in one call; a row's drafts are its last g slots (right-aligned),
        kept while each equals the argmax after the slot before it # per row [accepted, next,
        drafts...], still on the device."""
        best = out.base_argmax()  # [B, T - first]
        width, first = p.ids.shape[1], out.first
        index = torch.tensor(judged, dtype=torch.long, device=best.device)
        g = torch.tensor([p.drafts[j].tokens.numel() for j in judged], device=best.device)  # [R]
        best, tokens = best.index_select(0, index), p.ids.index_select(0, index)  # [R, T - first], [R, T]
        match = tokens[:, first + 1:] == best[:, :-1]  # [R, T - first - 1]: slot s + 1 equals the argmax after slot s
        slots = torch.arange(first, width - 1, device=best.device)  # the judged slot of each column
        start = width - 1 - g  # [R] the slot whose argmax judges the first draft (the anchor)
        ok = match | (slots[None, :] < start[:, None])  # columns before a row's window pass through
        accepted = ok.long().cumprod(1).sum(1) - (start - first)  # [R]
        after = best.gather(1, (start - first + accepted)[:, None])[:, 0]  # the argmax after the last kept draft
        return [torch.cat([torch.stack([accepted[r], after[r]]), p.drafts[j].tokens]) for r, j in enumerate(judged)]

    # trees -------------------------------------------------------------------------------
    def _static(self, out, p, rows) -> list[TreeVerdict]:
        """A static tree under greedy verification, every row the same shape (no pads): tokens
        and verdicts in one read for all rows."""
        shape, tokens = p.static, p.ids  # [B, N]
        at = p.static_at
        if self.cfg.sampling.penalty != 1:  # each node's own context: the row's seen tokens and its path
            attend = p.attend[0]
            seen = torch.stack([tree_seen(row.seen, tokens[j], attend) for j, row in enumerate(rows)])
            best = penalised_logits(out.base_logits(), seen, self.cfg.sampling.penalty).argmax(-1)
        else:
            best = out.base_argmax()  # [B, N]
        kept = greedy_kept(tokens, best, at["parents"], at["level"], at["root"], max(shape.depths))  # [B, 2]
        host = torch.cat([tokens, kept], 1).tolist()  # the step's one read, for every row
        verdicts = []
        for row in host:
            tree = Tree(row[:-2], list(shape.parents), list(shape.depths), list(shape.ranks))
            verdicts.append(verdict_of(tree, row[-2], row[-1]))
        return verdicts

    def _trees(self, out, p, rows) -> list[TreeVerdict | None]:
        """Each row's verdict (None for a lone root): greedy in one host read for all rows,
        sampled / typical in two."""
        trees, width = p.trees, p.width
        judged = [j for j, t in enumerate(trees) if len(t) > 1]
        verdicts: list[TreeVerdict | None] = [None] * len(trees)
        if not judged:
            return verdicts
        if self.greedy_tree:  # the pass reads from slot 0
            if self.cfg.sampling.penalty != 1:  # each node's own context: the row's seen tokens and its path
                seen = torch.stack([self._padded_seen(rows[j], trees[j], p.attend[j], width) for j in range(len(trees))])
                best = penalised_logits(out.base_logits(), seen, self.cfg.sampling.penalty).argmax(-1)
            else:
                best = out.base_argmax()  # [B, T]
            judging = torch.from_numpy(np.stack([t.judging(width) for t in trees], 1)).to(best.device)  # [4, B, T]
            tokens, parents, level, root = judging
            depth = max(max(t.depths) for t in trees)
            kept = greedy_kept(tokens, best, parents, level, root > 0, depth).tolist()  # the one read
            for j in judged:
                verdicts[j] = verdict_of(trees[j], *kept[j])
            return verdicts
        logits = out.base_logits()  # [B, T, V]
        pads = {j: width - len(trees[j]) for j in judged}
        prepared = [self._walk_inputs(logits[j, pads[j]:], trees[j], p.attend[j, pads[j]:, pads[j]:], rows[j]) for j in judged]
        hosts = read_walks([inputs for inputs, _ in prepared])  # read 1
        walks = [self._walk(trees[j], host) for j, host in zip(judged, hosts)]
        after = torch.stack([self._draw(trees[j], target, path[-1], rows[j])
                             for j, (_, target), (path, _) in zip(judged, prepared, walks)]).tolist()  # read 2
        for j, (path, ranks), token in zip(judged, walks, after):
            verdicts[j] = TreeVerdict(path, token, ranks, [trees[j].tokens[n] for n in path[1:]])
        return verdicts

    def _node_seen(self, row, tree: Tree, attend: torch.Tensor) -> torch.Tensor:
        """The context of the row judging each node's children # [N, V] (or [V]: no penalty)."""
        if self.cfg.sampling.penalty == 1:
            return row.seen
        tokens = torch.tensor(tree.tokens, dtype=torch.long, device=row.seen.device)
        return tree_seen(row.seen, tokens, attend)

    def _padded_seen(self, row, tree: Tree, attend: torch.Tensor, width: int) -> torch.Tensor:
        """The row's node contexts right-aligned # [T, V] (pads: the row's context)."""
        n = len(tree)
        nodes = self._node_seen(row, tree, attend[width - n:, width - n:])  # [N, V]
        return torch.cat([row.seen.expand(width - n, -1), nodes])

    def _walk_inputs(self, logits, tree: Tree, attend, row):
        """Sampled / typical: (what the walk reads # [N, C] on the device, the target # [N, V]
        the token after the path is drawn from)."""
        cfg, sampler = self.cfg, row.sampler
        seen = self._node_seen(row, tree, attend)
        target = sampler.target(logits, seen)  # [N, V]
        if cfg.mode == "typical":
            spec = cfg.speculation
            return typical_inputs(tree, sampler.full(logits, seen), spec.typical_eps, spec.typical_delta), target
        return sampled_inputs(tree, target, sampler), target

    def _walk(self, tree: Tree, host) -> tuple[list[int], list[int]]:
        return (typical_walk if self.cfg.mode == "typical" else sampled_walk)(tree, host)

    def _draw(self, tree: Tree, target: torch.Tensor, node: int, row) -> torch.Tensor:
        """The token after a path ending at ``node``, from the row's generator # [] long."""
        if self.cfg.mode == "typical":
            return row.sampler.draw(target[node])
        return sampled_draw(tree, target, node, row.sampler)
