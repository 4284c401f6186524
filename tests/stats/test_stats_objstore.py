"""An object-store work dir (``--work-dir URL`` of a store without rename or mmap), on the local
executor: tasks stage locally and publish whole objects with a ``_COMPLETE`` marker last; the
stats dir is byte-identical to a local work dir; a shard without its marker (an upload cut short)
is counted again, a finished one never. The Ray path: test_stats_ray.py."""

from __future__ import annotations

import filecmp
import json
from pathlib import Path

from . import objstore
import pytest
from .stats_helpers import build_ids, write_jsonl_ids, zipf_docs

from multitoken.base.manifest import MANIFEST
from multitoken.stats.store import MARKER, is_remote, staging_root

VOCAB = 50000


@pytest.fixture(autouse=True, scope="module")
def registered():
    objstore.register()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("obj") / "corpus"
    root.mkdir()
    docs = zipf_docs(160, vocab=VOCAB, max_len=300, seed=4)
    write_jsonl_ids(root / "a.jsonl", docs[:70])
    write_jsonl_ids(root / "b.jsonl", docs[70:])
    return root


def same_stats(a: Path, b: Path) -> None:
    names = sorted(p.name for p in a.iterdir() if p.is_file() and p.name not in ("config.json", ".lock", MANIFEST))
    assert names == sorted(p.name for p in b.iterdir() if p.is_file() and p.name not in ("config.json", ".lock", MANIFEST))
    for name in names:
        assert filecmp.cmp(a / name, b / name, shallow=False), name


def test_the_test_store_is_an_object_store(tmp_path):
    import fsspec

    fs, path = fsspec.core.url_to_fs(f"mtobj://{tmp_path}/b")
    fs.pipe_file(f"{path}/x/y", b"1")  # no parent "dir" needed
    with pytest.raises(NotImplementedError):
        fs.mv(f"{path}/x/y", f"{path}/x/z")
    assert is_remote(f"mtobj://{tmp_path}/b") and not is_remote(f"file://{tmp_path}") and not is_remote(str(tmp_path))


def test_object_store_work_dir_gives_the_same_bytes_and_resumes(tmp_path, corpus, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a URL mistaken for a path would show up here as ./mtobj:
    local = build_ids(tmp_path, str(corpus), "local", VOCAB, min_count=(2,), num_proc=1)
    store = tmp_path / "bucket" / "work"
    url = f"mtobj://{store}"
    kept = build_ids(tmp_path, str(corpus), "obj", VOCAB, min_count=(2,), num_proc=1, work_dir=url, keep_partials=True)
    same_stats(local, kept)
    assert not (tmp_path / "mtobj:").exists() and not (tmp_path / "obj" / "partials").exists()
    shards = sorted((store / "partials").iterdir())
    # one task (spawned local workers would not have the test store registered; Ray workers do)
    assert len(shards) == 1 and all((s / MARKER).is_file() for s in shards)
    for s in shards:  # the marker names one attempt's complete runs
        marker = json.loads((s / MARKER).read_text())
        assert marker["info"]["done"] and all((s / marker["attempt"] / r / "info.json").is_file() for r in marker["runs"])
    assert not (store / "merge-parts").exists()
    assert not any(staging_root(url).glob("partials/shard-*"))  # staged shards removed once published

    # the shard's upload cut short (no marker): a rerun counts it again (a finished one: next test)
    (shards[0] / MARKER).unlink()
    (tmp_path / "obj" / "meta.json").unlink()
    again = build_ids(tmp_path, str(corpus), "obj", VOCAB, min_count=(2,), num_proc=1, work_dir=url)
    same_stats(local, again)
    assert not (store / "partials").exists() or not any((store / "partials").iterdir())  # removed after the merge


def test_a_finished_shard_in_the_store_is_not_recounted(tmp_path, corpus):
    url = f"mtobj://{tmp_path}/bucket/work"
    build_ids(tmp_path, str(corpus), "s", VOCAB, num_proc=1, work_dir=url, shard="0/1")
    markers = sorted((tmp_path / "bucket" / "work" / "partials").glob(f"*/{MARKER}"))
    before = [(m.stat().st_mtime_ns, m.read_text()) for m in markers]
    build_ids(tmp_path, str(corpus), "s", VOCAB, num_proc=1, work_dir=url, shard="0/1")
    assert [(m.stat().st_mtime_ns, m.read_text()) for m in markers] == before
    assert len(list((tmp_path / "bucket" / "work" / "partials").glob("*/a-*"))) == len(markers)  # one attempt each
