"""The recipe's training: several head types at once, heads only, on the distilled shards.

With the backbone frozen, every head type reads the same trunk pass, so one batch's trunk runs
once (without autograd) and each head set then takes its own loss, backward and AdamW step.
Under ``torchrun`` the ranks share each step's rows and average their gradients (gloo on the
CPU, NCCL on GPUs). The loss is each adapter's own (``HeadAdapter.loss``: cross-entropy of head i against token
t+i over the whole vocabulary, CP's mixture and aux loss where it applies); head 1 is the base
and is not trained. Learning rates warm up, then follow a cosine to zero over the planned steps;
a time budget shortens the plan once the first steps are timed, so the schedule still ends.
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch

from multitoken.adapters.base import Features, HeadAdapter
from multitoken.adapters.unembed import hits_counted
from multitoken.kernels import cpu_features


COMPUTE_DTYPES = ("auto", "float32", "bfloat16")
LOG_EVERY = 50  # steps between two progress records (the last step makes one too)


def resolve_dtype(device: torch.device, dtype: str) -> str:
    """``auto`` -> bfloat16 where it is native arithmetic (a CUDA GPU that has it; a CPU with
    AVX512-BF16 or AMX, cpu_features.py), else float32 (a CPU that would emulate it gains
    nothing); the others as given."""
    if dtype != "auto":
        return dtype
    if device.type == "cuda":
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float32"
    return "bfloat16" if device.type == "cpu" and cpu_features.features().native_bf16 else "float32"


def autocast(device: torch.device, dtype: str):
    """bfloat16 autocast where ``dtype`` (resolved: ``resolve_dtype``) asks for it, else nothing."""
    if resolve_dtype(device, dtype) != "bfloat16":
        return nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16)


def trunk_features(backbone, ids: torch.Tensor, collect: bool) -> Features:
    """The frozen trunk's pass over ``ids`` [B, T] -> Features ([B, T, H] each), no autograd."""
    with torch.no_grad():
        trunk = backbone.run_trunk(ids, collect=collect)
        base = backbone.final_norm(backbone.run_layer(backbone.layers[-1], trunk.hidden, trunk.ctx))  # [B, T, H]
    return Features(trunk=trunk.hidden, base=base, layer_states=trunk.layer_states, ctx=trunk.ctx)


@contextmanager
def trunk_in(backbone, dtype: str):
    """The frozen decoder layers' linear weights and the frozen unembedding held in bfloat16 while
    training runs under bfloat16 autocast (which would cast each of them again at every call: a
    copy of the whole trunk per step, and of the [V, H] unembedding per head and chunk), restored
    exactly after (the float32 tensors are kept); float32: as they are. An unembedding tied to the
    embedding gets a bf16 Parameter of its own for the while: the embedding's lookups keep float32."""
    if dtype != "bfloat16":
        yield
        return
    kept = [(m.weight, m.weight.data) for layer in backbone.layers for m in layer.modules()
            if type(m) is torch.nn.Linear and not m.weight.requires_grad and m.weight.dtype == torch.float32]
    head, original = backbone.unembedding, backbone.unembedding.weight
    frozen = type(head) is torch.nn.Linear and not original.requires_grad and original.dtype == torch.float32
    tied = frozen and any(p is original for p in backbone.embeddings.parameters())
    if frozen and not tied:
        kept.append((original, original.data))  # cast and restored with the layers' weights
    try:
        for weight, data in kept:
            weight.data = data.to(torch.bfloat16)
        if tied:
            head.weight = torch.nn.Parameter(original.detach().to(torch.bfloat16), requires_grad=False)
        yield
    finally:
        for weight, data in kept:
            weight.data = data
        if tied:
            head.weight = original


def lr_factor(step: int, total: int, warmup: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    frac = (step - warmup) / max(total - warmup, 1)
    return 0.5 * (1 + math.cos(math.pi * min(frac, 1.0)))


class HeadSet:
    """One head type under training: its model (sharing the backbone), optimizer and LR."""

    def __init__(self, name: str, model, lr: float, weight_decay: float = 0.0):
        self.name, self.model, self.lr = name, model, lr
        self.params = [p for p in model.heads.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=lr, weight_decay=weight_decay)
        model.heads.train()

    def backward(self, feats: Features, ids, valid, chunk: int, scale: float) -> dict:
        """This micro-batch's loss, its gradient (times ``scale``) added to the heads'."""
        if self.model.heads.needs_next_tokens:  # token t+1 from the text itself (teacher forcing)
            feats.next_ids = self.model.next_tokens(ids, feats.base)
        out = self.model.heads.loss(feats, ids, valid, chunk, skip_constant=True)
        loss = torch.stack([l.float() for l in out.per_head if l is not None]).sum()
        if out.aux is not None and hasattr(self.model.heads.config, "aux_weight"):
            loss = loss + self.model.heads.config.aux_weight * out.aux
        (loss * scale).backward()
        feats.next_ids = None
        return {k: round(v, 4) for k, v in out.metrics.items() if not k.startswith("head1/")}

    def update(self, factor: float, grad_clip: float, world: int) -> None:
        """Average the gradient over the ranks (their sum in rank order / world), clip, step."""
        if world > 1:
            import torch.distributed as tdist

            for p in self.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                tdist.all_reduce(p.grad)
                p.grad.div_(world)
        if grad_clip:
            torch.nn.utils.clip_grad_norm_(self.params, grad_clip)
        for g in self.opt.param_groups:
            g["lr"] = self.lr * factor
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


@dataclass
class Ranks:
    """This process's place among torchrun's (one process: rank 0 of 1)."""

    rank: int = 0
    world: int = 1

    def slice(self, rows: torch.Tensor) -> torch.Tensor:
        return rows[self.rank::self.world]

    def agree(self, value: int) -> int:
        """The smallest of every rank's ``value`` (a plan all ranks keep)."""
        if self.world == 1:
            return value
        import torch.distributed as tdist

        t = torch.tensor([value], dtype=torch.long)
        tdist.all_reduce(t, op=tdist.ReduceOp.MIN)
        return int(t)


def train_sets(backbone, sets: list[HeadSet], data: dict, *, epochs: float, batch_rows: int, warmup: int,
               seconds: float | None, dtype: str, chunk: int, grad_clip: float = 1.0, seed: int = 0,
               micro_batches: int = 1, ranks: Ranks | None = None, log=print) -> dict:
    """Train every head set on ``data`` (ids / valid [N, T]) for ``epochs`` passes or until
    ``seconds`` run out (timed over the first steps, then the plan is cut to fit). A step's
    ``batch_rows`` rows are shared by the ranks (rank r takes rows r, r + world, ...), each rank
    running its share in ``micro_batches`` parts whose gradients add up: one process with
    ``micro_batches`` = k computes what k ranks of one part each compute, in the same order."""
    ranks = ranks or Ranks()
    g = torch.Generator().manual_seed(seed)
    n_rows = data["ids"].shape[0]
    total = planned = max(int(epochs * n_rows / batch_rows), 1)
    collect = any(s.model.heads.needs_layer_states for s in sets)
    device = backbone.device
    order, at, step, history = torch.randperm(n_rows, generator=g), 0, 0, []
    started, cpu, mark = time.time(), time.process_time(), (time.time(), 0)
    with trunk_in(backbone, resolve_dtype(device, dtype)):  # its weights cast once, not at every linear
        while step < total:
            if at + batch_rows > n_rows:
                order, at = torch.randperm(n_rows, generator=g), 0
            mine = ranks.slice(order[at:at + batch_rows])
            at += batch_rows
            logged = (step + 1) % LOG_EVERY == 0 or step + 1 == total
            for part in range(micro_batches):
                rows = mine[part::micro_batches]
                ids = data["ids"][rows].to(device, non_blocking=True)  # [b, T]
                valid = data["valid"][rows].to(device, non_blocking=True)
                # hit rates (a [C, V] top-k per chunk) only where the record reads them: a logged
                # step's last part, whose metrics it keeps
                with autocast(device, dtype), hits_counted(logged and part == micro_batches - 1):
                    feats = trunk_features(backbone, ids, collect)
                    metrics = {s.name: s.backward(feats, ids, valid, chunk, 1.0 / micro_batches) for s in sets}
            factor = lr_factor(step, total, warmup)
            for s in sets:
                s.update(factor, grad_clip, ranks.world)
            step += 1
            if seconds is not None:
                total, mark = _fit(step, mark, started, seconds, planned, total, ranks)
            if step % LOG_EVERY == 0 or step == total:
                elapsed = time.time() - started
                rec = {"step": step, "of": total, "seconds": round(elapsed, 1), "eta_s": round(elapsed / step * (total - step)),
                       **{f"{name}/{k}": v for name, m in metrics.items() for k, v in m.items()}}
                history.append(rec)
                log(rec)
    for s in sets:
        s.model.heads.eval()
    tokens = step * batch_rows * data["ids"].shape[1]
    return {"steps": step, "planned_steps": planned, "epochs": round(step * batch_rows / n_rows, 3),
            "seconds": round(time.time() - started, 1), "cpu_seconds": round(time.process_time() - cpu, 2),
            "tokens_seen": tokens, "batch_rows": batch_rows, "compute_dtype": resolve_dtype(device, dtype),
            "processes": ranks.world, "history": history}


FIT_FIRST, FIT_EVERY = (5, 20), 100  # the time budget's plan made at step 20 from the pace since step 5 (warm-up
# left out), then remade every 100 steps from the pace since the last


def _fit(step: int, mark: tuple[float, int], started: float, seconds: float, planned: int, total: int,
         ranks: Ranks) -> tuple[int, tuple[float, int]]:
    """The plan cut to end inside ``seconds``: at step 20 and every ``FIT_EVERY`` steps, the
    steps that fit the time left at the pace since the last mark (never past ``planned``), the
    same on every rank. Returns (total, the new mark)."""
    if step not in FIT_FIRST and step % FIT_EVERY:
        return total, mark
    now = time.time()
    if step != FIT_FIRST[0]:
        per_step = (now - mark[0]) / (step - mark[1])
        left = max(int((seconds - (now - started)) / per_step), 1)
        total = ranks.agree(min(planned, step + left))
    return total, (now, step)


@torch.no_grad()
def rank_accuracy(backbone, model, data: dict, batch_rows: int, dtype: str, max_ranks: int) -> dict:
    """Every head's top-1 / top-5 over the whole vocabulary on ``data``, head 1 included, and
    the draft heads' accuracy per rank of their guesses (``rank_accuracy.json``'s counts).

    Head i (1-based) at position t is right at rank r when its r-th best token is the text's
    token t+i; on the recipe's held-out rows (the base's greedy continuations) that is the
    base's own token there. Heads with a distribution of their own (``log_probs`` overridden:
    CP's mixture, eagle3's drafter) are ranked by it; the others by their hidden state through
    the base's unembedding. For eagle3 this is the training-time test run as drafting: head
    i+1 is draft step i of a greedy chain started at t, step 1 fed token t+1 (the text's) and
    each later step the previous step's own top-1 (mapped to the base's ids), its keys those of
    step 1 at positions <= t and of its own earlier steps at t; ranks fall only inside the
    drafter's draft vocabulary (a token outside it is never a hit)."""
    W = backbone.unembedding.weight
    n = model.n_future
    ranks, counts = [[0] * max_ranks for _ in range(n)], [0] * n
    for start in range(0, data["ids"].shape[0], batch_rows):
        ids = data["ids"][start:start + batch_rows].to(backbone.device)
        valid = data["valid"][start:start + batch_rows].to(backbone.device)
        with autocast(backbone.device, dtype):
            feats = trunk_features(backbone, ids, model.heads.needs_layer_states)
            if model.heads.needs_next_tokens:
                feats.next_ids = model.next_tokens(ids, feats.base)
            for i in range(n):
                off = i + 1
                ok = valid[:, off:] & valid[:, :-off]  # [b, T - off]
                target = ids[:, off:][ok]  # [N]
                scores = _head_scores(model, i, feats, W, lambda x: x[:, :-off][ok])  # [N, V]
                best = scores.topk(max_ranks, dim=-1)  # [N, R]
                hits = ((best.indices == target[:, None]) & torch.isfinite(best.values)).sum(0).tolist()
                ranks[i] = [a + b for a, b in zip(ranks[i], hits)]
                counts[i] += int(target.numel())
    summary = {f"head{i + 1}/top1": round(ranks[i][0] / max(counts[i], 1), 4) for i in range(n)}
    summary.update({f"head{i + 1}/top5": round(sum(ranks[i][:5]) / max(counts[i], 1), 4) for i in range(n)})
    summary["positions"] = counts[0]
    return {"summary": summary, "ranks": ranks[1:], "counts": counts[1:]}


def _head_scores(model, i: int, feats: Features, W: torch.Tensor, pick) -> torch.Tensor:
    """Head ``i``'s scores over the whole vocabulary at the positions ``pick`` keeps # [b, T, ...]
    -> [N, ...]: -> [N, V] float (-inf: a token the head never drafts)."""
    heads = model.heads
    if type(heads).log_probs is not HeadAdapter.log_probs:  # a distribution of its own
        return pick(heads.log_probs(i, feats)).float()
    return pick(heads.hidden(i, feats)).float() @ W.float().T  # unembed the kept rows only
