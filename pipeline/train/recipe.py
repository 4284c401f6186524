"""``multitoken build-heads``: one recipe from a base to shipped-quality heads dirs.

Stages, each resumable (a finished stage's output is reused, a killed one redone):
1. prompts: ``prompt_len``-token windows of the ``--data`` text (training), and the first
   ``prompt_len`` tokens of the ``--heldout`` text's sentences (evaluation), none shared;
2. distil: the base continues every prompt by ``new_tokens`` (greedy, every
   ``sample_every``-th batch sampled) into token shards (``distill/train``, ``distill/heldout``),
   until ``tokens`` new tokens exist or ``distill_seconds`` run out;
3. train: every head type of ``heads`` at once on the training shards, heads only, the frozen
   trunk run once per batch (``recipe_train``), for ``epochs`` passes or ``train_seconds``. The
   training text's token ranking (``draft_vocab.json``) is made first: the eagle3 drafter's own
   ``lm_head`` is set to its first ``draft_vocab`` tokens before it trains (EAGLE-3's training-
   time test on the base's distribution there: ``adapters/eagle3.py``);
4. measure: held-out top-1 / top-5 of every head and each draft head's accuracy per rank
   (``rank_accuracy.json``, what ``--tree static`` reads; eagle3's steps as a greedy chain of
   drafts, ``recipe_train.rank_accuracy``), the ranking written beside the heads that read it;
5. write ``heads-TYPE/`` (a heads dir each) and ``report/build_report.json`` (text size, times,
   machine, accuracies) under ``--out``.
On a GPU the whole recipe runs in one call (``scripts/gpu/build_heads.sh``).
"""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from multitoken.adapters.registry import registered_heads
from multitoken.base.atomic import atomic_write_text
from multitoken.base.errors import UsageError
from multitoken.decoding.trees import MAX_RANKS, accuracy_record
from multitoken.pipeline.model.draft_vocab import DRAFT_VOCAB_FILE, drafter_vocab_ids, owns_draft_vocab, ranked_ids, ranking_record
from multitoken.pipeline.model.model import MultiTokenModel
from multitoken.pipeline.train import recipe_data as rdata
from multitoken.pipeline.train import recipe_train as rtrain

HEAD_TYPES = ("replicated", "medusa", "conditioned", "eagle3")
REPORT = "report/build_report.json"  # inside a work dir of the output's record (see cmd_build_heads)


@dataclass
class RecipeConfig:
    """Drives ``multitoken build-heads``."""

    data: tuple[str, ...] = field(default=(), metadata={"help": "text files (.txt, or .jsonl with a text field) the training prompts are cut from"})
    heldout: tuple[str, ...] = field(default=(), metadata={"help": "text files whose sentences' starts are the held-out prompts (never trained on)"})
    out: str | None = field(default=None, metadata={"help": "output folder: the shards, one heads dir per type, the build report"})
    heads: tuple[str, ...] = field(default=HEAD_TYPES, metadata={"help": "head types to train"})
    n_future: int = field(default=3, metadata={"help": "tokens each head set predicts (head 1 is the base)"})
    tokens: int = field(default=2_000_000, metadata={"help": "new tokens to distil for training"})
    heldout_prompts: int = field(default=200, metadata={"help": "held-out prompts (continued greedily)"})
    prompt_len: int = field(default=16, metadata={"help": "tokens per prompt"})
    prompt_stride: int = field(default=4, metadata={"help": "tokens between two training prompts' starts"})
    new_tokens: int = field(default=64, metadata={"help": "tokens the base adds to each prompt"})
    sample_every: int = field(default=2, metadata={"help": "every N-th batch sampled (temperature 0.7, top-k 50); 0: all greedy"})
    distill_batch: int = field(default=0, metadata={"help": "prompts continued at once; 0: 256 in bfloat16 (oneDNN's bf16 "
                                                            "matmuls reach AMX's rate past ~128 rows), else 64 (the rows "
                                                            "kernel's rows per call)"})
    shard_rows: int = field(default=1024, metadata={"help": "continuations per shard (the unit of resumption)"})
    epochs: float = field(default=1.0, metadata={"help": "passes over the distilled text"})
    batch_rows: int = field(default=16, metadata={"help": "continuations per training step (shared by torchrun's processes)"})
    micro_batches: int = field(default=1, metadata={"help": "parts each process runs a step's rows in, gradients summed (less memory, same steps)"})
    lr: float = field(default=1e-3, metadata={"help": "peak learning rate (AdamW, warm-up then cosine)"})
    warmup: int = field(default=50, metadata={"help": "warm-up steps"})
    distill_seconds: float = field(default=0.0, metadata={"help": "stop distilling after this long (0: no limit)"})
    train_seconds: float = field(default=0.0, metadata={"help": "fit training into this long (0: no limit)"})
    compute_dtype: str = field(default="auto", metadata={"help": "training's arithmetic: float32, or bfloat16 autocast; auto = bfloat16 "
                                                         "on GPUs that have it and CPUs with native bf16 (AVX512-BF16, AMX), else float32",
                                                         "choices": rtrain.COMPUTE_DTYPES})
    distill_engine: str = field(default="auto", metadata={"help": "who continues the prompts: our batched engine on our CPU "
                                                          "linears (multitoken), or transformers' generate (the first recipe's path); "
                                                          "auto = multitoken on the CPU, transformers on a GPU",
                                                          "choices": ("auto", *rdata.ENGINES)})
    distill_dtype: str = field(default="auto", metadata={"help": "the continuing model's arithmetic for the training text: "
                                                        "bfloat16 runs a bf16 copy of the base (its own text, several times "
                                                        "faster where bf16 is native); auto = bfloat16 on CPUs with native bf16 "
                                                        "(AVX512-BF16, AMX), else float32. Held-out text is always float32",
                                                        "choices": rdata.DTYPES})
    draft_vocab: int = field(default=8192, metadata={"help": "tokens the drafts score by default (draft_vocab.json's size); "
                                                              "the eagle3 drafter's lm_head holds exactly these"})
    seed: int = field(default=0, metadata={"help": "random seed"})


def validate(cfg: RecipeConfig) -> None:
    if not cfg.data or not cfg.heldout:
        raise UsageError("build-heads needs training and held-out text", "pass --data FILE... and --heldout FILE...")
    for path in (*cfg.data, *cfg.heldout):
        if not Path(path).is_file():
            raise UsageError(f"{path!r} is not a file", "pass text files (.txt or .jsonl)")
    unknown = [h for h in cfg.heads if h not in registered_heads()]
    if unknown:
        raise UsageError(f"unknown head type {unknown[0]!r}", f"use some of: {', '.join(registered_heads())}")
    if cfg.n_future < 2 or cfg.tokens < 1 or cfg.new_tokens < 1 or cfg.prompt_len < 2 or cfg.batch_rows < 1 or cfg.distill_batch < 0:
        raise UsageError("--n-future must be >= 2, and --tokens, --new-tokens, --batch-rows >= 1, --prompt-len >= 2, "
                         "--distill-batch >= 0 (0: its dtype's default)")


def machine() -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__, "cpu": platform.processor() or platform.machine(),
            "threads": torch.get_num_threads()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def _head_config(kind: str, cfg: RecipeConfig) -> dict:
    out = {"head_type": kind, "n_future": cfg.n_future}
    if kind == "eagle3":  # the drafter's lm_head scores the ranking's first --draft-vocab tokens
        return {**out, "draft_vocab_size": cfg.draft_vocab}
    return {**out, "init": "copy"} if kind in ("replicated", "conditioned", "whs") else out


def distill_stage(backbone, cfg: RecipeConfig, out: Path, ranks: rtrain.Ranks, log) -> dict:
    tok = backbone.tokenizer
    held = rdata.sentence_prompts(tok, [Path(p) for p in cfg.heldout], cfg.prompt_len, seed=1)[: cfg.heldout_prompts]
    rows_wanted = -(-cfg.tokens // cfg.new_tokens)
    train = rdata.window_prompts(tok, [Path(p) for p in cfg.data], cfg.prompt_len, cfg.prompt_stride, seed=cfg.seed,
                                 exclude={tuple(r) for r in held.tolist()})
    log(f"prompts: {len(train):,} training windows of {cfg.prompt_len} tokens, {len(held):,} held out")
    if len(train) < rows_wanted:
        log(f"distill: the data holds {len(train):,} prompts, {rows_wanted:,} wanted; each is continued once")
    train = train[:rows_wanted]
    budget = cfg.distill_seconds or None
    share = dict(rank=ranks.rank, world=ranks.world, log=log)
    engine, dtype = rdata.resolve_engine(cfg.distill_engine, backbone.device), rdata.resolve_dtype(cfg.distill_dtype, backbone)
    # the training text's continuer first: its bf16 copy is made before the float32 one packs the base's linears
    fast = rdata.Continuer(backbone, engine, dtype) if dtype != "float32" else None
    exact = rdata.Continuer(backbone, engine)  # held-out text: the base's own greedy text, what accuracy is measured on
    held_rec = rdata.distill_shards(exact, held, out / "distill" / "heldout", cfg.new_tokens, cfg.shard_rows,
                                    cfg.distill_batch or rdata.BATCH["float32"], 0, cfg.seed + 1, **share)
    train_rec = rdata.distill_shards(fast or exact, train, out / "distill" / "train", cfg.new_tokens, cfg.shard_rows,
                                     cfg.distill_batch or rdata.BATCH[dtype], cfg.sample_every, cfg.seed, seconds=budget, **share)
    return {"heldout": held_rec, "train": train_rec, "prompts_available": int(len(train))}


def join_ranks(device: torch.device) -> rtrain.Ranks:
    """torchrun's process group (gloo on the CPU, NCCL on GPUs), or one process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return rtrain.Ranks()
    import torch.distributed as tdist

    if not tdist.is_initialized():
        tdist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return rtrain.Ranks(tdist.get_rank(), tdist.get_world_size())


def _barrier(ranks: rtrain.Ranks) -> None:
    if ranks.world > 1:
        import torch.distributed as tdist

        tdist.barrier()


def build(backbone, cfg: RecipeConfig, log=print) -> dict | None:
    """Run every stage into ``cfg.out``; returns the build report (None on ranks but 0)."""
    out = Path(cfg.out)
    started = time.time()
    ranks = join_ranks(backbone.device)
    if cfg.batch_rows % (ranks.world * cfg.micro_batches):
        raise UsageError(f"--batch-rows {cfg.batch_rows} does not split into {ranks.world} process(es) x "
                         f"{cfg.micro_batches} micro-batch(es)", "pass a multiple of their product")
    report = {"config": asdict(cfg), "machine": machine(), "base": backbone.name, "processes": ranks.world, "stages": {}}
    report["stages"]["distill"] = distill_stage(backbone, cfg, out, ranks, log)
    _barrier(ranks)
    report["stages"]["distill"]["seconds_total"] = round(time.time() - started, 1)
    train = rdata.read_shards(out / "distill" / "train")
    held = rdata.read_shards(out / "distill" / "heldout")
    report["text"] = {"train_rows": int(train["ids"].shape[0]), "train_tokens": int(train["valid"].sum()),
                      "heldout_rows": int(held["ids"].shape[0]), "heldout_tokens": int(held["valid"].sum())}
    log(f"text: {report['text']}")
    todo = [k for k in cfg.heads if not (out / f"heads-{k}" / "heads_config.json").is_file()]
    ranking = ranking_record(torch.bincount(train["ids"][train["valid"]], minlength=backbone.vocab_size), cfg.draft_vocab,
                             "the recipe's self-distilled training text (multitoken build-heads)")
    torch.manual_seed(cfg.seed)
    models = [MultiTokenModel.attach(backbone, _head_config(k, cfg)) for k in todo]
    for model in models:  # a drafter with its own lm_head trains over the draft vocabulary it ships with
        if owns_draft_vocab(model.heads):
            model.heads.set_draft_vocab(ranked_ids(ranking, len(drafter_vocab_ids(model.heads)), backbone.vocab_size))
    sets = [rtrain.HeadSet(k, m, cfg.lr) for k, m in zip(todo, models)]
    if sets:
        t0 = time.time()
        run = rtrain.train_sets(backbone, sets, train, epochs=cfg.epochs, batch_rows=cfg.batch_rows, warmup=cfg.warmup,
                                seconds=cfg.train_seconds or None, dtype=cfg.compute_dtype, chunk=4096, seed=cfg.seed,
                                micro_batches=cfg.micro_batches, ranks=ranks, log=log if ranks.rank == 0 else _quiet)
        report["stages"]["train"] = {k: v for k, v in run.items() if k != "history"}
        report["stages"]["train"]["heads"] = todo
        if ranks.rank == 0:
            _write_heads(cfg, out, sets, run, report, held, ranking, log)
        report["stages"]["train"]["seconds_total"] = round(time.time() - t0, 1)
    _barrier(ranks)
    if ranks.rank != 0:
        return None
    report["heldout"] = {k: json.loads((out / f"heads-{k}" / "train_metrics.json").read_text())["heldout"] for k in cfg.heads}
    report["seconds"] = round(time.time() - started, 1)
    (out / REPORT).parent.mkdir(exist_ok=True)
    atomic_write_text(out / REPORT, json.dumps(report, indent=2) + "\n")
    return report


def _quiet(_message) -> None:
    pass


def _write_heads(cfg: RecipeConfig, out: Path, sets, run: dict, report: dict, held: dict, ranking: dict, log) -> None:
    """Measure every trained head set on the held-out text and write its heads dir, with the
    training text's token ranking where the drafts read one (``ranking``, draft_vocab.json)."""
    for s in sets:
        # measured in float32 whatever training's arithmetic, so that builds compare
        acc = rtrain.rank_accuracy(s.model.backbone, s.model, held, 32, "float32", MAX_RANKS)
        record = {"head": _head_config(s.name, cfg), "heldout": acc["summary"],
                  "train": report["stages"]["train"], "text": report["text"], "machine": report["machine"],
                  "history": [{k: v for k, v in h.items() if k.startswith(s.name + "/") or "/" not in k} for h in run["history"]]}
        extra = {"rank_accuracy.json": json.dumps(accuracy_record(acc["ranks"], acc["counts"]), indent=2) + "\n",
                 "train_metrics.json": json.dumps(record, indent=2) + "\n"}
        if s.model.heads.num_head_layers or owns_draft_vocab(s.model.heads):  # drafts over a ranked vocabulary
            extra[DRAFT_VOCAB_FILE] = json.dumps(ranking) + "\n"
        s.model.save_heads(out / f"heads-{s.name}", extra=extra, command="build-heads")
        log(f"heads-{s.name}: held-out {acc['summary']}")
