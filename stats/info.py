"""``multitoken stats info``: a human summary of a stats dir."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .format import decode
from .table import CooccurrenceTable


def dir_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def top_pmi_pairs(table: CooccurrenceTable, top: int, min_pair_count: int) -> list[tuple[int, int, int, float]]:
    """The ``top`` bigrams by PMI = log ratio among those seen >= ``min_pair_count`` times."""
    if table.max_order < 2:
        return []
    keys, counts = table.arrays(2)
    keep = np.flatnonzero(np.asarray(counts) >= min_pair_count)
    if keep.size == 0:
        return []
    pairs = decode(np.asarray(keys[keep]), 2, table.vocab_size)
    c = np.asarray(counts[keep], dtype=np.float64)
    u = np.asarray(table.unigrams, dtype=np.float64)
    pmi = np.log(c / table.totals[2]) - np.log(u[pairs[:, 0]] / table.totals[1]) - np.log(u[pairs[:, 1]] / table.totals[1])
    best = np.argsort(-pmi, kind="stable")[:top]
    return [(int(pairs[i, 0]), int(pairs[i, 1]), int(c[i]), float(pmi[i])) for i in best]


def summary(path: str | Path, top: int = 10, min_pair_count: int = 10, tokenizer=None) -> str:
    table = CooccurrenceTable(path)
    m = table.meta
    lines = [
        f"stats dir     {table.path}",
        f"tokenizer     {m['tokenizer']['name']} (fingerprint {table.fingerprint[:16]})",
        f"vocab size    {m['vocab_size']:,}",
        f"tokens        {m['total_tokens']:,}",
        f"source        {m['source'].get('data')} (split {m['source'].get('split')}, max tokens {m['source'].get('max_tokens')})",
        f"size on disk  {dir_size(table.path) / 2**20:.2f} MiB",
        f"built by      multitoken {m['package_version']}",
    ]
    for k in m["orders"]:
        lines.append(f"order {k}       {int(m['distinct'][str(k)]):,} distinct (of {int(m['ngram_totals'][str(k)]):,} occurrences), min count {m['min_counts'][str(k)]}")
    pairs = top_pmi_pairs(table, top, min_pair_count)
    if pairs:
        lines.append(f"top {len(pairs)} pairs by PMI (count >= {min_pair_count}):")
        for a, b, c, pmi in pairs:
            shown = f"{tokenizer.decode([a])!r} {tokenizer.decode([b])!r}" if tokenizer is not None else f"{a} {b}"
            lines.append(f"  {pmi:7.2f}  {c:>10,}  {shown}")
    return "\n".join(lines)
