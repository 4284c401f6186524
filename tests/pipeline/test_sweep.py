"""The eps_b sweep: grid parsing, prompts, quality metrics, same-quality selection, end to end."""

import json

import pytest
import torch

from multitoken.pipeline.backbone import BackboneConfig, load_backbone
from multitoken.pipeline.errors import UsageError
from multitoken.pipeline.model import MultiTokenModel
from multitoken.pipeline.sweep import (
    TABLE7_PROMPTS, TABLE8, SweepConfig, continuation_nll, parse_grid, read_prompts, same_quality, sweep,
)


@pytest.fixture(scope="module")
def tiny_model(tiny_llama_dir):
    torch.manual_seed(0)
    bb = load_backbone(BackboneConfig(base=str(tiny_llama_dir)))
    return MultiTokenModel.attach(bb, {"head_type": "replicated", "n_future": 3, "init": "random"})


def test_parse_grid_lists_and_ranges():
    assert parse_grid("0:1:0.1") == pytest.approx([i / 10 for i in range(11)])
    assert parse_grid(["1", "0", "0.5", "0.5"]) == [0.0, 0.5, 1.0]
    assert parse_grid([1.0, 0.0]) == [0.0, 1.0]
    assert parse_grid("0.2:0.6:0.2") == pytest.approx([0.2, 0.4, 0.6])
    assert parse_grid(["0", "0.5:1:0.25"]) == [0.0, 0.5, 0.75, 1.0]
    for bad in ("", "0:1:0", "1.5", "a b", "0,1", ["1:0:0.1"]):
        with pytest.raises(UsageError):
            parse_grid(bad)


def test_prompts_default_txt_jsonl(tmp_path):
    assert read_prompts("") == list(TABLE7_PROMPTS) and len(TABLE7_PROMPTS) == 10
    (tmp_path / "p.txt").write_text("one\n\n two\n")
    assert read_prompts(str(tmp_path / "p.txt")) == ["one", " two"]
    (tmp_path / "p.jsonl").write_text('{"prompt": "a"}\n{"text": "b"}\n')
    assert read_prompts(str(tmp_path / "p.jsonl")) == ["a", "b"]


def test_table8_ablations_map_to_decode_switches():
    assert TABLE8["CO"] == {"alpha_c": 1.0, "adaptive_threshold": False, "blur_kernel": 0}
    assert TABLE8["AT+G-3"]["alpha_c"] == 0.0 and TABLE8["CO-0.5+AT+G-3"]["alpha_c"] == 0.5
    assert SweepConfig(ablations=True).configs() == list(TABLE8)
    # without stats there is no co-occurrence mask, so no CO configuration is claimed
    assert SweepConfig(stats="none", ablations=True).configs() == ["AT+G-3"]
    assert SweepConfig(stats="none").configs() == ["AT+G-3"]


def test_continuation_nll_is_hf_loss(tiny_model):
    prompt, new = [5, 9, 17], [33, 2, 100, 7]
    ids = torch.tensor([prompt + new])
    labels = ids.clone()
    labels[0, : len(prompt)] = -100  # score the continuation only
    expected = float(tiny_model.backbone.causal_lm(input_ids=ids, labels=labels).loss)
    assert continuation_nll(tiny_model.backbone, prompt, new) == pytest.approx(expected, rel=1e-5)


def _pt(tpf, nll_lo, nll_hi, wall=1.0, eps=0.5, config="CO+AT+G-3"):
    ci = lambda m, lo, hi: {"mean": m, "lo": lo, "hi": hi, "n": 3}  # noqa: E731
    return {"config": config, "eps_b": eps, "tokens_per_forward": ci(tpf, tpf, tpf),
            "wall_speedup": ci(wall, wall, wall), "cpu_speedup": ci(wall, wall, wall), "nll": ci((nll_lo + nll_hi) / 2, nll_lo, nll_hi)}


def test_same_quality_picks_fastest_overlapping_point():
    ar = _pt(1.0, 2.0, 2.4)
    points = [_pt(1.2, 2.1, 2.5, wall=1.1, eps=0.8), _pt(2.0, 2.3, 2.9, wall=1.4, eps=0.5), _pt(2.9, 3.0, 3.5, eps=0.0)]
    sq = same_quality(points, ar)
    assert sq["eps_b"] == 0.5 and sq["tokens_per_forward"] == 2.0 and sq["wall_clock"] == 1.4
    assert same_quality([_pt(2.9, 3.0, 3.5)], ar) is None


def test_sweep_end_to_end_counts(tiny_model):
    cfg = SweepConfig(seeds=2, max_new_tokens=8)
    res = sweep(tiny_model, cfg, ["Once upon", "The cat"], [0.0, 1.0], table=None, log=lambda m: None)
    by_eps = {p["eps_b"]: p for p in res["points"]}
    # eps_b = 1 always backs off to one token; eps_b = 0 never does: steps of 3, 3, 2 tokens
    # after the prompt's pass = 3 forward passes for 8 tokens (the last step needs no pass).
    assert by_eps[1.0]["tokens_per_forward"]["mean"] == 1.0
    assert by_eps[0.0]["tokens_per_forward"]["mean"] == pytest.approx(8 / 3)
    assert by_eps[0.0]["nll"]["n"] == 4 and res["ar"]["tokens_per_forward"]["mean"] == 1.0
    assert res["same_quality_speedup"] is not None
    json.dumps(res)


def test_cli_sweep_writes_json_csv_png(tiny_model, tmp_path, capsys):
    from multitoken.pipeline.cli import main

    heads = tiny_model.save_heads(tmp_path / "heads")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Once upon a time\nThe dog\n")
    out = tmp_path / "sweep"
    code = main(["sweep", "--heads", str(heads), "--prompts", str(prompts), "--eps-b", "0", "1", "--seeds", "1",
                 "--max-new-tokens", "6", "--stats", "none", "--quiet", "--out", str(out)])
    assert code == 0
    res = json.loads((out / "sweep.json").read_text())
    assert "same_quality_speedup" in res and len(res["points"]) == 2
    assert {p["config"] for p in res["points"]} == {"AT+G-3"}  # --stats none: no CO label
    rows = (out / "sweep.csv").read_text().splitlines()
    assert rows[0].startswith("config,eps_b,tokens_per_forward_mean") and "cpu_speedup_lo" in rows[0] and len(rows) == 4
    assert (out / "sweep.png").stat().st_size > 5000
    assert "same_quality_speedup" in capsys.readouterr().out


def test_ablations_add_one_curve_each(tiny_model):
    res = sweep(tiny_model, SweepConfig(seeds=1, max_new_tokens=4, ablations=True), ["Once"], [0.5],
                table=None, log=lambda m: None)
    assert [p["config"] for p in res["points"]] == list(TABLE8)
    assert all(p["theory"]["predicted_wall_speedup"] > 0 for p in res["points"])


def test_ar_reference_timing_is_the_mean_of_its_two_runs():
    from multitoken.pipeline.sweep import _average_timing

    a = {"nll": 1.0, "sec_per_token": 0.010, "cpu_per_token": 0.008}
    b = {"nll": 1.0, "sec_per_token": 0.030, "cpu_per_token": 0.010}
    assert _average_timing(a, b) == pytest.approx({"nll": 1.0, "sec_per_token": 0.020, "cpu_per_token": 0.009})
