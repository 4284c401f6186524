"""``TrainConfig``: every knob of ``multitoken train``, validated before anything is loaded.

Training modes (DESIGN "Training modes"; Mehra et al. and DynaMo):
- ``heads``: frozen backbone, the backbone pass runs without autograd; only new head weights train.
- ``joint``: LoRA on the backbone (peft; default q/k/v, rank 8 as in Mehra et al.) trained with the heads.
- ``warmup``: ``heads`` for ``--head-warmup-steps`` steps, then ``joint`` (Mehra et al.'s "head warmup").
Learning rates: ``--lr`` for LoRA, ``--lr x --head-lr-mult`` for heads (Mehra et al.'s "differential
LR": 4). DynaMo (App. A.1) instead sets three rates: ``--lr-b`` for the base path
(LoRA, and copy-initialised head weights, as DynaMo trains copies at LR_B), ``--lr-m`` for freshly
initialised head weights, and ``--lr-mb`` for the gradient that heads 2..n send into the backbone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from multitoken.base.config_io import nested
from multitoken.base.dtypes import DTYPES
from multitoken.base.errors import UsageError
from multitoken.base.threads import THREADS_BATCHES, threads_field
from multitoken.embedded import BASE_FORMS
from multitoken.pipeline.model.loading import BackboneConfig

MODES = ("heads", "joint", "warmup")
SCHEDULES = ("cosine", "constant")
BALANCES = ("none", "rms")
SEPARATORS = ("eos", "bos")
SAVE_EVERY_MINUTES = 5.0  # a killed run with the defaults loses at most this much work
# Learning rates where float32 training arithmetic stays meaningful: AdamW moves each weight by
# about the rate per step, so past MAX_LR a few steps overflow the products (all-NaN heads), and
# below MIN_LR an update is under float32's resolution of a typical weight (it changes nothing).
MIN_LR, MAX_LR = 1e-10, 10.0
MAX_AUX_WEIGHT = 1e3  # the aux loss is O(1): a larger weight only drowns the heads' own loss


# The base-model flags as training reads them: base and dtype default to the heads dir's record.
BACKBONE_HELP = {
    "base": {"help": f"the base model: {BASE_FORMS} (default: the one recorded in the heads dir)"},
    "dtype": {"help": "backbone weights dtype (default: the one recorded in the heads dir)", "choices": tuple(DTYPES)},
    "device": {"help": "torch device (under torchrun, cuda picks cuda:LOCAL_RANK)"},
    "threads": threads_field(THREADS_BATCHES).metadata,
}


@dataclass
class TrainConfig:
    heads: str | None = field(default=None, metadata={"help": "heads dir to start from (made by `multitoken attach`, a trained one, or embedded:NAME)"})
    out: str | None = field(default=None, metadata={"help": "output heads dir (replaced atomically at the end)"})
    backbone: BackboneConfig = nested(BackboneConfig, help=BACKBONE_HELP, base=None, dtype=None)
    eval_data: str | None = field(default=None, metadata={"help": "held-out data spec (default: the first --eval-batches batches of --data, skipped by training)"})
    separator: str = field(default="eos", metadata={"help": "token joining packed documents", "choices": SEPARATORS})
    mode: str = field(default="heads", metadata={"help": "heads (frozen backbone) | joint (LoRA + heads) | warmup (heads, then joint)", "choices": MODES})
    head_warmup_steps: int = field(default=0, metadata={"help": "steps of heads-only training before joint (mode warmup)"})
    train_base_head: bool = field(default=False, metadata={"help": "also train head 1's own final layer (full weights; DynaMo trains it at LR_B). Head 1 then no longer equals the base model"})
    lora_r: int = field(default=8, metadata={"help": "LoRA rank"})
    lora_alpha: int = field(default=16, metadata={"help": "LoRA alpha"})
    lora_dropout: float = field(default=0.0, metadata={"help": "LoRA dropout"})
    lora_targets: tuple[str, ...] | None = field(default=None, metadata={"help": "LoRA target modules (default: the architecture's q/k/v)"})
    max_steps: int = field(default=1000, metadata={"help": "optimizer steps"})
    seq_len: int = field(default=256, metadata={"help": "tokens per packed sequence"})
    batch_size: int = field(default=8, metadata={"help": "sequences per micro-batch per process"})
    grad_accum: int = field(default=1, metadata={"help": "micro-batches per optimizer step"})
    lr: float = field(default=1e-4, metadata={"help": "learning rate (LoRA; heads get lr x head-lr-mult)"})
    head_lr_mult: float = field(default=1.0, metadata={"help": "head LR multiplier (Mehra et al.'s differential LR: 4)"})
    lr_b: float | None = field(default=None, metadata={"help": "DynaMo LR_B: base path (LoRA, copied head weights)"})
    lr_m: float | None = field(default=None, metadata={"help": "DynaMo LR_M: newly initialised head weights"})
    lr_mb: float | None = field(default=None, metadata={"help": "DynaMo LR_MB: heads 2..n's gradient into the backbone"})
    schedule: str = field(default="cosine", metadata={"help": "LR schedule after warm-up", "choices": SCHEDULES})
    lr_warmup_steps: int = field(default=0, metadata={"help": "linear LR warm-up steps"})
    weight_decay: float = field(default=0.01, metadata={"help": "AdamW weight decay"})
    grad_clip: float = field(default=1.0, metadata={"help": "clip the global grad norm (0: off)"})
    loss_balance: str = field(default="none", metadata={"help": "rms: rescale each head's loss to head 1's RMS (Mehra et al.)", "choices": BALANCES})
    aux_weight: float = field(default=0.01, metadata={"help": "weight of the adapter's aux loss (CP balancing)"})
    eval_every: int = field(default=200, metadata={"help": "evaluate every N steps (0: only at the end)"})
    eval_batches: int = field(default=4, metadata={"help": "held-out batches per evaluation"})
    save_every: int = field(default=500, metadata={"help": "checkpoint every N steps (0: only at the end)"})
    save_every_minutes: float = field(default=SAVE_EVERY_MINUTES, metadata={"help": "also checkpoint when this many minutes passed since the last checkpoint, so a killed run loses at most that much (0: steps only)"})
    keep_checkpoints: int = field(default=2, metadata={"help": "checkpoints kept"})
    checkpoint_dir: str | None = field(default=None, metadata={"help": "checkpoint directory (default: OUT.checkpoints beside --out)"})
    resume: bool = field(default=False, metadata={"help": "resume from the latest checkpoint"})
    draft_vocab: int = field(default=8192, metadata={"help": (
        "write draft_vocab.json beside the heads: the training data's tokens by frequency; layer heads' drafts then "
        "score only the first N when decoding (FR-Spec; generate --draft-vocab overrides; 0: write none)")})
    seed: int = field(default=0, metadata={"help": "random seed"})
    progress: bool = field(default=True, metadata={"help": "show a progress bar"})

    @property
    def dynamo(self) -> bool:
        return any(v is not None for v in (self.lr_b, self.lr_m, self.lr_mb))

    @property
    def uses_lora(self) -> bool:
        return self.mode in ("joint", "warmup")

    def ckpt_dir(self) -> Path:
        if self.checkpoint_dir:
            return Path(self.checkpoint_dir)
        out = Path(self.out)
        return out.with_name(out.name + ".checkpoints")

    def lora_trains_at(self, step: int) -> bool:
        """Is the backbone's LoRA trained at (0-based) optimizer step ``step``?"""
        return self.mode == "joint" or (self.mode == "warmup" and step >= self.head_warmup_steps)


def validate(cfg: TrainConfig) -> None:
    """Cheap checks of the flags alone (files are checked when loaded)."""
    if not cfg.heads:
        raise UsageError("no heads dir given", "pass --heads DIR (create one with `multitoken attach`)")
    if not cfg.out:
        raise UsageError("no output dir given", "pass --out DIR")
    if not Path(cfg.heads).is_dir():
        raise UsageError(f"heads dir {cfg.heads!r} does not exist", "create one with `multitoken attach`")
    if Path(cfg.out).exists() and not Path(cfg.out).is_dir():
        raise UsageError(f"--out {cfg.out!r} exists and is not a directory")
    positive = {"max-steps": cfg.max_steps, "seq-len": cfg.seq_len, "batch-size": cfg.batch_size,
                "grad-accum": cfg.grad_accum, "eval-batches": cfg.eval_batches, "keep-checkpoints": cfg.keep_checkpoints}
    for name, value in positive.items():
        if value < 1:
            raise UsageError(f"--{name} must be >= 1, got {value}")
    if cfg.seq_len < 2:
        raise UsageError(f"--seq-len must be >= 2, got {cfg.seq_len}")
    for name, value in {"eval-every": cfg.eval_every, "save-every": cfg.save_every, "save-every-minutes": cfg.save_every_minutes,
                        "lr-warmup-steps": cfg.lr_warmup_steps, "draft-vocab": cfg.draft_vocab,
                        "head-warmup-steps": cfg.head_warmup_steps, "lora-r": cfg.lora_r - 1}.items():
        if value < 0:
            raise UsageError(f"--{name} must be >= {1 if name == 'lora-r' else 0}")
    _validate_rates(cfg)
    if not 0 <= cfg.seed <= 2**63 - 1:
        raise UsageError(f"--seed must be in [0, 2**63 - 1], got {cfg.seed}", "pass a non-negative seed, e.g. --seed 0")
    if cfg.mode == "warmup" and not 0 < cfg.head_warmup_steps < cfg.max_steps:
        raise UsageError("mode warmup needs 0 < --head-warmup-steps < --max-steps",
                         f"got --head-warmup-steps {cfg.head_warmup_steps} with --max-steps {cfg.max_steps}")
    if cfg.train_base_head and cfg.backbone.quantization:
        raise UsageError("--train-base-head needs float weights", "drop --quantization or --train-base-head")
    if cfg.mode != "warmup" and cfg.head_warmup_steps:
        raise UsageError("--head-warmup-steps only applies to --mode warmup")


def _validate_rates(cfg: TrainConfig) -> None:
    if cfg.dynamo:
        if None in (cfg.lr_b, cfg.lr_m, cfg.lr_mb):
            raise UsageError("DynaMo learning rates come as a set", "pass all of --lr-b, --lr-m and --lr-mb")
        if min(cfg.lr_b, cfg.lr_m, cfg.lr_mb) <= 0:
            raise UsageError("--lr-b, --lr-m and --lr-mb must be > 0")
        if cfg.head_lr_mult != 1.0:
            raise UsageError("--head-lr-mult and the DynaMo rates are alternatives", "pass one or the other")
    import math

    floats = {"lr": cfg.lr, "head-lr-mult": cfg.head_lr_mult, "lr-b": cfg.lr_b, "lr-m": cfg.lr_m, "lr-mb": cfg.lr_mb,
              "weight-decay": cfg.weight_decay, "grad-clip": cfg.grad_clip, "aux-weight": cfg.aux_weight,
              "lora-dropout": cfg.lora_dropout, "save-every-minutes": cfg.save_every_minutes}
    for name, value in floats.items():
        if value is not None and not math.isfinite(value):  # an inf rate trains all-NaN heads
            raise UsageError(f"--{name} must be a finite number, got {value}")
    if cfg.lr <= 0 or cfg.head_lr_mult <= 0:
        raise UsageError(f"--lr and --head-lr-mult must be > 0, got {cfg.lr} and {cfg.head_lr_mult}")
    if cfg.weight_decay < 0 or cfg.grad_clip < 0 or cfg.aux_weight < 0:
        raise UsageError("--weight-decay, --grad-clip and --aux-weight must be >= 0")
    _check_rate_range(cfg)
    if cfg.aux_weight > MAX_AUX_WEIGHT:
        raise UsageError(f"--aux-weight must be <= {MAX_AUX_WEIGHT:g}, got {cfg.aux_weight:g}", "the CP papers use 0.01 to 1")


def _check_rate_range(cfg: TrainConfig) -> None:
    """Every rate AdamW applies within [MIN_LR, MAX_LR], and the decay factor 1 - rate x decay
    positive (at 1 or more it flips or grows every weight each step)."""
    rates = ({"--lr-b": cfg.lr_b, "--lr-m": cfg.lr_m, "--lr-mb": cfg.lr_mb} if cfg.dynamo
             else {"--lr": cfg.lr, "--lr x --head-lr-mult": cfg.lr * cfg.head_lr_mult})
    for name, rate in rates.items():
        if not MIN_LR <= rate <= MAX_LR:
            raise UsageError(f"{name} must be in [{MIN_LR:g}, {MAX_LR:g}] (where float32 training stays finite and moves), got {rate:g}",
                             "AdamW rates are typically 1e-5 to 1e-3")
    top = max(v for k, v in rates.items() if k != "--lr-mb")  # lr-mb scales a gradient, not a weight update
    if top * cfg.weight_decay >= 1:
        raise UsageError(f"the learning rate {top:g} x --weight-decay {cfg.weight_decay:g} must be < 1 "
                         "(AdamW multiplies every weight by 1 - rate x decay each step)", "lower --weight-decay, e.g. 0.01")
    if not 0 <= cfg.lora_dropout < 1:
        raise UsageError(f"--lora-dropout must be in [0, 1), got {cfg.lora_dropout}")
