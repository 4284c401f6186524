"""Claim 3 (Mehra et al., Table 1 "Diff. LR + WHS", eq. 5, Fig. 2): weighted hidden states
against replicated final-layer heads at equal head budgets (same n, same head layers, same data,
seed, steps; both joint LoRA with the 4x head LR, the paper's WHS setting). Reported: top-1 /
top-5 of heads 2..3 on held-out text, and each WHS head's learned layer weights
softmax(W_s / T) plotted beside the base model's logit-lens KL per layer (Fig. 2): a head that
needs information the last layers discard should weight earlier layers.

Model and data: pythia-mini, tinyshakespeare's first 90% / held-out tail (as frozen_vs_joint).

    python scripts/experiments/whs_vs_replicated.py [--quick] [--out DIR]
"""

from __future__ import annotations

import sys

from multitoken.pipeline.eval import experiment as common

NAME = "whs_vs_replicated"
FULL = common.Budget(steps=40, batch_size=4, seq_len=64, lr=5e-4, eval_tokens=4096, eval_batches=2)
QUICK = common.Budget(steps=2, batch_size=2, seq_len=16, lr=5e-4, eval_tokens=64, eval_batches=1)
VARIANTS = {
    "replicated": {"head_type": "replicated", "n_future": 3, "init": "copy"},
    "whs": {"head_type": "whs", "n_future": 3, "init": "copy", "temperature": 0.1, "init_weight": 0.1},
}
TRAIN = {"mode": "joint", "head_lr_mult": 4.0}


def main(argv=None) -> dict:
    args = common.parser(__doc__, NAME).parse_args(argv)
    run = common.Run(NAME, args, FULL, QUICK)
    train_data, heldout = common.shakespeare_split(run.work, args.quick)
    backbone = common.load_base(common.PYTHIA_MINI)
    rows, weights, lens = [], {}, None
    for name, heads in VARIANTS.items():
        trained = common.train_heads(run, name, backbone, heads, train_data, heldout, **TRAIN)
        model = common.load_heads(trained["heads"])
        if lens is None:  # the frozen base's logit lens (Fig. 2 is of the pretrained model)
            base_report = common.evaluate_on(run, "lens", common.load_heads(trained["init"]), heldout, parts=("ppl", "lens"))
            lens = base_report["logit_lens"]["kl_per_layer"]
        report = common.evaluate_on(run, name, model, heldout)
        h = {row["head"]: row for row in common.head_rows(report)}
        params = sum(p.numel() for p in model.heads.parameters())
        rows.append({"variant": name, "head_params": params, "head1_ppl": h[1]["ppl"],
                     **{f"head{i}_{k}": h[i][k] for i in (2, 3) for k in ("top1", "top5", "ppl")},
                     "train_seconds": trained["train_seconds"]})
        if name == "whs":
            weights = {f"head{i + 2}": model.heads.mixing(i).tolist() for i in range(len(model.heads.layers))}
        print(f"{name}: top-5 heads 2/3 {rows[-1]['head2_top5']:.3f}/{rows[-1]['head3_top5']:.3f}", file=sys.stderr)
    result = {"model": "pythia-mini", "variants": VARIANTS, "train": TRAIN, "rows": rows,
              "whs_layer_weights": weights, "whs_layers": "trunk layer outputs Z^1..Z^{L-1} (index 0 = layer 1)",
              "initial_weight": 1.0 / len(lens[1:-1]) if lens else None,
              "logit_lens_kl": lens, "logit_lens_layers": "0 = embeddings, L = final layer",
              "data": {"train": "tinyshakespeare, first 90% of the characters",
                       "heldout": f"tinyshakespeare tail, first {run.budget.eval_tokens} tokens"}}
    return run.finish(result, plot(rows, weights, lens))


def plot(rows: list[dict], weights: dict, lens: list[float]):
    plt = common.pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6), dpi=120)
    x = range(len(rows))
    for i, (key, label) in enumerate((("head2_top1", "head 2 top-1"), ("head2_top5", "head 2 top-5"),
                                      ("head3_top1", "head 3 top-1"), ("head3_top5", "head 3 top-5"))):
        ax1.bar([j + (i - 1.5) * 0.2 for j in x], [r[key] for r in rows], 0.2, label=label)
    ax1.set_xticks(list(x), [r["variant"] for r in rows])
    ax1.set_ylabel("held-out accuracy")
    ax1.legend(fontsize=7)
    ax1.grid(axis="y", alpha=0.3)
    for name, w in weights.items():
        ax2.plot(range(1, len(w) + 1), w, "o-", label=f"WHS weight, {name.replace('head', 'head ')}")
    if weights:
        ax2.axhline(1.0 / len(next(iter(weights.values()))), color="grey", ls=":", label="initial (equal)")
    ax2.set_xlabel("layer")
    ax2.set_ylabel("softmax(W_s / T)")
    twin = ax2.twinx()
    twin.plot(range(len(lens)), lens, "k--", alpha=0.6, label="logit-lens KL to final")
    twin.set_ylabel("KL(p_layer || p_final), nats")
    lines = ax2.get_legend_handles_labels()
    more = twin.get_legend_handles_labels()
    ax2.legend(lines[0] + more[0], lines[1] + more[1], fontsize=7)
    fig.suptitle("WHS vs replicated heads (pythia-mini, joint LoRA + 4x head LR)", fontsize=9)
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    main()
