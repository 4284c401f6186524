"""A work dir in an object store (``--work-dir s3://...``, any fsspec URL that is not local).

Object stores have no rename and no mmap, but a put is atomic per object. So a task works in a
local dir and publishes its output as whole objects, then a ``_COMPLETE`` marker object last:
an output without its marker is unfinished and ignored (a rerun writes it again).

* Map task (``count_to_store``): counts its shard in a local staging dir (``staging_root``:
  fixed per work dir, so a task rerun on the same node resumes from the runs it spilled there),
  uploads the shard's runs under ``partials/SHARD/a-ATTEMPT/`` and then ``partials/SHARD/_COMPLETE``
  naming that attempt and its runs. Attempts have their own prefix, so two attempts of one shard
  (a retried task and the orphan of a killed driver) never mix their runs; the marker written
  last names one complete set. A finished shard (marker present) is never counted again.
* Reduce task (``range_from_store``): fetches the order's arrays of every run it reads into a
  local temp dir, merges its key range there, uploads the part and its marker.
* Driver (``mirror_shards``): fetches the finished shards to a local dir to check and plan the
  merge (job records, totals, key samples) and fetches the parts to assemble the stats dir.

The cost: every run is downloaded by the driver once and by each reduce task of each order
(``1 + ranges`` reads of the partials); a shared mount reads each slice once. See stats/README.md.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import tempfile
import uuid
from pathlib import Path

from multitoken.base.errors import CheckpointError, UsageError

from .format import INFO_NAME
from .merge import RangeTask, run_range
from .shard import JOB_NAME, Job, Shard, count_shard, list_runs, read_job, shard_dir

MARKER = "_COMPLETE"


def is_remote(path) -> bool:
    """Whether ``path`` is an fsspec URL of a non-local file system (``file://`` is local)."""
    text = str(path)
    if "://" not in text:
        return False
    fs = _fs(text)[0]
    protocols = {fs.protocol} if isinstance(fs.protocol, str) else set(fs.protocol)
    return not protocols & {"file", "local"}


def _fs(url: str):
    import fsspec  # lazy: see is_remote

    return fsspec.core.url_to_fs(url)


def join(url: str, *parts: str) -> str:
    return "/".join([url.rstrip("/"), *parts])


def read_marker(url: str) -> dict | None:
    fs, path = _fs(url)
    try:
        return json.loads(fs.cat_file(f"{path}/{MARKER}"))
    except FileNotFoundError:
        return None


def put_dir(local: Path, url: str, marker: dict) -> None:
    """Upload every file under ``local`` (whole objects), then the marker: the dir is done."""
    fs, path = _fs(url)
    for file in sorted(p for p in local.rglob("*") if p.is_file() and p.name != ".lock"):
        fs.put_file(str(file), f"{path}/{file.relative_to(local).as_posix()}")
    fs.pipe_file(f"{path}/{MARKER}", json.dumps(marker).encode())


def fetch(url: str, dest: Path, names: list[str]) -> Path:
    fs, path = _fs(url)
    dest.mkdir(parents=True, exist_ok=True)
    for name in names:
        fs.get_file(f"{path}/{name}", str(dest / name))
    return dest


def remove(url: str) -> None:
    fs, path = _fs(url)
    if fs.exists(path):
        fs.rm(path, recursive=True)


def staging_root(work: str) -> Path:
    """This node's local dir for a remote work dir's unfinished shards (one per work dir)."""
    return Path(tempfile.gettempdir()) / "multitoken-stage" / hashlib.sha256(work.encode()).hexdigest()[:16]


def remote_shard(work: str, shard: Shard) -> str:
    return join(work, "partials", shard_dir("", shard).name)


def count_to_store(job: Job, shard: Shard, progress=None) -> dict:
    """Map task with a remote ``job.out``: count locally, publish the shard; returns its last info."""
    url = remote_shard(job.out, shard)
    done = read_marker(url)
    want = {**job.identity(), **shard.record()}
    if done is not None:
        have = {k: v for k, v in done["job"].items() if k != "tokenizer"}
        if have != want:
            raise UsageError(f"{url} holds partial counts of a different job", "rerun with the original options, or use another --work-dir")
        if progress:
            progress(done["info"]["tokens"])
        return done["info"]
    local = dataclasses.replace(job, out=str(staging_root(job.out)))
    info = count_shard(local, shard, progress)
    info = {k: v for k, v in info.items() if k != "cpu_seconds"}
    sdir = shard_dir(local.out, shard)
    attempt = f"a-{uuid.uuid4().hex[:12]}"
    runs = [r.name for r in list_runs(sdir)]
    put_dir(sdir, join(url, attempt), {"attempt": attempt})
    fs, path = _fs(url)
    fs.pipe_file(f"{path}/{MARKER}", json.dumps({"attempt": attempt, "runs": runs, "job": read_job(sdir), "info": info}).encode())
    shutil.rmtree(sdir, ignore_errors=True)
    return info


def count_anywhere(job: Job, shard: tuple[int, ...], progress=None) -> dict:
    """``count_shard``, through local staging when the work dir is an object store."""
    return count_to_store(job, Shard(*shard), progress) if is_remote(job.out) else count_shard(job, shard, progress)


def lock_dir(job: Job, shard: Shard) -> Path:
    """The local shard dir whose lock the map task takes (the staging dir for a remote work dir)."""
    return shard_dir(staging_root(job.out) if is_remote(job.out) else job.out, shard)


def mirror_shards(work: str, shards: list[Shard], dest: Path) -> tuple[list[Path], dict[str, str]]:
    """Fetch the finished ``shards`` into ``dest``; returns the local shard dirs and, per local
    run dir, its URL (what a reduce task fetches)."""
    fs, _ = _fs(work)
    names = [shard_dir("", s).name for s in shards]
    local_dirs, urls = [], {}
    for name in names:
        url = join(work, "partials", name)
        marker = read_marker(url)
        if marker is None:
            raise CheckpointError(f"{url} is not finished counting", "rerun its `multitoken stats build` command to complete it")
        sdir = dest / name
        sdir.mkdir(parents=True, exist_ok=True)
        (sdir / JOB_NAME).write_text(json.dumps(marker["job"]))
        for run in marker["runs"]:
            run_url = join(url, marker["attempt"], run)
            info = json.loads(fs.cat_file(f"{_fs(run_url)[1]}/{INFO_NAME}"))
            fetch(run_url, sdir / run, [INFO_NAME] + [f"{a}.npy" for a in info["arrays"]])
            urls[str(sdir / run)] = run_url
        local_dirs.append(sdir)
    return local_dirs, urls


def range_from_store(task: RangeTask) -> int:
    """Reduce task with remote runs and part: fetch, merge locally, publish the part."""
    done = read_marker(task.part)
    if done is not None and done.get("range") == [task.lo, task.hi]:
        return done["entries"]
    names = [INFO_NAME] + [f"{x}{task.order}.npy" for x in ("k", "c", "s")]
    with tempfile.TemporaryDirectory(prefix="multitoken-range-") as tmp:
        runs = tuple(str(fetch(r, Path(tmp) / f"run-{i:06d}", names)) for i, r in enumerate(task.runs))
        local = dataclasses.replace(task, runs=runs, part=str(Path(tmp) / "part"))
        entries = run_range(local)
        put_dir(Path(local.part), task.part, {"range": [task.lo, task.hi], "entries": entries})
    return entries


def range_anywhere(task: RangeTask) -> int:
    return range_from_store(task) if is_remote(task.part) else run_range(task)


def fetch_parts(parts: list[str], dest: Path) -> list[Path]:
    """The reduce tasks' finished parts, fetched into ``dest`` (to be assembled there)."""
    out = []
    for url in parts:
        if read_marker(url) is None:
            raise CheckpointError(f"{url} is not finished merging", "rerun the same command")
        out.append(fetch(url, dest / url.rstrip("/").rsplit("/", 1)[1], [INFO_NAME, "keys.npy", "counts.npy"]))
    return out


def exists(url: str) -> bool:
    fs, path = _fs(url)
    return fs.exists(path)


def shard_names(work: str) -> set[str]:
    """Names of the shard dirs under ``work/partials`` (finished or not)."""
    fs, path = _fs(work)
    return {p.rstrip("/").rsplit("/", 1)[1] for p in fs.glob(f"{path}/partials/shard-*")}
