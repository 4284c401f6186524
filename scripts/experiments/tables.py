"""Markdown tables of the experiments' JSON (what docs/experiments.md shows), and the PNGs
copied beside the docs:

    python scripts/experiments/tables.py out/experiments [--copy-png docs/experiments]
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path


def f(x, digits=3) -> str:
    return "—" if x is None else f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def cp_rank(d: dict) -> list[str]:
    lines = ["| rank | joint loss 1..3 | joint loss 2..3 given 1 | first-token loss | tokens/forward (cp drafts) | tokens/forward (independent drafts) | max abs diff., sequential vs independent log p |",
             "|---|---|---|---|---|---|---|"]
    for r in d["rows"]:
        lines.append(f"| {r['rank']} | {f(r['joint_loss'])} | {f(r['joint_loss_tokens_2_to_n'])} | {f(r['first_token_loss'])} | "
                     f"{f(r['spec_cp']['tokens_per_forward'], 2)} | {f(r['spec_independent']['tokens_per_forward'], 2)} | "
                     f"{r['sequential_minus_independent_max_abs']:.1e} |")
    return lines


def frozen_vs_joint(d: dict) -> list[str]:
    lines = ["| strategy | head 1 PPL (base) | head 2 top-1 | head 2 top-5 | head 3 top-1 | head 3 top-5 |", "|---|---|---|---|---|---|"]
    for r in d["rows"]:
        lines.append(f"| {r['strategy']} | {f(r['head1_ppl'], 2)} | {f(r['head2_top1'])} | {f(r['head2_top5'])} | "
                     f"{f(r['head3_top1'])} | {f(r['head3_top5'])} |")
    return lines


def whs_vs_replicated(d: dict) -> list[str]:
    lines = ["| heads | head params | head 1 PPL | head 2 top-1 | head 2 top-5 | head 3 top-1 | head 3 top-5 |", "|---|---|---|---|---|---|---|"]
    for r in d["rows"]:
        lines.append(f"| {r['variant']} | {r['head_params']:,} | {f(r['head1_ppl'], 2)} | {f(r['head2_top1'])} | {f(r['head2_top5'])} | "
                     f"{f(r['head3_top1'])} | {f(r['head3_top5'])} |")
    lines += ["", "| layer | " + " | ".join(str(i) for i in range(len(d["logit_lens_kl"]))) + " |",
              "|---" * (len(d["logit_lens_kl"]) + 1) + "|",
              "| logit-lens KL | " + " | ".join(f(x, 2) for x in d["logit_lens_kl"]) + " |"]
    for name, w in d["whs_layer_weights"].items():
        lines.append(f"| WHS weight {name} | — | " + " | ".join(f(x, 4) for x in w) + " | — |")
    return lines


def marginal_baseline(d: dict) -> list[str]:
    lines = ["| predictor of token t+2 | PPL_2 | top-1 | top-5 |", "|---|---|---|---|"]
    for name, r in d["rows"].items():
        lines.append(f"| {name} | {f(r['ppl_2'], 1)} | {f(r['top1'])} | {f(r['top5'])} |")
    m = d["rows"]["marginalization"]
    lines.append(f"\n{d['positions']} positions; nucleus {m['nucleus_size']:.0f} candidates on average, holding {m['nucleus_mass']:.2f} of the mass.")
    return lines


def dynamo_ppl(d: dict) -> list[str]:
    p = d["ppl"]
    lines = ["| " + " | ".join(list(p["PPL_n"]) + list(p["PPL_1:n"])) + " |", "|---" * (len(p["PPL_n"]) + len(p["PPL_1:n"])) + "|",
             "| " + " | ".join(f(v, 2) for v in list(p["PPL_n"].values()) + list(p["PPL_1:n"].values())) + " |", "",
             "| eps_b | PPL_d | tokens / step |", "|---|---|---|"]
    lines += [f"| {r['eps_b']} | {f(r['ppl_d'], 2)} | {f(r['tokens_per_step'], 2)} |" for r in p["PPL_d"]]
    lines += ["", "| config | " + " | ".join(f"eps_b {p['eps_b']}" for p in next(iter(d["ablation_curves"].values()))) + " | best same-quality point |",
              "|---" * (len(next(iter(d["ablation_curves"].values()))) + 2) + "|"]
    for name, pts in d["ablation_curves"].items():
        cells = [f"{q['tokens_per_forward']:.2f} tok/fwd, NLL {q['nll']:.2f}" + ("" if q["same_quality"] else f" ✗ ({', '.join(f'{k} {v}' for k, v in q['failed'].items())})")
                 for q in pts]
        best = d["same_quality_best"].get(name)
        best_cell = f"eps_b {best['eps_b']}: {best['tokens_per_forward']:.2f} tok/fwd, CPU x{best['cpu_time']:.2f}" if best else "none"
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {best_cell} |")
    ar = d["ar"]
    lines.append(f"\n`ar`: NLL {ar['nll']['mean']:.2f} [{ar['nll']['lo']:.2f}, {ar['nll']['hi']:.2f}], repetition {ar['repetition']['mean']:.3f}, "
                 f"distinct-2 {ar['distinct2']['mean']:.3f}, distinct-3 {ar['distinct3']['mean']:.3f}.")
    return lines


def speedup_theory(d: dict) -> list[str]:
    lines = ["| method | predicted tokens/step (held-out accuracies) | predicted (Leviathan, measured alpha) | measured tokens/step | measured tokens/forward | alpha | predicted wall x | measured CPU x |",
             "|---|---|---|---|---|---|---|---|"]
    for r in d["rows"]:
        a = r.get("measured_acceptance", {}).get("alpha")
        lines.append(f"| {r['method']} | {f(r.get('heldout_formula_tokens_per_step'), 2)} | {f(r.get('leviathan_tokens_per_step'), 2)} | "
                     f"{f(r['measured_tokens_per_step'], 2)} | {f(r['measured_tokens_per_forward'], 2)} | {f(a)} | "
                     f"{f(r.get('leviathan_wall_speedup'), 2)} | {f(r['measured_cpu_speedup'], 2)} |")
    h = d["heldout"]
    lines.append(f"\nHeld-out top-1 of heads 2, 3: {', '.join(f(x) for x in h['draft_top1'])}; c = {d['draft_cost_ratio']:.3f}.")
    return lines


TABLES = {"cp_rank": cp_rank, "frozen_vs_joint": frozen_vs_joint, "whs_vs_replicated": whs_vs_replicated,
          "marginal_baseline": marginal_baseline, "dynamo_ppl": dynamo_ppl, "speedup_theory": speedup_theory}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("root", help="folder holding one output folder per experiment (NAME/NAME.json)")
    p.add_argument("--copy-png", default=None, help="copy each NAME.png here")
    args = p.parse_args(argv)
    for name, table in TABLES.items():
        path = Path(args.root) / name / f"{name}.json"
        if not path.is_file():
            continue
        d = json.loads(path.read_text())
        m, t = d["machine"], d["timing"]
        print(f"### {name}\n\n`{d['command']}`: {t['wall_s']:.0f} s wall, {t['cpu_s']:.0f} s CPU; {m['cpu']}, {m['cores']} cores, "
              f"load {m['load_before'][0] if m['load_before'] else '?'} -> {m['load_after'][0] if m['load_after'] else '?'}\n")
        print("\n".join(table(d)) + "\n")
        if args.copy_png:
            Path(args.copy_png).mkdir(parents=True, exist_ok=True)
            shutil.copy(path.with_suffix(".png"), Path(args.copy_png) / f"{name}.png")


if __name__ == "__main__":
    main()
