"""One tree-verification step of the generation loop (``--tree static|dynamic``).

Given the last pass ``out``, its ``anchor`` row and the committed token, build a candidate tree
from the heads' top guesses at the anchor, run it in one forward pass (tree mask, depth
positions), keep the path the acceptance rule picks, compact the caches to that path and emit
its tokens. The next step reads the heads at the path's last node (its row in this pass) and
starts from the token the verification decided, exactly as the chain loop does.
"""

from __future__ import annotations

import numpy as np
import torch

from .sampling import penalised_logits
from .tree import Accuracies, Tree, Shape, auto_budget, best_first, parse_nodes, read_accuracies, MAX_RANKS
from .tree_accept import TreeVerdict, greedy_tree, sampled_tree, tree_seen, typical_tree


class TreeSteps:
    """Tree decoding state of one run: the shape (static) or the budget (dynamic)."""

    def __init__(self, model, cfg, run, order: int, trace, accuracies: Accuracies | None = None):
        self.model, self.cfg, self.run, self.trace = model, cfg, run, trace
        self.depth = order - 1  # draft heads read: head d guesses the token d after the root
        self.accuracy = accuracies or read_accuracies(getattr(model, "heads_dir", None), self.depth)
        nodes = parse_nodes(cfg.tree_nodes)
        self.budget = nodes if nodes is not None else auto_budget(model, self.accuracy, self.depth)
        self.shape: Shape | None = None
        if cfg.tree == "static":
            self.shape = best_first(self.accuracy.log_scores(self.depth), self.budget)
        self.ranks = min(MAX_RANKS, self.budget, run.vocab_size)
        trace.tree, trace.tree_nodes = cfg.tree, self.budget
        trace.tree_accuracies = self.accuracy.source if cfg.tree == "static" else "step probabilities"

    # propose -------------------------------------------------------------------------------
    def propose(self, out, anchor: int, root: int, depth: int) -> Tree:
        """The tree for this step: heads 1..depth's top guesses at ``anchor`` under ``root``."""
        if depth <= 0:
            return Tree([root], [-1], [0], [0])
        shape = self.shape.within(depth) if self.shape is not None else None
        ranks = self.ranks if shape is None else max(shape.max_rank(d) for d in range(1, depth + 1))
        logp = torch.stack([out.head_log_probs(i, anchor)[0] for i in range(1, depth + 1)])  # [depth, V]
        if self.cfg.penalty != 1:  # rank as the verification will judge: seen tokens penalised
            logp = penalised_logits(logp, self.run.seen, self.cfg.penalty)
        vals, ids = torch.topk(logp.float(), ranks, dim=-1)  # [depth, R]
        if shape is not None:
            guesses = ids.tolist()
        else:  # dynamic: this step's own probabilities score the paths; ids and scores in one read
            host = torch.stack([ids.double(), vals.double()]).cpu().numpy()  # [2, depth, R]
            guesses, shape = host[0].astype(np.int64).tolist(), best_first(list(host[1]), self.budget)
        return shape.fill(root, guesses)

    # verify --------------------------------------------------------------------------------
    def verify(self, out, tree: Tree, attend: torch.Tensor) -> TreeVerdict:
        run, cfg = self.run, self.cfg
        logits = out.base_logits()[0]  # [N, V]
        tokens = torch.tensor(tree.tokens, dtype=torch.long, device=logits.device)
        seen = tree_seen(run.seen, tokens, attend) if cfg.penalty != 1 else run.seen
        if cfg.mode == "speculative" and cfg.greedy:
            return greedy_tree(tree, penalised_logits(logits, seen, cfg.penalty).argmax(-1).tolist())
        target = run.sampler.target(logits, seen)  # [N, V]
        if cfg.mode == "typical":
            return typical_tree(tree, target, run.sampler.full(logits, seen), run.sampler, cfg.typical_eps, cfg.typical_delta)
        return sampled_tree(tree, target, run.sampler)

    # the step ------------------------------------------------------------------------------
    def step(self, out, anchor: int, root: int, depth: int, caches, forward, emit):
        """-> (out, anchor, forced, done), the loop's state after this step."""
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
        self.trace.accepted_lengths[len(verdict.path) - 1] += 1
        self.trace.tree_sibling_ranks.update(verdict.sibling_ranks)
        done = emit([tree.tokens[i] for i in verdict.path[1:]])
        return out, verdict.path[-1], verdict.next_token, done
