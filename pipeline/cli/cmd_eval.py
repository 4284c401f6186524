"""``multitoken eval``: multi-token metrics of a heads dir on a text dataset.

Writes ``report.json``, ``logit_lens.png`` (when the lens part runs) and the resolved config
``eval_config.json`` to ``--out``, and prints a readable table.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path

from multitoken.base.atomic import atomic_write_text
from multitoken.base.config_io import save_resolved_config
from multitoken.base.data import DataConfig, describe_files
from multitoken.base.errors import MultitokenError
from multitoken.base.outputs import EVAL, HEADS, add_overwrite_flag, claim_output
from multitoken.base.publish import staged_output
from multitoken.pipeline.cli import add_command, base_from_heads, threads_for_batches
from multitoken.pipeline.cli.args import dataclass_from_args

RESOLVED_CONFIG = "eval_config.json"
REPORT = "report.json"
LENS_PNG = "logit_lens.png"


def register(sub) -> None:
    from multitoken.pipeline.eval.evaluate import EvalConfig  # lazy: torch
    from multitoken.pipeline.model.loading import BackboneConfig  # lazy: torch

    parser = add_command(sub, "eval", EvalConfig, BackboneConfig, DataConfig, run=run)
    base_from_heads(parser)
    threads_for_batches(parser)
    add_overwrite_flag(parser)


def run(args) -> None:
    from multitoken.pipeline.eval.evaluate import EvalConfig  # lazy: torch
    from multitoken.pipeline.model.loading import BackboneConfig  # lazy: torch

    cfg = dataclass_from_args(EvalConfig, args)
    bb_cfg = dataclass_from_args(BackboneConfig, args)
    data_cfg = dataclass_from_args(DataConfig, args)
    with claim_output(cfg.out, "eval", overwrite=args.overwrite, inputs=(cfg.heads, cfg.stats, bb_cfg.base, data_cfg.data)):
        _run(cfg, bb_cfg, data_cfg)


def _run(cfg, bb_cfg, data_cfg) -> None:
    from multitoken.decoding.trees import ACCURACY_FILE  # lazy: torch
    from multitoken.pipeline.eval.evaluate import evaluate  # lazy: torch
    from multitoken.pipeline.sources.assets import default_stats, load_model  # lazy: torch

    cfg.validate()
    files, lines = describe_files(data_cfg)  # also refuses a --split the data does not have
    model, cfg.heads = load_model(cfg.heads, **dataclasses.asdict(bb_cfg))
    bb_cfg.base = model.backbone.name  # resolved: the base the heads ran on
    print("\n".join(lines), file=sys.stderr, flush=True)
    if cfg.stats is None:
        cfg.stats = default_stats(model.backbone)
    report = evaluate(model, cfg, data_cfg)
    report = {"heads_dir": cfg.heads, "base": model.backbone.name, "head_type": model.config.head_type, **report}
    out = Path(cfg.out)
    with staged_output(out, EVAL.kind, "eval", marker=EVAL.marker) as stage:
        if "logit_lens" in report:
            from multitoken.pipeline.eval.lens import plot_lens  # lazy: torch

            plot_lens(report["logit_lens"]["kl_per_layer"], stage / LENS_PNG, f"logit lens: {Path(model.backbone.name).name}")
            report["logit_lens"]["png"] = str(out / LENS_PNG)
        atomic_write_text(stage / REPORT, json.dumps(report, indent=2, default=_json_default) + "\n")
        if "tree" in report:
            atomic_write_text(stage / ACCURACY_FILE, json.dumps(report["tree"], indent=2) + "\n")
        save_resolved_config(stage / RESOLVED_CONFIG, "eval", cfg, bb_cfg, data_cfg, extra={"data_files": files})
    print(format_report(report))
    print(f"\nreport: {out / REPORT}")
    if "tree" in report and cfg.beside_heads:
        _write_beside_heads(cfg.heads, report["tree"])


def _write_beside_heads(heads: str, record: dict) -> None:
    """rank_accuracy.json into the heads dir, added to its record (a previous one its record
    lists is replaced: it is derived data; the heads dir's other files stay listed), or one line
    saying why not (a read-only install of the embedded heads, a file multitoken did not write)."""
    from multitoken.decoding.trees import ACCURACY_FILE  # lazy: torch

    path = Path(heads) / ACCURACY_FILE
    try:
        with staged_output(heads, HEADS.kind, "eval", keep=lambda rel: rel != ACCURACY_FILE) as stage:
            atomic_write_text(stage / ACCURACY_FILE, json.dumps(record, indent=2) + "\n")
    except OSError as err:
        print(f"note: could not write {path} ({err.strerror}); copy it from --out to use it with --tree static", file=sys.stderr)
        return
    except MultitokenError as err:
        print(f"note: did not write {path} ({err.problem}); copy it from --out to use it with --tree static", file=sys.stderr)
        return
    print(f"tree accuracies: {path} (read by generate --tree static)")


def _json_default(value):
    return float(value) if hasattr(value, "__float__") else str(value)


def _f(x: float, digits: int = 3) -> str:
    return "nan" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def format_report(r: dict) -> str:
    """Plain-text tables of a report (what ``multitoken eval`` prints)."""
    lines = [f"{r.get('base', '')} + {r.get('head_type', '')} heads: {r['tokens']} tokens, {r['sequences']} sequences", ""]
    lines.append(f"{'head':>4} {'PPL_n':>10} {'top-1':>7} {'top-5':>7} {'PPL_1:n':>10}")
    for h in r["heads"]:
        joint = r["ppl_joint"][f"PPL_1:{h['head']}"]
        lines.append(f"{h['head']:>4} {_f(h['ppl'], 2):>10} {_f(h['top1']):>7} {_f(h['top5']):>7} {_f(joint, 2):>10}")
    a = r["accept_length"]
    lines += ["", "expected tokens per step from draft top-1 accuracies (heads 2..n):",
              f"  formula 1 + sum_k prod acc: {_f(a['formula_with_base_token'])} (drafts only: {_f(a['formula_without_base_token'])})",
              f"  empirical chain:            {_f(a['empirical_with_base_token'])} (drafts only: {_f(a['empirical_without_base_token'])})"]
    if "speedup_theory" in r:
        t = r["speedup_theory"]
        lines.append(f"  speculative-sampling theory (Leviathan et al.) at the implied acceptance a = {_f(t['a'])}, g = {t['g']}, c = {_f(t['c'], 4)}: "
                     f"wall-time x{_f(t['speed'], 2)}, operations x{_f(t['operations'], 2)}")
    if "dynamic" in r:
        lines += ["", f"{'eps_b':>6} {'PPL_d':>10} {'tokens/step':>12}"]
        lines += [f"{d['eps_b']:>6.2f} {_f(d['ppl_d'], 2):>10} {_f(d['tokens_per_step']):>12}" for d in r["dynamic"]]
    if "marginal" in r:
        m = r["marginal"]
        lines += ["", f"marginalization baseline for t+2 ({m['positions']} positions, nucleus {m['top_p']} capped at "
                      f"{m['max_candidates']}: mean {_f(m['mean_nucleus_size'], 1)} tokens holding {_f(m['mean_nucleus_mass'])} of the mass)",
                  f"  marginal: PPL_2 {_f(m['ppl_2'], 2)}  top-1 {_f(m['top1'])}  top-5 {_f(m['top5'])}"]
        if "head2_same_positions" in m:
            h = m["head2_same_positions"]
            lines.append(f"  head 2:   PPL_2 {_f(h['ppl_2'], 2)}  top-1 {_f(h['top1'])}  top-5 {_f(h['top5'])}")
    if "logit_lens" in r:
        kl = " ".join(_f(v, 2) for v in r["logit_lens"]["kl_per_layer"])
        lines += ["", f"logit-lens KL(layer || final) per layer 0..L: {kl}"]
    lines += ["", "wall seconds: " + ", ".join(f"{k} {v:.1f}" for k, v in r["seconds"].items()),
              "CPU seconds:  " + ", ".join(f"{k} {v:.1f}" for k, v in r.get("cpu_seconds", {}).items())]
    return "\n".join(lines)
