"""The experiment scripts (issue 16) run end to end in their ``--quick`` mode and write the JSON
and PNG the docs read: every claim's result keys, one row per compared setting, finite numbers.

The scripts run in this process (loaded by their paths), so torch and the models load once for
the whole file.
"""

from __future__ import annotations

import json
import math

import pytest

from .conftest import REPO, fixture_path
from .test_scripts import load_script

EXPERIMENTS = REPO / "scripts" / "experiments"


def run_quick(name: str, tmp_path) -> dict:
    """``scripts/experiments/NAME.py --quick`` -> its JSON record (the PNG checked too)."""
    fixture_path("pythia-mini")  # a missing fixture fails here with its fix
    module = load_script(EXPERIMENTS / f"{name}.py")
    out = tmp_path / name
    record = module.main(["--quick", "--out", str(out), "--threads", "1"])
    on_disk = json.loads((out / f"{name}.json").read_text())
    png = (out / f"{name}.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000  # a drawn figure, not an empty canvas
    assert on_disk["experiment"] == name and on_disk["quick"] is True
    assert on_disk["machine"]["cores"] >= 1 and on_disk["machine"]["cpu"]
    assert on_disk["timing"]["wall_s"] > 0 and on_disk["command"].startswith("python ")
    assert set(on_disk) == set(json.loads(json.dumps(record, default=str)))
    return on_disk


def finite(*values) -> bool:
    return all(isinstance(v, (int, float)) and math.isfinite(v) for v in values)


def test_cp_rank(tmp_path):
    rec = run_quick("cp_rank", tmp_path)
    assert [r["rank"] for r in rec["rows"]] == [1, 2, 4, 8]
    for r in rec["rows"]:
        assert finite(r["joint_loss"], r["first_token_loss"], r["spec_cp"]["tokens_per_forward"])
        assert r["joint_loss_tokens_2_to_n"] == pytest.approx(r["joint_loss"] - r["first_token_loss"])
        assert len(r["head_losses"]) == 3 and r["joint_loss"] == pytest.approx(sum(r["head_losses"]), rel=1e-5)
        assert 1.0 <= r["spec_cp"]["tokens_per_step"] <= 3.0
    rank1 = rec["rows"][0]
    # rank 1: the CP posterior update changes nothing, sequential drafts are independent ones
    assert rank1["sequential_minus_independent_max_abs"] < 1e-4 and rank1["max_expert_share"] == 1.0
    assert rank1["spec_cp"] == rank1["spec_independent"]


def test_frozen_vs_joint(tmp_path):
    rec = run_quick("frozen_vs_joint", tmp_path)
    names = [r["strategy"] for r in rec["rows"]]
    assert names == ["untrained (reference)", "heads only", "joint", "warm-up + joint", "joint + diff. LR 4x", "joint + RMS balance"]
    for r in rec["rows"]:
        assert finite(r["head1_ppl"], r["head2_top5"], r["head3_top5"]) and 0 <= r["head2_top1"] <= r["head2_top5"] <= 1
    # heads only leaves the base untouched: head 1 is the base model's own path
    assert rec["rows"][1]["head1_ppl"] == pytest.approx(rec["rows"][0]["head1_ppl"], rel=1e-5)


def test_whs_vs_replicated(tmp_path):
    rec = run_quick("whs_vs_replicated", tmp_path)
    assert [r["variant"] for r in rec["rows"]] == ["replicated", "whs"]
    layers = 6  # pythia-mini: the lens has L + 1 points, WHS weights one per trunk layer (L - 1)
    assert len(rec["logit_lens_kl"]) == layers + 1 and rec["logit_lens_kl"][-1] == pytest.approx(0.0, abs=1e-6)
    assert sorted(rec["whs_layer_weights"]) == ["head2", "head3"]
    for w in rec["whs_layer_weights"].values():
        assert len(w) == layers - 1 and sum(w) == pytest.approx(1.0, abs=1e-5)
    assert rec["rows"][1]["head_params"] > rec["rows"][0]["head_params"]  # the layer weights


def test_marginal_baseline(tmp_path):
    rec = run_quick("marginal_baseline", tmp_path)
    assert list(rec["rows"]) == ["marginalization", "head 2 (untrained)", "head 2 (trained)"]
    assert rec["positions"] > 0
    m = rec["rows"]["marginalization"]
    assert 0 < m["nucleus_mass"] <= 1 and 1 <= m["nucleus_size"] <= rec["marginal"]["max_candidates"]
    for row in rec["rows"].values():
        assert finite(row["ppl_2"]) and 0 <= row["top1"] <= row["top5"] <= 1


def test_dynamo_ppl(tmp_path):
    rec = run_quick("dynamo_ppl", tmp_path)
    ppl = rec["ppl"]
    assert list(ppl["PPL_n"]) == ["PPL_1", "PPL_2", "PPL_3"] and list(ppl["PPL_1:n"]) == ["PPL_1:1", "PPL_1:2", "PPL_1:3"]
    assert [r["eps_b"] for r in ppl["PPL_d"]] == [0.0, 1.0]
    # eps_b = 1 always backs off to one token: PPL_d is PPL_1 over the walked tokens
    assert ppl["PPL_d"][1]["tokens_per_step"] == 1.0
    assert sorted(rec["ablation_curves"]) == sorted(["CO+AT+G-3", "CO+AT", "CO", "CO-0.5+AT+G-3", "AT+G-3"])
    for pts in rec["ablation_curves"].values():
        assert [p["eps_b"] for p in pts] == [0.5] and 1 <= pts[0]["tokens_per_forward"] <= 3
        # one prompt: no interval over prompts, so no verdict but undetermined (never "same" for lack of data)
        assert pts[0]["same_quality"] is False and pts[0]["failed"] == dict.fromkeys(("nll", "repetition", "distinct2", "distinct3"), "undetermined")
    tables = load_script(EXPERIMENTS / "tables.py")
    assert "✗ (nll undetermined, repetition undetermined, distinct2 undetermined, distinct3 undetermined)" in "\n".join(tables.dynamo_ppl(rec))


def test_speedup_theory(tmp_path, capsys):
    rec = run_quick("speedup_theory", tmp_path)
    methods = [r["method"] for r in rec["rows"]]
    assert methods == ["chain (greedy)", "static tree 16 (greedy)", "dynamic tree 16 (greedy)", "chain (sampled)"]
    g = rec["g"]
    for r in rec["rows"]:
        assert 1 <= r["measured_tokens_per_step"] <= g + 1 and finite(r["measured_cpu_speedup"])
    chain = rec["rows"][0]
    assert len(chain["measured_acceptance"]["per_head"]) == g
    assert 1 <= chain["leviathan_tokens_per_step"] <= g + 1 and 1 <= chain["heldout_formula_tokens_per_step"] <= g + 1
    assert rec["static_tree_shape"]["nodes"] == 16
    assert 1 <= rec["rows"][1]["heldout_formula_tokens_per_step"] <= g + 1  # static: Medusa's expected accepted
    err = capsys.readouterr().err
    assert "nan" not in err and "dynamic tree 16 (greedy): measured" in err and "n/a (no formula for dynamic trees)" in err


def test_a_work_dir_of_the_users_is_refused_and_our_own_is_reused(tmp_path):
    """Runs replace their scratch in --work-dir (trained heads, checkpoints): a folder holding
    files they did not write is refused before any work; an experiments work dir is reused."""
    from multitoken.pipeline.eval import experiment as common

    args = common.parser("doc", "x").parse_args(["--out", str(tmp_path / "out"), "--work-dir", str(tmp_path / "work")])
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "x-trained").mkdir()  # a name a run would clear: the user's here
    budget = common.Budget()
    with pytest.raises(SystemExit, match="holds files not written by these experiments"):
        common.Run("x", args, budget, budget)
    assert (tmp_path / "work" / "x-trained").is_dir()
    args.work_dir = str(tmp_path / "fresh")
    first = common.Run("x", args, budget, budget)
    (first.work / "x-trained").mkdir()
    assert common.Run("x", args, budget, budget).work == first.work  # its own dir: accepted again
