"""The corpus reader shared by training, stats and evaluation."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ..conftest import PYTHIA_TOKENIZER, fixture_path
from multitoken.base.tokenizer import load_tokenizer
from multitoken.base.data import DataConfig, iter_documents
from multitoken.base.errors import DataError, UsageError


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(str(PYTHIA_TOKENIZER))


def _texts(path):
    return [json.loads(line)["text"] for line in open(path)]


def test_jsonl_and_zst_read_the_same_pile_documents(tok):
    plain = fixture_path("pile_dummy", "train_00.jsonl")
    zst = fixture_path("pile_dummy", "train_00.jsonl.zst")
    a = list(iter_documents(DataConfig(str(plain)), tok))
    b = list(iter_documents(DataConfig(str(zst)), tok))
    assert len(a) == len(_texts(plain)) and len(a) == len(b)
    for (i, x), (j, y), text in zip(a, b, _texts(plain)):
        assert i == j and np.array_equal(x, y)
        assert x.tolist() == tok(text, add_special_tokens=False).input_ids


def test_parquet_ids_shards_start_and_budget(tmp_path):
    docs = [list(range(i, i + 5)) for i in range(10)]
    pq.write_table(pa.table({"input_ids": docs}), tmp_path / "d.parquet")
    cfg = DataConfig(str(tmp_path / "d.parquet"))
    got = list(iter_documents(cfg, vocab_size=100))
    assert [d.tolist() for _, d in got] == docs
    odd = list(iter_documents(cfg, vocab_size=100, shard=(1, 2)))
    assert [i for i, _ in odd] == [1, 3, 5, 7, 9]
    assert [i for i, _ in iter_documents(cfg, vocab_size=100, start=7)] == [7, 8, 9]
    cut = list(iter_documents(DataConfig(str(tmp_path / "d.parquet"), max_tokens=12), vocab_size=100))
    assert [len(d) for _, d in cut] == [5, 5, 2]


def test_txt_is_one_document(tmp_path, tok):
    (tmp_path / "a.txt").write_text("Hello world.\n\nSecond paragraph.")
    [(i, ids)] = list(iter_documents(DataConfig(str(tmp_path / "a.txt")), tok))
    assert tok.decode(ids) == "Hello world.\n\nSecond paragraph."


def test_bad_inputs_are_clear_errors(tmp_path, tok):
    (tmp_path / "x.jsonl").write_text('{"body": "no text column"}\n')
    with pytest.raises(DataError, match="no text or token-id column.*'body'"):
        list(iter_documents(DataConfig(str(tmp_path / "x.jsonl")), tok))
    with pytest.raises(DataError, match="column 'txt' not found"):
        list(iter_documents(DataConfig(str(tmp_path / "x.jsonl"), column="txt"), tok))
    (tmp_path / "ids.jsonl").write_text('{"input_ids": [1, 2, 999]}\n')
    with pytest.raises(DataError, match="outside the vocabulary"):
        list(iter_documents(DataConfig(str(tmp_path / "ids.jsonl")), vocab_size=100))
    (tmp_path / "broken.jsonl").write_text('{"text": "ok"}\n{not json\n')
    with pytest.raises(DataError, match="broken.jsonl:2: not valid JSON"):
        list(iter_documents(DataConfig(str(tmp_path / "broken.jsonl")), tok))
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(DataError, match="holds no rows"):
        list(iter_documents(DataConfig(str(tmp_path / "empty.jsonl")), tok))
    (tmp_path / "a.csv").write_text("text\nhi\n")
    with pytest.raises(DataError, match="unsupported file type"):
        list(iter_documents(DataConfig(str(tmp_path / "a.csv")), tok))
    with pytest.raises(UsageError, match="shard 2/2"):
        list(iter_documents(DataConfig(str(tmp_path / "x.jsonl")), tok, shard=(2, 2)))


# Local splits and duplicates (pile_dummy: train_00.jsonl + train_00.jsonl.zst, val.jsonl, test.jsonl)
PILE_SPLITS = {"train": "train_00.jsonl.zst", "validation": "val.jsonl", "test": "test.jsonl"}


@pytest.mark.parametrize("split", ["train", "validation", "val", "test"])
def test_split_selects_the_files_named_so(split, tok):
    from multitoken.base.data import canonical_split, describe_files

    cfg = DataConfig(str(fixture_path("pile_dummy")), split=split)
    files, lines = describe_files(cfg)
    assert files == [str(fixture_path("pile_dummy", PILE_SPLITS[canonical_split(split)]))]
    docs = [tok.decode(ids) for _, ids in iter_documents(cfg, tok)]
    assert docs == _texts(fixture_path("pile_dummy", PILE_SPLITS[canonical_split(split)].removesuffix(".zst")))
    assert files[0] in lines[1]


def test_a_jsonl_beside_its_zst_is_read_once(tmp_path, tok):
    from multitoken.base.data import describe_files

    (tmp_path / "a.jsonl").write_text('{"text": "one"}\n{"text": "two"}\n')
    import zstandard

    (tmp_path / "a.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress((tmp_path / "a.jsonl").read_bytes()))
    (tmp_path / "b.jsonl").write_text('{"text": "three"}\n')
    for spec in (str(tmp_path), str(tmp_path / "*.jsonl*")):
        cfg = DataConfig(spec)
        assert [tok.decode(ids) for _, ids in iter_documents(cfg, tok)] == ["one", "two", "three"]
        files, lines = describe_files(cfg)
        assert files == [str(tmp_path / "a.jsonl.zst"), str(tmp_path / "b.jsonl")]
        assert f"data: skipped {tmp_path / 'a.jsonl'} (same content as {tmp_path / 'a.jsonl.zst'})" in lines


def test_folders_named_by_split_win_over_file_names(tmp_path, tok):
    from multitoken.base.data import describe_files

    for folder, name, text in (("train", "test_a.jsonl", "t1"), ("validation", "x.jsonl", "v1"), ("dev-2", "y.jsonl", "v2")):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / name).write_text(json.dumps({"text": text}) + "\n")
    got = lambda split: [tok.decode(i) for _, i in iter_documents(DataConfig(str(tmp_path), split=split), tok)]  # noqa: E731
    assert got("train") == ["t1"] and got("validation") == ["v2", "v1"]
    with pytest.raises(UsageError, match="no test split .it has: train, validation"):
        describe_files(DataConfig(str(tmp_path), split="test"))


def test_split_is_refused_for_data_without_splits(tmp_path, tok):
    (tmp_path / "corpus.jsonl").write_text('{"text": "x"}\n')
    assert len(list(iter_documents(DataConfig(str(tmp_path)), tok))) == 1  # no split names: all of it is train
    for spec in (str(tmp_path), str(tmp_path / "corpus.jsonl"), str(tmp_path / "*.jsonl")):
        with pytest.raises(UsageError, match="--split validation: .*(no splits|names files)"):
            list(iter_documents(DataConfig(spec, split="validation"), tok))
    with pytest.raises(UsageError, match="slicing a split works only for Hub datasets"):
        list(iter_documents(DataConfig(str(tmp_path), split="train[:10%]"), tok))
    with pytest.raises(UsageError, match="has no train split .it has: test, validation"):
        list(iter_documents(DataConfig(str(fixture_path("wikitext2_tokens"))), tok))
