"""Verification of a candidate tree by the base model: which path to keep and the token after it.

Each function walks the tree from the root, reading the base's rows at the nodes
(``target`` [N, V]: row u is the base's processed distribution after node u's path):
- greedy: follow the child equal to the base's argmax; stop where none is;
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


def greedy_tree(tree: Tree, best: list[int]) -> TreeVerdict:
    """``best`` [N]: the base's (penalised) argmax after each node."""
    path, ranks, node = [0], [], 0
    while True:
        hit = next((i for i, c in enumerate(tree.children[node]) if tree.tokens[c] == best[node]), None)
        if hit is None:
            return TreeVerdict(path, best[node], ranks)
        node = tree.children[node][hit]
        path.append(node)
        ranks.append(hit)


def _children_at(tree: Tree, rows: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Each node's row of ``rows`` [N, V] read at its children's tokens # -> [N, W] (W = the most
    children of a node; missing children read column 0 and are never looked at), and W."""
    width = max(len(k) for k in tree.children)
    index = [[tree.tokens[c] for c in kids] + [0] * (width - len(kids)) for kids in tree.children]
    return rows.gather(1, torch.tensor(index, dtype=torch.long, device=rows.device)), width


def sampled_tree(tree: Tree, target: torch.Tensor, sampler) -> TreeVerdict:
    """``target`` [N, V]: the processed distribution after each node; draws from ``sampler``.
    The walk reads the device once (children's probabilities, row masses, one uniform per
    sibling) and once more for the token drawn from the last node's residual."""
    p = target.double()  # [N, V]
    probs, width = _children_at(tree, p)  # [N, W]
    uniforms = sampler.uniform(len(tree) * width).reshape(len(tree), width).to(p.device)
    host_p, host_u, mass = torch.cat([probs, uniforms, p.sum(-1, keepdim=True)], dim=1).cpu().split([width, width, 1], 1)
    host_p, host_u, mass = host_p.tolist(), host_u.tolist(), mass[:, 0].tolist()
    path, ranks, node = [0], [], 0
    while True:
        kept, rejected = None, 0.0  # mass of the siblings rejected so far: the residual is p minus them
        for i in range(len(tree.children[node])):
            left = mass[node] - rejected
            if not left > 0:  # only rejected tokens had mass: cannot happen (p(x) = 1 keeps x)
                break
            if host_u[node][i] < host_p[node][i] / left:
                kept = i
                break
            rejected += host_p[node][i]
        if kept is None:  # every sibling rejected (or a leaf): the residual without them
            residual = p[node].clone()
            residual[[tree.tokens[c] for c in tree.children[node]]] = 0.0
            return TreeVerdict(path, int(sampler.draw(residual)), ranks)
        node = tree.children[node][kept]
        path.append(node)
        ranks.append(kept)


def typical_tree(tree: Tree, target: torch.Tensor, rule_probs: torch.Tensor, sampler,
                 eps: float, delta: float) -> TreeVerdict:
    """``rule_probs`` [N, V]: the whole-vocabulary distribution the rule reads (Medusa's)."""
    p = rule_probs.double()
    entropy = -(p * torch.log(p.clamp_min(1e-30))).sum(-1)  # [N]
    bound = torch.clamp(delta * torch.exp(-entropy), max=eps)  # [N]
    probs, _ = _children_at(tree, p)  # [N, W]
    passes = (probs > bound[:, None]).cpu().tolist()  # the walk's one read of the device (+ the final draw)
    ok = [False] * len(tree)
    for node, kids in enumerate(tree.children):
        for i, c in enumerate(kids):
            ok[c] = passes[node][i]
    longest = [0] * len(tree)  # passing nodes on the best path below (and including) each node
    for c in range(len(tree) - 1, 0, -1):  # children follow their parents: reverse order is bottom-up
        if ok[c]:
            longest[c] = 1 + max([longest[k] for k in tree.children[c] if ok[k]], default=0)
    path, ranks, node = [0], [], 0
    while True:
        kids = [(i, c) for i, c in enumerate(tree.children[node]) if ok[c]]
        if not kids:
            return TreeVerdict(path, int(sampler.draw(target[node])), ranks)
        i, node = max(kids, key=lambda ic: (longest[ic[1]], -ic[0]))
        path.append(node)
        ranks.append(i)
