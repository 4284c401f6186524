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


def sampled_tree(tree: Tree, target: torch.Tensor, sampler) -> TreeVerdict:
    """``target`` [N, V]: the processed distribution after each node; draws from ``sampler``."""
    path, ranks, node = [0], [], 0
    while True:
        p = target[node].double().clone()  # [V] the residual, updated per rejected sibling
        kept = None
        for i, child in enumerate(tree.children[node]):
            x = tree.tokens[child]
            if float(sampler.uniform(1)[0]) < float(p[x]):
                kept = i
                break
            p[x] = 0.0
            mass = p.sum()
            if not mass > 0:  # only rejected tokens had mass: cannot happen (p(x) = 1 keeps x)
                break
            p /= mass
        if kept is None:
            return TreeVerdict(path, int(sampler.draw(p)), ranks)
        node = tree.children[node][kept]
        path.append(node)
        ranks.append(kept)


def typical_tree(tree: Tree, target: torch.Tensor, rule_probs: torch.Tensor, sampler,
                 eps: float, delta: float) -> TreeVerdict:
    """``rule_probs`` [N, V]: the whole-vocabulary distribution the rule reads (Medusa's)."""
    p = rule_probs.double()
    entropy = -(p * torch.log(p.clamp_min(1e-30))).sum(-1)  # [N]
    bound = torch.clamp(delta * torch.exp(-entropy), max=eps).tolist()  # [N]
    parents, tokens = tree.parents, tree.tokens
    ok = [False] + [float(p[parents[c], tokens[c]]) > bound[parents[c]] for c in range(1, len(tree))]
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
