"""Logit-lens KL of every layer to the final distribution (Mehra et al. §3, Fig. 2).

Layer l's hidden state z^l_t goes through the model's own final norm and unembedding,
p_l = softmax(U norm(z^l_t)), and we average KL(p_l || p_L) over positions. Index 0 is the
embedding output, L the final layer (KL 0 by definition, kept so the curve ends at zero).
A model strongly specialised for next-token prediction reaches the final distribution late:
the curve stays high until the last layers (why frozen-backbone heads struggle, Mehra et al.).
"""

from __future__ import annotations

from pathlib import Path

import torch

from multitoken.pipeline.eval.metrics import kl_divergence
from multitoken.pipeline.eval.plotting import pyplot, save_figure


@torch.no_grad()
def lens_kl_sums(backbone, ids: torch.Tensor, chunk: int = 128) -> torch.Tensor:
    """Sum over positions of KL(p_l || p_L) for l = 0..L # ids [B, T] -> [L + 1] (float64)."""
    states = backbone.hidden_states(ids)  # L+1 x [B, T, H]; the last is already normed
    flat = [s.reshape(-1, s.shape[-1]) for s in states]  # L+1 x [N, H]
    sums = torch.zeros(len(flat), dtype=torch.float64)
    for start in range(0, flat[0].shape[0], chunk):
        final = torch.log_softmax(backbone.logits(flat[-1][start:start + chunk]).float(), -1)  # [C, V]
        for layer, h in enumerate(flat[:-1]):
            logp = torch.log_softmax(backbone.logits(backbone.final_norm(h[start:start + chunk])).float(), -1)
            sums[layer] += kl_divergence(logp, final).double().sum()
    return sums


def plot_lens(kl: list[float], path: str | Path, title: str = "") -> Path:
    """Line plot of mean KL per layer (log scale when every value is positive)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.2), dpi=120)
    ax.plot(range(len(kl)), kl, marker="o")
    ax.set_xlabel("layer (0 = embeddings)")
    ax.set_ylabel("KL(p_layer || p_final), nats")
    if all(v > 0 for v in kl[:-1]):
        ax.set_yscale("symlog", linthresh=1e-2)
    ax.set_title(title or "logit lens")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return save_figure(fig, path)
