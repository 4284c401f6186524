"""``DecodePlan``: each decoding choice made once from the settings and the model, and the
engine following it (the proposer it names runs, the trace states it)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from multitoken.base.errors import UsageError
from multitoken.decoding.config import DecodeConfig
from multitoken.decoding.engine import generate
from multitoken.decoding.plan import resolve

from .conftest import RatioTable, attach

LAYER_HEADS = SimpleNamespace(supports_sequential_drafts=False, config=SimpleNamespace(head_type="replicated"))
CP_HEADS = SimpleNamespace(supports_sequential_drafts=True, config=SimpleNamespace(head_type="cp"))


def plan_of(heads=LAYER_HEADS, table=None, n_future=3, **settings):
    return resolve(DecodeConfig(**settings), SimpleNamespace(n_future=n_future, heads=heads), table)


@pytest.mark.parametrize("mode, verifies", [("ar", False), ("dynamic", False), ("speculative", True), ("typical", True)])
def test_only_speculative_and_typical_verify_drafts(mode, verifies):
    plan = plan_of(mode=mode)
    assert DecodeConfig(mode=mode).verifies == plan.verifies == verifies
    assert (plan.rule is not None) == verifies and (plan.drafter is not None) == verifies


def test_argmax_only_is_greedy_without_a_penalty():
    assert plan_of(greedy=True).argmax_only
    assert not plan_of(greedy=True, repetition_penalty=1.3).argmax_only  # a penalty reads the logits
    assert not plan_of().argmax_only  # sampling (its default penalty 1.1 too)
    assert not plan_of(repetition_penalty=1.0).argmax_only and not plan_of(repetition_penalty=1.0).penalised


def test_the_drafter_is_named_from_the_heads_and_the_stats():
    assert plan_of().drafter == "independent"
    assert plan_of(greedy=True).drafter == "argmax"  # each head's argmax, every row at once
    assert plan_of(greedy=True, repetition_penalty=1.3).drafter == "independent"
    assert plan_of(table=RatioTable()).drafter == "joint"
    assert plan_of(heads=CP_HEADS, table=RatioTable()).drafter == "cp"
    assert plan_of(drafter="joint").drafter == "joint"
    with pytest.raises(UsageError, match="--drafter cp needs cp heads"):
        plan_of(drafter="cp")
    with pytest.raises(UsageError, match="--drafter cp needs cp heads"):
        plan_of(drafter="cp", tree="static")  # whatever the candidates: the setting is wrong for these heads


def test_lookup_on_a_chain_is_a_one_path_tree_in_the_plan():
    plan = plan_of(greedy=True, lookup=3)
    assert (plan.proposer, plan.tree, plan.drafter, plan.lookup) == ("tree", "path", None, 3)
    assert "one path (--lookup on a chain)" in plan.describe() and "lookup branch of up to 3" in plan.describe()
    assert not plan.device_tree  # its lookup branch is grafted on the host
    assert plan_of(greedy=True).proposer == "chain" and plan_of(greedy=True).tree == "chain"


def test_trees_and_rules():
    static = plan_of(greedy=True, tree="static")
    assert static.proposer == "tree" and static.device_tree and static.rule == "greedy"
    assert not plan_of(tree="static").device_tree  # sampled: walked on the host
    assert plan_of(mode="typical", greedy=True).rule == "typical"  # typical judges by its own rule, greedy or not
    assert plan_of(mode="speculative").rule == "sampled"
    joint = plan_of(tree="dynamic", table=RatioTable())
    assert joint.joint_tree and joint.grids and joint.drafter is None
    assert not plan_of(tree="dynamic").joint_tree


def test_the_stats_order_caps_dynamic_steps_and_joint_chains_only():
    table = RatioTable()
    table.max_order = 2
    assert plan_of(mode="dynamic", table=table, n_future=4).order == 2
    assert plan_of(table=table, n_future=4).stats_cap == 2  # joint drafts: masked over 2 positions
    assert plan_of(table=table, n_future=4, lookup=2).stats_cap is None  # the path reads every head
    assert plan_of(table=table, n_future=4, tree="static").order == 4
    assert plan_of(mode="dynamic", eps_b=1.0, n_future=4).heads_read == 1  # every order backs off unread


def test_a_custom_drafter_or_rule_needs_a_chain():
    model = SimpleNamespace(n_future=3, heads=LAYER_HEADS)
    plan = resolve(DecodeConfig(greedy=True), model, None, drafter=lambda *a: None, acceptor=lambda *a: None)
    assert plan.drafter == "custom" and plan.rule == "custom"
    with pytest.raises(UsageError, match="build their own candidates"):
        resolve(DecodeConfig(greedy=True, lookup=2), model, None, drafter=lambda *a: None)


def test_validation_keeps_no_memo():
    """A config checked once and then changed is checked again (nothing remembered between calls)."""
    cfg = DecodeConfig(mode="speculative")
    cfg.validate()
    cfg.sampling.top_k = 0
    with pytest.raises(UsageError, match="--top-k must be >= 1"):
        cfg.validate()
    cfg.sampling.top_k = 5
    cfg.validate(vocab_size=8)
    with pytest.raises(UsageError, match=r"--top-k must be in \[1, 4\]"):
        cfg.validate(vocab_size=4)


@pytest.mark.parametrize("settings, proposer", [(dict(mode="ar"), "chain"), (dict(mode="dynamic", top_k=4), "dynamo"),
                                                (dict(greedy=True), "chain"), (dict(greedy=True, lookup=2), "tree")])
def test_the_engine_runs_the_plan_and_its_trace_says_so(tiny_backbones, settings, proposer):
    model = attach(tiny_backbones["llama"], "replicated")
    cfg = DecodeConfig(max_new_tokens=6, stop_at_eos=False, **settings)
    res = generate(model, [1, 5, 9, 3], cfg)
    assert len(res.token_ids) == 6 and res.trace.plan == resolve(cfg.resolved(), model).describe()
    assert "plan: " + res.trace.plan in res.trace.summary(verbose=True)
    assert bool(res.trace.accepted_lengths) == (proposer != "dynamo" and settings.get("mode") != "ar")  # verified
    assert (res.trace.tree_nodes > 0) == (proposer == "tree")
