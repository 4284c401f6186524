"""The stats job on a local Ray cluster: byte-identical to the local executor, also when a map or
reduce worker is killed mid-task (Ray retries it) and when the driver is killed -9 and rerun
(finished partials reused, no shard counted twice); without Ray, one line saying how to get it.

One cluster for the module (ray.init takes seconds); fault hooks: tests/stats/ray_hooks.py.
"""

from __future__ import annotations

import filecmp
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from . import objstore
import pytest
from .stats_helpers import write_jsonl_ids, zipf_docs

from multitoken.base.manifest import MANIFEST
from multitoken.base.data import DataConfig
from multitoken.base.tokenizer import load_tokenizer
from multitoken.embedded import default_base
from multitoken.stats.job import BuildConfig, build

HERE = Path(__file__).resolve().parent
SETTINGS = dict(num_proc=2, memory_mb=4, min_count=(2,), order=3)
# config.json records the options: where the tasks ran, and --out (two stats dirs cannot share a
# path); these alone may differ
RUN_ONLY = ("executor", "address", "work_dir", "out")


@pytest.fixture(scope="module")
def control(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("ray-hooks")


@pytest.fixture(scope="module")
def cluster(control):
    """A 2-CPU local Ray cluster whose workers carry the fault hooks; returns its address."""
    ray = pytest.importorskip("ray", reason="the Ray executor needs ray (pip install \"multitoken[ray]\")")
    saved = {k: os.environ.get(k) for k in ("RAY_AUTH_MODE", "MT_RAY_HOOKS", "PYTHONPATH")}
    os.environ["RAY_AUTH_MODE"] = "disabled"  # a local test cluster; drivers in subprocesses join without a token
    os.environ["MT_RAY_HOOKS"] = str(control)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), saved["PYTHONPATH"]) if p)
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False,
             runtime_env={"worker_process_setup_hook": "ray_hooks.install"})
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


@pytest.fixture(autouse=True)
def clean_control(control):
    """Hold and pid files of one test must not leak into the next."""
    for p in control.iterdir():
        p.unlink()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    vocab = len(load_tokenizer(default_base()))
    return write_jsonl_ids(tmp_path_factory.mktemp("ray-corpus") / "ids.jsonl", zipf_docs(600, vocab=vocab, max_len=800, seed=3))


def _build(out: Path, corpus: Path, **kw) -> Path:
    build(BuildConfig(out=str(out), **{**SETTINGS, **kw}), DataConfig(data=str(corpus)), log=lambda *_: None)
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory, corpus) -> Path:
    return _build(tmp_path_factory.mktemp("ray-ref") / "local", corpus)


def assert_identical(ref: Path, got: Path, also: tuple[str, ...] = ()) -> None:
    """Every file of the stats dir byte for byte (meta.json included: it records no executor,
    path or timing); config.json too, but for the fields RUN_ONLY."""
    names = sorted(p.name for p in ref.iterdir() if p.is_file())
    assert names == sorted(p.name for p in got.iterdir() if p.is_file() and p.name != ".lock")
    assert {"meta.json", "counts1.npy", "keys3.npy", "counts3.npy"} <= set(names)
    for name in names:
        if name == "config.json":
            a, b = (json.loads((d / name).read_text()) for d in (ref, got))
            for cfg in (a, b):
                for key in RUN_ONLY + also:
                    cfg["BuildConfig"].pop(key)
            assert a == b
        elif name == MANIFEST:  # the same files, but config.json's sha256 (the run-only fields above)
            a, b = (json.loads((d / name).read_text())["files"] for d in (ref, got))
            assert {k: v for k, v in a.items() if k != "config.json"} == {k: v for k, v in b.items() if k != "config.json"}
        else:
            assert filecmp.cmp(ref / name, got / name, shallow=False), name


def _kill_when_held(control: Path, name: str, killed: list) -> None:
    """Background: SIGKILL the worker that reports holding ``name``, then release the hold."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        pids = list(control.glob(f"pid-{name}-*"))
        if pids:
            pid = int(pids[0].name.rsplit("-", 1)[1])
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
            break
        time.sleep(0.05)
    (control / f"hold-{name}").unlink(missing_ok=True)


def test_ray_equals_local_byte_for_byte(cluster, corpus, reference, tmp_path):
    work = tmp_path / "shared"
    out = _build(tmp_path / "ray", corpus, executor="ray", work_dir=f"file://{work}")
    assert_identical(reference, out)
    assert not (work / "partials").exists() and not (work / "merge-parts").exists()  # cleaned up as locally


@pytest.mark.heavy
@pytest.mark.parametrize("hold", ["count-1", "merge-3-0"])
def test_worker_killed_mid_task_is_retried(cluster, control, corpus, reference, tmp_path, hold):
    (control / f"hold-{hold}").write_text("")
    killed: list[int] = []
    killer = threading.Thread(target=_kill_when_held, args=(control, hold, killed))
    killer.start()
    try:
        out = _build(tmp_path / "ray", corpus, executor="ray")
    finally:
        killer.join()
    assert killed, f"no task reached the hold {hold}"
    assert not Path(f"/proc/{killed[0]}").exists() or "Z" in Path(f"/proc/{killed[0]}/stat").read_text().split()[2]
    assert_identical(reference, out)


DRIVER = """
import sys, ray
from multitoken.base.data import DataConfig
from multitoken.stats.job import BuildConfig, build
ray.init(address=sys.argv[1], logging_level="ERROR", runtime_env={"worker_process_setup_hook": "ray_hooks.install"})
build(BuildConfig(out=sys.argv[2], executor="ray", keep_partials=True, num_proc=2, memory_mb=4, min_count=(2,), order=3),
      DataConfig(data=sys.argv[3]), log=lambda *_: None)
"""


def _runs(out: Path, shard: int) -> dict[str, tuple[int, int]]:
    """Finished run dirs of a shard -> (inode, mtime ns) of their info.json."""
    return {p.parent.name: (p.stat().st_ino, p.stat().st_mtime_ns)
            for p in out.glob(f"partials/shard-{shard:05d}-of-00002/run-*/info.json")}


def _done(out: Path, shard: int) -> bool:
    return any(json.loads(p.read_text())["done"] for p in out.glob(f"partials/shard-{shard:05d}-of-00002/run-*/info.json"))


def _gone(pid: int) -> bool:
    stat = Path(f"/proc/{pid}/stat")
    try:
        return stat.read_text().split()[2] == "Z"
    except OSError:
        return True


@pytest.mark.heavy
def test_driver_killed_then_rerun_reuses_partials(cluster, control, corpus, reference, tmp_path, capsys):
    """kill -9 of a driver (Python API, its own process, joining the cluster by address) while
    shard 0 is done and shard 1 half counted; the rerun, by the CLI in this process (on the warm
    cluster: no second start-up), leaves every run finished before the kill as it was (same inode
    and mtime: nothing recounted), adds runs to shard 1 only, and prints progress."""
    from multitoken.pipeline.cli import main

    out, hold = tmp_path / "ray", control / "hold-count-1"
    hold.write_text("")
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, cluster, str(out), str(corpus)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not (_done(out, 0) and list(control.glob("pid-count-1-*"))) and time.monotonic() < deadline:
            assert driver.poll() is None, "the driver stopped before it was killed"
            time.sleep(0.05)
        kept = {0: _runs(out, 0), 1: _runs(out, 1)}
        assert kept[0] and kept[1], "shard 0 done and shard 1 part-counted when the driver dies"
        driver.send_signal(signal.SIGKILL)
    finally:
        driver.kill()
        driver.wait()
    assert not (out / "meta.json").exists()
    orphan = int(next(control.glob("pid-count-1-*")).name.rsplit("-", 1)[1])
    deadline = time.monotonic() + 20
    while not _gone(orphan) and time.monotonic() < deadline:  # Ray ends the dead driver's tasks
        time.sleep(0.05)
    hold.unlink()
    capsys.readouterr()
    code = main(["stats", "build", "--data", str(corpus), "--out", str(out), "--executor", "ray", "--address", cluster,
                 "--num-proc", "2", "--memory-mb", "4", "--min-count", "2", "--keep-partials"])
    rerun = capsys.readouterr()
    assert code == 0, rerun.err[-2000:]
    assert "shards 2/2" in rerun.err and "tok/s" in rerun.err and "ray executor" in rerun.out
    for shard in (0, 1):  # every run finished before the kill is the same file, untouched
        now = _runs(out, shard)
        assert {k: now.get(k) for k in kept[shard]} == kept[shard]
    assert set(_runs(out, 0)) == set(kept[0])  # the finished shard was not counted again
    assert len(_runs(out, 1)) > len(kept[1])   # the other one resumed
    assert_identical(reference, out, also=("keep_partials",))


BLOCK_RAY = """
import sys
sys.modules["ray"] = None  # what an install without the [ray] extra looks like to `import ray`
from multitoken.pipeline.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_without_ray_one_line_says_how_to_install(corpus, tmp_path):
    out = tmp_path / "none"
    done = subprocess.run([sys.executable, "-c", BLOCK_RAY, "stats", "build", "--data", str(corpus), "--out", str(out),
                           "--executor", "ray"], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    errors = [line for line in done.stderr.splitlines() if "error" in line]
    assert errors == ['multitoken stats: error: --executor ray needs Ray, which is not installed: pip install "multitoken[ray]"']
    assert "Traceback" not in done.stderr
    assert not (out / "meta.json").exists()


def test_object_store_work_dir_gives_the_same_bytes(cluster, corpus, reference, tmp_path):
    """``--work-dir`` in an object store without rename or mmap (objstore.py, registered here
    and in the workers): runs and parts published whole with _COMPLETE markers, fetched by the
    reduce tasks and the driver."""
    objstore.register()
    store = tmp_path / "bucket"
    out = _build(tmp_path / "ray", corpus, executor="ray", work_dir=f"mtobj://{store}/work", keep_partials=True)
    assert_identical(reference, out, also=("keep_partials",))
    markers = sorted(store.glob("work/partials/shard-*/_COMPLETE"))
    assert len(markers) == 2 and not (store / "work" / "merge-parts").exists()


def test_a_map_task_waits_only_for_a_live_shard_lock(tmp_path):
    from multitoken.base.atomic import lock_file
    from multitoken.stats.ray_executor import _lock_held

    lock = tmp_path / ".lock"
    assert not _lock_held(lock)  # no file
    with lock_file(lock, "a shard"):
        assert _lock_held(lock)
    lock.write_text("4242\n")  # what a killed holder leaves: the file, no flock
    assert not _lock_held(lock)
