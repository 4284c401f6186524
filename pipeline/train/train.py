"""``multitoken train``: train a heads dir on a dataset, resumably, on one or several processes.

One optimizer step = ``grad_accum`` micro-batches of ``batch_size`` packed sequences per process.
Under ``torchrun`` (gloo on CPU, nccl on GPU) every rank reads the same global sequence stream
and takes its own slice of each step's rows, so the data position is one value for the whole
job; gradients are averaged by DDP. Rank 0 evaluates, checkpoints and writes the output, which
is built in a hidden staging directory and moved over ``--out`` only once complete.
"""

from __future__ import annotations

import json
import os
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from multitoken.pipeline.train import optim
from multitoken.pipeline.train.checkpoint import list_checkpoints, load_checkpoint, save_checkpoint
from multitoken.pipeline.train.fingerprint import already_finished, check_same_run, holds_finished, run_fingerprint
from multitoken.base.progress import progress_bar
from multitoken.base.data import DataConfig, describe_files
from multitoken.base.errors import CheckpointError, DataError, DivergedError, UsageError
from multitoken.base.finite import describe, non_finite
from multitoken.base.packing import PackedStream, PackPosition, take_sequences
from multitoken.pipeline.train.trainer_config import TrainConfig, validate
from multitoken.base.config_io import resolved_config_text
from multitoken.pipeline.model.loading import LoraSpec, load_backbone
from multitoken.pipeline.model.draft_vocab import DRAFT_VOCAB_FILE
from multitoken.pipeline.train.draft_ranking import draft_vocab_text, set_drafter_vocab
from multitoken.pipeline.model.heads_io import read_heads_config
from multitoken.pipeline.model.model import MultiTokenModel


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0


def init_distributed(cfg: TrainConfig) -> Dist:
    """Join the torchrun process group when launched by torchrun (WORLD_SIZE > 1)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Dist()
    import torch.distributed as tdist

    if cfg.backbone.device.startswith("cuda"):  # one GPU per process, as NCCL expects
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not tdist.is_initialized():
        tdist.init_process_group("nccl" if cfg.backbone.device.startswith("cuda") else "gloo")
    return Dist(tdist.get_rank(), tdist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")))


def _device(cfg: TrainConfig, dist: Dist) -> str:
    if cfg.backbone.device == "cuda" and dist.world > 1:
        return f"cuda:{dist.local_rank}"
    return cfg.backbone.device


# Model ----------------------------------------------------------------------------------
def load_trainable_model(cfg: TrainConfig, dist: Dist):
    """The heads of ``cfg.heads`` on their base, with a trainable LoRA in joint modes (what
    training needs on top of ``sources.assets.load_model``, the loader of every other command)."""
    record = read_heads_config(cfg.heads)
    if any(k.startswith("base_head.") for k in record["shapes"]) and not cfg.train_base_head:
        # Saving frozen heads would drop the trained final layer (only trained weights are saved).
        raise UsageError(f"the heads in {cfg.heads!r} carry a trained final layer (head 1)",
                         "pass --train-base-head to keep training it")
    base = cfg.backbone.base or record["base"]  # load_backbone resolves embedded:NAME
    dtype = cfg.backbone.dtype or record.get("dtype") or "float32"
    bb_cfg = replace(cfg.backbone, base=base, dtype=dtype, device=_device(cfg, dist))
    lora_kwargs: dict = {}
    if record.get("lora"):  # continue training (or keep using) the LoRA saved with the heads
        lora_kwargs = {"lora_adapter": str(Path(cfg.heads) / record["lora"]), "trainable_lora": cfg.uses_lora}
    elif cfg.uses_lora:
        spec = LoraSpec(r=cfg.lora_r, alpha=cfg.lora_alpha, dropout=cfg.lora_dropout, target_modules=cfg.lora_targets)
        lora_kwargs = {"lora": spec, "trainable_lora": True}
    backbone = load_backbone(bb_cfg, **lora_kwargs)
    model = MultiTokenModel.from_pretrained(backbone, cfg.heads)
    if cfg.dynamo and not model.heads.head1_is_base:
        raise UsageError("DynaMo rates need head 1 to be the base path", "use --lr/--head-lr-mult with this head variant")
    return model


def set_backbone_trainable(model, trainable: bool) -> None:
    """Switch LoRA training on or off (head warm-up); frozen LoRA means no backbone autograd."""
    for p in model.lora_parameters():
        p.requires_grad_(trainable)


# Data -----------------------------------------------------------------------------------
def _separator(tokenizer, cfg: TrainConfig) -> int:
    tok_id = tokenizer.bos_token_id if cfg.separator == "bos" else tokenizer.eos_token_id
    if tok_id is None:
        raise UsageError(f"the tokenizer has no {cfg.separator.upper()} token to join documents with",
                         f"pass --separator {'eos' if cfg.separator == 'bos' else 'bos'}")
    return int(tok_id)


def make_streams(cfg: TrainConfig, data: DataConfig, model, position: dict | None):
    """(train stream iterator, eval batches # list of [B, T] arrays, epoch start)."""
    tok = model.backbone.tokenizer
    sep, vocab = _separator(tok, cfg), model.backbone.vocab_size
    n_eval = cfg.eval_batches * cfg.batch_size
    if cfg.eval_data:
        eval_cfg = DataConfig(data=cfg.eval_data, split=data.split, column=data.column)
        eval_it = iter(PackedStream(eval_cfg, tok, cfg.seq_len, sep, vocab_size=vocab, loop=False))
        rows = [s for s, _ in (next(eval_it, (None, None)) for _ in range(n_eval)) if s is not None]
        if not rows:
            raise DataError(f"--eval-data {cfg.eval_data!r} holds fewer than {cfg.seq_len} tokens")
        epoch_start = PackPosition()
    else:  # hold out the head of the training stream
        head = iter(PackedStream(data, tok, cfg.seq_len, sep, vocab_size=vocab, loop=False))
        rows, epoch_start = [], PackPosition()
        for seq, pos in head:
            rows.append(seq)
            epoch_start = pos
            if len(rows) == n_eval:
                break
        if len(rows) < n_eval:
            raise DataError(f"the data holds fewer than {n_eval + 1} sequences of {cfg.seq_len} tokens",
                             "pass more data, --eval-data, or fewer --eval-batches")
    eval_batches = [np.stack(rows[i:i + cfg.batch_size]) for i in range(0, len(rows), cfg.batch_size)]
    start = PackPosition.from_dict(position) if position else epoch_start
    stream = PackedStream(data, tok, cfg.seq_len, sep, vocab_size=vocab, position=start, epoch_start=epoch_start)
    return iter(stream), eval_batches, epoch_start


@torch.no_grad()
def evaluate(model, batches: list[np.ndarray]) -> dict[str, float]:
    """Per-head loss and top-1/top-5 accuracy, averaged over equally sized batches."""
    was_training = model.training
    model.train(False)
    sums: dict[str, float] = {}
    for rows in batches:
        out = model.compute_loss(torch.from_numpy(rows).to(model.backbone.device))
        for k, v in out.metrics.items():
            sums[k] = sums.get(k, 0.0) + float(v)
    model.train(was_training)
    return {k: v / len(batches) for k, v in sums.items()}


# Loop -----------------------------------------------------------------------------------
class Runner:
    """The model as the step sees it: wrapped in DDP when several processes train."""

    def __init__(self, model, dist: Dist):
        self.model, self.dist, self.ddp = model, dist, None
        self.rewrap()

    def rewrap(self) -> None:
        """(Re)build DDP over the currently trainable weights (after a warm-up switch)."""
        if self.dist.world == 1:
            return
        from torch.nn.parallel import DistributedDataParallel

        # Ranks load identical weights from disk and seed identically: no initial broadcast
        # (it would also touch quantized base weights, which gloo cannot send).
        self.ddp = DistributedDataParallel(self.model, init_sync=False, forward_sync_buffers=False)

    def __call__(self, ids, **kwargs):
        return (self.ddp or self.model)(ids, **kwargs)

    def no_sync(self, last: bool):
        return self.ddp.no_sync() if (self.ddp is not None and not last) else nullcontext()


def train_step(runner: Runner, optimizer, rows: np.ndarray, cfg: TrainConfig, step: int) -> dict[str, float]:
    """One optimizer step on this rank's rows # [grad_accum * B, T]."""
    model = runner.model
    backbone_trains = any(p.requires_grad for p in model.lora_parameters() + model.base_head_parameters())
    scale = optim.stem_scale(cfg, backbone_trains)
    optim.set_lr(optimizer, optim.lr_factor(step, cfg))
    optimizer.zero_grad(set_to_none=True)
    metrics: dict[str, float] = {}
    for k in range(cfg.grad_accum):
        ids = torch.from_numpy(rows[k * cfg.batch_size:(k + 1) * cfg.batch_size]).to(model.backbone.device)  # [B, T]
        with runner.no_sync(last=k == cfg.grad_accum - 1):
            out = runner(ids, skip_constant=cfg.loss_balance != "rms")  # rms reads head 1's value
            loss = optim.combine_losses(out, cfg, scale) / cfg.grad_accum
            loss.backward()
        for key, v in out.metrics.items():
            metrics[key] = metrics.get(key, 0.0) + float(v) / cfg.grad_accum
    optim.unscale_head_grads(optimizer.param_groups, scale)
    if cfg.grad_clip:
        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        metrics["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip))
    optimizer.step()
    return metrics


def _rank_rows(rows: np.ndarray, cfg: TrainConfig, dist: Dist) -> np.ndarray:
    """This rank's micro-batches of a step's global rows # [accum*world*B, T] -> [accum*B, T]."""
    b = cfg.batch_size
    per_micro = rows.reshape(cfg.grad_accum, dist.world, b, -1)  # micro-step k, rank r
    return per_micro[:, dist.rank].reshape(cfg.grad_accum * b, -1)


def train(cfg: TrainConfig, data: DataConfig, model=None) -> dict:
    """Run training; returns the final evaluation and run facts. ``model`` may be given
    (library use); otherwise it is loaded from ``cfg.heads``."""
    validate(cfg)
    dist = init_distributed(cfg)
    ckpt_root = cfg.ckpt_dir()
    existing = list_checkpoints(ckpt_root)
    if existing and not cfg.resume:
        raise UsageError(f"{ckpt_root} already holds checkpoints", "pass --resume to continue, or another --checkpoint-dir")
    files = _list_data(cfg, data, dist)
    run = run_fingerprint(cfg, data, files)
    torch.manual_seed(cfg.seed)
    model = model if model is not None else load_trainable_model(cfg, dist)
    ranking = set_drafter_vocab(cfg, data, model, _separator(model.backbone.tokenizer, cfg))  # before any checkpoint loads
    model.train(True)  # stock linears (a decoding run may have packed them) before parameters are collected
    for p in model.base_head_parameters():  # head 1's own layer: base weights unless asked for
        p.requires_grad_(cfg.train_base_head)
    set_backbone_trainable(model, cfg.lora_trains_at(0))
    optimizer = torch.optim.AdamW(optim.param_groups(model, cfg), lr=cfg.lr, weight_decay=cfg.weight_decay)
    state: dict = {}
    if cfg.resume and existing:
        state = load_checkpoint(existing[-1], model, optimizer)
        if state.get("stream", _stream_key(cfg, dist)) != _stream_key(cfg, dist):
            raise UsageError(f"{existing[-1]} was made with other data settings: {state['stream']}",
                             "resume with the same --data, --seq-len, --batch-size, --grad-accum, --separator and process count")
        check_same_run(state.get("run"), run, existing[-1])
    step = int(state.get("step", 0))
    if step > cfg.max_steps:  # a finished run stops at max_steps: more is a damaged state or a lowered --max-steps
        raise CheckpointError(f"{existing[-1] / 'state.json'}: step {step} is past --max-steps {cfg.max_steps}",
                              f"resume with --max-steps {step} or more, or delete {existing[-1]} if it is damaged")
    set_backbone_trainable(model, cfg.lora_trains_at(step))
    stream, eval_batches, epoch_start = make_streams(cfg, data, model, state.get("position"))  # checks the position
    if cfg.resume and existing and step == cfg.max_steps and holds_finished(cfg, step):
        return already_finished(cfg, ckpt_root, step, state)
    runner = Runner(model, dist)
    model.train(True)
    history = state.get("history", [])
    from tqdm import tqdm

    bar = progress_bar(total=cfg.max_steps, initial=step, desc="train", unit="step", disable=not (cfg.progress and dist.main))
    position = state.get("position")
    saved_at = time.monotonic()
    while step < cfg.max_steps:
        if cfg.mode == "warmup" and step == cfg.head_warmup_steps:
            set_backbone_trainable(model, True)  # head warm-up over: joint from here on
            runner.rewrap()
        rows, pos = take_sequences(stream, cfg.batch_size * cfg.grad_accum * dist.world, cfg.seq_len)
        metrics = train_step(runner, optimizer, _rank_rows(rows, cfg, dist), cfg, step)
        step, position = step + 1, pos.to_dict()
        _stop_if_diverged(cfg, step, metrics, model, optimizer, ckpt_root)
        bar.update(1)
        bar.set_postfix({k: f"{v:.3f}" for k, v in metrics.items() if k.endswith("/loss")})
        if dist.main and cfg.eval_every and step % cfg.eval_every == 0 and step < cfg.max_steps:
            history.append({"step": step, **evaluate(model, eval_batches)})
            tqdm.write(format_eval(history[-1], cfg.max_steps), file=sys.stderr)
        if _save_due(cfg, dist, step, saved_at) and step < cfg.max_steps:
            _checkpoint(cfg, dist, ckpt_root, step, model, optimizer, position, epoch_start, history, run)
            saved_at = time.monotonic()
    bar.close()
    final = evaluate(model, eval_batches) if dist.main else {}
    if history and history[-1].get("step") == step:  # a rerun of a finished job: same entry again
        history.pop()
    history.append({"step": step, **final})
    _checkpoint(cfg, dist, ckpt_root, step, model, optimizer, position, epoch_start, history, run)
    if dist.main:
        _write_output(cfg, data, model, history, files, ranking)
    _barrier(dist)
    return {"step": step, "eval": final, "checkpoint_dir": str(ckpt_root), "out": cfg.out}


def _stop_if_diverged(cfg: TrainConfig, step: int, metrics: dict[str, float], model, optimizer, ckpt_root: Path) -> None:
    """Stop at the first non-finite loss or weight: every later step would be NaN too, and
    neither a checkpoint nor the heads get written from it (the last good checkpoint stays)."""
    import math

    bad_loss = next((k for k, v in metrics.items() if k.endswith("loss") and not math.isfinite(v)), None)
    trained = {id(p) for g in optimizer.param_groups for p in g["params"]}
    found = None if bad_loss else non_finite((n, p.detach()) for n, p in model.named_parameters() if id(p) in trained)
    if bad_loss is None and found is None:
        return
    what = f"{bad_loss} is {metrics[bad_loss]}" if bad_loss else describe(found)
    kept = list_checkpoints(ckpt_root)
    last = f"the last good checkpoint is kept: {kept[-1]}" if kept else "no checkpoint was written"
    fix = f"train again with a lower --lr (now {cfg.lr:g})" + (", from the start: resuming keeps the checkpoint's rates" if kept else "")
    raise DivergedError(f"training diverged at step {step}: {what}; stopped, {last}", fix)


def _list_data(cfg: TrainConfig, data: DataConfig, dist: Dist) -> dict:
    """The data files read (stderr lines on the main process; saved in train_config.json)."""
    files, lines = describe_files(data)
    record = {"data_files": files}
    if cfg.eval_data:
        eval_files, eval_lines = describe_files(DataConfig(data=cfg.eval_data, split=data.split, column=data.column))
        record["eval_data_files"] = eval_files
        lines += ["eval " + line if line.startswith("data:") else line for line in eval_lines]
    if dist.main:
        print("\n".join(lines), file=sys.stderr, flush=True)
    return record


def _save_due(cfg: TrainConfig, dist: Dist, step: int, saved_at: float) -> bool:
    """Checkpoint now? Every ``save_every`` steps, and once ``save_every_minutes`` passed since
    the last one. Rank 0's clock decides for every rank (they must save together)."""
    if cfg.save_every and step % cfg.save_every == 0:
        return True
    if not cfg.save_every_minutes:
        return False
    due = time.monotonic() - saved_at >= cfg.save_every_minutes * 60
    if dist.world > 1:
        import torch.distributed as tdist

        flag = torch.tensor([int(due)], device=_device(cfg, dist) if cfg.backbone.device.startswith("cuda") else "cpu")
        tdist.broadcast(flag, src=0)
        due = bool(flag.item())
    return due


def format_eval(record: dict, max_steps: int) -> str:
    """One readable line of an evaluation: per-head loss and top-1, heads 1..n."""
    heads = sorted({int(k.split("/")[0][4:]) for k in record if k.startswith("head") and k.endswith("/loss")})
    loss = " ".join(f"{record[f'head{h}/loss']:.3f}" for h in heads)
    top1 = " ".join(f"{record[f'head{h}/top1']:.3f}" for h in heads if f"head{h}/top1" in record)
    return f"step {record['step']}/{max_steps} eval: loss {loss} | top-1 {top1} (heads 1..{len(heads)})"


def format_summary(summary: dict) -> str:
    """The end-of-training summary ``multitoken train`` prints (the JSON is in train_metrics.json)."""
    final = summary["eval"]
    heads = sorted({int(k.split("/")[0][4:]) for k in final if k.startswith("head") and k.endswith("/loss")})
    done = (f"the run had finished at step {summary['step']}; its heads in {summary['out']} are unchanged"
            if summary.get("unchanged") else f"trained {summary['step']} steps; heads written to {summary['out']}")
    lines = [done,
             "held-out evaluation:", f"  {'head':>4} {'loss':>8} {'top-1':>7} {'top-5':>7}"]
    for h in heads:
        lines.append(f"  {h:>4} {final[f'head{h}/loss']:>8.3f} {final.get(f'head{h}/top1', float('nan')):>7.3f} "
                     f"{final.get(f'head{h}/top5', float('nan')):>7.3f}")
    lines += [f"metrics per evaluation: {Path(summary['out']) / 'train_metrics.json'}",
              f"checkpoints (--resume continues from the latest): {summary['checkpoint_dir']}"]
    return "\n".join(lines)


def _stream_key(cfg: TrainConfig, dist: Dist) -> dict:
    """What the saved data position means: resuming under other values would not continue it."""
    return {"seq_len": cfg.seq_len, "rows_per_step": cfg.batch_size * cfg.grad_accum * dist.world,
            "separator": cfg.separator, "eval_data": cfg.eval_data, "eval_batches": cfg.eval_batches}


def _barrier(dist: Dist) -> None:
    if dist.world > 1:
        import torch.distributed as tdist

        tdist.barrier()


def _checkpoint(cfg, dist, root, step, model, optimizer, position, epoch_start, history, run) -> None:
    if dist.main:
        state = {"position": position, "epoch_start": epoch_start.to_dict(), "history": history, "stream": _stream_key(cfg, dist),
                 "mode_phase": "joint" if cfg.lora_trains_at(step) else "heads", "run": run}
        save_checkpoint(root, step, model, optimizer, state, cfg.keep_checkpoints)
    _barrier(dist)


def _write_output(cfg: TrainConfig, data: DataConfig, model, history: list[dict], files: dict, ranking: str | None) -> None:
    """Save heads, resolved config and metrics: staged, then published over ``--out`` all or
    nothing (only the files its record lists are replaced; see ``heads_io.save_heads``).
    ``ranking``: the drafter's draft vocabulary set before training (else ranked now)."""
    extra = {"train_config.json": resolved_config_text("train", cfg, data, extra=files),
             "train_metrics.json": json.dumps(history, indent=2) + "\n"}
    if ranking is None:
        ranking = draft_vocab_text(cfg, data, model, _separator(model.backbone.tokenizer, cfg))
    if ranking is not None:
        extra[DRAFT_VOCAB_FILE] = ranking
    model.save_heads(Path(cfg.out), extra=extra, command="train")
