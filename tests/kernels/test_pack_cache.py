"""Packed weights cached on disk (kernels/pack_cache.py): a hit gives the same packed bytes and the
same greedy text without packing; changed weights or a changed GGUF are another key; a damaged
entry is packed again and rewritten; nothing is written outside the cache folder."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from multitoken.kernels import cpu_linear, gguf_codes, gguf_file, pack_cache
from multitoken.kernels.cpu_linear import ROWS, PackedLinear

from .test_cpu_linear import _model
from .test_gemv_rows import assert_greedy_equals_stock
from .test_gguf_codes import grid_llama_dir, on_q4  # noqa: F401  (a fixture, used by name)

# as collected: the session fixture that sets the suite's own folder (conftest) runs after collection
DEFAULT_FOLDER = pack_cache.folder
pytestmark = pytest.mark.skipif(not cpu_linear.grids_on(),
                                reason="needs the compiled rows kernel (an x86-64 CPU and a C++ compiler with OpenMP)")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """The cache folder in ``tmp_path``; every linear packed and cached, however small."""
    folder = tmp_path / "cache" / "packed"
    monkeypatch.setattr(pack_cache, "folder", lambda: folder)
    monkeypatch.setattr(cpu_linear, "MIN_WEIGHTS", 0)
    monkeypatch.setattr(pack_cache, "MIN_CACHED", 0)
    return folder


@pytest.fixture
def searches(monkeypatch):
    """The weights whose codes were searched for (each miss searches; a hit none)."""
    seen: list[tuple] = []
    real = gguf_codes.codes_in
    monkeypatch.setattr(gguf_codes, "codes_in", lambda w, kind: seen.append(tuple(w.shape)) or real(w, kind))
    return seen


def _packed(model) -> dict[str, tuple[str, torch.Tensor]]:
    return {n: (m.format, m.packed) for n, m in model.named_modules() if isinstance(m, PackedLinear)}


def _entries(folder: Path) -> list[Path]:
    return sorted(folder.glob(f"*{pack_cache.SUFFIX}"))


def test_a_hit_packs_nothing_and_gives_the_same_bytes_and_greedy_text(grid_llama_dir, cache, searches):
    first = _model(grid_llama_dir, cpu_linear=ROWS)
    n = first.prepare_linears()
    assert searches and len(_entries(cache)) == 1
    searches.clear()
    second = _model(grid_llama_dir, cpu_linear=ROWS)
    assert second.prepare_linears() == n and not searches  # read back: no code searched
    a, b = _packed(first), _packed(second)
    assert a.keys() == b.keys() and {f for f, _ in a.values()} == {"q4_1", "q8_0", "f32"}
    assert all(a[k][0] == b[k][0] and torch.equal(a[k][1], b[k][1]) for k in a)
    assert_greedy_equals_stock(second)  # the oracle: transformers' greedy text, token for token


def test_changed_weights_are_another_entry_never_the_stale_one(grid_llama_dir, cache, searches):
    _model(grid_llama_dir, cpu_linear=ROWS).prepare_linears()
    model = _model(grid_llama_dir, cpu_linear=ROWS)
    layer = model.backbone.layers[0].mlp.up_proj
    with torch.no_grad():
        layer.weight.copy_(on_q4(layer.weight * 2))
    want = gguf_codes.pack(*gguf_codes.find_codes(layer.weight.detach()))
    searches.clear()
    model.prepare_linears()
    assert searches and len(_entries(cache)) == 2
    assert torch.equal(model.backbone.layers[0].mlp.up_proj.packed, want)


def test_the_key_follows_the_gguf_bytes(tmp_path):
    """A GGUF rewritten in place (same size, same modification time) is another identity, in the
    same process too."""
    path = tmp_path / "base.gguf"
    path.write_bytes(bytes(range(256)) * 64)
    st = path.stat()
    before = gguf_file.GGUFCodes(path).identity()
    assert gguf_file.GGUFCodes(path).identity() == before
    time.sleep(0.05)  # past the file system's clock tick: the write below moves the change time
    data = bytearray(path.read_bytes())
    data[5000] ^= 1
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert gguf_file.GGUFCodes(path).identity() != before


@pytest.mark.parametrize("damage", ["flip", "truncate", "foreign"])
def test_a_damaged_entry_is_packed_again_and_rewritten(grid_llama_dir, cache, searches, damage):
    first = _model(grid_llama_dir, cpu_linear=ROWS)
    first.prepare_linears()
    (entry,) = _entries(cache)
    data = bytearray(entry.read_bytes())
    if damage == "flip":
        data[-100] ^= 0xFF  # inside the last tensor's bytes: only its digest tells
    elif damage == "truncate":
        data = data[:len(data) // 2]
    else:  # another entry's file under this key: its recorded key differs
        data = data.replace(entry.stem.encode(), b"0" * len(entry.stem))
    entry.write_bytes(bytes(data))
    searches.clear()
    second = _model(grid_llama_dir, cpu_linear=ROWS)
    second.prepare_linears()
    assert searches  # packed again
    a, b = _packed(first), _packed(second)
    assert all(torch.equal(a[k][1], b[k][1]) for k in a)
    searches.clear()
    third = _model(grid_llama_dir, cpu_linear=ROWS)
    third.prepare_linears()
    assert not searches and _entries(cache) == [entry]  # rewritten whole: a hit again


def test_nothing_is_written_outside_the_cache_folder(grid_llama_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(pack_cache, "folder", DEFAULT_FOLDER)  # the suite's own folder is set apart (conftest)
    monkeypatch.setenv("MULTITOKEN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(cpu_linear, "MIN_WEIGHTS", 0)
    monkeypatch.setattr(pack_cache, "MIN_CACHED", 0)
    monkeypatch.chdir(tmp_path)
    assert pack_cache.folder() == tmp_path / "cache" / "packed"
    base = {p: p.read_bytes() for p in Path(grid_llama_dir).rglob("*") if p.is_file()}
    _model(grid_llama_dir, cpu_linear=ROWS).prepare_linears()
    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert written and all(p.parent == pack_cache.folder() and p.suffix == pack_cache.SUFFIX for p in written)
    assert {p: p.read_bytes() for p in Path(grid_llama_dir).rglob("*") if p.is_file()} == base


def test_small_models_and_onednn_layouts_are_not_cached(grid_llama_dir, cache, monkeypatch):
    monkeypatch.setattr(pack_cache, "MIN_CACHED", 10**9)
    _model(grid_llama_dir, cpu_linear=ROWS).prepare_linears()
    monkeypatch.setattr(pack_cache, "MIN_CACHED", 0)
    _model(grid_llama_dir, cpu_linear=cpu_linear.PACKED).prepare_linears()
    assert not cache.exists() or not _entries(cache)


def test_an_unwritable_cache_is_said_once_and_decoding_goes_on(grid_llama_dir, cache, capsys):
    cache.parent.mkdir(parents=True)
    cache.write_text("a file where the folder goes")
    model = _model(grid_llama_dir, cpu_linear=ROWS)
    assert model.prepare_linears() > 0
    assert "were not cached" in capsys.readouterr().err
    assert_greedy_equals_stock(model)


def test_the_newest_entries_are_kept_within_the_size_bound(cache, monkeypatch):
    layers = [nn.Linear(64, 64, bias=False) for _ in range(3)]
    sizes = []
    for layer in layers:  # one entry per model: the third pushes the first out
        cpu_linear.pack(nn.Sequential(layer), ROWS)
        sizes.append(max(_entries(cache), key=lambda p: p.stat().st_mtime_ns).stat().st_size)
        monkeypatch.setattr(pack_cache, "MAX_BYTES", 2 * sizes[0])
    assert len(_entries(cache)) == 2
