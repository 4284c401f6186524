"""Property: a heads dir or a stats dir damaged at random bytes or JSON keys either loads and
works, or fails with one of our errors (a line naming the file and the fix), never another
exception. In process, against one loaded backbone, so that many damages run in seconds."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

hypothesis = pytest.importorskip("hypothesis", reason="the damage property test needs hypothesis (test extras)")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from multitoken.embedded import EMBEDDED_HEADS, EMBEDDED_STATS  # noqa: E402
from multitoken.base.errors import MultitokenError  # noqa: E402

SETTINGS = settings(max_examples=150, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6)


def _paths(value, prefix=()):
    """Every key path of a JSON value (dict keys and list indices)."""
    yield prefix
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _paths(v, prefix + (i,))


def _damage_json(file: Path, data) -> None:
    record = json.loads(file.read_text())
    path = data.draw(st.sampled_from(sorted(_paths(record), key=repr)))
    new = data.draw(json_values)
    if not path:
        record = new
    else:
        parent = record
        for key in path[:-1]:
            parent = parent[key]
        if data.draw(st.booleans()) and isinstance(parent, dict):
            del parent[path[-1]]
        else:
            parent[path[-1]] = new
    file.write_text(json.dumps(record))


def _damage_bytes(file: Path, data) -> None:
    blob = bytearray(file.read_bytes())
    how = data.draw(st.sampled_from(["flip", "truncate", "empty"]))
    if how == "flip" and blob:
        i = data.draw(st.integers(0, len(blob) - 1))
        blob[i] ^= data.draw(st.integers(1, 255))
    elif how == "truncate":
        blob = blob[:data.draw(st.integers(0, max(len(blob) - 1, 0)))]
    else:
        blob = bytearray()
    file.write_bytes(bytes(blob))


def _damage(root: Path, data) -> None:
    files = sorted(p.name for p in root.iterdir() if p.is_file() and p.suffix in (".json", ".npy", ".safetensors"))
    file = root / data.draw(st.sampled_from(files))
    if file.suffix == ".json" and data.draw(st.booleans()):
        _damage_json(file, data)
    else:
        _damage_bytes(file, data)


@pytest.fixture(scope="module")
def backbone():
    from multitoken.pipeline.model.loading import BackboneConfig, load_backbone
    from multitoken.embedded import DEFAULT_BASE

    return load_backbone(BackboneConfig(base=str(DEFAULT_BASE)))


@SETTINGS
@given(data=st.data())
def test_a_damaged_stats_dir_loads_or_fails_cleanly(tmp_path_factory, data):
    from multitoken.stats.table import CooccurrenceTable

    root = Path(shutil.copytree(EMBEDDED_STATS, tmp_path_factory.mktemp("s") / "S"))
    _damage(root, data)
    try:
        table = CooccurrenceTable(root).prepare()
    except MultitokenError as err:
        assert str(err).strip() and "\n  fix: " in str(err)
        return
    grid = table.mask([[1, 2, 3], [4, 5], [6, 7]][:table.max_order])  # a working table answers
    assert grid.shape == (3, 2, 2)[:table.max_order]


@SETTINGS
@given(data=st.data())
def test_a_damaged_heads_dir_loads_or_fails_cleanly(tmp_path_factory, backbone, data):
    import torch

    from multitoken.pipeline.model.model import MultiTokenModel

    root = Path(shutil.copytree(EMBEDDED_HEADS, tmp_path_factory.mktemp("h") / "H"))
    _damage(root, data)
    try:
        model = MultiTokenModel.from_pretrained(backbone, root)
    except MultitokenError as err:
        assert str(err).strip()
        return
    with torch.no_grad():
        logp = model.head_logits(torch.tensor([[1, 2, 3]]))  # a working model answers: n_future x [1, 3, V]
    assert len(logp) == model.n_future and all(x.shape[-1] == backbone.vocab_size for x in logp)
