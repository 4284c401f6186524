"""The stats job: assign this machine's map tasks (sharding.py), count them (locally or on Ray),
merge by key range, write the stats dir. ``--shard I/N`` counts only this machine's part;
``multitoken stats merge`` joins the parts of all machines, checking they tile the corpus.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from multitoken.base.atomic import atomic_write_text, output_lock
from multitoken.base.config_io import resolved_config_text
from multitoken.base.cores import bounded_by_cores
from multitoken.base.outputs import STATS, STATS_WORK, prepare_output
from multitoken.base.manifest import MANIFEST, read_record, work_dir_ours
from multitoken.base.publish import claim_work, drop_work, remove_work, staged_output
from multitoken.base.data import DataConfig, describe_files
from multitoken.embedded import default_base, portable_base
from multitoken.base.errors import CheckpointError, DataError, UsageError

from .format import FORMAT_VERSION, META_NAME, check_order, check_vocab
from .executors import EXECUTORS, Executor, check_executor, make_executor, work_path
from .merge import merge_orders
from .sharding import SHARD_BY, assign_shards, check_tiling
from .store import fetch_parts as store_fetch_parts
from .store import join, mirror_shards, remove, shard_names, staging_root
from .shard import JOB_NAME, Job, Shard, check_runs, list_runs, read_job, shard_dir
from .table import _read_meta
from multitoken.base.tokenizer import load_tokenizer, tokenizer_fingerprint

CONFIG_NAME = "config.json"
MERGE_WORK = "merge-parts"
SHARD_KEYS = ("shard", "files", "tokenizer")  # job.json fields that may differ between shards of one job


@dataclass
class BuildConfig:
    out: str | None = field(default=None, metadata={"help": "stats directory to write"})
    tokenizer: str = field(default_factory=default_base, metadata={"help": "the base model whose tokenizer the corpus is tokenized with, named as --base names it (Hub id, dir, embedded:NAME, fetched:NAME, .gguf) (default: embedded:stories260K)"})
    order: int = field(default=3, metadata={"help": "highest n-gram order counted (1-3)"})
    min_count: tuple[int, ...] = field(default=(1,), metadata={"help": "prune n-grams rarer than this at merge: one value for orders 2..N, or one per order 1..N"})
    num_proc: int = field(default=1, metadata={"help": "local worker processes"})
    shard: str | None = field(default=None, metadata={"help": "count only shard I/N of the corpus (merge the shards later with `multitoken stats merge`)", "metavar": "I/N"})
    memory_mb: int = field(default=1024, metadata={"help": "memory bound per process for count buffers; counts beyond it spill to disk"})
    vocab_size: int | None = field(default=None, metadata={"help": "vocabulary size (default: the tokenizer's length)"})
    keep_partials: bool = field(default=False, metadata={"help": "keep OUT/partials after merging (to merge again with other shards later)"})
    executor: str = field(default="local", metadata={"help": "where the map (count) and reduce (merge) tasks run: local processes, or Ray tasks on a cluster (pip install \"multitoken[ray]\")", "choices": EXECUTORS})
    address: str | None = field(default=None, metadata={"help": "--executor ray: the cluster's address (default: $RAY_ADDRESS, else a new local Ray)"})
    shard_by: str = field(default="auto", metadata={"help": "how the corpus is cut into map tasks: by files (each task reads only its own files), by documents (every task reads the whole corpus and keeps every N-th document), or auto: files when the corpus has several and no --max-tokens is given", "choices": SHARD_BY})
    work_dir: str | None = field(default=None, metadata={"help": "where partial counts and merge parts go (default: OUT): a path every worker can read and write (a shared mount on a cluster), or an fsspec URL such as s3://bucket/dir (needs that protocol's fsspec package, e.g. s3fs)", "metavar": "DIR_OR_URL"})


def min_counts_per_order(min_count: tuple[int, ...], order: int) -> list[int]:
    """One minimum per order 1..order (a single value applies to orders >= 2)."""
    values = list(min_count) if min_count else [1]
    if any(v < 1 for v in values):
        raise UsageError(f"--min-count values must be >= 1, got {values}")
    if len(values) == 1:
        return [1] + values * (order - 1)
    if len(values) != order:
        raise UsageError(f"--min-count takes 1 or {order} values for order {order}, got {len(values)}", f"e.g. --min-count 2 or --min-count {' '.join(['1'] + ['2'] * (order - 1))}")
    return values


def make_job(cfg: BuildConfig, data: DataConfig) -> Job:
    if not cfg.out:
        raise UsageError("no output directory given", "pass --out DIR")
    check_order(cfg.order)
    if cfg.num_proc < 1:
        raise UsageError(f"--num-proc must be >= 1, got {cfg.num_proc}")
    if cfg.memory_mb < 4:
        raise UsageError(f"--memory-mb {cfg.memory_mb} is too small", "pass at least 4 (MB)")
    if data.max_tokens is not None and data.max_tokens < 1:
        raise UsageError(f"--max-tokens must be >= 1, got {data.max_tokens}")
    tok = load_tokenizer(cfg.tokenizer)
    vocab = cfg.vocab_size or len(tok)
    check_vocab(vocab, cfg.order)
    return Job(data=data, tokenizer=cfg.tokenizer, fingerprint=tokenizer_fingerprint(tok), vocab_size=vocab,
               order=cfg.order, memory_bytes=cfg.memory_mb << 20, out=cfg.out)


@contextmanager
def job_lock(out: Path, what: str = "the stats dir"):
    """One lock over a whole job on ``out`` (counting, merge, clean-up): the output's own lock
    (``atomic.output_lock``; the command has taken it already), so a second job on the same dir
    fails at once."""
    with output_lock(out, f"{what} {out} (a stats build or merge)"):
        yield


def build(cfg: BuildConfig, data: DataConfig, log=print, overwrite: bool = False) -> Path | None:
    """Count (resuming if partials exist) and, unless ``--shard`` is given, merge. Returns the stats dir.

    ``overwrite``: a finished stats dir in ``--out`` is recounted (else a finished dir of the
    same job is left as it is, and one of another job is refused). ``cfg.executor`` picks where
    the tasks run; the stats dir is the same either way."""
    if not cfg.out:
        raise UsageError("no output directory given", "pass --out DIR")
    out = Path(cfg.out)
    root = work_path(cfg.work_dir) if cfg.work_dir else out
    check_executor(cfg.executor, cfg.address)
    if cfg.executor == "local":  # the tasks stay --num-proc (they tile the corpus, the job records them); the
        # processes running them are bounded by the cores (workers.py, merge.py)
        bounded_by_cores(cfg.num_proc, "--num-proc", f"worker processes for its {cfg.num_proc} tasks")
    with ExitStack() as stack:
        stack.enter_context(job_lock(out))
        if _separate_work_dir(out, root):  # a local --work-dir is an output of its own: recorded, locked
            stack.enter_context(job_lock(root, "the stats work dir"))
            prepare_output(str(root), STATS_WORK.kind, inputs=(data.data, cfg.tokenizer), resume=True, flag="--work-dir")
        return _build_locked(cfg, data, out, root, log, overwrite)


WORK_DIRS = ("partials", MERGE_WORK)  # what a job writes into its work root (OUT, or --work-dir)


def _separate_work_dir(out: Path, root: Path | str) -> bool:
    return isinstance(root, Path) and root.resolve() != out.resolve()


def _work_kind(out: Path, root: Path) -> str:
    return STATS_WORK.kind if _separate_work_dir(out, root) else STATS.kind


def _build_locked(cfg: BuildConfig, data: DataConfig, out: Path, root: Path | str, log, overwrite: bool) -> Path | None:
    """``root``: where partials and merge parts go (``out`` unless --work-dir; a URL string for
    an object store)."""
    job = make_job(cfg, data)
    job.out = str(root)
    files, lines = describe_files(data)  # also refuses a --split the data does not have
    print("\n".join(lines), file=sys.stderr, flush=True)
    mins = min_counts_per_order(cfg.min_count, cfg.order)
    shard_by, shards = assign_shards(cfg.shard, cfg.num_proc, cfg.shard_by, data)
    if (out / META_NAME).exists():
        meta = _existing_meta(out, overwrite)
        if overwrite:
            log(f"{out}: --overwrite: recounting (the old stats stay until the new ones replace them)")
            _remove_partials(root, kind=_work_kind(out, root) if isinstance(root, Path) else None)
            _rmtree(_sub(root, MERGE_WORK), out)
        elif meta.get("job") != job.identity():
            raise UsageError(f"{out} already holds stats of another job", "pass --overwrite to recount it, or another --out")
        elif not _same_min_counts(meta, mins):
            _prepare_reprune(out, root, meta, mins, cfg.shard is not None)
            log(f"{out}: re-pruning the kept partial counts with min counts {mins}")
        else:
            log(f"{out} is complete already (pass --overwrite to recount)")
            if not cfg.keep_partials:  # a kill between writing meta.json and the clean-up
                _remove_partials(root, shards, kind=_work_kind(out, root) if isinstance(root, Path) else None)
            return out
    _check_no_foreign_shards(root, shards)
    sharding = {"shard_by": shard_by, "shards": [shard_dir("", s).name for s in shards]}
    config = resolved_config_text("stats build", cfg, data, extra={"data_files": files, "sharding": sharding})
    if isinstance(root, Path):  # recorded before the job makes them: only then are they ever removed
        claim_work(root, _work_kind(out, root), "stats build", WORK_DIRS)
    if cfg.shard is not None:  # no merge here: the shard's config is published now, beside its partials
        with staged_output(out, STATS.kind, "stats build", keep=lambda rel: rel != CONFIG_NAME) as stage:
            atomic_write_text(stage / CONFIG_NAME, config)
    executor = make_executor(cfg.executor, cfg.num_proc, cfg.address)
    try:
        return _count_and_merge(cfg, job, executor, shards, mins, files, out, root, log, config)
    finally:
        executor.close()


def _count_and_merge(cfg: BuildConfig, job: Job, executor: Executor, shards: list[Shard], mins: list[int],
                     files: list[str] | None, out: Path, root: Path | str, log, config: str) -> Path | None:
    t0 = time.perf_counter()
    tokens = executor.count(job, shards)
    seconds = time.perf_counter() - t0
    log(f"counted {tokens:,} tokens in {seconds:.1f}s ({tokens / max(seconds, 1e-9):,.0f} tokens/s, {executor.name} executor)")
    if cfg.shard is not None:
        log(f"shard {cfg.shard} done; merge all shards with: multitoken stats merge DIR... --out STATS_DIR")
        return None
    if isinstance(root, str):  # an object store: check and plan on local copies (store.py)
        with tempfile.TemporaryDirectory(prefix="multitoken-mirror-") as tmp:
            sdirs, urls = mirror_shards(root, shards, Path(tmp))
            write_stats(out, sdirs, mins, cfg.num_proc, job.memory_bytes, log, files=files, executor=executor,
                        work=_sub(root, MERGE_WORK), remote_runs=urls, config=config)
    else:
        write_stats(out, [shard_dir(root, s) for s in shards], mins, cfg.num_proc, job.memory_bytes, log, files=files,
                    executor=executor, work=root / MERGE_WORK, config=config, work_kind=_work_kind(out, root))
    if not cfg.keep_partials:
        _remove_partials(root, shards, kind=_work_kind(out, root) if isinstance(root, Path) else None)
    return out


def _existing_meta(out: Path, overwrite: bool) -> dict:
    """The meta.json already in ``--out`` (validated); damaged, it is refused unless overwriting."""
    try:
        return _read_meta(out)
    except CheckpointError as err:
        if overwrite:
            return {}
        raise UsageError(f"--out {out} holds a damaged stats dir: {err.problem}", "pass --overwrite to recount it, or another --out") from err


def _sub(root: Path | str, name: str) -> Path | str:
    return join(root, name) if isinstance(root, str) else root / name


def _rmtree(path: Path | str, root: Path, kind: str | None = None) -> None:
    """Remove a work dir: a URL's objects, or a local one its record in ``root`` lists (never
    through a symlink)."""
    if isinstance(path, str):
        remove(path)
    else:
        remove_work(path.parent, kind or _work_kind(root, path.parent), path.name)


def _remove_partials(out: Path | str, shards: list[Shard] | None = None, kind: str | None = None) -> None:
    """Remove our shard dirs (those of ``shards``, or every ``shard-*`` holding a job.json) and
    ``partials/`` itself once empty: nothing else in it is touched, nothing is reached through a
    symlink, and a local ``partials/`` its record does not list is left alone."""
    if isinstance(out, str):  # and this node's staged copies (a killed task's, or an old job's)
        for name in [shard_dir("", s).name for s in shards] if shards is not None else sorted(shard_names(out)):
            remove(join(out, "partials", name))
        _remove_partials(staging_root(out), shards)
        return
    root = out / "partials"
    if kind is None or not root.is_dir() or not _listed_work(out, kind, "partials"):
        return
    dirs = [shard_dir(out, s) for s in shards] if shards is not None else \
        [d for d in root.glob("shard-*") if (d / JOB_NAME).is_file()]
    for d in dirs:
        if not d.is_symlink():
            shutil.rmtree(d, ignore_errors=True)
    if not any(root.iterdir()):
        root.rmdir()
        drop_work(out, kind, "partials")


def _listed_work(root: Path, kind: str, name: str) -> bool:
    record = read_record(root / MANIFEST, str(root))
    return record is not None and name in record["work"] and work_dir_ours(root, name)


def _same_min_counts(meta: dict, mins: list[int]) -> bool:
    return meta.get("min_counts") == {str(k + 1): m for k, m in enumerate(mins)}


def _prepare_reprune(out: Path, root: Path | str, meta: dict, mins: list[int], sharded: bool) -> None:
    """A finished dir asked for other min counts: re-merge from its partials, or say why not.

    Pruning drops counts for good, so only the kept partials (``--keep-partials``) can give a
    lower or a different threshold. The re-merge is published all or nothing: a kill mid re-merge
    leaves the old stats, and a rerun re-prunes again.
    """
    was = ",".join(str(v) for _, v in sorted(meta.get("min_counts", {}).items(), key=lambda kv: int(kv[0])))
    if sharded or not (shard_names(root) if isinstance(root, str) else (root / "partials").is_dir()):
        raise UsageError(
            f"{out} is complete with --min-count {was}; re-pruning to {','.join(map(str, mins))} needs its partial "
            "counts, which were removed after the merge",
            f"rerun with --min-count {was} to reuse it, or delete {out} and rebuild with the new --min-count "
            "(add --keep-partials to be able to re-prune later)",
        )  # the old stats stay complete until the re-merged ones replace them


def _check_no_foreign_shards(out: Path | str, shards: list[Shard]) -> None:
    planned = {shard_dir("", s).name for s in shards}
    if isinstance(out, str):
        found = shard_names(out)
    else:
        found = {p.name for p in (out / "partials").glob("shard-*")} if (out / "partials").exists() else set()
    if found - planned:
        raise UsageError(
            f"{out}/partials holds shards {sorted(found - planned)} from a run with other --num-proc/--shard values",
            "rerun with the original --num-proc and --shard (or delete the partials to start over)",
        )


def find_shard_dirs(inputs: list[str]) -> list[Path]:
    dirs = []
    for spec in inputs:
        p = Path(spec)
        if p.name.startswith("shard-") and (p / JOB_NAME).exists():
            dirs.append(p)
        elif (p / "partials").is_dir():
            dirs.extend(sorted(d for d in (p / "partials").glob("shard-*") if d.is_dir()))
        else:
            raise UsageError(f"{spec} holds no partial counts (no partials/ directory)", "pass directories written by `multitoken stats build --shard I/N`")
    if not dirs:
        raise UsageError("no shard partials found in " + ", ".join(inputs))
    return dirs


def write_stats(out: Path, sdirs: list[Path], mins: list[int], num_proc: int, memory_bytes: int, log=print,
                files: list[str] | None = None, executor: Executor | None = None, work: Path | str | None = None,
                remote_runs: dict[str, str] | None = None, config: str | None = None, command: str = "stats build",
                work_kind: str = STATS.kind) -> dict:
    """Merge the finished shards ``sdirs`` into the stats dir ``out`` and write its meta.json
    (staged, then published all or nothing with the record of its files: the files an older
    stats dir's record lists are replaced or removed, other files kept). ``config``: the
    resolved config text, published with it as config.json. ``files``: the local data files counted,
    when known; a merge of shards counted elsewhere records None, each shard's config.json lists
    its own. ``executor`` runs the key-range merges (default: ``num_proc`` local processes);
    ``work`` holds their parts (default ``out/merge-parts``; every worker must reach it).
    ``remote_runs``: the runs' object-store URLs by local copy, when ``work`` is one (store.py)."""
    jobs = [read_job(d) for d in sdirs]
    ident = {k: v for k, v in jobs[0].items() if k not in SHARD_KEYS}
    for d, j in zip(sdirs, jobs):
        if {k: v for k, v in j.items() if k not in SHARD_KEYS} != ident:
            raise UsageError(f"{d} belongs to another job than {sdirs[0]} (data, tokenizer or order differ)", "merge only shards of one job")
    order = ident["order"]
    if len(mins) != order:
        mins = min_counts_per_order(tuple(mins), order)
    check_tiling(jobs)
    runs, totals = [], [0] * order
    for d in sdirs:
        infos = check_runs(d, order)
        if not infos or not infos[-1]["done"]:
            raise CheckpointError(f"{d} is not finished counting", "rerun its `multitoken stats build` command to complete it")
        runs += list_runs(d)
        for info in infos:
            totals = [a + b for a, b in zip(totals, info["totals"])]
    if totals[0] == 0:
        raise DataError("the corpus produced no tokens", "check --data, --column and --max-tokens")
    short = [k + 1 for k, t in enumerate(totals) if t == 0]
    if short:
        raise DataError(f"the corpus holds no n-grams of order {short[0]} (every document is shorter than {short[0]} tokens)",
                        f"pass longer documents, or --order {short[0] - 1}")
    t0 = time.perf_counter()
    work = work if work is not None else out / MERGE_WORK
    if isinstance(work, Path):  # recorded before the merge makes it: only then is it ever removed
        claim_work(work.parent, work_kind, command, (work.name,))
    with staged_output(out, STATS.kind, command, marker=META_NAME) as stage:
        kept = merge_orders(runs, stage, order, mins, ident["vocab_size"], memory_bytes, num_proc, log, work=work,
                            map_ranges=executor.map_ranges if executor is not None else None,
                           names=remote_runs, fetch_parts=store_fetch_parts if remote_runs is not None else None)
        meta = _meta(jobs, ident, order, totals, kept, mins, files)
        atomic_write_text(stage / META_NAME, json.dumps(meta, indent=1) + "\n")  # published last: marks the dir complete
        if config is not None:
            atomic_write_text(stage / CONFIG_NAME, config)
    _rmtree(work, out, work_kind)
    log(f"merged {len(runs)} runs in {time.perf_counter() - t0:.1f}s")
    return meta


def _meta(jobs: list[dict], ident: dict, order: int, totals: list[int], kept: dict, mins: list[int],
          files: list[str] | None) -> dict:
    from importlib.metadata import version

    meta = {
        "format_version": FORMAT_VERSION,
        "tokenizer": {"name": portable_base(str(jobs[0].get("tokenizer"))), "fingerprint": ident["tokenizer_fingerprint"]},
        "vocab_size": ident["vocab_size"],
        "orders": list(range(1, order + 1)),
        "total_tokens": totals[0],
        "ngram_totals": {str(k + 1): t for k, t in enumerate(totals)},
        "distinct": {str(k): v["distinct"] for k, v in kept.items()},
        "count_dtypes": {str(k): v["dtype"] for k, v in kept.items()},
        "min_counts": {str(k + 1): m for k, m in enumerate(mins)},
        "source": ident["data"],  # no sharding: the counts do not depend on it (config.json has it)
        "data_files": files,
        "package_version": version("multitoken"),
        "job": ident,
    }
    return meta


def merge(inputs: list[str], out: str, min_count: tuple[int, ...], num_proc: int, memory_mb: int, log=print,
          config: str | None = None) -> dict:
    sdirs = find_shard_dirs(inputs)
    mins = min_counts_per_order(min_count, read_job(sdirs[0])["order"])
    bounded_by_cores(num_proc, "--num-proc", "worker processes")  # the processes; any key ranges give the same stats
    with job_lock(Path(out)):
        return write_stats(Path(out), sdirs, mins, num_proc, memory_mb << 20, log, config=config, command="stats merge")

