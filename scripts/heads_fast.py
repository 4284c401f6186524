"""Heads-only training on tapped trunk states (``heads_corpus.py``), for bases where a trunk
pass per step is the cost that matters (a 135M model on a CPU).

With the backbone frozen, a heads-only step computes the same trunk output for the same text
every epoch; here it is read from the corpus file instead. The loss is the heads' cross-entropy
for token t+i+1 (head i, 0-based; head 1 is the frozen base and is not trained). The softmax
runs over the training corpus's own vocabulary (``--vocab corpus``): the unembedding of the
2 x 49k-token heads is ~85% of a step's arithmetic on SmolLM2, and tokens the corpus never holds
are never a target there; held-out accuracy is always measured over the full vocabulary.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from multitoken.adapters.base import Features


@dataclass
class FastTrainConfig:
    epochs: float = 2.0
    batch_rows: int = 16
    lr: float = 5e-4
    warmup_steps: int = 20
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    vocab: str = "corpus"  # corpus | full
    seed: int = 0


def features(model, data: dict, rows: torch.Tensor) -> Features:
    """The heads' inputs for ``rows`` of the tapped corpus (float, on the model's device)."""
    bb = model.backbone
    trunk = data["trunk"][rows].to(bb.device, torch.float32)  # [b, T, H]
    base = data["base"][rows].to(bb.device, torch.float32)  # [b, T, H]
    # heads that read token t+1: the text's own (teacher forcing), as ``model.features`` gives it
    next_ids = model.next_tokens(data["ids"][rows].to(bb.device), base) if model.heads.needs_next_tokens else None
    return Features(trunk=trunk, base=base, layer_states=(), ctx=bb.layer_context(trunk), next_ids=next_ids)


def head_targets(ids: torch.Tensor, valid: torch.Tensor, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat (position index, target id) pairs for a head predicting token t+offset."""
    ok = valid[:, offset:] & valid[:, :-offset]  # [b, T - offset]
    pos = ok.nonzero()  # [N, 2]
    flat = pos[:, 0] * ids.shape[1] + pos[:, 1]
    return flat, ids[:, offset:][ok]


def head_rows(model, feats: Features, ids, valid, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Head ``index``'s hidden states where it has a target, and those targets # [N, H], [N]."""
    hidden = model.heads.hidden(index, feats)  # [b, T, H]
    flat, target = head_targets(ids, valid, index + 1)
    h = hidden.reshape(-1, hidden.shape[-1]).index_select(0, flat.to(hidden.device))  # [N, H]
    return h, target.to(hidden.device)


def head_loss(model, feats: Features, ids, valid, index: int, weight: torch.Tensor, remap: torch.Tensor | None):
    """Mean CE and top-1 hits of head ``index`` against ``weight`` (the unembedding rows the
    softmax runs over; ``remap`` maps a vocabulary id to its row, None for the full table)."""
    h, target = head_rows(model, feats, ids, valid, index)
    logits = h @ weight.T  # [N, V']
    if remap is not None:
        target = remap[target]
    return F.cross_entropy(logits, target), (logits.argmax(-1) == target).sum().item(), int(target.numel())


def corpus_vocab(data: dict, V: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ids the corpus holds, and a map id -> row of the restricted table (-1: absent)."""
    vocab = torch.unique(data["ids"][data["valid"]])
    remap = torch.full((V,), -1, dtype=torch.long)
    remap[vocab] = torch.arange(len(vocab))
    return vocab, remap


def lr_at(step: int, total: int, cfg: FastTrainConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    frac = (step - cfg.warmup_steps) / max(total - cfg.warmup_steps, 1)
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0)))


def train(model, data: dict, cfg: FastTrainConfig, log=print) -> dict:
    torch.manual_seed(cfg.seed)
    W = model.backbone.unembedding.weight.detach().float()  # [V, H]
    vocab, remap = corpus_vocab(data, W.shape[0]) if cfg.vocab == "corpus" else (None, None)
    weight = W if vocab is None else W[vocab.to(W.device)]
    remap = None if remap is None else remap.to(W.device)
    params = [p for p in model.heads.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    n_rows = data["ids"].shape[0]
    total = max(int(cfg.epochs * n_rows / cfg.batch_rows), 1)
    model.heads.train()
    started, history = time.time(), []
    order = torch.randperm(n_rows)
    for step in range(total):
        at = (step * cfg.batch_rows) % n_rows
        if at + cfg.batch_rows > n_rows:
            order, at = torch.randperm(n_rows), 0
        rows = order[at:at + cfg.batch_rows]
        feats = features(model, data, rows)
        ids, valid = data["ids"][rows], data["valid"][rows]
        losses = [head_loss(model, feats, ids, valid, i, weight, remap) for i in range(1, model.n_future)]
        loss = torch.stack([l for l, _, _ in losses]).sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.grad_clip:
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, total, cfg)
        opt.step()
        if step % 10 == 0 or step == total - 1:
            rec = {"step": step, "of": total, "seconds": round(time.time() - started, 1),
                   **{f"head{i + 2}/loss": round(l.item(), 4) for i, (l, _, _) in enumerate(losses)},
                   **{f"head{i + 2}/top1": round(h / max(n, 1), 4) for i, (_, h, n) in enumerate(losses)}}
            history.append(rec)
            log(rec)
    model.heads.eval()
    return {"steps": total, "seconds": round(time.time() - started, 1), "vocab": "full" if vocab is None else int(len(vocab)),
            "tokens_seen": total * cfg.batch_rows * data["ids"].shape[1], "history": history}


@torch.no_grad()
def accuracy(model, data: dict, batch_rows: int = 16) -> dict:
    """Every head's top-1 / top-5 (full vocabulary) on a tapped corpus, head 1 included, and
    the draft heads' accuracy per rank of their guesses (``rank_accuracy.json``'s record)."""
    from multitoken.decoding.trees import MAX_RANKS, accuracy_record

    W = model.backbone.unembedding.weight.detach().float()
    n = model.n_future
    ranks = [[0] * MAX_RANKS for _ in range(n)]
    counts = [0] * n
    for start in range(0, data["ids"].shape[0], batch_rows):
        rows = torch.arange(start, min(start + batch_rows, data["ids"].shape[0]))
        feats = features(model, data, rows)
        ids, valid = data["ids"][rows], data["valid"][rows]
        for i in range(n):
            h, target = head_rows(model, feats, ids, valid, i)
            top = (h @ W.T).topk(MAX_RANKS, dim=-1).indices  # [N, R]
            hits = (top == target[:, None]).sum(0).tolist()
            ranks[i] = [a + b for a, b in zip(ranks[i], hits)]
            counts[i] += int(target.numel())
    out = {f"head{i + 1}/top1": round(ranks[i][0] / max(counts[i], 1), 4) for i in range(n)}
    out.update({f"head{i + 1}/top5": round(sum(ranks[i][:5]) / max(counts[i], 1), 4) for i in range(n)})
    out["positions"] = counts[0]
    return {"summary": out, "rank_accuracy": accuracy_record(ranks[1:], counts[1:])}


def save_bf16(src, dest) -> None:
    """Copy a heads dir with its tensors in bfloat16 (what ships: half the bytes; heads load
    into the base's dtype), its config's dtypes and checksum updated to match."""
    import hashlib
    import json
    import shutil
    from pathlib import Path

    from safetensors.torch import load_file, save

    src, dest = Path(src), Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.to(torch.bfloat16).contiguous() for k, v in load_file(src / "heads.safetensors").items()}
    blob = save(tensors, metadata={"format": "pt"})
    record = json.loads((src / "heads_config.json").read_text())
    record["dtypes"] = {k: "bfloat16" for k in tensors}
    record["heads_sha256"] = hashlib.sha256(blob).hexdigest()
    (dest / "heads.safetensors").write_bytes(blob)
    (dest / "heads_config.json").write_text(json.dumps(record, indent=2) + "\n")
    for extra in ("rank_accuracy.json", "draft_vocab.json"):
        if (src / extra).is_file():
            shutil.copy(src / extra, dest / extra)
