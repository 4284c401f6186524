"""Claim 4 (Mehra et al., §2 and A.1): the base model already predicts token t+2 by numerical
marginalization over the top-0.99 nucleus of token t+1, p(x_{t+2}) = sum_y p(x_{t+2} | y) p(y),
and that baseline is hard for a trained head 2 to beat. Both are scored on the same held-out
positions (``pipeline.eval.evaluate``'s ``marginal`` part): PPL_2, top-1, top-5; head 2 before
training (a copy of the final layer) is shown too.

Model and data: pythia-mini with n = 2 replicated heads trained with the backbone frozen on
tinyshakespeare's first 90%, scored on its held-out tail.

    python scripts/experiments/marginal_baseline.py [--quick] [--out DIR]
"""

from __future__ import annotations

import sys

from multitoken.pipeline.eval import experiment as common

NAME = "marginal_baseline"
FULL = common.Budget(steps=60, batch_size=4, seq_len=64, lr=1e-3, eval_tokens=4096, eval_batches=2)
QUICK = common.Budget(steps=2, batch_size=2, seq_len=16, lr=1e-3, eval_tokens=64, eval_batches=1)
HEADS = {"head_type": "replicated", "n_future": 2, "init": "copy"}
MARGINAL = {"FULL": {"marginal_every": 48, "max_candidates": 256, "top_p": 0.99},
            "QUICK": {"marginal_every": 8, "max_candidates": 16, "top_p": 0.99}}


def main(argv=None) -> dict:
    args = common.parser(__doc__, NAME).parse_args(argv)
    run = common.Run(NAME, args, FULL, QUICK)
    marginal = MARGINAL["QUICK" if args.quick else "FULL"]
    train_data, heldout = common.shakespeare_split(run.work, args.quick)
    backbone = common.load_base(common.PYTHIA_MINI)
    trained = common.train_heads(run, "heads", backbone, HEADS, train_data, heldout, mode="heads")
    rows = {}
    for label, path in (("untrained", trained["init"]), ("trained", trained["heads"])):
        report = common.evaluate_on(run, label, common.load_heads(path), heldout, parts=("ppl", "marginal"), **marginal)
        m = report["marginal"]
        if "marginalization" not in rows:
            rows["marginalization"] = {k: m[k] for k in ("ppl_2", "top1", "top5")}
            rows["marginalization"].update(nucleus_size=m["mean_nucleus_size"], nucleus_mass=m["mean_nucleus_mass"])
            positions = m["positions"]
        rows[f"head 2 ({label})"] = dict(m["head2_same_positions"])
        rows[f"head 2 ({label})"]["all_positions"] = {k: report["heads"][1][k] for k in ("ppl", "top1", "top5", "count")}
    print("  ".join(f"{k}: top-5 {v['top5']:.3f} PPL_2 {v['ppl_2']:.0f}" for k, v in rows.items()), file=sys.stderr)
    result = {"model": "pythia-mini", "heads": HEADS, "train_mode": "heads (frozen backbone)", "marginal": marginal,
              "positions": positions, "rows": rows,
              "data": {"train": "tinyshakespeare, first 90% of the characters",
                       "heldout": f"tinyshakespeare tail, first {run.budget.eval_tokens} tokens"}}
    return run.finish(result, plot(rows))


def plot(rows: dict):
    plt = common.pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.4), dpi=120)
    names = list(rows)
    x = range(len(names))
    ax1.bar([i - 0.2 for i in x], [rows[n]["top1"] for n in names], 0.4, label="top-1")
    ax1.bar([i + 0.2 for i in x], [rows[n]["top5"] for n in names], 0.4, label="top-5")
    ax1.set_xticks(list(x), names, fontsize=7)
    ax1.set_ylabel("token t+2 accuracy (same positions)")
    ax1.legend(fontsize=7)
    ax1.grid(axis="y", alpha=0.3)
    ax2.bar(list(x), [rows[n]["ppl_2"] for n in names], color="grey")
    ax2.set_yscale("log")
    ax2.set_xticks(list(x), names, fontsize=7)
    ax2.set_ylabel("PPL_2 (same positions)")
    ax2.grid(axis="y", alpha=0.3)
    fig.suptitle("Marginalization baseline vs head 2 (pythia-mini, tinyshakespeare held-out tail)", fontsize=9)
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    main()
