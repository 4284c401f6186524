"""``CooccurrenceTable``: the co-occurrence mask of DynaMo (eq. 3 and eq. 6).

For candidate token lists per position ``x1 in A, x2 in B[, x3 in C]`` the mask grid is

    mask[i, j(, l)] = ( p_hat(x1, x2(, x3)) / (p_hat(x1) p_hat(x2) (p_hat(x3))) ) ** alpha

with ``p_hat(n-gram) = count / (n-gram occurrences of that order in the corpus)`` and
``p_hat(token) = unigram count / tokens``. ``alpha = 0`` switches masking off (all ones),
``alpha = 1`` is the paper's default.

**Absent n-grams.** An n-gram missing from the table (never seen, or pruned below the
build's ``--min-count``), or one with a never-seen token, has no estimate. Its ratio is the
``absent`` value (default 0.0: eq. 3 read literally, an unseen combination gets no mass;
1.0 makes such cells neutral, i.e. left to the heads). ``absent`` is a ratio, so it is
raised to ``alpha`` like the others (and ``0 ** 0 = 1``: alpha 0 is always "no mask").

Lookups are vectorised (see ``hashindex``); the index of an order is built on first use
from the memory-mapped count arrays and kept.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from multitoken.base.errors import CheckpointError, DataError, MismatchError, UsageError

from .format import MAX_ORDER, META_NAME, NPY_ERRORS, check_meta, encode
from .hashindex import PrefixBlockIndex
from multitoken.base.tokenizer import tokenizer_fingerprint

class CooccurrenceTable:
    """Open a stats dir; ``mask(cands, alpha)`` gives the co-occurrence grid."""

    def __init__(self, path: str | Path, *, absent: float = 0.0, fingerprint: str | None = None):
        self.path = Path(path)
        self.meta = _read_meta(self.path)
        if fingerprint is not None and fingerprint != self.fingerprint:
            raise MismatchError(
                f"stats {self.path} were counted with tokenizer {self.meta['tokenizer']['name']!r} "
                f"(fingerprint {self.fingerprint[:12]}), the model's tokenizer differs ({fingerprint[:12]})",
                "build stats with the model's own tokenizer: multitoken stats build --tokenizer MODEL ...",
            )
        if not np.isfinite(absent) or absent < 0:
            raise UsageError(f"absent must be a finite ratio >= 0, got {absent}")
        self.absent = float(absent)
        self.vocab_size = int(self.meta["vocab_size"])
        self.max_order = max(self.meta["orders"])
        self.totals = {int(k): int(v) for k, v in self.meta["ngram_totals"].items()}
        self.unigrams = np.array(self._load("counts1.npy", self.vocab_size, "uint64"))  # [V], small: in RAM
        if int(self.unigrams.sum()) > self.totals[1]:  # pruning (--min-count) may only lower the sum
            raise CheckpointError(f"{self.path / 'counts1.npy'}: unigram counts sum to {int(self.unigrams.sum())}, "
                                  f"more than the {self.totals[1]} tokens {META_NAME} records", "rebuild the stats dir")
        for order in range(2, self.max_order + 1):  # present with the recorded lengths (memory-mapped: cheap)
            self.arrays(order)
        # per-token 1/count (0 for never-seen tokens) once, in float32 as the grid uses it:
        # the same float64 -> float32 rounding as computing it per call, without the per-call cost
        u = self.unigrams.astype(np.float64)
        self._inv_uni = np.where(u > 0, 1.0 / np.maximum(u, 1), 0.0).astype(np.float32)
        self._unseen = u == 0
        self._index: dict[int, PrefixBlockIndex] = {}

    @classmethod
    def for_tokenizer(cls, path: str | Path, tokenizer, **kwargs) -> CooccurrenceTable:
        """Open ``path`` checking it was counted with ``tokenizer`` (MismatchError if not)."""
        return cls(path, fingerprint=tokenizer_fingerprint(tokenizer), **kwargs)

    @property
    def fingerprint(self) -> str:
        return self.meta["tokenizer"]["fingerprint"]

    def _load(self, name: str, length: int, dtype: str) -> np.ndarray:
        file = self.path / name
        try:
            arr = np.load(file, mmap_mode="r", allow_pickle=False)
        except NPY_ERRORS as err:
            raise CheckpointError(f"{file}: missing or unreadable ({err})", "rebuild the stats dir with multitoken stats build") from err
        if arr.shape != (length,) or arr.dtype != np.dtype(dtype):
            raise CheckpointError(f"{file}: holds {arr.shape} {arr.dtype}, {META_NAME} says ({length},) {dtype}", "rebuild the stats dir")
        return arr

    def arrays(self, order: int) -> tuple[np.ndarray, np.ndarray]:
        """Sorted keys and counts of ``order`` (memory-mapped)."""
        self._check_order(order)
        n = int(self.meta["distinct"][str(order)])
        return (self._load(f"keys{order}.npy", n, "uint64"),
                self._load(f"counts{order}.npy", n, self.meta["count_dtypes"][str(order)]))

    def index(self, order: int) -> PrefixBlockIndex:
        if order not in self._index:
            keys, counts = self.arrays(order)
            _check_keys(keys, self.vocab_size ** order, self.path / f"keys{order}.npy")
            self._index[order] = PrefixBlockIndex(keys, counts, self.vocab_size, order)
        return self._index[order]

    def prepare(self) -> CooccurrenceTable:
        """Build every order's lookup index now (else the first ``mask`` call pays for it)."""
        for order in range(2, self.max_order + 1):
            self.index(order)
        return self

    def _check_order(self, order: int) -> None:
        if not 2 <= order <= self.max_order:
            rebuild = f", or rebuild with --order {order}" if order <= MAX_ORDER else f" (stats count at most order {MAX_ORDER})"
            raise UsageError(
                f"a mask of {order} positions needs order-{order} counts; {self.path} holds orders up to {self.max_order}",
                f"pass 2..{self.max_order} candidate lists{rebuild}",
            )

    def _ids(self, cand, pos: int) -> np.ndarray:
        ids = cand.detach().cpu().numpy() if hasattr(cand, "detach") else np.asarray(cand)
        if ids.ndim != 1 or ids.size == 0 or ids.dtype.kind not in "iu":  # kind: np.issubdtype is slow per call
            raise DataError(f"candidate list {pos} must be a non-empty 1-D array of token ids, got shape {ids.shape} {ids.dtype}")
        out = ids.astype(np.int64)
        if (out.view(np.uint64) >= self.vocab_size).any():  # negatives wrap to >= 2^63: one test for both bounds
            raise DataError(
                f"candidate list {pos} holds token ids outside the vocabulary [0, {self.vocab_size}) (min {ids.min()}, max {ids.max()})",
                "use stats counted with the model's tokenizer",
            )
        return out

    def counts(self, cands) -> np.ndarray:
        """Joint counts grid ``[k1, .., kn]`` (uint64) of the candidate lists (0 where absent)."""
        return self._counts([self._ids(c, i) for i, c in enumerate(cands)])

    def _counts(self, ids: list[np.ndarray]) -> np.ndarray:
        """``counts`` of already validated int64 id lists."""
        self._check_order(len(ids))
        prefix = ids[0]
        for col in ids[1:-1]:  # mixed-radix prefix keys of the grid's leading axes
            prefix = (prefix.astype(np.uint64)[..., None] * np.uint64(self.vocab_size) + col.astype(np.uint64)).reshape(-1)
        possible = None
        if len(ids) == 3 and self._suffix_filter:
            # a kept trigram (a, b, c) implies a kept bigram (b, c): probe only those cells
            bc = self.index(2).grid(ids[1], ids[2]) > 0   # [k2, k3]
            possible = np.tile(bc, (len(ids[0]), 1))                      # [k1*k2, k3]
        grid = self.index(len(ids)).grid(prefix, ids[-1], possible)
        return grid.reshape([len(x) for x in ids])

    @property
    def _suffix_filter(self) -> bool:
        """True when every kept trigram's suffix bigram is kept too (pruning no harsher for bigrams)."""
        mins = self.meta["min_counts"]
        return int(mins["2"]) <= int(mins["3"])

    def ratio(self, cands) -> np.ndarray:
        """``p_hat(joint) / prod p_hat(marginals)`` grid (float32), ``absent`` where unknown."""
        ids = [self._ids(c, i) for i, c in enumerate(cands)]
        n = len(ids)
        joint = self._counts(ids)
        # ratio = count * N1^n / N_n / prod(unigram counts): in place, one axis at a time
        r = np.multiply(joint, self.ratio_scale(n), dtype=np.float32)
        for axis, x in enumerate(ids):
            shape = [1] * n
            shape[axis] = len(x)
            r *= self._inv_uni.take(x).reshape(shape)
        if self.absent != 0.0:  # with absent 0 the zeros above are already right
            r[joint == 0] = self.absent
            for axis, x in enumerate(ids):
                idx = np.flatnonzero(self._unseen.take(x))
                if idx.size:
                    r[(slice(None),) * axis + (idx,)] = self.absent
        return r

    def ratio_scale(self, order: int) -> np.float32:
        """N1^n / N_n, the float32 factor of every order-n ratio (before the 1/unigram factors)."""
        return np.float32(self.totals[1] ** order / self.totals[order])

    @property
    def inv_unigrams(self) -> np.ndarray:
        """Per-token 1/unigram count in float32, 0 for never-seen tokens # [V] (read-only use)."""
        return self._inv_uni

    def mask(self, cands, alpha: float = 1.0):
        """The co-occurrence mask ``ratio ** alpha`` (DynaMo eq. 6) over the candidate grid.

        ``cands``: 2 or 3 (up to the table's order) 1-D int arrays or torch tensors of token ids.
        Returns float32, a numpy array, or a torch tensor on the candidates' device if they are tensors.
        """
        if not np.isfinite(alpha) or alpha < 0:
            raise UsageError(f"alpha must be >= 0, got {alpha}")
        out = self.ratio(cands)
        if alpha == 0:
            out = np.ones_like(out)  # 0 ** 0 = 1: alpha 0 is "no mask", absent cells included
        elif alpha != 1:
            np.power(out, np.float32(alpha), out=out)
        first = cands[0] if len(cands) else None
        if hasattr(first, "detach"):
            import torch

            return torch.from_numpy(out).to(first.device)
        return out

    def encode(self, ngrams: np.ndarray) -> np.ndarray:
        """Token ids ``[m, n]`` -> keys ``[m]`` in this table's radix."""
        ngrams = np.asarray(ngrams)
        return encode([ngrams[:, j] for j in range(ngrams.shape[1])], self.vocab_size)


def _read_meta(path: Path) -> dict:
    file = path / META_NAME
    if not file.exists():
        hint = " (counting is unfinished: rerun the build command)" if (path / "partials").exists() else ""
        raise CheckpointError(f"{path} is not a stats dir: no {META_NAME}{hint}", "build one with multitoken stats build")
    try:
        meta = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:  # ValueError: bad JSON or bad UTF-8
        raise CheckpointError(f"{file}: not valid JSON ({err})", "rebuild the stats dir") from err
    return check_meta(meta, file)


def _check_keys(keys: np.ndarray, limit: int, file: Path, block: int = 1 << 22) -> None:
    """Keys must be strictly increasing and below ``V ** order`` (lookups binary-search them)."""
    fix = "rebuild the stats dir with multitoken stats build"
    if keys.size and int(keys[-1]) >= limit:
        raise CheckpointError(f"{file}: key {int(keys[-1])} is outside the vocabulary's range", fix)
    for lo in range(0, max(keys.size - 1, 0), block):  # blockwise: the keys are memory-mapped
        chunk = np.asarray(keys[lo:lo + block + 1])
        if not (chunk[1:] > chunk[:-1]).all():
            raise CheckpointError(f"{file}: keys are not sorted and unique", fix)
