"""``multitoken sweep``: the eps_b sweep of dynamic decoding against ar sampling.

Writes ``sweep.json``, ``sweep.csv``, ``sweep.png`` and ``sweep_config.json`` to ``--out`` and
prints the table. How to read the plot: y is the base model's NLL of what was generated (lower =
text the base model finds likelier), x a speed measure (tokens per forward pass, wall-clock and
CPU-time speed-up over ar); each marker shape is one decoding configuration, its colour the
eps_b (colour bar; eps_b = 1 always emits one token per step, so it sits at x = 1 on the left
panel); filled markers are of ar's quality on all four criteria (NLL, repetition, distinct-2,
distinct-3: each verdict "same", ``pipeline.eval.equivalence``), hollow ones are not. ar is the
black star with its interval (and the grey band), transformers' sampling generate the black
cross. The bottom row has one panel per criterion: the paired difference point - ar against
eps_b with its 95% bootstrap interval over prompts, the grey band the equivalence margin. The
caption spells out the names. The table's second part gives each difference, its interval and
its mde (the smallest difference the data could detect).
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import sys
from pathlib import Path

from multitoken.base.atomic import atomic_write_text
from multitoken.base.config_io import save_resolved_config
from multitoken.base.outputs import SWEEP, add_overwrite_flag, claim_output
from multitoken.base.publish import staged_output
from multitoken.pipeline.cli import add_command, base_from_heads
from multitoken.pipeline.cli.args import dataclass_from_args

RESOLVED_CONFIG = "sweep_config.json"
FILES = ("sweep.json", "sweep.csv", "sweep.png")


def register(sub) -> None:
    from multitoken.pipeline.eval.sweep import SweepConfig  # lazy: torch
    from multitoken.pipeline.model.loading import BackboneConfig  # lazy: torch

    parser = add_command(sub, "sweep", SweepConfig, BackboneConfig, run=run)
    base_from_heads(parser)
    add_overwrite_flag(parser)


def run(args) -> None:
    from multitoken.pipeline.eval.sweep import SweepConfig  # lazy: torch
    from multitoken.pipeline.model.loading import BackboneConfig  # lazy: torch

    cfg = dataclass_from_args(SweepConfig, args)
    bb_cfg = dataclass_from_args(BackboneConfig, args)
    with claim_output(cfg.out, "sweep", overwrite=args.overwrite, inputs=(cfg.heads, cfg.stats, bb_cfg.base, cfg.prompts)):
        _run(cfg, bb_cfg)


def _run(cfg, bb_cfg) -> None:
    from multitoken.pipeline.eval.sweep import parse_grid, read_prompts, sweep  # lazy: torch
    from multitoken.pipeline.sources.assets import NO_STATS, default_stats, load_model, load_stats  # lazy: torch

    cfg.validate()
    grid, prompts = parse_grid(cfg.eps_b), read_prompts(cfg.prompts)
    model, heads = load_model(cfg.heads, **dataclasses.asdict(bb_cfg))
    bb_cfg.base = model.backbone.name  # resolved: the base the heads ran on
    if cfg.stats is None:
        cfg.stats = default_stats(model.backbone) or NO_STATS
    cfg.heads, cfg.decode = heads, cfg.decode.resolved()
    table = load_stats(cfg.stats, model.backbone.tokenizer)
    _check_points(cfg, grid, model, table)
    log = (lambda _msg: None) if cfg.quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
    result = sweep(model, cfg, prompts, grid, table, log)
    result = {"heads": heads, "base": model.backbone.name, "stats": cfg.stats, **result}
    out = Path(cfg.out)
    with staged_output(out, SWEEP.kind, "sweep", marker=SWEEP.marker) as stage:  # sweep.png too: all or nothing
        atomic_write_text(stage / "sweep.json", json.dumps(result, indent=2) + "\n")
        atomic_write_text(stage / "sweep.csv", to_csv(result))
        plot_sweep(result, stage / "sweep.png")
        save_resolved_config(stage / RESOLVED_CONFIG, "sweep", cfg, bb_cfg)
    print(format_table(result))
    print(f"\nwrote {', '.join(str(out / f) for f in FILES)}")


def _check_points(cfg, grid: list[float], model, table) -> None:
    """Every point's decoding settings against the model (top-k, the k^n grid), before any run."""
    from multitoken.decoding.config import stats_order_cap  # lazy: torch
    from multitoken.pipeline.eval.sweep import decode_configs  # lazy: torch

    ar, points = decode_configs(cfg, grid)
    for d in [ar] + [d for _, _, d in points]:
        d.validate(vocab_size=model.backbone.vocab_size, n_heads=model.n_future,
                   max_order=stats_order_cap(d, model.n_future, table, False))
    model.draft_unembedding(ar.speculation.draft_vocab)  # a missing token ranking fails here, before any run


CSV_KEYS = ("tokens_per_forward", "wall_speedup", "cpu_speedup", "nll", "distinct2", "distinct3", "repetition")
CRITERION_LABELS = {"nll": "NLL", "repetition": "rep", "distinct2": "d2", "distinct3": "d3"}  # equivalence.CRITERIA's order
# the Table 8 abbreviations, in the order the caption explains them
GLOSSARY = (("CO-0.5", "co-occurrence mask with exponent alpha_c = 0.5"), ("CO", "co-occurrence mask (alpha_c = 1)"),
            ("AT", "adaptive (Otsu) threshold of the joint grid"), ("G-3", "Gaussian blur, kernel 3, before Otsu"))


def _rows(result: dict) -> list[dict]:
    """ar, hf-sample (when run), then the dynamic points."""
    return [result["ar"]] + ([result["hf_sample"]] if result.get("hf_sample") else []) + result["points"]


TEST_KEYS = (("diff", "diff"), ("lo", "diff_lo"), ("hi", "diff_hi"), ("mde", "mde"))  # vs_ar field, CSV suffix


def to_csv(result: dict) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow(["config", "eps_b"] + [f"{k}_{s}" for k in CSV_KEYS for s in ("mean", "lo", "hi")]
                    + ["predicted_wall_speedup", "same_quality"]
                    + [f"{k}_{s}" for k in CRITERION_LABELS for s in [c for _, c in TEST_KEYS] + ["verdict"]])
    for p in _rows(result):
        row = [p["config"], p.get("eps_b", "")]
        for k in CSV_KEYS:
            ci = p.get(k, {"mean": 1.0, "lo": 1.0, "hi": 1.0})  # ar is its own reference: x1
            row += [f"{ci[s]:.6g}" for s in ("mean", "lo", "hi")]
        row.append(f"{p['theory']['predicted_wall_speedup']:.4g}" if "theory" in p else "")
        row.append(p.get("same_quality", ""))
        for k in CRITERION_LABELS:  # ar: no difference from itself
            test = p["vs_ar"][k] if "vs_ar" in p else None
            row += [f"{test[f]:.6g}" if test else "" for f, _ in TEST_KEYS] + [test["verdict"] if test else ""]
        writer.writerow(row)
    return buf.getvalue()


def _ci(ci: dict, digits: int = 2) -> str:
    half = (ci["hi"] - ci["lo"]) / 2
    return f"{ci['mean']:.{digits}f}±{half:.{digits}f}"


def _verdict(p: dict) -> str:
    """``yes`` or the criteria that are not ``same``, by verdict, e.g. ``no: worse rep,d2; undetermined NLL``."""
    if p["same_quality"]:
        return "yes"
    by = {}
    for k, test in p["vs_ar"].items():
        if test["verdict"] != "same":
            by.setdefault(test["verdict"], []).append(CRITERION_LABELS[k])
    return "no: " + "; ".join(f"{v} {','.join(by[v])}" for v in ("worse", "better", "undetermined") if v in by)


def _difference(test: dict) -> str:
    """``+0.012 [-0.030,+0.051] 0.061`` (difference, interval, mde); ``!`` after an mde above the margin."""
    flag = "!" if test["mde"] > test["margin"] or test["mde"] != test["mde"] else " "
    return f"{test['diff']:+.3f} [{test['lo']:+.3f},{test['hi']:+.3f}] {test['mde']:.3f}{flag}"


def _differences(result: dict) -> list[str]:
    """The second table: per point and criterion, the paired difference from ar, its interval and mde."""
    rows = [("hf-sample", "", result["hf_sample"])] if result.get("hf_sample") else []
    rows = [(p["config"], f"{p['eps_b']:.2f}", p) for p in result["points"]] + rows
    margins = {k: rows[0][2]["vs_ar"][k]["margin"] for k in CRITERION_LABELS} if rows else {}
    lines = ["", "point - ar, paired by prompt and seed: difference [95% bootstrap interval over prompts] mde "
             "(smallest difference detectable at 80% power; ! = above the margin: too little data for a difference that size)",
             f"{'config':<14} {'eps_b':>5} " + " ".join(f"{CRITERION_LABELS[k] + f' (margin ±{m:g})':<29}" for k, m in margins.items())]
    lines += [f"{name:<14} {eps:>5} " + " ".join(f"{_difference(p['vs_ar'][k]):<29}" for k in CRITERION_LABELS) for name, eps, p in rows]
    least = result.get("quality_test", {}).get("min_prompts", 0)
    if len(result["prompts"]) < least:
        lines.append(f"{len(result['prompts'])} prompts: every verdict is undetermined below {least} (the prompts are the sample size)")
    return lines


def format_table(result: dict) -> str:
    ar = result["ar"]
    head = (f"{'config':<14} {'eps_b':>5} {'tok/fwd':>11} {'wall x':>11} {'cpu x':>11} {'pred x':>6} {'NLL':>11} "
            f"{'dist-2':>6} {'dist-3':>6} {'rep':>5}  same quality?")
    lines = [f"{len(result['prompts'])} prompts x {result['seeds']} seeds, 95% intervals; ar reference: "
             f"NLL {_ci(ar['nll'], 3)}, {ar['sec_per_token']['mean'] * 1e3:.2f} ms/token",
             f"same quality = {result['same_quality_rule']}", "", head]

    def quality(p: dict) -> str:
        return (f"{_ci(p['nll'], 2):>11} {p['distinct2']['mean']:>6.3f} {p['distinct3']['mean']:>6.3f} "
                f"{p['repetition']['mean']:>5.3f}")

    for p in result["points"]:
        lines.append(f"{p['config']:<14} {p['eps_b']:>5.2f} {_ci(p['tokens_per_forward']):>11} {_ci(p['wall_speedup']):>11} "
                     f"{_ci(p['cpu_speedup']):>11} {p['theory']['predicted_wall_speedup']:>6.2f} {quality(p)}  {_verdict(p)}")
    hf = result.get("hf_sample")
    if hf:
        lines.append(f"{'hf-sample':<14} {'':>5} {'1.00':>11} {_ci(hf['wall_speedup']):>11} {_ci(hf['cpu_speedup']):>11} "
                     f"{'':>6} {quality(hf)}  {_verdict(hf)}")
    lines.append(f"{'ar':<14} {'':>5} {'1.00':>11} {'1.00':>11} {'1.00':>11} {'':>6} {quality(ar)}")
    if hf:
        lines.append("hf-sample: transformers' generate(do_sample=True) at the same temperature, top-k and penalty value; "
                     "its penalty is the logit form (logit / penalty if > 0, else x penalty, before temperature and "
                     "top-k), ours DynaMo's (probability / penalty after them)")
    lines += _differences(result)
    sq = result["same_quality_speedup"]
    lines.append("")
    if sq is None:
        lines.append("same_quality_speedup: none (no point meets every same-quality criterion)")
    else:
        lines.append(f"same_quality_speedup: {sq['tokens_per_forward']:.2f} tokens/forward, wall-clock x{sq['wall_clock']:.2f}, CPU-time x{sq['cpu_time']:.2f} "
                     f"({sq['config']}, eps_b {sq['eps_b']:.2f}; NLL {sq['nll']:.3f} vs ar {sq['ar_nll']:.3f})")
    if result["points"]:
        lines.append(headline(result))
    return "\n".join(lines)


def headline(result: dict) -> str:
    """The speed DynaMo buys and what it costs, side by side: the fastest point (wall-clock) with
    its verdicts against ar, then the fastest point of ar's quality, or that none was."""
    fast = max(result["points"], key=lambda p: p["wall_speedup"]["mean"])
    verdict = "same as ar's" if fast["same_quality"] else _verdict(fast).removeprefix("no: ")
    sq = result["same_quality_speedup"]
    same = (f"no point was of ar's quality on all four metrics ({len(result['prompts'])} prompts x {result['seeds']} seeds)"
            if sq is None else f"of ar's quality: {sq['config']} eps_b {sq['eps_b']:.2f}, wall-clock x{sq['wall_clock']:.2f}")
    return (f"headline: fastest {fast['config']} eps_b {fast['eps_b']:.2f}: {fast['tokens_per_forward']['mean']:.2f} tokens/forward, "
            f"wall-clock x{fast['wall_speedup']['mean']:.2f} over ar sampling; its quality against ar: {verdict}; {same}")


MARKERS = ("o", "s", "^", "D", "v", "P", "h")
DODGE = 0.06  # tokens per forward between configurations on the left panel (said in the caption)
PANELS = (("tokens_per_forward", "tokens per forward pass"), ("wall_speedup", "wall-clock speed-up over ar"),
          ("cpu_speedup", "CPU-time speed-up over ar"))


def caption(names) -> str:
    """What the configuration names and the marks mean (only the abbreviations in ``names``)."""
    used, rest = [], "+".join(names)
    for abbr, meaning in GLOSSARY:  # CO-0.5 first, so that CO is matched on what is left
        if abbr in rest.split("+"):
            used.append(f"{abbr} = {meaning}")
            rest = rest.replace(abbr, "")
    return ("; ".join(used) + ".\nTop: colour = eps_b. Filled = same quality as ar (NLL, repetition, distinct-2 and distinct-3 all 'same': "
            "the paired point - ar 95% bootstrap interval within the margin), hollow = not;\nringed = the same-quality point; "
            "larger marker = smaller eps_b (equal points nest). Bars = 95% intervals. Left panel: configurations drawn side by side, "
            f"{DODGE:g} tokens/forward apart.\nBottom: per metric, point - ar (same prompt and seed) against eps_b, bars = 95% "
            "bootstrap interval over prompts; grey band = the equivalence margin; filled = 'same' on that metric; "
            "mde = smallest difference detectable at 80% power.")


def plot_sweep(result: dict, path: str | Path) -> Path:
    """NLL vs tokens per forward, vs wall-clock and vs CPU-time speed-up: markers only (shape =
    configuration, colour = eps_b), ar and hf-sample as points with their intervals."""
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import Normalize
    from matplotlib.lines import Line2D

    from multitoken.pipeline.eval.plotting import pyplot, save_figure  # lazy: torch

    plt = pyplot()
    ar, hf, sq = result["ar"], result.get("hf_sample"), result["same_quality_speedup"]
    names = list(dict.fromkeys(p["config"] for p in result["points"]))
    shape = {name: MARKERS[i % len(MARKERS)] for i, name in enumerate(names)}
    cmap, norm = plt.get_cmap("viridis"), Normalize(0.0, 1.0)
    # tokens per forward takes few distinct values: configurations side by side, not on top of each other
    dodge = {name: (i - (len(names) - 1) / 2) * DODGE for i, name in enumerate(names)}
    fig = plt.figure(figsize=(14, 10), dpi=150)
    axes = fig.add_gridspec(1, 3, left=0.06, right=0.9, top=0.95, bottom=0.57, wspace=0.08).subplots(sharey=True)
    # small eps_b first and largest: points at the same place nest as rings, every colour visible
    points = sorted(result["points"], key=lambda p: p["eps_b"])
    for ax, (key, label) in zip(axes, PANELS):
        ax.axhspan(ar["nll"]["lo"], ar["nll"]["hi"], color="0.92", zorder=0)
        for p in points:
            x = p[key]["mean"] + (dodge[p["config"]] if key == "tokens_per_forward" else 0.0)
            y, (lo, hi) = p["nll"]["mean"], (p[key]["lo"] - p[key]["mean"], p[key]["hi"] - p[key]["mean"])
            ax.errorbar(x, y, xerr=[[-lo], [hi]], yerr=[[y - p["nll"]["lo"]], [p["nll"]["hi"] - y]],
                        fmt="none", ecolor="0.8", elinewidth=0.6, zorder=1)
            colour = cmap(norm(p["eps_b"]))
            good = p.get("same_quality")  # filled, dark outline (nested markers stay apart); else hollow
            ax.scatter([x], [y], marker=shape[p["config"]], s=14 + 70 * (1 - p["eps_b"]), zorder=3,
                       linewidths=0.5 if good else 1.4, facecolors=colour if good else "white",
                       edgecolors="0.1" if good else colour)
            if sq is not None and p["config"] == sq["config"] and p["eps_b"] == sq["eps_b"]:
                ax.scatter([x], [y], marker="o", s=320, facecolors="none", edgecolors="crimson", linewidths=1.5, zorder=4)
        _reference(ax, ar, 1.0, marker="*", size=15, label="ar")
        if hf:
            _reference(ax, hf, hf.get(key, {"mean": 1.0})["mean"], marker="X", size=9, label="hf-sample")
        ax.axvline(1.0, color="0.6", ls=":", lw=0.8)
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("base-model NLL of the continuation (lower = likelier)")
    handles = [Line2D([], [], ls="", marker=shape[n], mfc="0.5", mec="0.3", label=f"dynamic {n}") for n in names]
    handles += [Line2D([], [], ls="", marker="*", ms=11, color="black", label="ar (our sampling)")]
    if hf:
        handles.append(Line2D([], [], ls="", marker="X", ms=8, color="black", label="hf-sample (transformers generate)"))
    if sq is not None:
        handles.append(Line2D([], [], ls="", marker="o", ms=12, mfc="none", mec="crimson", label="same-quality point"))
    axes[0].legend(handles=handles, fontsize=7, loc="best")
    note = "none" if sq is None else f"{sq['config']} eps_b {sq['eps_b']:g}: {sq['tokens_per_forward']:.2f} tok/fwd, x{sq['wall_clock']:.2f} wall, x{sq['cpu_time']:.2f} CPU"
    fig.suptitle(f"eps_b sweep: {Path(result['base']).name} — same-quality point: {note}", fontsize=9)
    fig.text(0.01, 0.01, caption(names), fontsize=7.5, va="bottom", ha="left", wrap=True)
    fig.colorbar(ScalarMappable(norm=norm, cmap=cmap), cax=fig.add_axes([0.915, 0.57, 0.012, 0.38]), label="eps_b")
    _plot_differences(fig.add_gridspec(1, 4, left=0.06, right=0.9, top=0.47, bottom=0.15, wspace=0.28).subplots(),
                      result["points"], names, shape)
    return save_figure(fig, path)


DIFF_DODGE = 0.012  # eps_b between configurations on the bottom row


def _plot_differences(axes, points: list[dict], names: list[str], shape: dict) -> None:
    """One panel per criterion: point - ar against eps_b with its bootstrap interval, the margin as a band."""
    for ax, key in zip(axes, CRITERION_LABELS):
        tests = [p["vs_ar"][key] for p in points]
        margin = tests[0]["margin"] if tests else 0.0
        ax.axhspan(-margin, margin, color="0.9", zorder=0)
        ax.axhline(0.0, color="0.4", lw=0.8)
        for i, name in enumerate(names):
            rows = sorted((p["eps_b"], p["vs_ar"][key]) for p in points if p["config"] == name)
            dodge = (i - (len(names) - 1) / 2) * DIFF_DODGE
            xs, ys = [e + dodge for e, _ in rows], [t["diff"] for _, t in rows]
            ax.plot(xs, ys, "-", color=f"C{i}", lw=0.8, alpha=0.6)
            for x, (_, t) in zip(xs, rows):
                low, high = (t["diff"] - t["lo"], t["hi"] - t["diff"]) if t["lo"] == t["lo"] else (0.0, 0.0)  # NaN: no interval
                ax.errorbar([x], [t["diff"]], yerr=[[low], [high]], fmt=shape[name], ms=4.5, color=f"C{i}", capsize=2, lw=0.9,
                            mfc=f"C{i}" if t["verdict"] == "same" else "white", zorder=3, label=name if x == xs[0] else None)
        mdes = [t["mde"] for t in tests if t["mde"] == t["mde"]]
        power = f"; mde {min(mdes):.3f}-{max(mdes):.3f}" if mdes else "; no mde: 1 prompt"
        ax.set_title(f"{CRITERION_LABELS[key]}: point - ar (margin ±{margin:g}{power})", fontsize=8)
        ax.set_xlabel("eps_b")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("paired difference from ar (95% bootstrap interval)")
    axes[0].legend(fontsize=6, loc="best")


def _reference(ax, row: dict, x: float, marker: str, size: float, label: str) -> None:
    """A reference run (ar, hf-sample) as a black point with its NLL interval."""
    y = row["nll"]["mean"]
    ax.errorbar([x], [y], yerr=[[y - row["nll"]["lo"]], [row["nll"]["hi"] - y]], fmt=marker, ms=size, color="black",
                mfc="black" if marker == "*" else "white", mew=1.5, capsize=3, zorder=5, label=label)
