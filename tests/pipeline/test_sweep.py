"""The eps_b sweep: grid parsing, prompts, quality metrics, same-quality selection, end to end."""

import json

import pytest
import torch

from multitoken.decoding.config import DecodeConfig
from multitoken.base.errors import UsageError
from multitoken.pipeline.eval.sweep import (
    TABLE7_PROMPTS, TABLE8, SweepConfig, continuation_nll, decode_configs, parse_grid, quality_vs_ar, read_prompts,
    run_hf_sample, same_quality, sweep,
)


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


def _ci(m, lo=None, hi=None):
    return {"mean": m, "lo": m if lo is None else lo, "hi": m if hi is None else hi, "n": 3}


def _pt(tpf, nll_lo, nll_hi, wall=1.0, eps=0.5, config="CO+AT+G-3", rep=(0.0, 0.02), d2=(0.9, 0.95), d3=(0.95, 1.0)):
    return {"config": config, "eps_b": eps, "tokens_per_forward": _ci(tpf), "wall_speedup": _ci(wall), "cpu_speedup": _ci(wall),
            "nll": _ci((nll_lo + nll_hi) / 2, nll_lo, nll_hi), "repetition": _ci(sum(rep) / 2, *rep),
            "distinct2": _ci(sum(d2) / 2, *d2), "distinct3": _ci(sum(d3) / 2, *d3)}


def test_same_quality_picks_fastest_overlapping_point():
    ar = _pt(1.0, 2.0, 2.4)
    points = [_pt(1.2, 2.1, 2.5, wall=1.1, eps=0.8), _pt(2.0, 2.3, 2.9, wall=1.4, eps=0.5), _pt(2.9, 3.0, 3.5, eps=0.0)]
    sq = same_quality(points, ar)
    assert sq["eps_b"] == 0.5 and sq["tokens_per_forward"] == 2.0 and sq["wall_clock"] == 1.4
    assert same_quality([_pt(2.9, 3.0, 3.5)], ar) is None


def test_a_looping_point_with_good_nll_is_not_same_quality():
    """The issue's case: eps_b = 0 had NLL 2.81 vs ar's 2.99 (inside) but repetition 0.197 vs
    0.010 and distinct-2 0.57 vs 0.93: its text loops. Each criterion alone must reject."""
    ar = _pt(1.0, 2.8, 3.2, rep=(0.0, 0.02), d2=(0.90, 0.96), d3=(0.95, 1.0))
    fine = _pt(1.5, 2.9, 3.1, eps=0.6)
    looping = _pt(2.9, 2.7, 2.95, eps=0.0, rep=(0.15, 0.25), d2=(0.5, 0.64), d3=(0.6, 0.7))
    assert same_quality([fine, looping], ar)["eps_b"] == 0.6
    assert same_quality([looping], ar) is None
    assert quality_vs_ar(looping, ar) == {"nll": True, "repetition": False, "distinct2": False, "distinct3": False}
    for key, bad in (("repetition", (0.1, 0.2)), ("distinct2", (0.5, 0.6)), ("distinct3", (0.5, 0.6))):
        one_bad = _pt(2.9, 2.9, 3.1, **{{"repetition": "rep", "distinct2": "d2", "distinct3": "d3"}[key]: bad})
        assert same_quality([one_bad], ar) is None, key
        assert [k for k, ok in quality_vs_ar(one_bad, ar).items() if not ok] == [key]


def test_ar_reference_uses_the_points_sampling_settings():
    cfg = SweepConfig(seeds=2, decode=DecodeConfig(max_new_tokens=17, temperature=0.9, top_k=7, repetition_penalty=1.3),
                      ablations=True)
    ar, points = decode_configs(cfg, [0.0, 0.5])
    assert ar.mode == "ar" and ar.sampling.penalty == 1.3 and len(points) == 2 * len(TABLE8)
    for _, eps, dcfg in points:
        assert dcfg.mode == "dynamic" and dcfg.dynamo.eps_b == eps
        assert dcfg.sampling == ar.sampling and (dcfg.max_new_tokens, dcfg.stop_at_eos) == (ar.max_new_tokens, ar.stop_at_eos)


def test_hf_sample_is_seeded_and_honours_the_budget(tiny_model):
    from dataclasses import replace

    ar, _ = decode_configs(SweepConfig(decode=DecodeConfig(max_new_tokens=6)), [])
    a = run_hf_sample(tiny_model.backbone, [5, 9, 17], replace(ar, seed=3))
    b = run_hf_sample(tiny_model.backbone, [5, 9, 17], replace(ar, seed=3))
    assert 1 <= a["tokens"] <= 6 and a["nll"] == b["nll"] and a["sec_per_token"] > 0


def test_sweep_end_to_end_counts(tiny_model):
    cfg = SweepConfig(seeds=2, decode=DecodeConfig(max_new_tokens=8))
    res = sweep(tiny_model, cfg, ["Once upon", "The cat"], [0.0, 1.0], table=None, log=lambda m: None)
    by_eps = {p["eps_b"]: p for p in res["points"]}
    # eps_b = 1 always backs off to one token; eps_b = 0 never does: steps of 3, 3, 2 tokens
    # after the prompt's pass = 3 forward passes for 8 tokens (the last step needs no pass).
    assert by_eps[1.0]["tokens_per_forward"]["mean"] == 1.0
    assert by_eps[0.0]["tokens_per_forward"]["mean"] == pytest.approx(8 / 3)
    assert by_eps[0.0]["nll"]["n"] == 4 and res["ar"]["tokens_per_forward"]["mean"] == 1.0
    assert set(by_eps[0.0]["vs_ar"]) == {"nll", "repetition", "distinct2", "distinct3"}
    assert by_eps[0.0]["same_quality"] == all(by_eps[0.0]["vs_ar"].values())
    hf = res["hf_sample"]
    assert hf["config"] == "hf-sample" and hf["nll"]["n"] == 4 and hf["wall_speedup"]["n"] == 4
    assert res["sampling"] == {"temperature": 0.7, "top_k": 50, "repetition_penalty": 1.1, "max_new_tokens": 8, "seeds": [0, 1]}
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
    assert rows[0].startswith("config,eps_b,tokens_per_forward_mean") and "cpu_speedup_lo" in rows[0] and len(rows) == 5
    assert rows[0].endswith("same_quality,nll_overlaps_ar,repetition_overlaps_ar,distinct2_overlaps_ar,distinct3_overlaps_ar")
    assert [r.split(",")[0] for r in rows[1:]] == ["ar", "hf-sample", "AT+G-3", "AT+G-3"]
    assert (out / "sweep.png").stat().st_size > 5000
    saved = json.loads((out / "sweep_config.json").read_text())  # the decoding settings nested, resolved
    decode = saved["SweepConfig"]["decode"]
    assert (decode["mode"], decode["max_new_tokens"]) == ("ar", 6)
    assert decode["sampling"] == {**decode["sampling"], "repetition_penalty": 1.1, "temperature": 0.7}
    assert saved["SweepConfig"]["stats"] == "none" and saved["BackboneConfig"]["base"] == tiny_model.backbone.name
    assert DecodeConfig(**saved["SweepConfig"]["decode"]) == decode_configs(SweepConfig(decode=DecodeConfig(max_new_tokens=6)), [])[0]
    printed = capsys.readouterr().out
    assert "same_quality_speedup" in printed and "hf-sample" in printed and "same quality?" in printed


def test_ablations_add_one_curve_each(tiny_model):
    res = sweep(tiny_model, SweepConfig(seeds=1, decode=DecodeConfig(max_new_tokens=4), ablations=True), ["Once"], [0.5],
                table=None, log=lambda m: None)
    assert [p["config"] for p in res["points"]] == list(TABLE8)
    assert all(p["theory"]["predicted_wall_speedup"] > 0 for p in res["points"])


def test_ar_reference_timing_is_the_mean_of_its_two_runs():
    from multitoken.pipeline.eval.sweep import _average_timing

    a = {"nll": 1.0, "sec_per_token": 0.010, "cpu_per_token": 0.008}
    b = {"nll": 1.0, "sec_per_token": 0.030, "cpu_per_token": 0.010}
    assert _average_timing(a, b) == pytest.approx({"nll": 1.0, "sec_per_token": 0.020, "cpu_per_token": 0.009})


def test_batched_sweep_gives_the_sequential_results(tiny_model):
    """--batch-size 3 over 2 prompts x 2 seeds (a batch of 3 and one of 1): every quality figure
    and tokens per forward equal the one-at-a-time sweep's (same seeds, same tokens)."""
    def figures(batch_size):
        cfg = SweepConfig(seeds=2, decode=DecodeConfig(max_new_tokens=10), hf_sample=False, batch_size=batch_size)
        res = sweep(tiny_model, cfg, ["Once upon", "The cat sat on the"], [0.0, 0.3, 1.0], table=None, log=lambda m: None)
        keys = ("tokens_per_forward", "nll", "distinct2", "distinct3", "repetition")
        return [{k: p[k] for k in keys} for p in [res["ar"], *res["points"]]]

    assert figures(3) == figures(1)


def test_sweep_scores_each_continuation_once_and_never_the_warm_up(tiny_model, monkeypatch):
    """The quality forward runs once per distinct (prompt, continuation): ar's second run and
    grid points with the same tokens reuse it; the discarded warm-up runs are not scored."""
    from multitoken.pipeline.eval import sweep as sweep_mod

    scored = []
    real = sweep_mod.continuation_nll

    def counting(backbone, prompt_ids, new_ids):
        scored.append((tuple(prompt_ids), tuple(new_ids)))
        return real(backbone, prompt_ids, new_ids)

    monkeypatch.setattr(sweep_mod, "continuation_nll", counting)
    cfg = SweepConfig(seeds=2, decode=DecodeConfig(max_new_tokens=10, stop_at_eos=False), batch_size=2, hf_sample=False)
    res = sweep(tiny_model, cfg, ["Once upon", "The cat sat on the"], [0.0, 1.0], table=None, log=lambda m: None)
    assert len(scored) == len(set(scored))  # no pair scored twice
    assert all(len(new) == 10 for _, new in scored)  # the 4-token warm-ups were never scored
    # 4 runs each of ar and 2 points: at most 12 distinct continuations, all scored
    assert 4 <= len(scored) <= 12 and res["ar"]["nll"]["n"] == 4
