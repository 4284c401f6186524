"""Verification of a candidate tree by the base model: which path to keep and the token after it.

Each rule keeps a path from the root, reading the base's rows at the nodes
(``target`` [N, V]: row u is the base's processed distribution after node u's path):
- greedy (``greedy_kept``, on the device for one tree or a batch of them): follow the child equal
  to the base's argmax; stop where none is;
- sampled: recursive rejection sampling over the siblings (SpecInfer / SpecTr). The tree's
  candidates are the heads' top guesses, a deterministic function of the context, so each
  sibling is a draft from a point mass: it is kept with probability p(x) under the current
  residual p; a rejection zeroes x in p and renormalises; when every sibling is rejected the
  token is drawn from the residual. Kept or drawn, the token is distributed exactly as p
  (by induction over the siblings), and the walk repeats at the kept node with its own row;
- typical (Medusa, lossy): the longest path whose every node passes the rule
  p(x) > min(eps, delta * exp(-H(p))), the token after it drawn from the target.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .tree import Tree


@dataclass
class TreeVerdict:
    path: list[int]  # node indices, the root first: the kept tokens are path[1:]
    next_token: int  # the token after the path (final)
    sibling_ranks: list[int] = field(default_factory=list)  # per kept node: its index among its siblings


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
    return TreeVerdict(path, after, [tree.children[tree.parents[n]].index(n) for n in path[1:]])


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
    entropy = -(p * torch.log(p.clamp_min(1e-30))).sum(-1)  # [N]
    bound = torch.clamp(delta * torch.exp(-entropy), max=eps)  # [N]
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
