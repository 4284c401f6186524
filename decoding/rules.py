"""The verification rules, each a function of one row's tensors (``verify.py`` composes them
into a step's verdicts):
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
the bonus token), so a caller may pass its own. The tree rules come in pieces (below).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .trees import Tree


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

