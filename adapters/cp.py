"""Rank-r canonical-polyadic heads, "CP experts" (the CP-heads paper, eqs. 2-13).

    P(x_{t+1..t+n}) = sum_a w_a prod_s P_s(x_{t+s} | a)                         (eq. 2)
    P_s(. | a) = softmax(U f_{s,a}(e_t)),  w = softmax(W_h e_t)                (eqs. 6-7)

``e_t`` is the base model's final normalised hidden state, U the shared frozen unembedding and
f_{s,a}(e) = e + SiLU(W_{s,a} e + b_{s,a}) a small per-(head, expert) block. The loss is
eq. 9 in log space (logsumexp over experts). ``per_head[s]`` is its chain-rule term
-log P(x_{t+s} | x_{t+1..t+s-1}) (eqs. 11-13), so sum(per_head) == eq. 9 exactly. Head 1's
*output distribution* (``log_probs(0)``) is still the base model's: the experts' own first
factors P_1(. | a) exist to weight the experts by the first token (the posterior of eq. 12).
Rank 1 is the independent-heads model (eq. 1).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from .base import IGNORE, Features, HeadAdapter, LossOutput, head_dtype, shifted_targets
from .registry import register_head
from .unembed import counting, target_log_probs
from multitoken.base.errors import UsageError


MAX_RANK = 256  # experts per head a config may ask for


@dataclass
class CPConfig:
    head_type: str = "cp"
    n_future: int = field(default=3, metadata={"help": "tokens predicted per position"})
    rank: int = field(default=4, metadata={"help": "CP rank r: number of experts"})
    init_std: float = field(default=0.02, metadata={"help": "std of the expert blocks' initial weights (breaks expert symmetry)"})

    def validate(self) -> None:
        if not 1 <= self.rank <= MAX_RANK:  # each expert is a block per head: thousands never fit nor train
            raise UsageError(f"rank must be in [1, {MAX_RANK}], got {self.rank}", "the CP-heads paper's ranks are 1 to 16")
        if self.init_std < 0:
            raise UsageError(f"init_std must be >= 0, got {self.init_std}")


class CPHeads(HeadAdapter):
    supports_sequential_drafts = True  # conditional_log_probs: posterior over experts

    def __init__(self, config: CPConfig, backbone):
        super().__init__(config, backbone)
        n, r, width = config.n_future, config.rank, backbone.hidden_size
        dtype, device = head_dtype(backbone), backbone.device
        self.weight = nn.Parameter(torch.randn(n, r, width, width, dtype=dtype, device=device) * config.init_std)
        self.bias = nn.Parameter(torch.zeros(n, r, width, dtype=dtype, device=device))
        self.mixture = nn.Linear(width, r).to(device=device, dtype=dtype)
        nn.init.zeros_(self.mixture.weight)  # equal expert weights at the start: balanced
        nn.init.zeros_(self.mixture.bias)

    @property
    def rank(self) -> int:
        return self.config.rank

    # Factors --------------------------------------------------------------------------------
    def log_mixture(self, e: torch.Tensor) -> torch.Tensor:
        """log w = log_softmax(W_h e) # [..., H] -> [..., r]."""
        return torch.log_softmax(self.mixture(e).float(), dim=-1)

    def expert_log_probs(self, s: int, a: int, e: torch.Tensor) -> torch.Tensor:
        """log P_s(. | a) # [..., H] -> [..., V]."""
        return torch.log_softmax(self.backbone.logits(self.expert_hidden(s, a, e)).float(), dim=-1)

    def expert_hidden(self, s: int, a: int, e: torch.Tensor) -> torch.Tensor:
        """f_{s,a}(e) = e + SiLU(W_{s,a} e + b_{s,a}) # [..., H]."""
        return e + F.silu(F.linear(e, self.weight[s, a], self.bias[s, a]))

    def target_log_probs(self, e: torch.Tensor, x: torch.Tensor, chunk: int) -> torch.Tensor:
        """C[., s, a] = log P_s(x_s | a) for real targets # e [N, H], x [N, n] -> [N, n, r].
        Chunked through the frozen unembedding: only [chunk, V] logits live at a time."""
        unembed = self.backbone.unembedding
        out = [[target_log_probs(unembed, self.expert_hidden(s, a, e), x[:, s], chunk)[0]
                for a in range(self.rank)] for s in range(self.n_future)]
        return torch.stack([torch.stack(per_expert, -1) for per_expert in out], 1)

    # Distributions -----------------------------------------------------------------------------
    def log_probs(self, index: int, feats: Features, last_only: bool = False) -> torch.Tensor:
        """Head 1: the base distribution. Head s > 1: the CP marginal sum_a w_a P_s(. | a)."""
        e = feats.base[:, -1:] if last_only else feats.base  # [B, T, H]
        if index == 0:
            return torch.log_softmax(self.backbone.logits(e).float(), dim=-1)
        log_w = self.log_mixture(e)
        return self._mix(log_w, index, e)

    def _mix(self, log_weights: torch.Tensor, s: int, e: torch.Tensor) -> torch.Tensor:
        """log sum_a exp(log_weights_a) P_s(. | a) # [..., r] -> [..., V], one expert at a time."""
        out = None
        for a in range(self.rank):
            term = log_weights[..., a, None] + self.expert_log_probs(s, a, e)
            out = term if out is None else torch.logaddexp(out, term)
        return out

    def conditional_log_probs(self, e: torch.Tensor, prefix: torch.Tensor) -> torch.Tensor:
        """log P(x_{t+k+1} | x_{t+1..t+k}) for k = prefix length (eqs. 11-13): the experts are
        reweighted by how well each predicted the prefix # e [B, H], prefix [B, k] -> [B, V]."""
        log_w = self.log_mixture(e)  # [B, r]
        for s in range(prefix.shape[1]):
            hit = torch.stack([self.expert_log_probs(s, a, e).gather(-1, prefix[:, s, None]).squeeze(-1)
                               for a in range(self.rank)], -1)  # [B, r]
            log_w = log_w + hit
        return self._mix(torch.log_softmax(log_w, dim=-1), prefix.shape[1], e)

    # Training --------------------------------------------------------------------------------
    def loss(self, feats: Features, input_ids: torch.Tensor, valid: torch.Tensor, chunk: int,
             skip_constant: bool = False) -> LossOutput:
        # every term of eq. 9 depends on the trained experts: none is ever constant
        n = self.n_future
        tgts = torch.stack([shifted_targets(input_ids, valid, s + 1) for s in range(n)], -1)  # [B, T, n]
        keep = (tgts != IGNORE).all(-1)  # positions whose n future tokens all exist
        e, x = feats.base[keep], tgts[keep]  # [N, H], [N, n]
        count = max(e.shape[0], 1)
        log_w = self.log_mixture(e)  # [N, r]
        c = self.target_log_probs(e, x, chunk)  # [N, n, r]
        prefix = torch.logsumexp(log_w[:, None, :] + c.cumsum(1), dim=-1)  # [N, n]: log P(x_1..x_s), eq. 9
        cond = prefix - F.pad(prefix[:, :-1], (1, 0))  # [N, n]: log P(x_s | x_<s)
        per_head = [-cond[:, s].sum() / count for s in range(n)]
        aux, metrics = self._balance(log_w)
        metrics["cp/joint_nll"] = (-prefix[:, -1].sum() / count).item()
        metrics.update({f"head{s + 1}/loss": per_head[s].item() for s in range(n)})
        if not self.training and counting():
            metrics.update(self._accuracy(e, x, log_w, c, chunk))
        return LossOutput(per_head=per_head, aux=aux, metrics=metrics)

    def _balance(self, log_w: torch.Tensor):
        """Eq. 10 counts tokens by their argmax expert (not differentiable): logged. The trained
        surrogate replaces counts by mean soft weights: sum_a (mean_t w_a - 1/r)^2."""
        r = self.rank
        if log_w.shape[0] == 0:
            return log_w.sum() * 0, {"cp/aux_eq10": 0.0}
        w = log_w.exp()  # [N, r]
        surrogate = ((w.mean(0) - 1.0 / r) ** 2).sum()
        share = torch.bincount(w.argmax(-1), minlength=r).float() / w.shape[0]
        eq10 = ((share - 1.0 / r) ** 2).sum()
        return surrogate, {"cp/aux_eq10": eq10.item(), "cp/aux_surrogate": surrogate.item(), "cp/max_expert_share": share.max().item()}

    @torch.no_grad()
    def _accuracy(self, e, x, log_w, c, chunk) -> dict[str, float]:
        """Top-1/top-5 of head 1 (the base) and of the teacher-forced conditionals (eq. 13)."""
        n, count = self.n_future, max(e.shape[0], 1)
        hits = torch.zeros(n, 2)
        log_post = log_w[:, None, :] + F.pad(c.cumsum(1)[:, :-1], (0, 0, 1, 0))  # [N, n, r], unnormalised
        log_post = torch.log_softmax(log_post, dim=-1)
        for i in range(0, e.shape[0], chunk):
            ec, xc = e[i:i + chunk], x[i:i + chunk]
            for s in range(n):
                lp = torch.log_softmax(self.backbone.logits(ec).float(), -1) if s == 0 else self._mix(log_post[i:i + chunk, s], s, ec)
                top = lp.topk(min(5, lp.shape[-1]), -1).indices == xc[:, s, None]
                hits[s] += torch.tensor([top[:, 0].sum().item(), top.any(-1).sum().item()])
        out = {}
        for s in range(n):
            out[f"head{s + 1}/top1"], out[f"head{s + 1}/top5"] = (hits[s] / count).tolist()
        return out


register_head("cp", CPConfig, CPHeads)
