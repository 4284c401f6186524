"""Damaged corpora end in one DataError naming the file (and line) and the fix."""

from __future__ import annotations

import json

import pytest
import zstandard

from multitoken.base.data import DataConfig, iter_documents, iter_rows
from multitoken.base.errors import DataError

ROWS = [{"input_ids": list(range(i, i + 5))} for i in range(300)]
RAW = "".join(json.dumps(r) + "\n" for r in ROWS).encode()


def test_zst_frames_are_all_read_and_a_cut_frame_is_truncated(tmp_path):
    cut = len(RAW) // 3
    frames = zstandard.ZstdCompressor().compress(RAW[:cut]) + zstandard.ZstdCompressor().compress(RAW[cut:])
    (tmp_path / "two.jsonl.zst").write_bytes(frames)
    assert list(iter_rows(DataConfig(data=str(tmp_path / "two.jsonl.zst")))) == ROWS
    (tmp_path / "cut.jsonl.zst").write_bytes(frames[:-5])
    with pytest.raises(DataError, match="cut.jsonl.zst: truncated or corrupt zstd file"):
        list(iter_rows(DataConfig(data=str(tmp_path / "cut.jsonl.zst"))))


@pytest.mark.parametrize("raw, message", [
    (b'{"input_ids": [1]}\n7\n', r"c.jsonl:2: holds a JSON number, not an object"),
    (b'{"input_ids": [1, [2, 3]]}\n', "got a nested or mixed list"),
    (b'{"input_ids": ["a", "b"]}\n', "got a list of strings"),
    (b'{"text": ["a", "b"]}\n', "column 'text' holds a list of strings, not one text"),
    (b'{"text": 12345}\n', "column 'text' holds a JSON number, not text"),
    (b'{"text": "\xe9"}\n', r"c.jsonl:1: not UTF-8 text \(byte 0xe9 at offset 10\)"),
])
def test_bad_rows_name_the_problem(tmp_path, raw, message):
    (tmp_path / "c.jsonl").write_bytes(raw)
    with pytest.raises(DataError, match=message):
        list(iter_documents(DataConfig(data=str(tmp_path / "c.jsonl")), vocab_size=512))


@pytest.mark.parametrize("spec", ["copus.jsonl", "./nowhere", "runs/missing.parquet"])
def test_a_path_like_data_spec_that_is_missing_is_not_tried_on_the_hub(spec, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    with pytest.raises(DataError, match=f"data path '{spec}' not found"):
        list(iter_rows(DataConfig(data=spec)))
