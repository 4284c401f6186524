"""The tree proposer (``--tree static|dynamic``, and ``--lookup``): per row per step, a tree of
the heads' top guesses under the committed token, verified in one forward pass (``trees.py``:
shapes, budgets, lookup branches). One shape (static: Medusa's, from the heads' measured per-rank
accuracies) or budget (dynamic: EAGLE-2's, from the step's own head probabilities, or their
co-occurrence-masked joint) for the run; ``--lookup`` on a chain makes the chain a one-path tree
(the plan's ``path``) so that the lookup branch can sit beside it. Every row's guesses are read
in one top-k call and one host read (a static tree under greedy verification none: its tokens
are gathered on the device and read with the verdict).
"""

from __future__ import annotations

import numpy as np
import torch

from .dynamo.step import joint_cells
from .proposal import Proposal, next_tokens
from .sampling import Candidates, penalised_logits, with_tokens
from .trees import (MAX_RANKS, Shape, Tree, attend_rows, auto_budget, best_first, joint_tree, parse_nodes,
                    read_accuracies, right_aligned, with_lookup)


class Trees:
    """Candidate trees (``--tree static|dynamic``): one shape (static: Medusa's, from the heads'
    measured per-rank accuracies) or budget (dynamic: EAGLE-2's, from the step's own head
    probabilities, or their co-occurrence-masked joint) for the run, a tree per row per step."""

    def __init__(self, run, accuracies=None):
        cfg, model, plan = run.cfg, run.model, run.plan
        self.run, self.cfg, self.plan = run, cfg, plan
        self.depth = plan.order - 1  # draft heads read: head d guesses the token d after the root
        self.accuracy = accuracies or read_accuracies(getattr(model, "heads_dir", None), self.depth)
        if plan.tree == "path":  # the heads' top guesses as a one-path tree
            self.budget, self.shape = self.depth, Shape(tuple(range(-1, self.depth)), tuple(range(self.depth + 1)), (0,) * (self.depth + 1))
        else:
            nodes = parse_nodes(cfg.trees.tree_nodes)
            self.budget = nodes if nodes is not None else auto_budget(model, self.accuracy, self.depth, plan.argmax_only)
            self.shape = best_first(self.accuracy.log_scores(self.depth), self.budget) if plan.tree == "static" else None
        # the joint ranks paths over the joint drafter's candidates (draft_k per head)
        joint_k = min(cfg.speculation.draft_k, cfg.sampling.top_k)
        self.ranks = min(joint_k if plan.joint_tree else min(MAX_RANKS, self.budget), run.vocab)
        self._at: dict = {}  # each static shape's index tensors on the device

    def label(self, trace) -> None:
        trace.tree, trace.tree_nodes, trace.lookup = self.cfg.trees.tree, self.budget, self.plan.lookup
        scores = "step probabilities x co-occurrence mask" if self.plan.joint_tree else "step probabilities"
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
        if self.plan.penalised:
            seen = torch.stack([with_tokens(rows[j].seen, [roots[j]]) for j in keep])[:, None]  # [R, 1, V]
            logp = penalised_logits(logp, seen, self.plan.penalty)
        vals, ids = torch.topk(logp.float(), self.ranks_for(depth), dim=-1)  # [R, D, ranks]
        return ids if self.shape is not None else torch.stack([ids.double(), vals.double()], dim=-3)

    def tree(self, host, root: int, depth: int, row) -> Tree:
        """A row's tree from its ``guesses`` read on the host (its first ``depth`` levels)."""
        if self.shape is not None:
            return self.shape.within(depth).fill(root, host[:depth])
        ids, scores = (np.asarray(part[:depth]) for part in host)
        if not self.plan.joint_tree:
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
        roots = tree_roots(out, rows, live, anchors, self.plan)
        depths = [min(self.depth, rows[j].budget - 1) for j in live]
        keep = [j for j, d in zip(live, depths) if d > 0]
        for j in live:
            rows[j].forced = None
        commits = [[roots[j]] for j in live]
        no = [self.run.no_drafts] * len(live)
        if self.plan.device_tree and min(depths) == self.depth:
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
        if self.plan.lookup:  # each row's context is on the host already: no device read
            for j in live:
                rows[j].lookup_len = 0
            for j in keep:
                context = rows[j].prompt + rows[j].out_ids + [roots[j]]
                trees[j], rows[j].lookup_len = with_lookup(trees[j], context, min(rows[j].lookup_k or self.plan.lookup, rows[j].budget - 1))
        return tree_proposal([trees[j] for j in live], commits, self.run)


def tree_roots(out, rows, live, anchors, plan) -> dict[int, int]:
    """Each live row's tree root: its forced token, the base's next token where none is forced
    yet (after the prompt or a lone root), forced from then on."""
    need = [j for j in live if rows[j].forced is None]
    if need:
        for j, token in zip(need, next_tokens(out, rows, need, anchors, plan)):
            rows[j].forced = token
    return {j: rows[j].forced for j in live}


def tree_proposal(trees: list[Tree], commits: list[list[int]], run) -> Proposal:
    """Every row's tree (node 0 its committed token) right-aligned in one step, with each
    node's ancestors and depth, copied to the device once."""
    width = max(len(t) for t in trees)
    ids = torch.from_numpy(right_aligned([t.tokens for t in trees], width)).to(run.device)
    attend = torch.from_numpy(attend_rows(trees, width)).to(run.device)
    offsets = torch.from_numpy(right_aligned([t.depths for t in trees], width)).to(run.device)
    return Proposal(ids, [len(t) for t in trees], commits, [run.no_drafts] * len(trees), trees, attend, offsets)


# EAGLE-2 with the eagle3 drafter -------------------------------------------------------------
EAGLE3_CHILDREN = 4  # children per expanded node, and nodes expanded per depth (EAGLE-2's top-k)


class Eagle3Trees:
    """EAGLE-2's dynamic tree grown by the eagle3 drafter itself (``--tree dynamic``): after
    its catch-up (``Eagle3Chains.catch_up``), the root's top children; then per depth the
    best nodes by path probability (the product of the drafter's own probabilities along it)
    are expanded in one drafter step, each seeing the text and its ancestors' slots, into
    their top children; the ``--tree-nodes`` best of all the candidates are the tree (a
    node's path probability never exceeds its parent's: they form a tree). The drafter's
    ranking ignores the repetition penalty (verification applies it). Every row grows at once,
    one drafter pass per depth, on the device; every row's tree read in one host read;
    verified like any tree (its children distinct)."""

    def __init__(self, run, chains):
        self.run, self.plan, self.chains = run, run.plan, chains  # ``drafts.Eagle3Chains``: its cache and catch-up
        self.depth = run.plan.order - 1
        nodes = parse_nodes(run.cfg.trees.tree_nodes)
        self.budget = nodes if nodes is not None else EAGLE3_CHILDREN * self.depth  # auto: a full top-k per depth
        self.top = min(EAGLE3_CHILDREN, self.budget)

    def label(self, trace) -> None:
        trace.tree, trace.tree_nodes, trace.lookup = "dynamic", self.budget, 0
        trace.tree_accuracies = "the eagle3 drafter's step probabilities"

    def __call__(self, out, rows, anchors, live) -> Proposal:
        roots = tree_roots(out, rows, live, anchors, self.plan)
        depths = {j: min(self.depth, rows[j].budget - 1) for j in live}
        jobs = [(j, roots[j], depths[j]) for j in live if depths[j] > 0]
        host = self._grow(out, rows, anchors, jobs).tolist() if jobs else []  # the step's one read of the trees
        trees = {j: Tree([roots[j]], [-1], [0], [0]) for j in live}
        for (j, root, depth), cols in zip(jobs, host):
            trees[j] = _tree_of(cols, root, depth)
        for j in live:
            rows[j].forced = None
        return tree_proposal([trees[j] for j in live], [[roots[j]] for j in live], self.run)

    def _grow(self, out, rows, anchors, jobs) -> torch.Tensor:
        """The best tree candidates of every job's row (j, root, depth) on the device, best
        first # -> [R, 5, n] float64: token, parent + 1 (a candidate index; 0: the root), depth
        - 1, path log-probability, candidate index (offset so that zeros read as the root's
        children). Every row expands as many nodes per depth, in one drafter pass; a row
        shallower than the deepest (its budget's end) grows along, its deeper candidates scored
        -inf and left out by ``_tree_of``."""
        run, heads, cache = self.run, self.chains.heads, self.chains.cache
        logits, hidden = self.chains.catch_up(out, rows, anchors, jobs)  # [R, Vd], [R, 1, H]
        start, dev, R = run.clock(), run.device, len(jobs)
        ctx = [self.chains.done[rows[j].index] for j, *_ in jobs]  # each row's text length: its tree's slots follow
        at_ctx = torch.tensor(ctx, dtype=torch.long, device=dev)  # [R]
        top = min(self.top, logits.shape[-1])
        vals, ids = torch.log_softmax(logits.float(), -1).topk(top)  # [R, C] the roots' children
        tok, score = heads.to_target(ids), vals.double()  # [R, C] this depth's candidates
        parent = torch.full((R, top), -1, dtype=torch.long, device=dev)  # their parents (candidate index)
        slot_of = torch.full((R, top), -1, dtype=torch.long, device=dev)  # their parents' expanded slots (-1: the root)
        cands = [(tok, parent, torch.ones_like(tok), score)]
        seen_slots = torch.zeros(R, 0, 0, dtype=torch.bool, device=dev)  # [R, M, M] expanded slot -> the slots it sees
        outs, offset = hidden, 0  # the root's output, then each expanded slot's # [R, 1 + M, H]
        for d in range(1, max(depth for *_, depth in jobs)):
            pick = score.topk(min(self.top, score.shape[1])).indices  # [R, E] the best of depth d, expanded
            m, e = seen_slots.shape[1], pick.shape[1]
            src = slot_of.gather(1, pick) + 1  # [R, E] their parents' rows of ``outs``
            sees = torch.cat([seen_slots.new_zeros(R, 1, m), seen_slots], 1)  # [R, 1 + M, M]: the root sees no node
            sees = sees.gather(1, src[..., None].expand(R, e, m))  # [R, E, M]
            seen_slots = torch.cat([torch.cat([seen_slots, seen_slots.new_zeros(R, m, e)], 2),
                                    torch.cat([sees, torch.eye(e, dtype=torch.bool, device=dev).expand(R, e, e)], 2)], 1)
            span = max(ctx) + m + e
            rel = torch.arange(span, device=dev)[None] - at_ctx[:, None]  # [R, span]: a slot's place in its row's tree
            tree = seen_slots[:, m:].gather(2, rel.clamp(0, m + e - 1)[:, None].expand(R, e, span))  # [R, E, span]
            attend = (rel < 0)[:, None] | (tree & (rel < m + e)[:, None])  # the text, then the node's ancestors and itself
            at = (at_ctx + d - 1)[:, None].expand(R, e)  # depth d sits d - 1 after the root's step
            slots = at_ctx[:, None] + m + torch.arange(e, device=dev)[None]  # [R, E] after the text and the earlier nodes
            logits, h = heads.step(outs.gather(1, src[..., None].expand(R, e, outs.shape[-1])), tok.gather(1, pick), cache,
                                   at, attend, slots, span)  # [R, E, Vd], [R, E, H]
            outs = torch.cat([outs, h], 1)
            vals, ids = torch.log_softmax(logits.float(), -1).topk(top)  # [R, E, K]
            score = (score.gather(1, pick)[..., None] + vals.double()).reshape(R, -1)
            parent = (offset + pick).repeat_interleave(top, dim=1)
            slot_of = (m + torch.arange(e, device=dev)).repeat_interleave(top)[None].expand(R, -1)
            offset += cands[-1][0].shape[1]
            tok = heads.to_target(ids).reshape(R, -1)
            cands.append((tok, parent, torch.full_like(tok, d + 1), score))
        tokens, parents, depths, scores = (torch.cat(part, 1) for part in zip(*cands))  # [R, n]
        deeper = depths > torch.tensor([depth for *_, depth in jobs], device=dev)[:, None]  # past a row's own depth
        scores = scores.masked_fill(deeper, float("-inf"))
        best = scores.topk(min(self.budget, scores.shape[1])).indices  # [R, n'] sorted: best first
        out.model_s += run.clock() - start
        take = lambda x: x.gather(1, best).double()  # noqa: E731
        return torch.stack([take(tokens), take(parents) + 1, take(depths) - 1, take(scores), best.double()], 1)


def _tree_of(cols: list[list[float]], root: int, depth: int) -> Tree:
    """A row's tree from its ``_grow`` pack read on the host: nodes by depth then score (parents
    first), a candidate deeper than ``depth`` or whose parent was not kept (a tie at the cut) left out."""
    tokens, parents, depths, scores, index = cols
    order = sorted((i for i in range(len(tokens)) if depths[i] < depth), key=lambda i: (depths[i], -scores[i]))
    node_of, out_tokens, out_parents, out_depths, out_ranks = {-1: 0}, [root], [-1], [0], [0]
    children: dict[int, int] = {}
    for i in order:
        parent = node_of.get(int(parents[i]) - 1)
        if parent is None:
            continue
        node_of[int(index[i])] = len(out_tokens)
        out_tokens.append(int(tokens[i]))
        out_parents.append(parent)
        out_depths.append(int(depths[i]) + 1)
        out_ranks.append(children.get(parent, 0))
        children[parent] = children.get(parent, 0) + 1
    return Tree(out_tokens, out_parents, out_depths, out_ranks)
