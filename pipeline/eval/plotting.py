"""Headless matplotlib for the PNGs the commands write (no display on servers or CI)."""

from __future__ import annotations

from pathlib import Path


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend, imported only when a plot is drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: str | Path) -> Path:
    """Write ``fig`` to ``path`` (parents created) and free it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    pyplot().close(fig)
    return path


# bar colour by what a method is: transformers, one token a step, a chain, a tree (a lookup branch hatched)
KINDS = (("hf_", "0.55", "transformers"), ("ar", "C0", "one token a step"), ("chain", "C1", "chain of drafts"),
         ("static", "C2", "static tree"), ("dynamic", "C3", "dynamic tree"), ("sampled", "C4", "sampled"))


def kind_of(label: str) -> tuple[str, str]:
    """(colour, legend name) of a benchmark row by its label's prefix."""
    return next(((colour, name) for prefix, colour, name in KINDS if label.startswith(prefix)), ("C7", "other"))


def plot_speeds(parts: list[dict], path: str | Path, subtitle: str = "") -> Path:
    """Tokens/s of every row of ``parts`` (scripts/bench_tree.py's record parts: ``model`` and
    ``methods``: label -> tokens_per_s, tokens_per_forward, speedup_vs_hf_greedy, identical), one
    panel per part, bars coloured by kind, each annotated with its tokens per forward and its
    speed over transformers' greedy generate on the same model; a dashed line at that speed."""
    from matplotlib.patches import Patch

    plt = pyplot()
    heights = [max(len(p["methods"]), 1) for p in parts]
    fig, axes = plt.subplots(len(parts), 1, figsize=(9, 1.2 + 0.32 * sum(heights) + 0.6 * len(parts)), dpi=120,
                             gridspec_kw={"height_ratios": heights}, squeeze=False)
    top = max((m["tokens_per_s"] for p in parts for m in p["methods"].values()), default=1.0)
    for ax, part in zip(axes[:, 0], parts):
        labels = list(part["methods"])
        rows = [part["methods"][k] for k in labels]
        ys = range(len(labels))[::-1]  # first row on top
        kinds = [kind_of(k) for k in labels]
        ax.barh(list(ys), [r["tokens_per_s"] for r in rows], color=[c for c, _ in kinds],
                edgecolor="0.2", linewidth=0.4)
        for y, label, r in zip(ys, labels, rows):
            if "+lookup" in label:
                ax.barh([y], [r["tokens_per_s"]], color="none", hatch="//", edgecolor="0.25", linewidth=0)
            note = [f"{r['tokens_per_forward']:.2f} tok/fwd"] if "tokens_per_forward" in r else []
            note += [f"x{r['speedup_vs_hf_greedy']:.2f} HF"] if "speedup_vs_hf_greedy" in r else []
            note += ["NOT transformers' text"] if r.get("identical") is False else []
            ax.text(r["tokens_per_s"] + top * 0.01, y, f"{r['tokens_per_s']:.1f}  " + ", ".join(note), va="center", fontsize=7)
        if "hf_greedy" in part["methods"]:
            ax.axvline(part["methods"]["hf_greedy"]["tokens_per_s"], color="0.3", ls="--", lw=0.8)
        ax.set_yticks(list(ys), labels, fontsize=7)
        ax.set_xlim(0, top * 1.45)
        ax.set_title(part["model"], fontsize=9)
        ax.grid(axis="x", alpha=0.3)
    axes[-1, 0].set_xlabel("tokens per second (higher is faster); dashed: transformers' greedy generate")
    seen = dict.fromkeys(kind_of(k) for p in parts for k in p["methods"])
    handles = [Patch(color=c, label=n) for c, n in seen] + [Patch(facecolor="white", edgecolor="0.25", hatch="//",
                                                                  label="+ prompt lookup branch")]
    fig.legend(handles=handles, fontsize=7, loc="lower center", ncol=len(handles), frameon=False)  # clear of the bars' notes
    fig.suptitle("chains and trees against transformers" + (f": {subtitle}" if subtitle else ""), fontsize=10)
    fig.tight_layout(rect=(0, 0.5 / fig.get_figheight(), 1, 1))
    return save_figure(fig, path)
