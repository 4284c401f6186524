"""Which map tasks (shards) a stats job runs, and the check that shards tile the corpus.

``--shard I/N`` with ``--num-proc P`` makes this machine count tasks ``I*P .. I*P+P-1`` of
``T = N*P`` (``assign_shards``). A corpus of F > 1 files is cut by files (``--shard-by auto``):
with F >= T, task s reads files ``s*F//T .. (s+1)*F//T - 1`` and nothing else; with F < T,
each file is shared by about T/F tasks, each keeping one residue of its documents. A single
file (or ``--shard-by documents``, or a ``--max-tokens`` budget) is cut by documents: this
machine's tasks are ``(I + N*p) mod N*P``, and each reads the whole corpus. Counts are sums,
so the stats dir is the same whatever the cut. Partials of all machines are merged later by
``multitoken stats merge``, which checks they tile the corpus exactly.
"""

from __future__ import annotations

import math

import numpy as np

from multitoken.base.data import DataConfig, count_files
from multitoken.base.errors import UsageError

from .shard import Shard

SHARD_BY = ("auto", "files", "documents")


def parse_shard(spec: str | None) -> tuple[int, int]:
    if spec is None:
        return 0, 1
    try:
        i, n = (int(x) for x in spec.split("/"))
    except ValueError as err:
        raise UsageError(f"--shard {spec!r} is not of the form I/N", "e.g. --shard 0/4 for the first of four shards") from err
    if not 0 <= i < n:
        raise UsageError(f"--shard {spec}: need 0 <= I < N", "shards are numbered from 0")
    return i, n


def local_shards(shard: tuple[int, int], num_proc: int) -> list[tuple[int, int]]:
    """Cut by documents: this machine's residues ``(I + N*p) mod N*P``."""
    i, n = shard
    return [(i + n * p, n * num_proc) for p in range(num_proc)]


def file_shard(slot: int, tasks: int, files: int) -> Shard:
    """Task ``slot`` of ``tasks`` over ``files`` files: a contiguous group of whole files when
    there are at least as many files as tasks, else one file's residue class of documents (file
    f is shared by tasks ceil(f*T/F) .. ceil((f+1)*T/F) - 1)."""
    if files >= tasks:
        return Shard(0, 1, slot * files // tasks, (slot + 1) * files // tasks, files)
    f = slot * files // tasks
    lo, hi = -(-f * tasks // files), -(-(f + 1) * tasks // files)
    return Shard(slot - lo, hi - lo, f, f + 1, files)


def assign_shards(shard: str | None, num_proc: int, shard_by: str, data: DataConfig) -> tuple[str, list[Shard]]:
    """(how the corpus is cut, this machine's map tasks) for ``--shard``, ``--num-proc``,
    ``--shard-by``; see the module docstring."""
    if shard_by not in SHARD_BY:
        raise UsageError(f"--shard-by {shard_by!r} is not known", f"pass one of {', '.join(SHARD_BY)}")
    i, n = parse_shard(shard)
    by = shard_by
    if by == "files" and data.max_tokens is not None:
        raise UsageError("--shard-by files cannot split a --max-tokens budget (it is shared by document residues)",
                         "pass --shard-by documents (or auto), or drop --max-tokens")
    files = count_files(data) if by != "documents" and data.max_tokens is None else 1
    if by == "auto":
        by = "files" if files > 1 else "documents"
    if by == "documents":
        return by, [Shard(*s) for s in local_shards((i, n), num_proc)]
    tasks = n * num_proc
    return by, [file_shard(i * num_proc + p, tasks, files) for p in range(num_proc)]


def check_tiling(jobs: list[dict]) -> None:
    """The shards' job.json records must cover every document once: whole-corpus residues that
    tile the integers, or file groups that tile the files, each group's residues tiling it."""
    grouped = [j for j in jobs if "files" in j]
    if not grouped:
        return check_coverage([tuple(j["shard"]) for j in jobs])
    fix = "count every machine's shard with the same --shard-by, --num-proc and data files"
    if len(grouped) != len(jobs):
        raise UsageError("the shards mix a cut by files with a cut by documents, which cannot be checked to tile the corpus", fix)
    totals = sorted({j["files"][2] for j in jobs})
    if len(totals) > 1:
        raise UsageError(f"the shards were planned on different numbers of data files {totals}", fix)
    groups: dict[tuple[int, int], list] = {}
    for j in jobs:
        groups.setdefault(tuple(j["files"][:2]), []).append(tuple(j["shard"]))
    pos = 0
    for first, end in sorted(groups):
        if first != pos:
            what = "missing" if first > pos else "counted twice"
            raise UsageError(f"the shards do not cover the corpus's {totals[0]} files exactly once (files from {min(first, pos)} on {what})",
                             "pass the partials of every shard I/N, each once")
        check_coverage(groups[first, end])
        pos = end
    if pos != totals[0]:
        raise UsageError(f"the shards do not cover the corpus's {totals[0]} files exactly once (files {pos}..{totals[0] - 1} missing)",
                         "pass the partials of every shard I/N, each once")


def check_coverage(shards: list[tuple[int, int]]) -> None:
    """The residue classes ``i mod n`` of the shards must tile the integers exactly once."""
    period = math.lcm(*(n for _, n in shards))
    if period > 10_000_000:
        raise UsageError(f"shard counts {sorted({n for _, n in shards})} are too irregular to check", "use the same N on every machine")
    cover = np.zeros(period, np.int64)
    for i, n in shards:
        cover[i::n] += 1
    if (cover == 0).any() or (cover > 1).any():
        missing = int((cover == 0).sum() * 100 / period)
        raise UsageError(
            f"the shards {sorted(shards)} do not cover the corpus exactly once ({missing}% of documents missing, {int((cover > 1).sum() * 100 / period)}% counted twice)",
            "pass the partials of every shard I/N, each once",
        )
