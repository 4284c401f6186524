"""``multitoken generate`` with heads of another base, with more heads than the stats' order,
and ``--threads``."""

from __future__ import annotations

import json

import pytest
import torch

from multitoken.pipeline.cli import main
from multitoken.embedded import DEFAULT_BASE, EMBEDDED_STATS

from .conftest import attach


@pytest.fixture(scope="module")
def pythia_heads(tmp_path_factory, pythia_mini_dir):
    from multitoken.pipeline.model.loading import BackboneConfig, load_backbone

    out = tmp_path_factory.mktemp("heads") / "pythia"
    attach(load_backbone(BackboneConfig(base=str(pythia_mini_dir))), "medusa", n_future=2).save_heads(out)
    return out


@pytest.fixture(scope="module")
def four_heads(tmp_path_factory):
    from multitoken.pipeline.model.loading import BackboneConfig, load_backbone

    out = tmp_path_factory.mktemp("heads") / "four"
    attach(load_backbone(BackboneConfig(base=str(DEFAULT_BASE))), "medusa", n_future=4).save_heads(out)
    return out


def _json(capsys, *argv) -> tuple[dict, str]:
    assert main(["generate", "Once upon a time", "--json", "--max-new-tokens", "6", *argv]) == 0
    cap = capsys.readouterr()
    return json.loads(cap.out), cap.err


def test_heads_bring_their_own_base(capsys, pythia_heads, pythia_mini_dir):
    # no --base: the base recorded in the heads dir (pythia-mini), not the embedded stories260K
    out, _ = _json(capsys, "--heads", str(pythia_heads), "--greedy")
    assert out["config"]["BackboneConfig"]["base"] == str(pythia_mini_dir)
    assert len(out["token_ids"]) == 6


def test_an_explicit_base_still_wins(capsys, pythia_heads):
    assert main(["generate", "Once", "--heads", str(pythia_heads), "--base", str(DEFAULT_BASE)]) == 1
    err = capsys.readouterr().err
    assert "trained on" in err and "Traceback" not in err


@pytest.mark.parametrize("mode", ["dynamic", "speculative"])
def test_more_heads_than_the_stats_order_read_the_first_ones(capsys, four_heads, mode):
    # 4 heads, order-3 stats: DynaMo's mask / the joint drafter cover 3 positions, so 3 heads are read
    out, err = _json(capsys, "--heads", str(four_heads), "--stats", str(EMBEDDED_STATS), "--mode", mode,
                     "--eps-b", "0", "--max-new-tokens", "9")
    trace = out["trace"]
    assert trace["stats_order_cap"] == 3 and len(out["token_ids"]) == 9
    if mode == "dynamic":
        assert trace["orders"] == {"3": 3}  # eps_b = 0 never backs off: 3 tokens per step
    else:
        assert max(int(k) for k in trace["accepted_lengths"]) <= 2  # at most 2 drafts per step
    assert err.count("note: the stats hold n-grams up to order 3") == 1


def test_no_cap_without_a_mask(capsys, four_heads):
    out, err = _json(capsys, "--heads", str(four_heads), "--stats", str(EMBEDDED_STATS), "--mode", "dynamic",
                     "--eps-b", "0", "--alpha-c", "0", "--max-new-tokens", "8")
    assert out["trace"]["stats_order_cap"] == 0 and out["trace"]["orders"] == {"4": 2} and "note:" not in err


def test_threads_default_and_flag(capsys):
    from multitoken.base.threads import THREADS_ONE_SEQUENCE

    torch.set_num_threads(2)
    out, _ = _json(capsys, "--greedy")
    assert out["config"]["BackboneConfig"]["threads"] == THREADS_ONE_SEQUENCE == torch.get_num_threads()
    out, _ = _json(capsys, "--greedy", "--threads", "2")
    assert out["config"]["BackboneConfig"]["threads"] == 2 == torch.get_num_threads()


def test_negative_threads_fail_clearly(capsys):
    assert main(["generate", "Once", "--threads", "-1"]) == 2
    err = capsys.readouterr().err
    assert "--threads must be >= 0" in err and "Traceback" not in err


def test_library_loads_leave_torch_threads_alone_unless_asked():
    from multitoken.pipeline.model.loading import BackboneConfig, load_backbone

    torch.set_num_threads(2)
    load_backbone(BackboneConfig())  # threads None: the caller's setting stays
    assert torch.get_num_threads() == 2
    load_backbone(BackboneConfig(threads=1))
    assert torch.get_num_threads() == 1


@pytest.mark.parametrize("tree", ["static", "dynamic"])
def test_trees_read_every_head_whatever_the_stats_order(capsys, four_heads, tree):
    # a tree's candidates are the heads' own guesses: all 4 heads are read (no order cap, no note)
    out, err = _json(capsys, "--heads", str(four_heads), "--stats", str(EMBEDDED_STATS), "--greedy",
                     "--tree", tree, "--tree-nodes", "12", "--max-new-tokens", "9")
    trace = out["trace"]
    assert trace["tree"] == tree and trace["tree_nodes"] == 12 and trace["stats_order_cap"] == 0
    assert len(out["token_ids"]) == 9 and "note:" not in err
    plain, _ = _json(capsys, "--heads", str(four_heads), "--greedy", "--mode", "ar", "--max-new-tokens", "9")
    assert out["token_ids"] == plain["token_ids"]
    if tree == "static":
        assert trace["tree_accuracies"] == "fallback prior"


def test_tree_with_ar_is_a_usage_error(capsys):
    assert main(["generate", "Once", "--mode", "ar", "--tree", "static"]) == 2
    err = capsys.readouterr().err
    assert "needs --mode speculative" in err and "Traceback" not in err
