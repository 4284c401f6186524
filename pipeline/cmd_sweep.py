"""``multitoken sweep``: the eps_b sweep of dynamic decoding against ar sampling.

Writes ``sweep.json``, ``sweep.csv``, ``sweep.png`` and ``sweep_config.json`` to ``--out`` and
prints the table. How to read the plot: each curve is one decoding configuration, each dot one
eps_b (eps_b = 1 always emits one token per step, so it sits at x = 1 on the left panel); x is a speed-up,
y the base model's NLL of what was generated (lower = text the base model finds likelier); the
grey band is ar sampling's 95% interval. Dots inside the band are "same quality".
"""

from __future__ import annotations

import csv
import io
import json
import sys
from pathlib import Path

RESOLVED_CONFIG = "sweep_config.json"
FILES = ("sweep.json", "sweep.csv", "sweep.png")


def register(sub) -> None:
    from .cli import add_command
    from .sweep import SweepConfig

    from .outputs import add_overwrite_flag

    add_overwrite_flag(add_command(sub, "sweep", SweepConfig, run=run))


def run(args) -> None:
    from .assets import default_stats, load_model, load_stats
    from .atomic import atomic_dir
    from .cliargs import atomic_write_text, dataclass_from_args, save_resolved_config
    from .errors import UsageError
    from .outputs import SWEEP, prepare_output
    from .sweep import SweepConfig, parse_grid, read_prompts, sweep

    cfg = dataclass_from_args(SweepConfig, args)
    prepare_output(cfg.out, "sweep", overwrite=args.overwrite, inputs=(cfg.heads, cfg.stats, cfg.base, cfg.prompts))
    if not cfg.out:
        raise UsageError("--out is required", "pass a directory for the results, e.g. --out sweep/")
    if cfg.seeds < 1 or cfg.max_new_tokens < 1:
        raise UsageError("--seeds and --max-new-tokens must be >= 1")
    grid, prompts = parse_grid(cfg.eps_b), read_prompts(cfg.prompts)
    if cfg.threads > 0:
        import torch

        torch.set_num_threads(cfg.threads)
    model, heads = load_model(cfg.heads, cfg.base, cfg.dtype, cfg.device)
    cfg.heads, cfg.stats = heads, cfg.stats or default_stats(model.backbone) or "none"
    table = load_stats(cfg.stats, model.backbone.tokenizer)
    log = (lambda _msg: None) if cfg.quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
    result = sweep(model, cfg, prompts, grid, table, log)
    result = {"heads": heads, "base": model.backbone.name, "stats": cfg.stats, **result}
    out = Path(cfg.out)
    with atomic_dir(out, marker=SWEEP.marker, owned=SWEEP.owned) as stage:  # sweep.png too: all or nothing
        atomic_write_text(stage / "sweep.json", json.dumps(result, indent=2) + "\n")
        atomic_write_text(stage / "sweep.csv", to_csv(result))
        plot_sweep(result, stage / "sweep.png")
        save_resolved_config(stage / RESOLVED_CONFIG, "sweep", cfg)
    print(format_table(result))
    print(f"\nwrote {', '.join(str(out / f) for f in FILES)}")


CSV_KEYS = ("tokens_per_forward", "wall_speedup", "cpu_speedup", "nll", "distinct2", "distinct3", "repetition")


def to_csv(result: dict) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow(["config", "eps_b"] + [f"{k}_{s}" for k in CSV_KEYS for s in ("mean", "lo", "hi")]
                    + ["predicted_wall_speedup"])
    for p in [result["ar"]] + result["points"]:
        row = [p["config"], p.get("eps_b", "")]
        for k in CSV_KEYS:
            ci = p.get(k, {"mean": 1.0, "lo": 1.0, "hi": 1.0})  # ar is its own reference: x1
            row += [f"{ci[s]:.6g}" for s in ("mean", "lo", "hi")]
        row.append(f"{p['theory']['predicted_wall_speedup']:.4g}" if "theory" in p else "")
        writer.writerow(row)
    return buf.getvalue()


def _ci(ci: dict, digits: int = 2) -> str:
    half = (ci["hi"] - ci["lo"]) / 2
    return f"{ci['mean']:.{digits}f}±{half:.{digits}f}"


def format_table(result: dict) -> str:
    ar = result["ar"]
    head = (f"{'config':<14} {'eps_b':>5} {'tok/fwd':>11} {'wall x':>11} {'cpu x':>11} {'pred x':>6} {'NLL':>11} "
            f"{'dist-2':>6} {'dist-3':>6} {'rep':>5}")
    lines = [f"{len(result['prompts'])} prompts x {result['seeds']} seeds, 95% intervals; ar reference: "
             f"NLL {_ci(ar['nll'], 3)}, {ar['sec_per_token']['mean'] * 1e3:.2f} ms/token", "", head]
    for p in result["points"]:
        lines.append(f"{p['config']:<14} {p['eps_b']:>5.2f} {_ci(p['tokens_per_forward']):>11} {_ci(p['wall_speedup']):>11} "
                     f"{_ci(p['cpu_speedup']):>11} {p['theory']['predicted_wall_speedup']:>6.2f} {_ci(p['nll'], 2):>11} {p['distinct2']['mean']:>6.3f} "
                     f"{p['distinct3']['mean']:>6.3f} {p['repetition']['mean']:>5.3f}")
    lines.append(f"{'ar':<14} {'':>5} {'1.00':>11} {'1.00':>11} {'1.00':>11} {'':>6} {_ci(ar['nll'], 2):>11} "
                 f"{ar['distinct2']['mean']:>6.3f} {ar['distinct3']['mean']:>6.3f} {ar['repetition']['mean']:>5.3f}")
    sq = result["same_quality_speedup"]
    lines.append("")
    if sq is None:
        lines.append("same_quality_speedup: none (no point's NLL interval overlaps ar's)")
    else:
        lines.append(f"same_quality_speedup: {sq['tokens_per_forward']:.2f} tokens/forward, wall-clock x{sq['wall_clock']:.2f}, CPU-time x{sq['cpu_time']:.2f} "
                     f"({sq['config']}, eps_b {sq['eps_b']:.2f}; NLL {sq['nll']:.3f} vs ar {sq['ar_nll']:.3f})")
    return "\n".join(lines)


def plot_sweep(result: dict, path: str | Path) -> Path:
    """NLL vs tokens per forward, vs wall-clock and vs CPU-time speed-up; ar's band in grey."""
    from .plotting import pyplot, save_figure

    plt = pyplot()
    ar = result["ar"]["nll"]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4), dpi=110, sharey=True)
    for ax, key, label in ((axes[0], "tokens_per_forward", "tokens per forward pass"),
                           (axes[1], "wall_speedup", "wall-clock speed-up over ar"),
                           (axes[2], "cpu_speedup", "CPU-time speed-up over ar")):
        ax.axhspan(ar["lo"], ar["hi"], color="0.85", label="ar sampling (95% CI)")
        ax.axhline(ar["mean"], color="0.5", lw=0.8)
        for name in dict.fromkeys(p["config"] for p in result["points"]):
            # the curve is parametrised by eps_b: join the dots in eps_b order on every panel
            pts = sorted((p for p in result["points"] if p["config"] == name), key=lambda p: p["eps_b"])
            x = [p[key]["mean"] for p in pts]
            y = [p["nll"]["mean"] for p in pts]
            yerr = [[p["nll"]["mean"] - p["nll"]["lo"] for p in pts], [p["nll"]["hi"] - p["nll"]["mean"] for p in pts]]
            ax.errorbar(x, y, yerr=yerr, marker="o", ms=4, capsize=2, label=f"dynamic {name}")
            for p in pts:
                ax.annotate(f"{p['eps_b']:g}", (p[key]["mean"], p["nll"]["mean"]), fontsize=6,
                            xytext=(3, 3), textcoords="offset points")
        ax.axvline(1.0, color="0.6", ls=":", lw=0.8)
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("base-model NLL of the continuation (lower = likelier)")
    axes[0].legend(fontsize=7)
    sq = result["same_quality_speedup"]
    note = "" if sq is None else f" — same-quality: {sq['tokens_per_forward']:.2f} tok/fwd, x{sq['wall_clock']:.2f} wall, x{sq['cpu_time']:.2f} CPU"
    fig.suptitle(f"eps_b sweep: {Path(result['base']).name}, numbers = eps_b{note}", fontsize=9)
    fig.tight_layout()
    return save_figure(fig, path)
