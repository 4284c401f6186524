"""The target distributions decoding draws from and judges drafts by, and the draws themselves.

The target of every mode (DynaMo's processing): logits / temperature, restricted to the top-k
(chosen on the raw logits), softmax over those k, then the probability of every token already
in the context divided by the repetition penalty and renormalised. Dividing a probability by
the penalty is subtracting log(penalty) from its scaled logit, so the whole target is a softmax
over k values: no full-vocabulary softmax per step. Greedy decoding ignores temperature and
top-k (as transformers' ``generate`` does) and takes argmax(logits - log(penalty) * seen).

``seen`` is a bool tensor on the logits' device: [V] for one row, or [m, V] when rows see
different contexts (verification row i also sees the drafts before it: ``rows_seen``).

Also here, the same top-k at the temperature on the host for DynaMo's grids and the joint
drafts (``Candidates``, ``head_candidates``), with the exact host top-k of CPU rows it reads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from multitoken.kernels import gemv_rows


def processed_probs(logp: torch.Tensor, temperature: float, top_k: int, seen: torch.Tensor | None = None,
                    penalty: float = 1.0) -> torch.Tensor:
    """The target as a dense distribution # [..., V] logits or log-probs -> [..., V] probs
    (``top_k`` 0 = the whole vocabulary)."""
    return dense(*top_probs(logp, temperature, top_k, seen, penalty), logp)


def dense(ids: torch.Tensor | None, probs: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``top_probs``' (ids [..., k], probs [..., k]) as a distribution shaped like ``like``
    # -> [..., V] (probs as they are when ids is None: already over the vocabulary)."""
    if ids is None:
        return probs
    return torch.zeros(like.shape, dtype=probs.dtype, device=like.device).scatter_(-1, ids, probs)


def top_probs(logits: torch.Tensor, temperature: float, top_k: int, seen: torch.Tensor | None = None,
              penalty: float = 1.0) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The target on its support: (ids [..., k], probs [..., k]); ids None when k covers the
    vocabulary (probs then [..., V]). Softmax shift invariance: logits and log-probs agree."""
    vocab = logits.shape[-1]
    if 0 < top_k < vocab:
        vals, ids = top_k_rows(logits, top_k)  # [..., k] the cut comes first: the rest is k-sized
        scaled = vals.float() / temperature
        if seen is not None and penalty != 1:
            scaled = scaled - math.log(penalty) * seen.expand(logits.shape).gather(-1, ids)
        return ids, torch.softmax(scaled, dim=-1)
    scaled = logits.float() / temperature
    if seen is not None and penalty != 1:
        scaled = scaled - math.log(penalty) * seen
    return None, torch.softmax(scaled, dim=-1)


def top_k_rows(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's k largest logits, largest first, equal values by lower index first (NaNs first,
    as larger than any value) # [..., V] -> (values [..., k], ids [..., k]). torch's ``topk``
    leaves ties in its partial sort's order, and bfloat16 logits tie often: this rule makes a
    seeded draw the same whoever computes the cut. On the CPU the kernels' ``rows_topk`` (two reads
    of a row); without them torch's ops give the same values and ids."""
    if logits.device.type == "cpu" and logits.dim() >= 1:
        if logits.dtype in (torch.float32, torch.bfloat16) and (lib := gemv_rows.library()) is not None:
            return lib.rows_topk(logits.contiguous(), k)
        vals = torch.topk(logits, k, dim=-1).values  # [..., k]: its k-th value does not depend on the order of ties
        if not torch.isnan(vals).any():
            floor = vals[..., -1:]  # [..., 1]
            above, level = logits > floor, logits == floor
            keep = above | (level & (level.cumsum(-1) <= k - above.sum(-1, keepdim=True)))  # the first equal values fill up to k
            ids = keep.nonzero()[:, -1].reshape(*logits.shape[:-1], k)  # [..., k] in index order
            vals = logits.gather(-1, ids)
            order = torch.sort(vals, dim=-1, descending=True, stable=True).indices  # equal values keep index order
            return vals.gather(-1, order), ids.gather(-1, order)
    vals, ids = torch.sort(logits, dim=-1, descending=True, stable=True)  # no host read: a device's own sort
    return vals[..., :k], ids[..., :k]


def penalised_logits(logits: torch.Tensor, seen: torch.Tensor | None, penalty: float) -> torch.Tensor:
    """logits - log(penalty) on seen tokens # [..., V]: what greedy decoding takes the argmax of."""
    if seen is None or penalty == 1:
        return logits
    return logits.float() - math.log(penalty) * seen


def rows_seen(seen: torch.Tensor, tokens: torch.Tensor, rows: int) -> torch.Tensor:
    """Row i's context: ``seen`` [V] plus tokens[:i] # -> [rows, V] bool (verification row i
    judges the token after drafts[:i]). Fixed shapes throughout: no data-dependent op (nonzero
    would make the host wait for the device)."""
    g = tokens.numel()
    if not g or rows <= 1:
        return seen.expand(rows, -1).clone()
    pos = torch.arange(max(rows, g), device=seen.device)
    earlier = (pos[:g][None, :] < pos[:rows][:, None]).long()  # [rows, g]: draft c precedes row r
    index = tokens.to(seen.device)[None, :].expand(rows, g)
    hits = torch.zeros(rows, seen.shape[-1], dtype=torch.long, device=seen.device).scatter_add_(1, index, earlier)
    return seen | (hits > 0)  # [rows, V]


def with_tokens(seen: torch.Tensor, tokens) -> torch.Tensor:
    """``seen`` [V] plus ``tokens`` (a list of ids, or an id tensor on ``seen``'s device; a copy)."""
    out = seen.clone()
    if len(tokens):
        out[tokens] = True
    return out


def _generator(device: torch.device, seed: int) -> torch.Generator | None:
    """A seeded generator on ``device``: the same seed gives the same draws there. ``meta``
    tensors carry no values (they stand in for an accelerator in device-placement tests): no
    generator, and draws on them return meta tensors."""
    return None if device.type == "meta" else torch.Generator(device=device).manual_seed(seed)


class Sampler:
    """Greedy (argmax) or seeded multinomial draws from the target; one object per decoding run.
    The generator lives on the logits' device and every draw returns a device tensor (0-d long):
    nothing here waits for the device; the loop moves the committed ids to the host once a step."""

    def __init__(self, greedy: bool, temperature: float, top_k: int, seed: int = 0, penalty: float = 1.0,
                 device: torch.device | str = "cpu"):
        self.greedy = greedy
        self.temperature = temperature
        self.top_k = top_k
        self.penalty = penalty
        self.device = torch.device(device)
        self.gen = _generator(self.device, seed)

    def target(self, logits: torch.Tensor, seen: torch.Tensor | None = None) -> torch.Tensor:
        """The dense distribution a token is drawn from # [..., V] -> [..., V] probs. Greedy:
        the real (penalised, temperature-1) probabilities, of which argmax is all greedy reads."""
        if self.greedy:
            return torch.softmax(penalised_logits(logits, seen, self.penalty).float(), dim=-1)
        return processed_probs(logits, self.temperature, self.top_k, seen, self.penalty)

    def full(self, logits: torch.Tensor, seen: torch.Tensor | None = None) -> torch.Tensor:
        """softmax((logits / T) - log(penalty) * seen) over the whole vocabulary # [..., V]: no
        top-k (Medusa's typical-acceptance rule reads this; T = 1 when greedy)."""
        temperature = 1.0 if self.greedy else self.temperature
        return torch.softmax(penalised_logits(logits.float() / temperature, seen, self.penalty), dim=-1)

    def _pick(self, logits: torch.Tensor, seen: torch.Tensor | None):
        """(token [] long, ids [k] | None, probs [k] | [V] | None): the draw from the target of
        ``logits`` [V], top-k first then everything on k values (greedy: argmax, no probs)."""
        if self.greedy:
            return penalised_logits(logits, seen, self.penalty).argmax(), None, None
        ids, probs = top_probs(logits, self.temperature, self.top_k, seen, self.penalty)
        i = torch.multinomial(probs, 1, generator=self.gen)  # [1]
        return (i if ids is None else ids.gather(-1, i)).reshape(()), ids, probs

    def sample(self, logits: torch.Tensor, seen: torch.Tensor | None = None) -> torch.Tensor:
        """One token from the target of ``logits`` [V] # -> [] long on the logits' device."""
        return self._pick(logits, seen)[0]

    def draft(self, logits: torch.Tensor, seen: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A draft from a head's ``logits`` [V] (# [] long) and the dense q [V] it was drawn from
        (the target's processing; None when greedy: greedy verification compares tokens only)."""
        tok, ids, probs = self._pick(logits, seen)
        return tok, None if probs is None else dense(ids, probs, logits)

    def draw(self, probs: torch.Tensor) -> torch.Tensor:
        """One token from a dense distribution ``probs`` [V] (argmax when greedy) # -> [] long."""
        if self.greedy:
            return probs.argmax()
        return torch.multinomial(probs.float(), 1, generator=self.gen).reshape(())

    def uniform(self, n: int) -> torch.Tensor:
        """n uniforms in [0, 1) # [n] float64 on the sampler's device."""
        return torch.rand(n, generator=self.gen, dtype=torch.float64, device=self.device)


def sample_rows(samplers: list[Sampler], logits: torch.Tensor, seen: torch.Tensor | None = None) -> torch.Tensor:
    """``samplers[r].sample(logits[r], seen[r])`` for every row # [R, V] -> [R] long: one cut and
    one softmax over all rows (each row's values as alone), then each row's draw from its own
    generator, so a row's token does not depend on the rows beside it."""
    first = samplers[0]
    if first.greedy or len({(s.greedy, s.temperature, s.top_k, s.penalty) for s in samplers}) > 1:
        return torch.stack([s.sample(logits[r], None if seen is None else seen[r]) for r, s in enumerate(samplers)])
    ids, probs = top_probs(logits, first.temperature, first.top_k, seen, first.penalty)  # [R, k] each
    picks = torch.stack([torch.multinomial(probs[r], 1, generator=s.gen) for r, s in enumerate(samplers)])  # [R, 1]
    return (picks if ids is None else ids.gather(-1, picks)).reshape(-1)


# DynaMo's candidates ---------------------------------------------------------------------------
@dataclass
class Candidates:
    """Top-k of one head: token ids and their renormalised probabilities (decreasing)."""

    ids: np.ndarray  # [k] int64
    probs: np.ndarray  # [k] float32, sums to 1


def head_candidates(scores: torch.Tensor, k: int, temperature: float) -> list[Candidates]:
    """Top-k of m heads with temperature # [m, V] -> m x (k ids + probs), in one top-k call on
    the scores' device and one host transfer. ``scores`` may be raw logits or log-probs: softmax
    is shift-invariant, so the top-k of either gives the same candidates (log-softmax over V is
    work the grid never reads)."""
    scores = scores.float()
    if scores.device.type == "cpu" and scores.shape[-1] >= MIN_VOCAB:  # below, torch's own sort is cheaper
        top = exact_topk(scores.detach().numpy(), k)  # torch.topk's very values and ids, at less than half its cost
        if top is not None:  # already on the host: no transfer
            return [Candidates(i, p) for i, p in zip(top[1], _tempered(torch.from_numpy(top[0]), temperature).numpy())]
    vals, idx = torch.topk(scores, k, dim=-1)  # [m, k] sorted: the grid's axes run from most to least likely
    probs = _tempered(vals, temperature)
    # ids (< 2^53) and float32 probs are exact in float64: both cross in one transfer
    host = torch.stack([idx.double(), probs.double()], dim=1).cpu().numpy()  # [m, 2, k]
    return [Candidates(row[0].astype(np.int64), row[1].astype(np.float32)) for row in host]


def _tempered(vals: torch.Tensor, temperature: float) -> torch.Tensor:
    """Probabilities of the top-k values at ``temperature`` # [m, k] -> [m, k] float32 (the grid
    is float32: k^n cells stay cheap)."""
    return torch.softmax(vals.double() / temperature, dim=-1).float()


def top_candidates(logp: torch.Tensor, k: int, temperature: float) -> Candidates:
    """Top-k of one head's scores with temperature # [V] -> k ids + probs."""
    return head_candidates(logp[None], k, temperature)[0]


# Host top-k ----------------------------------------------------------------------------------
# ``torch.topk`` of CPU rows, exactly, at less than half its cost over a 50k vocabulary.
#
# torch's CPU top-k copies every (value, index) pair of a row and partial-sorts them, the whole
# row each time. Here each row's (k + 1)-th largest value is bounded from below by the
# (k + 1)-th largest of 2(k + 1) block maxima (k + 1 distinct cells
# are >= it), so one vectorised compare leaves a few hundred candidates to sort. The result equals torch's whenever it is unique: when
# the row's k + 1 largest values are distinct and not NaN (torch ranks NaN first). Otherwise --
# a tie at the top, where torch's order is its partial sort's, or a NaN -- ``exact_topk`` returns
# None and the caller runs ``torch.topk``.

MIN_VOCAB = 4096  # below, torch's sort of the whole row costs less than these numpy calls


def exact_topk(x: np.ndarray, k: int, min_vocab: int = MIN_VOCAB) -> tuple[np.ndarray, np.ndarray] | None:
    """(values [m, k] float32, ids [m, k] int64) of each row of ``x`` [m, V] float32, largest
    first, as ``torch.topk(x, k)``; None where torch's answer is not determined by the values,
    or where V < ``min_vocab``."""
    m, v = x.shape
    kk = k + 1
    width = v // (2 * kk)
    if k < 1 or width < 2 or v < min_vocab:  # k >= V / 4: little to save
        return None
    blocks = x[:, :2 * kk * width].reshape(m, 2 * kk, width).max(axis=-1)  # [m, 2(k + 1)]; NaN propagates
    if np.isnan(blocks).any() or (v > 2 * kk * width and np.isnan(x[:, 2 * kk * width:]).any()):
        return None
    # the (k + 1)-th largest block maximum: <= the row's (k + 1)-th largest (2(k + 1) blocks leave
    # far fewer candidates than k + 1 blocks; more blocks cost more maxima than they save)
    floor = np.partition(blocks, kk, axis=-1)[:, kk]  # [m]; ascending, k + 1 blocks from index kk on
    vals, ids = np.empty((m, k), np.float32), np.empty((m, k), np.int64)
    for row in range(m):
        cand = np.flatnonzero(x[row] >= floor[row])  # >= k + 1 cells, the k + 1 largest among them
        cv = x[row, cand]
        order = np.argsort(-cv)[:kk]  # any order of equal values: ties are refused below
        top = cv[order]
        if not (top[:-1] > top[1:]).all():  # a tie among the k + 1 largest
            return None
        vals[row], ids[row] = top[:k], cand[order[:k]]
    return vals, ids
