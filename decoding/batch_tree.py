"""Batched tree verification (``generate_batch`` with ``--tree static|dynamic``): B rows, each with
its own candidate tree, verified in one forward pass per step.

Each live row proposes its tree with the batch-1 ``TreeSteps`` (one shape / budget for the run,
the row's own run state and trace: ``TreeSteps.for_row``) from its heads at its anchor; the
trees are right-aligned after left pads in one [B, T] step (T = the largest tree), with a mask
[B, 1, T, past + T] built from every row's valid past slots and its own tree, at positions =
the row's length + depth (``pipeline/model/ragged.tree_context``). Each row's verdict comes from
the batch-1 acceptance functions on its node columns; the caches keep each row's accepted path
as its first slots of the step, the rest holes (``DecodeCaches.keep_paths``); the row's next
anchor is the column of its path's last node in this pass, and the verdict's next token is its
next root, exactly as in ``loop.generate``.

Host reads per step, whatever the batch size: a static tree under greedy verification, every
row at full depth, one (``static_step``: one shape, so every row's tokens are gathered and its
path judged on the device; the read brings every row's tokens, last kept node and next token);
otherwise every row's guesses in one (ids; and scores for dynamic trees), and for greedy
verification the argmax after every node of every row in one.
Sampled and typical verification read twice for all rows: every row's walk inputs in one (the
children's probabilities, uniforms and masses; or the rule's passes), then, after each row's
walk on the host, every row's token drawn after its path in one. Each row draws from its own
generator, its uniforms before its final token, as batch 1 does (``TreeSteps.judge``, the same
pieces): rows equal their runs alone, seed for seed.
"""

from __future__ import annotations

import numpy as np
import torch

from .batch_steps import Row, next_tokens
from .sampling import penalised_logits
from .tree import Tree
from .tree_accept import TreeVerdict, greedy_kept, read_walks, tree_seen, verdict_of
from .tree_step import TreeSteps


def attend_rows(trees: list[Tree], width: int) -> np.ndarray:
    """Each tree's ancestor mask right-aligned in a [B, width, width] bool array (pads: none)."""
    out = np.zeros((len(trees), width, width), dtype=bool)
    for row, tree in enumerate(trees):
        off = width - len(tree)
        out[row, off:, off:] = tree.ancestors()
    return out


def _right_aligned(rows: list[list[int]], width: int) -> np.ndarray:
    """Lists right-aligned in a [B, width] int64 array (pads 0)."""
    out = np.zeros((len(rows), width), dtype=np.int64)
    for row, values in enumerate(rows):
        out[row, width - len(values):] = values
    return out


class BatchTrees:
    """Tree steps for the rows of one batched run."""

    def __init__(self, steps: TreeSteps, rows: list[Row], order: int):
        self.steps = steps
        self.order = order
        self.rows = {id(row): steps.for_row(row.run, row.trace) for row in rows}  # per-row views

    def of(self, row: Row) -> TreeSteps:
        return self.rows[id(row)]

    def guesses(self, out, batch: list[Row], keep: list[int], anchors: tuple[int, ...], depth: int) -> torch.Tensor:
        """Rows ``keep``'s heads' top guesses at their anchors, on the device (``TreeSteps.guesses``
        of the first ``depth`` heads, one top-k call for all rows) # -> [R, ...]."""
        steps = self.steps
        logp = torch.stack([out.anchor_head_log_probs(i, anchors) for i in range(1, depth + 1)], dim=1)  # [B, D, V]
        index = torch.tensor(keep, dtype=torch.long, device=logp.device)
        penalised = steps.cfg.penalty != 1  # only then do the guesses read the rows' contexts
        seen = torch.stack([batch[j].run.seen for j in keep])[:, None] if penalised else None  # [R, 1, V]
        return steps.guesses(logp.index_select(0, index), seen, steps.ranks_for(depth))

    def propose(self, out, batch: list[Row], keep: list[int], anchors: tuple[int, ...], depths: dict[int, int]) -> list[Tree]:
        """The trees of rows ``keep`` (indices into ``out``'s rows): every row's top guesses in
        one top-k call and one host read, then each row's tree on the host."""
        deep = max(depths.values())
        if deep <= 0:
            return [Tree([batch[j].commit[0]], [-1], [0], [0]) for j in keep]
        host = self.guesses(out, batch, keep, anchors, deep).tolist()
        trees = []
        for slot, j in enumerate(keep):
            root, depth = batch[j].commit[0], depths[j]
            trees.append(Tree([root], [-1], [0], [0]) if depth <= 0 else self.of(batch[j]).tree(host[slot], root, depth))
        return trees

    def on_device(self, keep: list[int], depths: dict[int, int]) -> bool:
        """Whether this step is a static tree under greedy verification at full depth in every
        row: one shape, so tokens and verdicts stay on the device (``static_step``)."""
        return self.steps.static_greedy and all(depths[j] == self.order - 1 for j in keep)

    def static_tokens(self, out, batch: list[Row], keep: list[int], anchors: tuple[int, ...]) -> torch.Tensor:
        """Rows ``keep``'s static trees, their tokens gathered on the device from their heads'
        guesses # -> [R, N] (no read: the roots are host ids going to the device)."""
        guesses = self.guesses(out, batch, keep, anchors, self.order - 1)  # [R, D, ranks]
        roots = torch.tensor([[batch[j].commit[0]] for j in keep], dtype=torch.long, device=guesses.device)  # [R, 1]
        return self.steps.static_tokens(guesses, roots, self.steps._on_device(self.steps.shape, guesses.device))

    def static_step(self, forward, batch: list[Row], tokens: torch.Tensor):
        """One pass over every row's static tree (no pads: one shape) and every row's greedy
        verdict, in one read for all rows # tokens [B, N] -> (out, N, trees, verdicts)."""
        steps = self.steps
        at = steps._on_device(steps.shape, tokens.device)
        b, n = tokens.shape
        out = forward(batch, tokens, 0, None, attend=at["attend"].expand(b, n, n), offsets=at["offsets"].expand(b, n))
        logits = out.base_logits()  # [B, N, V]
        if steps.cfg.penalty != 1:  # each node's own context: the row's seen tokens and its path
            seen = torch.stack([tree_seen(row.run.seen, tokens[j], at["attend"]) for j, row in enumerate(batch)])
            logits = penalised_logits(logits, seen, steps.cfg.penalty)
        kept = greedy_kept(tokens, logits.argmax(-1), at["parents"], at["level"], at["root"], self.order - 1)  # [B, 2]
        host = torch.cat([tokens, kept], 1).tolist()  # the step's one read, for every row
        trees, verdicts = zip(*(steps.static_verdict(steps.shape, row) for row in host))
        return out, n, list(trees), list(verdicts)

    def forward(self, forward, batch: list[Row], trees: list[Tree], device):
        """One pass over every row's tree, right-aligned # -> (out, width, attend [B, T, T])."""
        width = max(len(t) for t in trees)
        ids = torch.from_numpy(_right_aligned([t.tokens for t in trees], width)).to(device)
        attend = torch.from_numpy(attend_rows(trees, width)).to(device)
        offsets = torch.from_numpy(_right_aligned([t.depths for t in trees], width)).to(device)
        lengths = [len(t) for t in trees]
        out = forward(batch, ids, 0, lengths if min(lengths) < width else None, attend=attend, offsets=offsets)
        return out, width, attend

    def verify(self, out, batch: list[Row], trees: list[Tree], width: int, attend: torch.Tensor) -> list[TreeVerdict | None]:
        """Each row's verdict (None for a lone root: nothing to verify): two host reads for all
        rows (greedy: one)."""
        logits = out.base_logits()  # [B, T, V] (the pass reads from slot 0)
        judged = [j for j, t in enumerate(trees) if len(t) > 1]
        verdicts: list[TreeVerdict | None] = [None] * len(trees)
        if not judged:
            return verdicts
        steps = self.steps
        if steps.cfg.mode == "speculative" and steps.cfg.greedy:
            if steps.cfg.penalty != 1:  # each node's own context: the row's seen tokens and its path
                seen = torch.stack([self._seen(batch[j], trees[j], attend[j], width) for j in range(len(trees))])
                logits = penalised_logits(logits, seen, steps.cfg.penalty)
            judging = torch.from_numpy(np.stack([t.judging(width) for t in trees], 1)).to(logits.device)  # [4, B, T]
            tokens, parents, level, root = judging
            kept = greedy_kept(tokens, logits.argmax(-1), parents, level, root > 0, self.order - 1).tolist()  # the one read
            for j in judged:
                verdicts[j] = verdict_of(trees[j], *kept[j])
            return verdicts
        for j, verdict in zip(judged, self._walks(logits, batch, trees, judged, width, attend)):
            verdicts[j] = verdict
        return verdicts

    def _walks(self, logits, batch: list[Row], trees: list[Tree], judged: list[int], width: int,
               attend: torch.Tensor) -> list[TreeVerdict]:
        """Sampled / typical verdicts of rows ``judged``: each row walks its own inputs and draws
        from its own generator; every row's inputs cross in one read, every row's token after
        its path in another."""
        rows, pads = [self.of(batch[j]) for j in judged], [width - len(trees[j]) for j in judged]
        prepared = [row.walk_inputs(logits[j, pad:], trees[j], attend[j, pad:, pad:])  # [N_j, C], [N_j, V]
                    for row, j, pad in zip(rows, judged, pads)]
        hosts = read_walks([inputs for inputs, _ in prepared])  # read 1
        walks = [row.walk(trees[j], host) for row, j, host in zip(rows, judged, hosts)]
        tokens = torch.stack([row.draw(trees[j], target, path[-1])
                              for row, j, (_, target), (path, _) in zip(rows, judged, prepared, walks)]).tolist()  # read 2
        return [TreeVerdict(path, token, ranks) for (path, ranks), token in zip(walks, tokens)]

    def _seen(self, row: Row, tree: Tree, attend: torch.Tensor, width: int) -> torch.Tensor:
        """The row's node contexts right-aligned # [T, V] (pads: the row's context)."""
        n = len(tree)
        nodes = self.of(row).node_seen(tree, attend[width - n:, width - n:])  # [N, V]
        return torch.cat([row.run.seen.expand(width - n, -1), nodes])


def tree_loop(trees: BatchTrees, out, batch: list[Row], caches, forward, finish, eos, on_tokens, device) -> None:
    """Decode every row of ``batch`` to its end with batched tree steps (``out``: the prompts'
    pass, each row's anchor set). Rows finish and leave the batch as in the chain loop (``batch``,
    the rows in the caches, is updated in place)."""
    while True:
        live = [j for j, row in enumerate(batch) if not row.done]
        if not live:
            break
        anchors = tuple(row.anchor for row in batch)
        need = [j for j in live if batch[j].forced is None]  # after the prompt or a lone root: the base's next token
        if need:
            for j, token in zip(need, next_tokens(out, batch, need, anchors)):
                batch[j].forced = token
        depths = {}
        for j in live:
            row = batch[j]
            row.commit, row.forced = [row.forced], None
            depths[j] = min(trees.order - 1, row.run.cfg.max_new_tokens - len(row.out_ids) - 1)
            if row.emit(row.commit, eos, on_tokens):
                finish(row)
        keep = [j for j in live if not batch[j].done]
        if not keep:
            break
        on_device = trees.on_device(keep, depths)  # static greedy at full depth: one read per step
        step = trees.static_tokens(out, batch, keep, anchors) if on_device else trees.propose(out, batch, keep, anchors, depths)
        for j in live:
            batch[j].trace.model_s += out.model_s  # head distributions: model time
        out.model_s = 0.0
        if len(keep) < len(batch):
            caches.keep_rows(keep)  # finished rows leave before the next pass
            batch[:] = [batch[j] for j in keep]
        caches.compact_if_sparse()
        start = caches.length
        if on_device:
            out, width, step_trees, verdicts = trees.static_step(forward, batch, step)
        else:
            step_trees = step
            out, width, attend = trees.forward(forward, batch, step_trees, device)
            verdicts = trees.verify(out, batch, step_trees, width, attend)
        paths = [[0] if v is None else v.path for v in verdicts]
        caches.keep_paths(start, [[width - len(t) + i for i in p] for t, p in zip(step_trees, paths)])
        for row, tree, verdict, path in zip(batch, step_trees, verdicts, paths):
            row.anchor = width - len(tree) + path[-1]
            if verdict is None:
                continue  # a lone root: its next token comes from the base at the next step
            row.forced = verdict.next_token
            trees.of(row).record(verdict)
            if row.emit([tree.tokens[i] for i in path[1:]], eos, on_tokens):
                finish(row)
