"""Candidate trees: several guesses per head verified in one forward pass (Medusa, EAGLE-2).

A tree's node 0 (the root) is the committed token; a node at depth d holds a candidate for the
token d positions after it, one of head d's top guesses at the anchor (its rank among them).
Every node sees the context and its ancestors (``attend``) and sits at position past + depth
(``depths``), so the base's row at a node is its distribution after the node's path.

Shapes. Both grow a tree best-first from scores per (depth, rank) whose sum along a path never
increases as the path grows (log-probabilities, log-accuracies), so the ``budget`` best nodes
always form a tree:
- ``static`` (Medusa's recipe): the score of a path is the product of the measured accuracies
  of its (head, rank) choices, the expected acceptance of that node; one shape per run.
- ``dynamic`` (EAGLE-2's expand-then-rerank): the product of the step's own head probabilities.
  EAGLE-2 expands the best nodes of each depth then keeps the ``budget`` best overall; our heads
  all read the anchor (a child's guesses do not depend on its parent's token), so that top set
  is exactly what the best-first walk here returns.
"""

from __future__ import annotations

import heapq
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from multitoken.base.json_cache import keep_entry, read_entries

ACCURACY_FILE = "rank_accuracy.json"  # written beside the heads by `multitoken eval`
MAX_RANKS = 32  # guesses per head a tree may take (the shipped heads gain up to rank ~30 at 64+ nodes)
AUTO_BUDGETS = (4, 8, 16, 32, 64)


@dataclass
class Tree:
    """Nodes in an order where every parent precedes its children."""

    tokens: list[int]  # [N] node 0 = the committed token
    parents: list[int]  # [N] -1 for the root
    depths: list[int]  # [N]
    ranks: list[int]  # [N] the token's rank among its head's guesses (0 for the root)
    children: list[list[int]] = field(default_factory=list)  # node -> children, best rank first

    def __post_init__(self):
        if not self.children:
            self.children = [[] for _ in self.tokens]
            for node, parent in enumerate(self.parents):
                if parent >= 0:
                    self.children[parent].append(node)
            for kids in self.children:
                kids.sort(key=lambda c: self.ranks[c])

    def __len__(self) -> int:
        return len(self.tokens)

    def path(self, node: int) -> list[int]:
        """Root .. node # node indices."""
        out = []
        while node >= 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]

    def ancestors(self) -> np.ndarray:
        """[N, N] bool on the host: row i marks node i and its ancestors."""
        seen = np.eye(len(self), dtype=bool)
        for node, parent in enumerate(self.parents):
            if parent >= 0:  # parents precede children: the parent's row is complete
                seen[node] |= seen[parent]
        return seen

    def attend(self, device=None) -> torch.Tensor:
        """[N, N] bool: row i sees node j when j is i or one of its ancestors."""
        return torch.from_numpy(self.ancestors()).to(device)  # one host-to-device copy, not N index ops

    def offsets(self, device=None) -> torch.Tensor:
        """[N] long: each node's depth (its position after the root's)."""
        return torch.tensor(self.depths, dtype=torch.long, device=device)

    def judging(self, width: int | None = None) -> np.ndarray:
        """What ``rules.greedy_kept`` reads, right-aligned in ``width`` slots (pads first:
        their own parents, depth -1, never kept) # -> [4, width] int64: tokens, parents (the
        root's: itself), depth + 1, root flag."""
        n = len(self)
        width = n if width is None else width
        out = np.zeros((4, width), dtype=np.int64)
        off = width - n
        out[1] = np.arange(width)  # pads point at themselves
        out[0, off:] = self.tokens
        out[1, off:] = [off + max(p, 0) for p in self.parents]
        out[2, off:] = [d + 1 for d in self.depths]
        out[3, off] = 1
        return out


@dataclass(frozen=True)
class Shape:
    """A tree of (depth, rank) choices without tokens: node i's parent and (depth, rank)."""

    parents: tuple[int, ...]
    depths: tuple[int, ...]
    ranks: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.parents)

    def max_rank(self, depth: int) -> int:
        return max([r + 1 for r, d in zip(self.ranks, self.depths) if d == depth], default=0)

    def within(self, depth: int) -> "Shape":
        """The nodes no deeper than ``depth`` (parents precede children: indices stay valid)."""
        keep = [i for i, d in enumerate(self.depths) if d <= depth]
        if len(keep) == len(self):
            return self
        index = {old: new for new, old in enumerate(keep)}
        return Shape(tuple(-1 if self.parents[i] < 0 else index[self.parents[i]] for i in keep),
                     tuple(self.depths[i] for i in keep), tuple(self.ranks[i] for i in keep))

    def fill(self, root: int, guesses: list[list[int]]) -> Tree:
        """The tree of this shape with ``root`` and guesses[d - 1][rank] at depth d."""
        tokens = [root if d == 0 else guesses[d - 1][r] for d, r in zip(self.depths, self.ranks)]
        return Tree(tokens, list(self.parents), list(self.depths), list(self.ranks))


def best_first(scores: list[np.ndarray], budget: int) -> Shape:
    """The ``budget`` best non-root nodes, a node's score being the sum of scores[d - 1][rank]
    along its path (each row sorted best first, all <= 0). Lazy: a node's next sibling and first
    child enter the frontier when it is taken (neither can beat it)."""
    parents, depths, ranks, values = [-1], [0], [0], [0.0]
    frontier: list[tuple[float, int, int, int]] = []  # (-value, parent, depth, rank)

    def offer(parent: int, depth: int, rank: int) -> None:
        if depth <= len(scores) and rank < len(scores[depth - 1]) and math.isfinite(scores[depth - 1][rank]):
            heapq.heappush(frontier, (-(values[parent] + float(scores[depth - 1][rank])), parent, depth, rank))

    offer(0, 1, 0)
    while frontier and len(parents) <= budget:
        neg, parent, depth, rank = heapq.heappop(frontier)
        node = len(parents)
        parents.append(parent)
        depths.append(depth)
        ranks.append(rank)
        values.append(-neg)
        offer(parent, depth, rank + 1)
        offer(node, depth + 1, 0)
    return Shape(tuple(parents), tuple(depths), tuple(ranks))


def expected_accepted(shape: Shape, accuracy: list[list[float]]) -> float:
    """Expected drafts accepted by greedy verification of ``shape`` if head d's rank-r guess is
    right with probability accuracy[d - 1][r] independently: the sum of its nodes' path products."""
    value = [1.0] * len(shape)
    for i in range(1, len(shape)):
        value[i] = value[shape.parents[i]] * accuracy[shape.depths[i] - 1][shape.ranks[i]]
    return sum(value[1:])


# Accuracies ----------------------------------------------------------------------------------
@dataclass
class Accuracies:
    """Per (draft head, rank) accuracy: table[d - 1][r] = P(head d's rank-r guess is the token)."""

    table: list[list[float]]
    source: str  # the file read, or "fallback prior"

    def log_scores(self, depth: int) -> list[np.ndarray]:
        """log accuracy per rank of the first ``depth`` draft heads (best_first's scores)."""
        return [np.log(np.maximum(np.asarray(row[:MAX_RANKS], dtype=np.float64), 1e-12)) for row in self.table[:depth]]


def fallback_accuracies(n_drafts: int) -> Accuracies:
    """A generic prior when no measurement sits beside the heads: top-1 accuracy 0.6 for head 2,
    falling by 0.7 per further head, and rank r right about 1 / (r + 1)^2 as often as rank 0
    (the shape of the shipped heads' measured curves)."""
    table = [[0.6 * 0.7 ** d / (r + 1) ** 2 for r in range(MAX_RANKS)] for d in range(n_drafts)]
    return Accuracies(table, "fallback prior")


def read_accuracies(heads_dir, n_drafts: int) -> Accuracies:
    """The accuracies ``multitoken eval`` wrote beside the heads (``rank_accuracy.json``:
    {"rank_accuracy": [[head 2 ranks...], [head 3 ranks...], ...]}), the fallback prior
    without them. Heads the file does not cover take the prior's rows."""
    prior = fallback_accuracies(n_drafts)
    path = Path(heads_dir) / ACCURACY_FILE if heads_dir else None
    if path is None or not path.is_file():
        return prior
    try:
        rows = json.loads(path.read_text())["rank_accuracy"]
        table = [[float(x) for x in row][:MAX_RANKS] for row in rows[:n_drafts]]
    except (OSError, ValueError, KeyError, TypeError):
        return Accuracies(prior.table, f"fallback prior ({path} unreadable)")
    if not table or any(not row or not all(0 <= x <= 1 for x in row) for row in table):
        return Accuracies(prior.table, f"fallback prior ({path} malformed)")
    return Accuracies(table + prior.table[len(table):], str(path))


def accuracy_record(rank_hits: list[list[int]], counts: list[int]) -> dict:
    """What ``multitoken eval`` writes to ``rank_accuracy.json``: per draft head (head 2 on) the
    fraction of positions whose target is its rank-r guess."""
    return {"rank_accuracy": [[h / max(c, 1) for h in hits] for hits, c in zip(rank_hits, counts)],
            "positions": counts, "ranks": MAX_RANKS,
            "note": "row d: head d+2; entry r: P(target == its rank-r guess); read by --tree static"}


# Budgets -------------------------------------------------------------------------------------
def parse_nodes(value) -> int | None:
    """``--tree-nodes``: an int in [1, MAX_TREE_NODES], or None for ``auto``."""
    if value is None or str(value) == "auto":
        return None
    return int(value)


_STEP_TIMES: dict[tuple, dict[int, float]] = {}  # (model id, device) -> budget -> seconds per verify step


def step_times(model, budgets=AUTO_BUDGETS, context: int = 64, reps: int = 5, argmax: bool = False) -> dict[int, float]:
    """Seconds of one verification forward over 1 + b tree tokens after a ``context``-token cache,
    per budget b (the median of ``reps``), measured once per model, device and read in this
    process (``argmax``: greedy without a penalty reads only the base's argmax; else its logits).
    A model with a ``step_times_store`` (``(file, key)``: the key names the machine and the
    model's shapes) reads them from that JSON file when it holds them, and records them there
    once measured: once per machine, not once per process."""
    key = (id(model), str(model.backbone.device), argmax)
    if key in _STEP_TIMES:
        return _STEP_TIMES[key]
    store = getattr(model, "step_times_store", None)
    entry = f"{store[1]}|argmax={argmax}|context={context}|budgets={','.join(map(str, budgets))}" if store else None
    if store and (kept := read_entries(store[0]).get(entry)):
        _STEP_TIMES[key] = {int(b): float(t) for b, t in kept.items()}
        return _STEP_TIMES[key]
    import time

    device = model.backbone.device
    vocab = model.backbone.vocab_size
    caches = model.new_caches()
    model.step(torch.randint(0, vocab, (1, context), generator=torch.Generator().manual_seed(0)).to(device), caches)
    times = {}
    for b in budgets:
        ids = torch.randint(0, vocab, (1, b + 1), generator=torch.Generator().manual_seed(b)).to(device)
        attend = torch.tril(torch.ones(b + 1, b + 1, dtype=torch.bool, device=device))
        offsets = torch.arange(b + 1, device=device)
        runs = []
        for _ in range(reps):
            start = time.perf_counter()
            out = model.step(ids, caches, attend=attend, offsets=offsets)
            out.base_argmax() if argmax else out.base_logits()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            runs.append(time.perf_counter() - start)
            caches.keep(context, [])
        times[b] = float(np.median(runs))
    _STEP_TIMES[key] = times
    if store:
        keep_entry(store[0], entry, {str(b): t for b, t in times.items()})
    return times


def auto_budget(model, accuracy: Accuracies, depth: int, argmax: bool = False) -> int:
    """The budget with the most expected tokens per second: (1 + expected accepted drafts of the
    static tree) / the measured step time (``argmax``: of a step that reads only the base's argmax)."""
    times = step_times(model, argmax=argmax)
    rate = {b: (1 + expected_accepted(best_first(accuracy.log_scores(depth), b), accuracy.table)) / t
            for b, t in times.items()}
    return max(rate, key=rate.get)


# EAGLE-2 under DynaMo's joint ------------------------------------------------------------------
def joint_tree(ids: np.ndarray, probs: np.ndarray, root: int, budget: int, cells) -> Tree:
    """EAGLE-2's rerank under DynaMo's joint: the ``budget`` nodes of highest mass, from the
    heads' top-k (``ids``, ``probs`` [depth, k], best first, at the temperature). ``cells``:
    the co-occurrence-masked joint given ``root`` over the first ``covered`` heads (eq. 6, the
    joint drafter's grid: no thresholds, the penalty already in the scores) # [k]*covered; a
    node's mass is its path's, the grid summed over the deeper covered heads. A deeper head
    multiplies its parent's mass by its own probability, as in the plain dynamic tree. A parent
    never has less mass than its children and ties put the shallower first, so the best nodes
    always hold their parents."""
    grid = cells.astype(np.float64)
    depth, k = ids.shape
    covered = grid.ndim
    # frontier: (-mass, depth, a, b): covered nodes (a = 0, b = flat index in their level),
    # deeper ones (a = parent node, b = rank), each entering when its parent or previous sibling is taken
    frontier = []
    for d in range(1, covered + 1):
        mass = (grid.sum(axis=tuple(range(d, covered))) if d < covered else grid).ravel()
        # a node behind ``budget`` others of its level is never taken: only the level's best enter
        best = np.lexsort((np.arange(mass.size), -mass))[:budget]
        frontier += [(-float(mass[f]), d, 0, int(f)) for f in best if mass[f] > 0]
    heapq.heapify(frontier)
    index = {(0, 0): 0}
    tokens, parents, depths, ranks, masses = [root], [-1], [0], [0], [1.0]
    while frontier and len(tokens) <= budget:
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


def attend_rows(trees: list[Tree], width: int) -> np.ndarray:
    """Each tree's ancestor mask right-aligned in a [B, width, width] bool array (pads: none)."""
    out = np.zeros((len(trees), width, width), dtype=bool)
    for row, tree in enumerate(trees):
        off = width - len(tree)
        out[row, off:, off:] = tree.ancestors()
    return out


def right_aligned(rows: list[list[int]], width: int) -> np.ndarray:
    """Lists right-aligned in a [B, width] int64 array (pads 0)."""
    out = np.zeros((len(rows), width), dtype=np.int64)
    for row, values in enumerate(rows):
        out[row, width - len(values):] = values
    return out


# Prompt lookup branches (``--lookup K``) ------------------------------------------------------
# Greedy text repeats itself: names, phrases, code, and whole loops in a small model's output.
# Prompt lookup decoding (Saxena, 2023; transformers' ``prompt_lookup_num_tokens``) drafts the K
# tokens that followed the latest earlier occurrence of the context's last n tokens (n = 3, then
# 2, then 1). Here that run is grafted onto the step's tree as one more path from the root (it
# shares the nodes whose tokens the heads already guessed), so it can run past the heads' depth
# and is verified in the same forward pass: no model work beyond its nodes, and greedy
# verification keeps the output the base model's greedy output.
MAX_NGRAM = 3  # the longest context suffix matched (transformers' prompt lookup: 2 by default)
LOOKUP_RANK = MAX_RANKS  # a grafted node's rank: after every head guess among its siblings


def context_draft(context: list[int], k: int) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the context's longest
    matching suffix (``MAX_NGRAM`` tokens down to one); [] when none occurs. Host lists only."""
    if k < 1 or len(context) < 2:
        return []
    seq = np.asarray(context, dtype=np.int64)
    for n in range(min(MAX_NGRAM, len(seq) - 1), 0, -1):
        starts = np.arange(len(seq) - n)  # earlier windows only: the suffix itself starts at len - n
        hit = np.ones(len(starts), dtype=bool)
        for i in range(n):
            hit &= seq[starts + i] == seq[len(seq) - n + i]
        found = np.flatnonzero(hit)
        if found.size:
            after = int(found[-1]) + n  # the latest occurrence: the most recent phrasing
            return context[after:after + k]
    return []


def graft(tree: Tree, tokens: list[int]) -> Tree:
    """``tree`` with the path root -> tokens[0] -> tokens[1] ... added: nodes the tree already
    holds on that path are shared, the rest appended (parents still precede children)."""
    toks, parents, depths, ranks = list(tree.tokens), list(tree.parents), list(tree.depths), list(tree.ranks)
    node = 0
    for token in tokens:
        child = next((c for c in tree.children[node] if toks[c] == token), None) if node < len(tree) else None
        if child is None:
            toks.append(token)
            parents.append(node)
            depths.append(depths[node] + 1)
            ranks.append(LOOKUP_RANK)
            child = len(toks) - 1
        node = child
    return Tree(toks, parents, depths, ranks)


def with_lookup(tree: Tree, context: list[int], k: int) -> tuple[Tree, int]:
    """A row's candidate tree with its context's lookup draft grafted on (``context`` ends with
    the tree's root: the token committed this step), and the draft's length (0: none)."""
    draft = context_draft(context, k)
    return (graft(tree, draft) if draft else tree), len(draft)


def adapt_lookup(k: int, drafted: int, kept: int, most: int) -> int:
    """The next step's branch length (transformers' assistant-length heuristic): two more after
    a step that kept a path as deep as the whole lookup draft, one less after one that did not,
    within [1, most]; a wrong branch then costs few nodes through a stretch that does not repeat."""
    k = k or most
    return min(k + 2, most) if kept >= drafted else max(k - 1, 1)


def looked_up(tree: Tree, path: list[int]) -> int:
    """Nodes of a kept ``path`` that only the lookup branch drafted."""
    return sum(tree.ranks[n] == LOOKUP_RANK for n in path[1:])
