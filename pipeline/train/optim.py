"""Learning-rate groups, the LR schedule and how per-head losses combine into one.

Groups (each carries ``base_lr``; the schedule multiplies it every step):
- ``lora``: the backbone's LoRA weights. ``--lr``; DynaMo LR_B.
- ``heads_copied``: head weights initialised as copies of base weights. ``--lr x --head-lr-mult``;
  DynaMo LR_B (DynaMo trains copied weights at the low rate).
- ``heads_new``: freshly initialised head weights. ``--lr x --head-lr-mult``; DynaMo LR_M.
- ``base_head``: head 1's own final layer + final norm, only with ``--train-base-head``.
  ``--lr``; DynaMo LR_B (DynaMo trains "the base model" at LR_B). Otherwise head 1 stays the
  base model's path exactly, or adapts only through the LoRA on the final layer in joint modes.

Loss (per micro-batch, ``L_i`` = head i's mean cross-entropy, ``sg`` = stop-gradient):

    total = w_1 L_1 + s * (sum_{i>=2} w_i L_i + aux_weight * aux)

- ``w_i = 1`` by default. With ``--loss-balance rms`` (Mehra et al.: "rescale each head's loss to
  normalize the RMS losses to that of the first head, per batch"), ``w_i = sg(RMS_1 / RMS_i)``,
  the RMS taken over the batch's loss values of a head; one loss value per head per batch
  makes it ``w_i = sg(L_1 / L_i)``, so every head's term has head 1's magnitude while keeping
  its own gradient direction.
- ``s = LR_MB / LR_B`` under DynaMo while the backbone trains, else 1. DynaMo updates the
  backbone with LR_B for head 1's gradient and LR_MB for heads 2..n's. For plain SGD that is
  exactly ``LR_B * (g_1 + s g_{2..n})``; we apply that weighting inside one backward (AdamW then
  normalises the combined gradient). Head weights receive gradient only from heads 2..n and
  aux, so ``unscale_head_grads`` divides their gradients by ``s`` afterwards: heads see their
  own unscaled gradient and train at LR_M. (Requires head 1 to be the base path.)
"""

from __future__ import annotations

import math

import torch

from multitoken.base.errors import UsageError
from multitoken.pipeline.train.trainer_config import TrainConfig


def param_groups(model, cfg: TrainConfig) -> list[dict]:
    """AdamW groups for ``model`` (a MultiTokenModel) under ``cfg``. Empty groups are dropped."""
    heads = model.head_parameter_groups()  # {"copied": [...], "new": [...]}
    lora = model.lora_parameters() if cfg.uses_lora else []
    base_head = [p for p in model.base_head_parameters() if p.requires_grad] if cfg.train_base_head else []
    if cfg.dynamo:
        rates = {"lora": cfg.lr_b, "base_head": cfg.lr_b, "heads_copied": cfg.lr_b, "heads_new": cfg.lr_m}
    else:
        head_lr = cfg.lr * cfg.head_lr_mult
        rates = {"lora": cfg.lr, "base_head": cfg.lr, "heads_copied": head_lr, "heads_new": head_lr}
    params = {"lora": lora, "base_head": base_head, "heads_copied": heads["copied"], "heads_new": heads["new"]}
    groups = [
        {"name": name, "params": params[name], "lr": rates[name], "base_lr": rates[name], "weight_decay": cfg.weight_decay}
        for name in ("lora", "base_head", "heads_copied", "heads_new") if params[name]
    ]
    if not any(g["name"].startswith("heads") for g in groups) and not lora:
        raise UsageError("nothing to train: the heads have no trainable weights and no LoRA is on",
                         "attach heads with n >= 2, or use --mode joint")
    return groups


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Multiplier of every group's ``base_lr`` at 0-based ``step``: linear warm-up, then
    cosine to 0 at ``max_steps`` (both seeds use cosine annealing) or constant."""
    if step < cfg.lr_warmup_steps:
        return (step + 1) / cfg.lr_warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    span = max(cfg.max_steps - cfg.lr_warmup_steps, 1)
    progress = min((step - cfg.lr_warmup_steps) / span, 1.0)
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, factor: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = group["base_lr"] * factor


def stem_scale(cfg: TrainConfig, backbone_trains: bool) -> float:
    """``s`` above: LR_MB / LR_B while the backbone trains under DynaMo, else 1."""
    if cfg.dynamo and backbone_trains:
        return cfg.lr_mb / cfg.lr_b
    return 1.0


def combine_losses(out, cfg: TrainConfig, scale: float) -> torch.Tensor:
    """The scalar to backpropagate for one micro-batch (formula in the module docstring).
    Skipped (None) terms are constants without gradient: leaving them out changes no gradient."""
    losses = [None if l is None else l.float() for l in out.per_head]  # n x [] (or None)
    weights = [1.0] * len(losses)
    if cfg.loss_balance == "rms":
        ref = losses[0].detach()  # the trainer never skips a term under rms
        weights = [ref / l.detach().clamp_min(1e-8) for l in losses]
    device = next(l for l in losses if l is not None).device
    zero = torch.zeros((), device=device)
    total = zero if losses[0] is None else weights[0] * losses[0]
    rest = sum((w * l for w, l in zip(weights[1:], losses[1:]) if l is not None), zero)
    if out.aux is not None and cfg.aux_weight:
        rest = rest + cfg.aux_weight * out.aux.float()
    return total + scale * rest


def unscale_head_grads(groups: list[dict], scale: float) -> None:
    """Undo ``scale`` on head gradients (they only ever saw the scaled heads 2..n terms)."""
    if scale == 1.0:
        return
    for group in groups:
        if group["name"].startswith("heads"):
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.div_(scale)
