"""What every proposer returns and reads. A proposer's one signature is

``proposer(out, rows, anchors, live) -> Proposal``: for every live row, the tokens already final
for its next positions (``commit``: the base's next token, or DynaMo's 1..n tokens) and the
candidates to verify after them (a chain of drafts, or a tree under the committed token; none in
``ar`` and ``dynamic`` modes), padded into one [B, T] step. ``out`` is the last pass
(``StepOutput``), row b reading its heads at position ``anchors[b]``: its scores there are read
here (``anchor_scores``, ``RowHeads``), and the base's next token after it (``next_tokens``).
Chain proposers live in ``drafts.py``, the tree proposer in ``tree_proposer.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampling import penalised_logits, sample_rows, with_tokens
from .trees import Shape, Tree


@dataclass
class Drafts:
    tokens: torch.Tensor  # [g] int64 on the target's device
    probs: torch.Tensor | None  # [g, V] the q each draft was drawn from (None: greedy drafts)

    @staticmethod
    def empty(device: torch.device | str = "cpu") -> "Drafts":
        return Drafts(torch.zeros(0, dtype=torch.long, device=device), None)


@dataclass
class Proposal:
    """One step for the rows of the batch, right-aligned after left pads."""

    ids: torch.Tensor  # [B, T] on the device
    lengths: list[int]  # tokens per row (the rest of its T are pads)
    commits: list[list[int]]  # per row: its final tokens (host), fed first
    drafts: list[Drafts]  # per row: chain drafts after its commit (empty for trees)
    trees: list[Tree | None] | None = None  # per row: its tree (node 0 = its committed token)
    attend: torch.Tensor | None = None  # [B, T, T] trees: each node sees its ancestors
    offsets: torch.Tensor | None = None  # [B, T] trees: each node's depth
    static: Shape | None = None  # a static tree whose tokens are still on the device (greedy)
    static_at: dict | None = None  # its index tensors on the device (``Trees.shape_tensors``)

    @property
    def width(self) -> int:
        return self.ids.shape[1]

    def select(self, keep: list[int]) -> "Proposal":
        """The rows ``keep`` (the others finished with their committed tokens)."""
        index = torch.tensor(keep, dtype=torch.long, device=self.ids.device)
        pick = lambda x: None if x is None else x.index_select(0, index)  # noqa: E731
        trees = None if self.trees is None else [self.trees[j] for j in keep]
        lengths = [self.lengths[j] for j in keep]
        width = max(lengths)  # a longer row may have left: its extra pad columns go
        cut = lambda x: None if x is None else x[..., self.width - width:]  # noqa: E731
        attend = None if self.attend is None else pick(self.attend)[:, self.width - width:, self.width - width:]
        return Proposal(cut(pick(self.ids)), lengths, [self.commits[j] for j in keep], [self.drafts[j] for j in keep],
                        trees, attend, cut(pick(self.offsets)), self.static, self.static_at)


def left_pad(seqs: list[torch.Tensor], width: int, device) -> torch.Tensor:
    """Rows right-aligned in a [B, width] tensor (pads, id 0, first: masked by the caches)."""
    out = torch.zeros(len(seqs), width, dtype=torch.long, device=device)
    for row, seq in enumerate(seqs):
        out[row, width - seq.numel():] = seq
    return out


def chain_step(commits: list[list[int]], drafts: list[Drafts], device) -> Proposal:
    """Each row's committed tokens then its drafts, right-aligned."""
    lengths = [len(c) + d.tokens.numel() for c, d in zip(commits, drafts)]
    width = max(lengths)
    if len(commits) == 1:  # one row: no pads
        ids = torch.tensor(commits[0], dtype=torch.long, device=device)
        ids = torch.cat([ids, drafts[0].tokens]) if drafts[0].tokens.numel() else ids
        return Proposal(ids[None], lengths, commits, drafts)
    if all(not d.tokens.numel() for d in drafts):  # host ids only: one copy to the device
        ids = left_pad([torch.tensor(c) for c in commits], width, "cpu").to(device)
    else:
        seqs = [torch.cat([torch.tensor(c, dtype=torch.long, device=device), d.tokens]) for c, d in zip(commits, drafts)]
        ids = left_pad(seqs, width, device)
    return Proposal(ids, lengths, commits, drafts)


def draw_draft(scores: torch.Tensor, row, context: torch.Tensor, plan):
    """A draft from a head's scores (raw logits or log-probs: the same distribution), processed
    like the target # [V] -> (id [], q [V] | None). ``context`` [j]: the tokens between the
    committed context and this draft, penalised like the context, as the verification row
    judging it does. Greedy drafts have no q: greedy verification compares tokens only."""
    seen = with_tokens(row.seen, context) if plan.penalised else row.seen
    return row.sampler.draft(scores, seen)


# Scores at the anchors ------------------------------------------------------------------------
def anchor_scores(out, i: int, anchors: tuple[int, ...]) -> torch.Tensor:
    """Head i's scores at every row's anchor # [B, V]: raw logits for the base and layer heads
    (their top-k or argmax is all most readers need: no log-softmax over V), log-probs from
    one-position heads (Medusa, CP), which make them so."""
    if i in out.hiddens:
        return out.anchor_head_logits(i, anchors)
    if i == 0:
        return out.at(out.base_logits(), tuple(a - out.first for a in anchors))[:, 0]
    return out.anchor_head_log_probs(i, anchors)


def anchor_argmax(out, i: int, anchors: tuple[int, ...]) -> torch.Tensor:
    """Head i's argmax at every row's anchor # [B] long (layer heads: without their logits where
    the model can)."""
    if i in out.hiddens:
        return out.anchor_head_argmax(i, anchors)
    return anchor_scores(out, i, anchors).argmax(-1)


class RowHeads:
    """Row ``row``'s head scores at its anchor, each read on first use # i -> [V] (the heads of
    every row are computed together, in one call per head)."""

    def __init__(self, out, row: int, anchors: tuple[int, ...], n: int, cands: list | None = None):
        self.out, self.row, self.anchors, self.n = out, row, anchors, n
        self.cands = cands  # heads 1..n-1's top-k (``dynamo.Candidates``), when the proposer read every row's at once

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return anchor_scores(self.out, i, self.anchors)[self.row]

    def hidden(self) -> torch.Tensor:
        """The heads' input at the anchor # [1, H] (CP's sequential drafts condition on it)."""
        return self.out.at(self.out.feats.base, self.anchors)[self.row:self.row + 1, 0]


def at_anchors(out, x: torch.Tensor, need: list[int], anchors: tuple[int, ...]) -> torch.Tensor:
    """Rows ``need`` of ``x`` [B, T - first, ...] (a pass's base outputs), each at its anchor # [R, ...]."""
    if len(anchors) == 1:  # one row: a plain slice
        return x[:, anchors[0] - out.first]
    picked = out.at(x, tuple(a - out.first for a in anchors))[:, 0]  # [B, ...]
    if len(need) < len(anchors):
        picked = picked.index_select(0, torch.tensor(need, dtype=torch.long, device=picked.device))
    return picked


def next_tokens(out, rows, need: list[int], anchors: tuple[int, ...], plan) -> list[int]:
    """A token from the base's target after each row's anchor: greedy takes every row's argmax
    in one call; sampling cuts every row's top-k at once and draws per row from its own
    generator. One host read either way."""
    if plan.argmax_only:  # the argmax alone (no logits where the model screens it)
        return at_anchors(out, out.base_argmax(), need, anchors).tolist()
    scores = at_anchors(out, out.base_logits(), need, anchors)  # the base's own (not a WHS head 1) # [R, V]
    seen = torch.stack([rows[j].seen for j in need]) if plan.penalised else None  # [R, V]
    if plan.greedy:
        return penalised_logits(scores, seen, plan.penalty).argmax(-1).tolist()
    return sample_rows([rows[j].sampler for j in need], scores, seen).tolist()

