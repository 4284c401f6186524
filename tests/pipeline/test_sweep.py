"""The eps_b sweep: grid parsing, prompts, quality metrics, same-quality selection, end to end."""

import json

import pytest
import torch

from multitoken.decoding.config import DecodeConfig
from multitoken.base.errors import UsageError
from multitoken.pipeline.eval.equivalence import CRITERIA, MARGINS, MDE_FACTOR, SAME_QUALITY_RULE, VERDICTS
from multitoken.pipeline.eval.sweep import (
    TABLE7_PROMPTS, TABLE8, SweepConfig, _judged, continuation_nll, decode_configs, parse_grid, read_prompts, run_hf_sample,
    same_quality, sweep,
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


PROMPTS, SEEDS = 10, 2
CLUSTERS = [p for p in range(PROMPTS) for _ in range(SEEDS)]  # the sweep's prompt-major run order


def _ar_runs(rep=0.01, d2=0.93, d3=0.97, nll=3.0):
    """ar's runs over 10 prompts x 2 seeds, each metric varying a little from run to run."""
    wobble = [((i * 7) % 5 - 2) / 2 for i in range(len(CLUSTERS))]  # -1 .. 1, mean 0
    return [{"nll": nll + 0.1 * w, "repetition": rep + 0.005 * w, "distinct2": d2 + 0.01 * w, "distinct3": d3 + 0.005 * w}
            for w in wobble]


def _point(ar_runs, tpf, eps=0.5, wall=1.0, config="CO+AT+G-3", **shift):
    """A judged point whose runs are ar's shifted per metric (``shift``: metric -> added value)."""
    runs = [{k: v + shift.get(k, 0.0) for k, v in r.items()} for r in ar_runs]
    summary = {"config": config, "eps_b": eps, "tokens_per_forward": {"mean": tpf}, "wall_speedup": {"mean": wall},
               "cpu_speedup": {"mean": wall}, **{k: {"mean": sum(r[k] for r in runs) / len(runs)} for k in CRITERIA}}
    return _judged(summary, runs, ar_runs, CLUSTERS)


def _ar_summary(ar_runs):
    return {k: {"mean": sum(r[k] for r in ar_runs) / len(ar_runs)} for k in CRITERIA}


def test_same_quality_picks_the_fastest_point_whose_every_verdict_is_same():
    ar_runs = _ar_runs()
    points = [_point(ar_runs, 1.2, eps=0.8, wall=1.1, nll=0.01), _point(ar_runs, 2.0, eps=0.5, wall=1.4, nll=-0.02),
              _point(ar_runs, 2.9, eps=0.0, nll=0.5)]
    assert [p["same_quality"] for p in points] == [True, True, False]
    sq = same_quality(points, _ar_summary(ar_runs))
    assert sq["eps_b"] == 0.5 and sq["tokens_per_forward"] == 2.0 and sq["wall_clock"] == 1.4
    assert sq["rule"] == SAME_QUALITY_RULE and sq["metrics"]["nll"]["diff"] == pytest.approx(-0.02)
    assert sq["metrics"]["nll"]["verdict"] == "same" and sq["metrics"]["nll"]["margin"] == MARGINS["nll"]
    assert sq["metrics"]["repetition"]["point"] == pytest.approx(sq["metrics"]["repetition"]["ar"])
    assert same_quality([points[2]], _ar_summary(ar_runs)) is None
    assert points[2]["vs_ar"]["nll"]["verdict"] == "worse"


def test_a_looping_point_with_good_nll_is_not_same_quality():
    """The issue's case: eps_b = 0 had NLL 2.81 vs ar's 2.99 but repetition 0.197 vs 0.010 and
    distinct-2 0.57 vs 0.93: its text loops. Each criterion alone must reject."""
    ar_runs = _ar_runs()
    fine = _point(ar_runs, 1.5, eps=0.6, nll=0.02)
    looping = _point(ar_runs, 2.9, eps=0.0, nll=-0.18, repetition=0.187, distinct2=-0.36, distinct3=-0.3)
    assert same_quality([fine, looping], _ar_summary(ar_runs))["eps_b"] == 0.6
    assert same_quality([looping], _ar_summary(ar_runs)) is None
    assert {k: v["verdict"] for k, v in looping["vs_ar"].items()} == {
        "nll": "better", "repetition": "worse", "distinct2": "worse", "distinct3": "worse"}
    for key, bad in (("repetition", 0.1), ("distinct2", -0.1), ("distinct3", -0.1), ("nll", 0.2)):
        one_bad = _point(ar_runs, 2.9, **{key: bad})
        assert not one_bad["same_quality"], key
        assert [k for k, v in one_bad["vs_ar"].items() if v["verdict"] != "same"] == [key]
        assert one_bad["vs_ar"][key]["verdict"] == "worse"


def test_the_headline_puts_the_fastest_points_speed_beside_its_quality():
    from multitoken.pipeline.cli.cmd_sweep import headline

    ar_runs = _ar_runs()
    fine = _point(ar_runs, 1.5, eps=0.6, wall=1.3, nll=0.02)
    looping = _point(ar_runs, 2.9, eps=0.0, wall=2.4, nll=-0.18, repetition=0.187, distinct2=-0.36, distinct3=-0.3)
    result = {"points": [fine, looping], "prompts": ["p"] * 10, "seeds": 2,
              "same_quality_speedup": same_quality([fine, looping], _ar_summary(ar_runs))}
    line = headline(result)
    assert "fastest CO+AT+G-3 eps_b 0.00: 2.90 tokens/forward, wall-clock x2.40 over ar sampling" in line
    assert "its quality against ar: worse rep,d2,d3; better NLL" in line
    assert line.endswith("of ar's quality: CO+AT+G-3 eps_b 0.60, wall-clock x1.30")
    line = headline({**result, "points": [looping], "same_quality_speedup": None})
    assert line.endswith("no point was of ar's quality on all four metrics (10 prompts x 2 seeds)")
    assert "same as ar's" in headline({**result, "points": [fine]})


def test_ar_reference_uses_the_points_sampling_settings():
    cfg = SweepConfig(seeds=2, decode=DecodeConfig(max_new_tokens=17, temperature=0.9, top_k=7, repetition_penalty=1.3),
                      ablations=True)
    ar, points = decode_configs(cfg, [0.0, 0.5])
    assert ar.mode == "ar" and ar.sampling.penalty == 1.3 and len(points) == 2 * len(TABLE8)
    for _, eps, dcfg in points:
        assert dcfg.mode == "dynamic" and dcfg.dynamo.eps_b == eps
        assert dcfg.sampling == ar.sampling and (dcfg.max_new_tokens, dcfg.stop_at_eos) == (ar.max_new_tokens, ar.stop_at_eos)


def test_the_dynamic_points_take_the_joint_and_order_given():
    """``sweep --dynamic-joint outer --n 2`` reaches every dynamic point (the conditional joint's
    comparison with the outer product on the same heads); ar still emits one token a pass."""
    from multitoken.pipeline.cli import build_parser
    from multitoken.pipeline.cli.args import dataclass_from_args

    args = build_parser("sweep").parse_args(["sweep", "--dynamic-joint", "outer", "--n", "2", "--eps-b", "0", "1"])
    cfg = dataclass_from_args(SweepConfig, args)
    ar, points = decode_configs(cfg, list(cfg.eps_b))
    assert ar.order(3) == 1 and len(points) == 2
    assert all(d.dynamo.dynamic_joint == "outer" and d.order(3) == 2 for _, _, d in points)


def test_hf_sample_is_seeded_and_honours_the_budget(tiny_model):
    from dataclasses import replace

    ar, _ = decode_configs(SweepConfig(decode=DecodeConfig(max_new_tokens=6)), [])
    a = run_hf_sample(tiny_model.backbone, [5, 9, 17], replace(ar, seed=3))
    b = run_hf_sample(tiny_model.backbone, [5, 9, 17], replace(ar, seed=3))
    assert 1 <= a["tokens"] <= 6 and a["nll"] == b["nll"] and a["sec_per_token"] > 0


def test_sweep_end_to_end_counts(tiny_model):
    cfg = SweepConfig(seeds=2, decode=DecodeConfig(max_new_tokens=8))
    said = []
    res = sweep(tiny_model, cfg, ["Once upon", "The cat"], [0.0, 1.0], table=None, log=said.append)
    assert said[0].startswith("4 prompt x seed runs of 2 points") and said[0].endswith("warming up")  # before any run
    assert said[1].startswith("warmed up") and len(said) == 2 + 4 and said[-1].startswith("prompt 2/2 seed 1: done (4/4")
    by_eps = {p["eps_b"]: p for p in res["points"]}
    # eps_b = 1 always backs off to one token; eps_b = 0 never does: steps of 3, 3, 2 tokens
    # after the prompt's pass = 3 forward passes for 8 tokens (the last step needs no pass).
    assert by_eps[1.0]["tokens_per_forward"]["mean"] == 1.0
    assert by_eps[0.0]["tokens_per_forward"]["mean"] == pytest.approx(8 / 3)
    assert by_eps[0.0]["nll"]["n"] == 4 and res["ar"]["tokens_per_forward"]["mean"] == 1.0
    assert list(by_eps[0.0]["vs_ar"]) == ["nll", "repetition", "distinct2", "distinct3"]
    for p in [*res["points"], res["hf_sample"]]:  # 2 prompts: intervals and mde, but fewer than 5 prompts for a verdict
        for key, test in p["vs_ar"].items():
            assert test["verdict"] == "undetermined" and (test["prompts"], test["runs"]) == (2, 4), key
            assert test["lo"] <= test["diff"] <= test["hi"] and test["margin"] == MARGINS[key]
            assert test["mde"] == pytest.approx(MDE_FACTOR * test["se"])  # a NaN (no interval) fails
        assert p["same_quality"] is False
    assert res["same_quality_speedup"] is None and res["quality_test"]["resamples"] == 2000
    # the paired difference is the point's mean minus ar's (every run scored on both sides)
    assert by_eps[0.0]["vs_ar"]["nll"]["diff"] == pytest.approx(by_eps[0.0]["nll"]["mean"] - res["ar"]["nll"]["mean"])
    hf = res["hf_sample"]
    assert hf["config"] == "hf-sample" and hf["nll"]["n"] == 4 and hf["wall_speedup"]["n"] == 4
    assert res["sampling"] == {"temperature": 0.7, "top_k": 50, "repetition_penalty": 1.1, "max_new_tokens": 8, "seeds": [0, 1]}
    json.dumps(res)


def test_cli_sweep_writes_json_csv_png(tiny_model, tmp_path, capsys):
    from multitoken.pipeline.cli import main
    from multitoken.pipeline.cli.cmd_sweep import CRITERION_LABELS

    assert tuple(CRITERION_LABELS) == CRITERIA  # the CSV's and table's column order is the test's
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
    tail = ",".join(f"{k}_{s}" for k in CRITERIA for s in ("diff", "diff_lo", "diff_hi", "mde", "verdict"))
    assert rows[0].endswith("predicted_wall_speedup,same_quality," + tail)
    assert [r.split(",")[0] for r in rows[1:]] == ["ar", "hf-sample", "AT+G-3", "AT+G-3"]
    header, point = rows[0].split(","), dict(zip(rows[0].split(","), rows[3].split(",")))
    assert all(len(r.split(",")) == len(header) for r in rows)
    assert point["nll_verdict"] == res["points"][0]["vs_ar"]["nll"]["verdict"] and point["same_quality"] == "False"
    assert float(point["nll_diff"]) == pytest.approx(res["points"][0]["vs_ar"]["nll"]["diff"], rel=1e-5)
    assert dict(zip(header, rows[1].split(",")))["nll_verdict"] == ""  # ar: no difference from itself
    assert (out / "sweep.png").stat().st_size > 5000
    saved = json.loads((out / "sweep_config.json").read_text())  # the decoding settings nested, resolved
    decode = saved["SweepConfig"]["decode"]
    assert (decode["mode"], decode["max_new_tokens"]) == ("ar", 6)
    assert decode["sampling"] == {**decode["sampling"], "repetition_penalty": 1.1, "temperature": 0.7}
    assert saved["SweepConfig"]["stats"] == "none" and saved["BackboneConfig"]["base"] == tiny_model.backbone.name
    assert DecodeConfig(**saved["SweepConfig"]["decode"]) == decode_configs(SweepConfig(decode=DecodeConfig(max_new_tokens=6)), [])[0]
    printed = capsys.readouterr().out
    assert "same_quality_speedup" in printed and "hf-sample" in printed and "same quality?" in printed
    assert "no: undetermined NLL,rep,d2,d3" in printed and "NLL (margin ±0.05)" in printed
    assert "2 prompts: every verdict is undetermined below 5" in printed
    assert printed.splitlines()[-3].startswith("headline: fastest AT+G-3 eps_b ")


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


def test_seeds_are_bounded():
    from multitoken.base.errors import UsageError
    from multitoken.pipeline.eval.sweep import MAX_SEEDS

    with pytest.raises(UsageError, match=r"--seeds must be in \[1, 1000\], got 1000000"):
        SweepConfig(seeds=1_000_000).validate()
    SweepConfig(seeds=MAX_SEEDS).validate()
