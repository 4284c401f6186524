"""``evaluate``: multi-token metrics of a heads model on a text dataset (DESIGN "Evaluation").

The data is read and packed exactly as for training (``PackedStream``: documents joined by
EOS, cut into ``seq_len`` sequences, one pass, no loop). Parts, each timed separately:
- ``ppl``: PPL_n and top-1/top-5 per head, PPL_1:n (DynaMo eq. 4), expected acceptance
  length from per-head accuracies (formula and empirical chain);
- ``dynamic``: PPL_d and mean tokens per step for each eps_b (``dynamic_ppl``);
- ``marginal``: Mehra et al.'s marginalization baseline for token t+2 at one position every
  ``marginal_every`` tokens, with head 2 scored at the same positions;
- ``lens``: logit-lens KL per layer on the first ``lens_tokens`` tokens, plotted to a PNG.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

import torch

from multitoken.pipeline.eval import metrics as M
from multitoken.base.progress import progress_bar
from multitoken.base.errors import DataError, UsageError
from multitoken.base.packing import PackedStream
from multitoken.pipeline.eval.dynamic_ppl import DynamicPPL
from multitoken.pipeline.eval.headscores import logp_at, score_head
from multitoken.pipeline.eval.lens import lens_kl_sums
from multitoken.pipeline.eval.marginal import marginal_second_token
from multitoken.pipeline.eval.speedup import draft_cost_ratio, theory_from_tokens
from multitoken.pipeline.sources.assets import load_stats
from multitoken.decoding.config import DecodeConfig
from multitoken.decoding.config import stats_order_cap
from multitoken.decoding.trees import MAX_RANKS as RANKS, accuracy_record

PARTS = ("ppl", "dynamic", "marginal", "lens")
DEFAULT_PARTS = PARTS


@dataclass
class EvalConfig:
    """What to measure; the model is loaded apart (``BackboneConfig``)."""

    heads: str | None = field(default=None, metadata={"help": "heads dir, or embedded:NAME for one the package ships (default: the embedded trained heads)"})
    out: str | None = field(default=None, metadata={"help": "output directory for report.json, the lens PNG and the resolved config"})
    seq_len: int = field(default=256, metadata={"help": "tokens per packed sequence (as in training)"})
    batch_size: int = field(default=4, metadata={"help": "sequences per forward pass"})
    parts: tuple[str, ...] = field(default=DEFAULT_PARTS, metadata={"help": f"parts to run, among {', '.join(PARTS)}"})
    eps_b: tuple[float, ...] = field(default=(0.0, 0.25, 0.5, 0.75, 1.0), metadata={"help": "back-off thresholds for PPL_d"})
    stats: str | None = field(default=None, metadata={"help": "co-occurrence stats dir (or embedded:NAME) for PPL_d's masking (default: the embedded stats; none: no mask)"})
    dynamic_tokens: int = field(default=2048, metadata={"help": "tokens walked for PPL_d (each step builds a k^n grid)"})
    marginal_every: int = field(default=1000, metadata={"help": "one marginalization position every N tokens"})
    top_p: float = field(default=0.99, metadata={"help": "nucleus of token t+1 marginalized over (Mehra et al.: 0.99)"})
    max_candidates: int = field(default=256, metadata={"help": "cap on the nucleus size (the covered mass is reported)"})
    lens_tokens: int = field(default=4096, metadata={"help": "tokens used for the logit-lens KL"})
    quiet: bool = field(default=False, metadata={"help": "no progress bars (they go to stderr, and only when it is a terminal)"})
    beside_heads: bool = field(default=True, metadata={"help": (
        "also write rank_accuracy.json (each head's accuracy per rank of its guesses, which `generate --tree static` "
        "reads) into the heads dir; it always goes to --out")})

    def validate(self) -> None:
        bad = [p for p in self.parts if p not in PARTS]
        if bad:
            raise UsageError(f"unknown eval parts {bad}", f"choose among {', '.join(PARTS)}")
        if self.seq_len < 4 or self.batch_size < 1:
            raise UsageError("--seq-len must be >= 4 and --batch-size >= 1")
        if not 0 < self.top_p <= 1 or self.marginal_every < 1 or self.max_candidates < 1:
            raise UsageError("--top-p must be in (0, 1], --marginal-every and --max-candidates >= 1")
        if any(not 0 <= e <= 1 for e in self.eps_b):
            raise UsageError(f"--eps-b values must be in [0, 1], got {list(self.eps_b)}")
        for part, flag, value in (("dynamic", "dynamic-tokens", self.dynamic_tokens), ("lens", "lens-tokens", self.lens_tokens)):
            if part in self.parts and value < 1:  # 0 tokens: every metric of the part is 0/0
                raise UsageError(f"--{flag} must be >= 1, got {value}", f"pass a positive count, or leave {part} out of --parts")


class HeadAccumulator:
    """Running sums for PPL_n, top-k, PPL_1:k and the acceptance chain over batches."""

    def __init__(self, n: int):
        self.n = n
        self.nll = [0.0] * n  # head i: sum of -log p_i(x_{t+i})
        self.count = [0] * n
        self.hits = [{1: 0, 5: 0} for _ in range(n)]
        self.joint_nll = [0.0] * n  # k: sum over positions of -sum_{i<=k} log p_i(x_{t+i})
        self.joint_count = [0] * n  # k: positions where all k targets exist
        self.chain = [0] * n  # k: positions where heads 2..k+1 are all top-1 correct
        self._lp: list[torch.Tensor] = []
        self._top1: list[torch.Tensor] = []
        self.rank_hits: list[list[int]] = [[0] * RANKS for _ in range(n)]  # head i: target == its rank-r guess

    def add_head(self, i: int, sc) -> None:
        """Head i's (0-based) ``HeadScores`` for one batch."""
        self.nll[i] -= float(sc.lp.double().sum())
        self.count[i] += sc.lp.numel()
        self.hits[i][1] += int(sc.top1.sum())
        self.hits[i][5] += int(sc.top5.sum())
        self._lp.append(sc.lp)
        self._top1.append(sc.top1)
        if sc.rank_hits is not None:
            hits = sc.rank_hits.reshape(-1, sc.rank_hits.shape[-1]).sum(0).tolist()
            self.rank_hits[i] = [a + b for a, b in zip(self.rank_hits[i], hits + [0] * (RANKS - len(hits)))]

    def end_batch(self) -> None:
        """Joint terms need every head of the batch: PPL_1:k and the top-1 chain."""
        span = self._lp[-1].shape[1]  # T - n: positions where all n targets exist
        for k in range(self.n):
            cut = self._lp[0].shape[1] - k  # positions where k+1 targets exist
            joint = sum(lp[:, :cut].double() for lp in self._lp[: k + 1])
            self.joint_nll[k] -= float(joint.sum())
            self.joint_count[k] += joint.numel()
        ok = torch.ones_like(self._top1[0][:, :span])
        for k in range(1, self.n):
            ok = ok & self._top1[k][:, :span]
            self.chain[k] += int(ok.sum())
        self.chain[0] += self._top1[0][:, :span].numel()  # denominator: positions with all targets
        self._lp, self._top1 = [], []

    def report(self) -> dict:
        heads = []
        for i in range(self.n):
            c = self.count[i]
            heads.append({"head": i + 1, "ppl": M.perplexity(self.nll[i], c), "nll": self.nll[i] / c if c else float("nan"),
                          "top1": self.hits[i][1] / c if c else float("nan"), "top5": self.hits[i][5] / c if c else float("nan"),
                          "count": c})
        joint = {f"PPL_1:{k + 1}": M.perplexity(self.joint_nll[k], (k + 1) * self.joint_count[k]) for k in range(self.n)}
        draft_acc = [h["top1"] for h in heads[1:]]
        denom = max(self.chain[0], 1)
        empirical = [self.chain[k] / denom for k in range(1, self.n)]
        accept = {
            "draft_top1": draft_acc,
            "formula_with_base_token": M.expected_accept_length(draft_acc),
            "formula_without_base_token": M.expected_accept_length(draft_acc) - 1.0,
            "empirical_with_base_token": 1.0 + sum(empirical),
            "empirical_without_base_token": sum(empirical),
        }
        return {"heads": heads, "ppl_joint": joint, "accept_length": accept,
                "tree": accuracy_record(self.rank_hits[1:], self.count[1:])}


def _batches(cfg: EvalConfig, data_cfg, tokenizer, device):
    """Packed eval sequences, ``batch_size`` at a time # -> [B, seq_len] int64."""
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    stream = PackedStream(data_cfg, tokenizer, cfg.seq_len, eos, loop=False)
    rows = []
    for seq, _ in stream:
        rows.append(torch.as_tensor(seq))
        if len(rows) == cfg.batch_size:
            yield torch.stack(rows).to(device)
            rows = []
    if rows:
        yield torch.stack(rows).to(device)


class _Timer:
    """Wall seconds per part, and process CPU seconds (all threads) that other processes on a
    shared machine cannot inflate; with ``show``, one progress bar per part on stderr (tokens
    it has processed)."""

    def __init__(self, parts: tuple[str, ...] = (), total: int | None = None, show: bool = False, lens_tokens: int = 0):
    
        totals = {p: total for p in parts}
        if "lens" in totals:  # the lens reads only the first lens_tokens tokens
            totals["lens"] = min(total or lens_tokens, lens_tokens)

        self.seconds: dict[str, float] = {}
        self.cpu: dict[str, float] = {}
        self._cpu0 = 0.0
        self.bars = {p: progress_bar(total=totals[p], desc=f"eval {p:<8}", unit="tok", unit_scale=True, position=i,
                                     disable=not show, dynamic_ncols=True) for i, p in enumerate(parts)}

    def close(self) -> None:
        for bar in self.bars.values():
            bar.close()

    def start(self) -> float:
        self._cpu0 = time.process_time()
        return time.perf_counter()

    def add(self, part: str, start: float, tokens: int = 0) -> None:
        self.seconds[part] = self.seconds.get(part, 0.0) + time.perf_counter() - start
        self.cpu[part] = self.cpu.get(part, 0.0) + time.process_time() - self._cpu0
        if part in self.bars:
            self.bars[part].update(tokens)


@torch.no_grad()
def evaluate(model, cfg: EvalConfig, data_cfg) -> dict:
    """Run the selected parts over the data; returns the JSON-ready report."""
    show = not cfg.quiet and sys.stderr.isatty()  # bars on a terminal only, never on stdout
    acc, timer = HeadAccumulator(model.n_future), _Timer(cfg.parts, data_cfg.max_tokens, show, cfg.lens_tokens)
    try:
        return _evaluate(model, cfg, data_cfg, acc, timer)
    finally:
        timer.close()


def _evaluate(model, cfg: EvalConfig, data_cfg, acc: HeadAccumulator, timer: _Timer) -> dict:
    bb, n = model.backbone, model.n_future
    dyn = _dynamic_state(cfg, model) if "dynamic" in cfg.parts else None
    lens_sum, lens_count, marg = None, 0, _MarginalSums()
    tokens = sequences = 0
    for ids in _batches(cfg, data_cfg, bb.tokenizer, bb.device):  # [B, T]
        tokens, sequences = tokens + ids.numel(), sequences + ids.shape[0]
        start = timer.start()
        feats = model.features(ids)
        k = dyn.k if dyn is not None and not dyn.full else None
        for i in range(n):
            sc = score_head(model, i, feats, ids, k=k)
            acc.add_head(i, sc)
            if k is not None:
                dyn.add_head(i, sc)
        acc.end_batch()
        timer.add("ppl", start, ids.numel())
        if dyn is not None:
            start = timer.start()
            dyn.end_batch(ids)
            timer.add("dynamic", start, ids.numel())
        if "marginal" in cfg.parts:
            start = timer.start()
            marg.add(model, feats, ids, cfg, tokens - ids.numel())
            timer.add("marginal", start, ids.numel())
        if "lens" in cfg.parts and lens_count < cfg.lens_tokens:
            start = timer.start()
            take = max(1, min(ids.shape[0], -(-(cfg.lens_tokens - lens_count) // ids.shape[1])))
            sums = lens_kl_sums(bb, ids[:take])
            lens_sum = sums if lens_sum is None else lens_sum + sums
            lens_count += ids[:take].numel()
            timer.add("lens", start, ids[:take].numel())
    if sequences == 0:
        raise DataError(f"the data holds fewer than {cfg.seq_len} tokens: no evaluation sequence", "pass more data or a smaller --seq-len")
    report = {"tokens": tokens, "sequences": sequences, "n_future": n, **acc.report()}
    report["speedup_theory"] = theory_from_tokens(report["accept_length"]["empirical_with_base_token"], n - 1,
                                                  draft_cost_ratio(model))
    if dyn is not None:
        report["dynamic"] = dyn.report()
    if "marginal" in cfg.parts:
        report["marginal"] = marg.report(cfg)
    if lens_sum is not None:
        report["logit_lens"] = {"kl_per_layer": (lens_sum / lens_count).tolist(), "tokens": lens_count}
    report["seconds"] = {k: round(v, 3) for k, v in timer.seconds.items()}
    report["cpu_seconds"] = {k: round(v, 3) for k, v in timer.cpu.items()}
    return report


class _MarginalSums:
    """Marginal baseline vs head 2 on the same positions (one every ``marginal_every`` tokens)."""

    def __init__(self):
        self.nll = self.head_nll = 0.0
        self.hits = {1: 0, 5: 0}
        self.head_hits = {1: 0, 5: 0}
        self.count = 0
        self.size = self.mass = 0.0

    def add(self, model, feats, ids: torch.Tensor, cfg: EvalConfig, offset: int) -> None:
        for b in range(ids.shape[0]):
            first = offset + b * ids.shape[1]  # global index of this sequence's first token
            t0 = (-first) % cfg.marginal_every
            if t0 >= ids.shape[1] - 2:  # token t+2 must lie inside the sequence
                continue
            pos = torch.arange(t0, ids.shape[1] - 2, cfg.marginal_every, device=ids.device)  # [P]
            out = marginal_second_token(model.backbone, ids[b], pos, top_p=cfg.top_p, max_candidates=cfg.max_candidates,
                                        p1_logp=logp_at(model, 0, feats, b, pos))
            target = ids[b, pos + 2]  # [P]
            self._score(out.logq, target, self.hits, "nll")
            if model.n_future > 1:
                self._score(logp_at(model, 1, feats, b, pos), target, self.head_hits, "head_nll")
            self.count += pos.numel()
            self.size += float(out.nucleus_size.float().sum())
            self.mass += float(out.nucleus_mass.double().sum())

    def _score(self, logq: torch.Tensor, target: torch.Tensor, hits: dict, attr: str) -> None:
        setattr(self, attr, getattr(self, attr) - float(logq.gather(-1, target[:, None]).double().sum()))
        top = logq.topk(5, dim=-1).indices  # [P, 5]
        hits[1] += int((top[:, 0] == target).sum())
        hits[5] += int((top == target[:, None]).any(-1).sum())

    def report(self, cfg: EvalConfig) -> dict:
        c = max(self.count, 1)
        out = {"positions": self.count, "top_p": cfg.top_p, "max_candidates": cfg.max_candidates,
               "mean_nucleus_size": self.size / c, "mean_nucleus_mass": self.mass / c,
               "ppl_2": M.perplexity(self.nll, self.count), "top1": self.hits[1] / c, "top5": self.hits[5] / c}
        if self.head_nll:
            out["head2_same_positions"] = {"ppl_2": M.perplexity(self.head_nll, self.count),
                                           "top1": self.head_hits[1] / c, "top5": self.head_hits[5] / c}
        return out


def _dynamic_state(cfg: EvalConfig, model):
    table = load_stats(cfg.stats, model.backbone.tokenizer)
    decode = DecodeConfig(mode="dynamic")  # DynamicPPL's own settings: its k^n grid must fit
    decode.sampling.top_k = min(decode.sampling.top_k, model.backbone.vocab_size)
    decode.validate(vocab_size=model.backbone.vocab_size, n_heads=model.n_future,
                    max_order=stats_order_cap(decode, model.n_future, table, False))
    return DynamicPPL(cfg.eps_b, model, decode, table=table, budget=cfg.dynamic_tokens)
