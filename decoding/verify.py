"""The verifier: which of each row's candidates the base model keeps, and the token after them.

One signature for every rule, chains and trees alike: ``verify(out, proposal, rows) -> verdicts``
(one per row; None where a row has nothing to verify), reading the device once per step for every
row (sampled and typical trees twice). A chain is a tree with one path: row b's candidates are its
committed token (the root) and the drafts after it; a verdict is the kept path from the root,
the tokens it accepts and the token that follows them, which is final. The rules themselves
(``rules.py``) and which one judges (``DecodePlan.rule``) are chosen once per call.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from .rules import (greedy_accept, greedy_kept, read_walks, sampled_draw, sampled_inputs, sampled_walk, speculative_accept,
                    tree_seen, typical_inputs, typical_rule, typical_walk)
from .sampling import penalised_logits, rows_seen
from .trees import Tree


@dataclass
class TreeVerdict:
    path: list[int]  # node indices, the root first: the kept tokens are path[1:]
    next_token: int  # the token after the path (final)
    sibling_ranks: list[int] = field(default_factory=list)  # per kept node: its index among its siblings
    tokens: list[int] = field(default_factory=list)  # the kept tokens (path[1:]'s)


def verdict_of(tree: Tree, last: int, after: int) -> TreeVerdict:
    """The verdict of a path ending at node ``last``, ``after`` the token that follows it."""
    path = tree.path(last)
    return TreeVerdict(path, after, [tree.children[tree.parents[n]].index(n) for n in path[1:]],
                       [tree.tokens[n] for n in path[1:]])


def chain_rule(plan, speculation):
    """The plan's chain rule, in the common signature (``rules.py``)."""
    if plan.rule == "typical":
        return typical_rule(speculation.typical_eps, speculation.typical_delta)
    return greedy_accept if plan.rule == "greedy" else speculative_accept


class Verifier:
    """The plan's rule over a step's rows (``acceptor``: a caller's own chain rule, the plan's
    ``custom``)."""

    def __init__(self, run, acceptor=None):
        self.run, self.cfg, self.plan = run, run.cfg, run.plan
        self.acceptor = acceptor or (chain_rule(self.plan, self.cfg.speculation) if self.plan.rule else None)
        # typical's rule reads the whole-vocabulary rows too (greedy: the target's own)
        self.wants_rule = getattr(self.acceptor, "wants_rule_probs", False) and not self.plan.greedy

    def __call__(self, out, proposal, rows) -> list[TreeVerdict | None]:
        if proposal.static is not None:
            return self._static(out, proposal, rows)
        if proposal.trees is not None:
            return self._trees(out, proposal, rows)
        return self._chains(out, proposal, rows)

    def _best(self, out, seen) -> torch.Tensor:
        """Greedy verification's base argmax after every slot # [B, T]: without a penalty the
        argmax alone (no logits where the model screens it); else of the penalised logits,
        ``seen()`` giving each slot's context [B, T, V]."""
        if self.plan.argmax_only:
            return out.base_argmax()
        return penalised_logits(out.base_logits(), seen(), self.plan.penalty).argmax(-1)

    # chains ------------------------------------------------------------------------------
    def _chains(self, out, p, rows) -> list[TreeVerdict | None]:
        """Every row's verdict and drafts in one host read."""
        judged = [j for j, d in enumerate(p.drafts) if d.tokens.numel()]
        verdicts: list[TreeVerdict | None] = [None] * len(rows)
        if not judged:
            return verdicts
        if self.plan.rule == "greedy" and self.plan.argmax_only:
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
        plan, sampler = self.plan, row.sampler
        logits = out.base_logits()[j, row.anchor - out.first:]  # [g + 1, V]
        seen = rows_seen(row.seen, drafts, logits.shape[0]) if plan.penalised else row.seen
        if plan.rule == "greedy":  # greedy verification reads only the argmax: no softmax over V
            return penalised_logits(logits, seen, plan.penalty), {}
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
        and verdicts in one read for all rows. With a penalty each node reads its own context:
        the row's seen tokens and its path."""
        shape, tokens, at = p.static, p.ids, p.static_at  # [B, N]
        best = self._best(out, lambda: torch.stack([tree_seen(row.seen, tokens[j], p.attend[0]) for j, row in enumerate(rows)]))
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
        if self.plan.rule == "greedy":  # the pass reads from slot 0
            best = self._best(out, lambda: torch.stack([self._padded_seen(rows[j], trees[j], p.attend[j], width)
                                                         for j in range(len(trees))]))
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
        walk = typical_walk if self.plan.rule == "typical" else sampled_walk
        walks = [walk(trees[j], host) for j, host in zip(judged, hosts)]
        after = torch.stack([self._draw(trees[j], target, path[-1], rows[j])
                             for j, (_, target), (path, _) in zip(judged, prepared, walks)]).tolist()  # read 2
        for j, (path, ranks), token in zip(judged, walks, after):
            verdicts[j] = TreeVerdict(path, token, ranks, [trees[j].tokens[n] for n in path[1:]])
        return verdicts

    def _node_seen(self, row, tree: Tree, attend: torch.Tensor) -> torch.Tensor:
        """The context of the row judging each node's children # [N, V] (or [V]: no penalty)."""
        if not self.plan.penalised:
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
        sampler = row.sampler
        seen = self._node_seen(row, tree, attend)
        target = sampler.target(logits, seen)  # [N, V]
        if self.plan.rule == "typical":
            spec = self.cfg.speculation
            return typical_inputs(tree, sampler.full(logits, seen), spec.typical_eps, spec.typical_delta), target
        return sampled_inputs(tree, target, sampler), target

    def _draw(self, tree: Tree, target: torch.Tensor, node: int, row) -> torch.Tensor:
        """The token after a path ending at ``node``, from the row's generator # [] long."""
        if self.plan.rule == "typical":
            return row.sampler.draw(target[node])
        return sampled_draw(tree, target, node, row.sampler)
