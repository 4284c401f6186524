"""One tree-verification step of the generation loop (``--tree static|dynamic``).

Given the last pass ``out``, its ``anchor`` row and the committed token, build a candidate tree
from the heads' top guesses at the anchor, run it in one forward pass (tree mask, depth
positions), keep the path the acceptance rule picks, compact the caches to that path and emit
its tokens. The next step reads the heads at the path's last node (its row in this pass) and
starts from the token the verification decided, exactly as the chain loop does.

Host reads per step: a static tree under greedy verification one (its shape is fixed, so its
tokens are gathered and its path judged on the device); a dynamic tree two (the guesses, which
shape it, then the argmax per node); sampled and typical trees three (the guesses, the walk's
inputs, the token drawn after the path).
"""

from __future__ import annotations

import copy
import heapq

import numpy as np
import torch

from .dynamo import Candidates, joint_cells
from .proposal import joint_drafts, pick_drafter
from .sampling import penalised_logits
from .tree import Accuracies, Tree, Shape, auto_budget, best_first, parse_nodes, read_accuracies, MAX_RANKS
from .tree_accept import (TreeVerdict, greedy_kept, read_walks, sampled_draw, sampled_inputs, sampled_walk, tree_seen,
                          typical_inputs, typical_walk, verdict_of)


def joint_scored(cfg, heads, table) -> bool:
    """Whether a dynamic tree ranks its paths by DynaMo's co-occurrence-masked joint: where the
    drafter (``--drafter``, ``auto``: with stats) would draft a chain from it."""
    return (cfg.tree == "dynamic" and table is not None and cfg.mode in ("speculative", "typical")
            and pick_drafter(cfg.drafter, heads, table) is joint_drafts)


class TreeSteps:
    """Tree decoding state of one run: the shape (static) or the budget (dynamic). A batch
    shares one (``for_row`` gives each row a view with its own run state and trace)."""

    def __init__(self, model, cfg, run, order: int, trace, accuracies: Accuracies | None = None):
        self.model, self.cfg, self.run, self.trace = model, cfg, run, trace
        self.depth = order - 1  # draft heads read: head d guesses the token d after the root
        self.accuracy = accuracies or read_accuracies(getattr(model, "heads_dir", None), self.depth)
        nodes = parse_nodes(cfg.tree_nodes)
        self.budget = nodes if nodes is not None else auto_budget(model, self.accuracy, self.depth)
        self.shape: Shape | None = None
        if cfg.tree == "static":
            self.shape = best_first(self.accuracy.log_scores(self.depth), self.budget)
        self.joint = joint_scored(cfg, model.heads, run.table) and getattr(run.table, "max_order", 2) >= 2
        self._shapes: dict = {}  # static greedy: each shape's index tensors on the device
        self._root: tuple[int, torch.Tensor] | None = None  # the last verdict's token, host value and device copy
        # the joint ranks paths over the joint drafter's candidates (draft_k per head)
        self.ranks = min(cfg.draft_k, cfg.top_k, run.vocab_size) if self.joint else min(MAX_RANKS, self.budget, run.vocab_size)
        self._label(trace)

    @property
    def static_greedy(self) -> bool:
        """A static tree under greedy verification: its steps stay on the device but for one read."""
        return self.shape is not None and self.cfg.mode == "speculative" and self.cfg.greedy

    def _label(self, trace) -> None:
        trace.tree, trace.tree_nodes = self.cfg.tree, self.budget
        scores = "step probabilities x co-occurrence mask" if self.joint else "step probabilities"
        trace.tree_accuracies = self.accuracy.source if self.cfg.tree == "static" else scores

    def for_row(self, run, trace) -> "TreeSteps":
        """The same shape / budget for another sequence (a batch row): its own run and trace."""
        row = copy.copy(self)
        row.run, row.trace, row._root = run, trace, None
        self._label(trace)
        return row

    # propose -------------------------------------------------------------------------------
    def ranks_for(self, depth: int) -> int:
        """Guesses per head a tree of ``depth`` levels takes."""
        if self.shape is None:
            return self.ranks
        shape = self.shape.within(depth)
        return max(shape.max_rank(d) for d in range(1, depth + 1))

    def guesses(self, logp: torch.Tensor, seen: torch.Tensor | None, ranks: int) -> torch.Tensor:
        """The heads' top ``ranks`` guesses, on the device, packed for one read: ``logp``
        [..., depth, V] (``seen`` [..., 1, V] or [V], read only with a penalty) -> ids
        [..., depth, R] (static) or ids and scores [..., 2, depth, R] as float64 (dynamic: this
        step's probabilities score the paths)."""
        if self.cfg.penalty != 1:  # rank as the verification will judge: seen tokens penalised
            logp = penalised_logits(logp, seen, self.cfg.penalty)
        vals, ids = torch.topk(logp.float(), ranks, dim=-1)  # [..., depth, R]
        if self.shape is not None:
            return ids
        return torch.stack([ids.double(), vals.double()], dim=-3)

    def tree(self, host, root: int, depth: int) -> Tree:
        """The tree from ``guesses`` read on the host (a nested list; its first ``depth`` levels)."""
        if self.shape is not None:
            return self.shape.within(depth).fill(root, host[:depth])
        ids, scores = (np.asarray(part[:depth]) for part in host)
        if self.joint:
            return self.joint_tree(ids.astype(np.int64), scores, root)
        return best_first(list(scores), self.budget).fill(root, ids.astype(np.int64).tolist())

    def joint_tree(self, ids: np.ndarray, scores: np.ndarray, root: int) -> Tree:
        """EAGLE-2's rerank under DynaMo's joint: the ``budget`` nodes of highest mass, from the
        heads' top-k (``ids``, ``scores`` [depth, k], best first). The heads the stats cover
        take the co-occurrence-masked joint given ``root`` (eq. 6, the joint drafter's grid: no
        thresholds, the penalty already in the scores): a node's mass is its path's, the grid
        summed over the deeper covered heads. A deeper head multiplies its parent's mass by its
        own probability, as in the plain dynamic tree. A parent never has less mass than its
        children and ties put the shallower first, so the best nodes always hold their parents."""
        t = self.cfg.temperature if self.cfg.temperature > 0 else 1.0
        p = np.exp((scores - scores.max(axis=1, keepdims=True)) / t)
        probs = p / p.sum(axis=1, keepdims=True)  # [depth, k] the top-k at the temperature (float64)
        depth, k = ids.shape
        covered = min(depth, getattr(self.run.table, "max_order", depth + 1) - 1)
        cands = [Candidates(np.array([root]), np.ones(1, dtype=np.float32))]
        cands += [Candidates(i, q.astype(np.float32)) for i, q in zip(ids[:covered], probs[:covered])]
        cells = joint_cells(cands, self.run.draft_cfg, self.run.table, None)
        self.run.kernels[cells.kernel] += 1
        grid = cells.dense()[0].astype(np.float64)  # [k]*covered
        # frontier: (-mass, depth, a, b): covered nodes (a = 0, b = flat index in their level),
        # deeper ones (a = parent node, b = rank), each entering when its parent or previous sibling is taken
        frontier = []
        for d in range(1, covered + 1):
            mass = (grid.sum(axis=tuple(range(d, covered))) if d < covered else grid).ravel()
            # a node behind ``budget`` others of its level is never taken: only the level's best enter
            best = np.lexsort((np.arange(mass.size), -mass))[:self.budget]
            frontier += [(-float(mass[f]), d, 0, int(f)) for f in best if mass[f] > 0]
        heapq.heapify(frontier)
        index = {(0, 0): 0}
        tokens, parents, depths, ranks, masses = [root], [-1], [0], [0], [1.0]
        while frontier and len(tokens) <= self.budget:
            neg, d, a, b = heapq.heappop(frontier)
            node, rank = len(tokens), b % k if a == 0 else b
            parents.append(index[d - 1, b // k if d > 1 else 0] if a == 0 else a)
            if a == 0:
                index[d, b] = node
            tokens.append(int(ids[d - 1, rank]))
            depths.append(d)
            ranks.append(rank)
            masses.append(-neg)
            if a > 0 and rank + 1 < k:  # its next sibling
                heapq.heappush(frontier, (-masses[a] * probs[d - 1, rank + 1], d, a, rank + 1))
            if covered <= d < depth:  # its first child, from the next head
                heapq.heappush(frontier, (neg * probs[d, 0], d + 1, node, 0))
        return Tree(tokens, parents, depths, ranks)

    def propose(self, out, anchor: int, root: int, depth: int) -> Tree:
        """The tree for this step: heads 1..depth's top guesses at ``anchor`` under ``root``."""
        if depth <= 0:
            return Tree([root], [-1], [0], [0])
        logp = torch.stack([out.head_log_probs(i, anchor)[0] for i in range(1, depth + 1)])  # [depth, V]
        return self.tree(self.guesses(logp, self.run.seen, self.ranks_for(depth)).tolist(), root, depth)  # one read

    # verify --------------------------------------------------------------------------------
    def verify(self, out, tree: Tree, attend: torch.Tensor) -> TreeVerdict:
        return self.judge(out.base_logits()[0], tree, attend)

    def judge(self, logits: torch.Tensor, tree: Tree, attend: torch.Tensor) -> TreeVerdict:
        """The verdict on ``tree`` from the base's logits after each node # [N, V] (``attend``
        [N, N]: the paths, for the repetition penalty's contexts). Reads the device once
        (greedy: the argmax after each node) or twice (the walk's inputs; the token after the
        path), with the same pieces a batch uses for all its rows at once (``batch_tree.py``)."""
        if self.cfg.mode == "speculative" and self.cfg.greedy:
            tokens, parents, level, root = torch.from_numpy(tree.judging()).to(logits.device)
            kept = greedy_kept(tokens, self.best(logits, tree, attend), parents, level, root > 0, max(tree.depths))
            return verdict_of(tree, *kept.tolist())
        inputs, target = self.walk_inputs(logits, tree, attend)
        path, ranks = self.walk(tree, read_walks([inputs])[0])
        return TreeVerdict(path, self.draw(tree, target, path[-1]).tolist(), ranks)

    def best(self, logits: torch.Tensor, tree: Tree, attend: torch.Tensor) -> torch.Tensor:
        """Greedy: the base's (penalised) argmax after each node # [N] on the device."""
        return penalised_logits(logits, self.node_seen(tree, attend), self.cfg.penalty).argmax(-1)

    def walk_inputs(self, logits: torch.Tensor, tree: Tree, attend: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Sampled / typical: (what the walk reads # [N, C] on the device: ``sampled_inputs``,
        which draws the row's uniforms, or ``typical_inputs``; the target # [N, V] the token
        after the path is drawn from)."""
        run, cfg = self.run, self.cfg
        seen = self.node_seen(tree, attend)
        target = run.sampler.target(logits, seen)  # [N, V]
        if cfg.mode == "typical":
            return typical_inputs(tree, run.sampler.full(logits, seen), cfg.typical_eps, cfg.typical_delta), target
        return sampled_inputs(tree, target, run.sampler), target

    def walk(self, tree: Tree, host: list[list]) -> tuple[list[int], list[int]]:
        """The kept path and its sibling ranks from ``walk_inputs`` read on the host."""
        return (typical_walk if self.cfg.mode == "typical" else sampled_walk)(tree, host)

    def draw(self, tree: Tree, target: torch.Tensor, node: int) -> torch.Tensor:
        """The token after a path ending at ``node``, from the row's generator # [] long on the device."""
        if self.cfg.mode == "typical":
            return self.run.sampler.draw(target[node])
        return sampled_draw(tree, target, node, self.run.sampler)

    def node_seen(self, tree: Tree, attend: torch.Tensor) -> torch.Tensor:
        """The context of the row judging each node's children # [N, V] (or [V]: no penalty)."""
        if self.cfg.penalty == 1:
            return self.run.seen
        tokens = torch.tensor(tree.tokens, dtype=torch.long, device=self.run.seen.device)
        return tree_seen(self.run.seen, tokens, attend)

    # the step ------------------------------------------------------------------------------
    def step(self, out, anchor: int, root: int, depth: int, caches, forward, emit):
        """-> (out, anchor, forced, done), the loop's state after this step."""
        if self.static_greedy and depth > 0:
            return self.static_greedy_step(out, anchor, root, depth, caches, forward, emit)
        tree = self.propose(out, anchor, root, depth)
        self.trace.model_s, out.model_s = self.trace.model_s + out.model_s, 0.0  # head distributions: model time
        device = self.run.seen.device
        ids = torch.tensor(tree.tokens, dtype=torch.long, device=device)
        if len(tree) == 1:  # nothing to verify (the last token of the budget)
            return forward(ids, 0), 0, None, False
        start, attend = caches.length, tree.attend(device)
        out = forward(ids, 0, attend=attend, offsets=tree.offsets(device))
        verdict = self.verify(out, tree, attend)
        caches.keep(start, verdict.path)  # the accepted path's slots, compacted; the rest forgotten
        self.record(verdict)
        done = emit([tree.tokens[i] for i in verdict.path[1:]])
        return out, verdict.path[-1], verdict.next_token, done

    def static_greedy_step(self, out, anchor: int, root: int, depth: int, caches, forward, emit):
        """``step`` for a static tree under greedy verification, reading the device once: the
        shape is fixed, so the tokens are gathered from the guesses and the path is judged where
        they are; the one read brings the tokens, the kept path's last node and the token after it."""
        shape = self.shape.within(depth)
        logp = torch.stack([out.head_log_probs(i, anchor)[0] for i in range(1, depth + 1)])  # [depth, V]
        self.trace.model_s, out.model_s = self.trace.model_s + out.model_s, 0.0  # head distributions: model time
        guesses = self.guesses(logp, self.run.seen, self.ranks_for(depth))  # [depth, R] on the device
        at = self._on_device(shape, guesses.device)
        first = self._root if self._root is not None and self._root[0] == root else (root, torch.tensor([root], device=guesses.device))
        tokens = self.static_tokens(guesses, first[1], at)  # [N]
        start = caches.length
        out = forward(tokens, 0, attend=at["attend"], offsets=at["offsets"])
        seen = self.run.seen if self.cfg.penalty == 1 else tree_seen(self.run.seen, tokens, at["attend"])
        best = penalised_logits(out.base_logits()[0], seen, self.cfg.penalty).argmax(-1)  # [N]
        kept = greedy_kept(tokens, best, at["parents"], at["level"], at["root"], depth)  # [2]
        host = torch.cat([tokens, kept]).tolist()  # the step's one read
        self._root = (host[-1], kept[1:])  # the next step's root, already on the device
        tree, verdict = self.static_verdict(shape, host)
        caches.keep(start, verdict.path)  # the accepted path's slots, compacted; the rest forgotten
        self.record(verdict)
        done = emit([tree.tokens[i] for i in verdict.path[1:]])
        return out, verdict.path[-1], verdict.next_token, done

    @staticmethod
    def static_tokens(guesses: torch.Tensor, roots: torch.Tensor, at: dict) -> torch.Tensor:
        """A static tree's tokens from the heads' guesses, on the device # [..., depth, R] and
        roots [..., 1] -> [..., N]."""
        return torch.cat([roots, guesses[..., at["heads"], at["ranks"]]], -1)

    @staticmethod
    def static_verdict(shape: Shape, host: list[int]) -> tuple[Tree, TreeVerdict]:
        """The tree and verdict from a static greedy step's read: its N tokens, the kept path's
        last node, the token after it."""
        tree = Tree(host[:-2], list(shape.parents), list(shape.depths), list(shape.ranks))
        return tree, verdict_of(tree, host[-2], host[-1])

    def _on_device(self, shape: Shape, device) -> dict[str, torch.Tensor]:
        """The shape's index tensors on ``device``, built once per shape (the last levels of a
        run's end give smaller ones): the guesses each non-root node takes (head, rank),
        ``Tree.judging``'s parents, depth + 1 and root flag, the ancestor mask and positions."""
        key = (shape, str(device))
        if key not in self._shapes:
            tree = Tree([0] * len(shape), list(shape.parents), list(shape.depths), list(shape.ranks))
            _, parents, level, root = torch.from_numpy(tree.judging()).to(device)
            self._shapes[key] = {"heads": torch.tensor([d - 1 for d in shape.depths[1:]], device=device),
                                 "ranks": torch.tensor(list(shape.ranks[1:]), device=device),
                                 "parents": parents, "level": level, "root": root > 0,
                                 "attend": tree.attend(device), "offsets": tree.offsets(device)}
        return self._shapes[key]

    def record(self, verdict: TreeVerdict) -> None:
        self.trace.accepted_lengths[len(verdict.path) - 1] += 1
        self.trace.tree_sibling_ranks.update(verdict.sibling_ranks)
