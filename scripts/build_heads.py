"""Train ``replicated`` heads (n = 3, or ``--n``) for a base model from its own samples: by default
the heads shipped beside the embedded stories260K model; ``--base DIR --dest DIR`` for another base
(the decoding benchmark's pythia-mini heads, say). A driver of the package's own commands
(``distill``, ``train``, ``eval``), no training of its own; it stays a script because
``multitoken build-heads`` (the recipe for bases with text, docs/training.md) cuts its prompts from
text files, and no TinyStories text ships for the embedded model.

Steps (each skipped when its output already exists in --work-dir):
1. distill training and held-out corpora (other seeds) from the base itself: sampled text,
   and greedy text (a sampled prefix of 0..64 tokens continued with argmax, ``--greedy-after``),
   which is what greedy speculative decoding verifies; the training file interleaves the two;
2. attach untrained replicated heads (heads 2..n start as copies of the final layer);
3. train them with the backbone frozen (``multitoken train --mode heads``), documents joined
   by BOS, the way stories260K saw its training stories;
4. evaluate per-head loss and top-1/top-5 accuracy on both held-out corpora;
5. copy the heads (heads.safetensors + heads_config.json) to --dest with the JSON report;
6. measure each head's accuracy per rank of its guesses on the greedy held-out corpus
   (``multitoken eval --parts ppl``) and write it beside the heads as ``rank_accuracy.json``:
   the static trees of ``generate --tree static`` are shaped by it (without it they fall back
   to a generic prior).

    python scripts/build_heads.py --work-dir /tmp/embedded_build
    python scripts/build_heads.py --base ../shared/fixtures/pythia-mini --dest out/pythia-mini-heads \\
        --work-dir /tmp/pythia_mini_build --train-tokens 100000 --greedy-tokens 150000 \\
        --heldout-tokens 20000 --greedy-after 32 --steps 400 --seq-len 128  # ~21 min here
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

from multitoken.base.quiet import quiet_dependencies
from multitoken.embedded import EMBEDDED_HEADS

quiet_dependencies()  # dependencies' progress bars and notices off, as in the CLI


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", default=None, help="base model (default: the embedded stories260K)")
    p.add_argument("--work-dir", default="/tmp/embedded_build")
    p.add_argument("--train-tokens", type=int, default=1_000_000)
    p.add_argument("--greedy-tokens", type=int, default=1_000_000, help="greedy-continued training tokens (0: none)")
    p.add_argument("--greedy-after", type=int, default=64)
    p.add_argument("--heldout-tokens", type=int, default=60_000)
    p.add_argument("--n", type=int, default=3, help="tokens per forward pass: the base's head + n - 1 replicated heads")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--eval-batches", type=int, default=4, help="batches per in-training evaluation")
    p.add_argument("--dest", default=None, help="where the heads go (default: the package, for the embedded base only)")
    p.add_argument("--json", default=None, help="report path (default: WORK_DIR/heads_report.json)")
    return p.parse_args(argv)


def distill_corpora(args, work: Path, backbone) -> dict[str, Path]:
    from multitoken.pipeline.train.distill import DistillConfig, distill

    plan = {"train": (args.train_tokens, 0, -1), "heldout": (args.heldout_tokens, 1, -1),
            "greedy": (args.greedy_tokens, 2, args.greedy_after), "greedy_heldout": (args.heldout_tokens, 3, args.greedy_after)}
    paths = {}
    for name, (tokens, seed, greedy_after) in plan.items():
        path = work / f"{name}.jsonl"
        if tokens and not path.is_file():
            distill(backbone, DistillConfig(num_tokens=tokens, out=str(path), batch_size=64, max_new_tokens=256, seed=seed,
                                            greedy_after=greedy_after))
        paths[name] = path
    return paths


def interleave(sources: list[Path], out: Path) -> Path:
    """One jsonl alternating the sources' documents, so every batch sees both kinds of text."""
    if not out.is_file():
        import itertools

        from multitoken.base.atomic import atomic_write_text

        lines = [p.read_text().splitlines() for p in sources if p.is_file()]
        mixed = [line for group in itertools.zip_longest(*lines) for line in group if line is not None]
        atomic_write_text(out, "\n".join(mixed) + "\n")  # a rerun trusts an existing file
    return out


def heldout_accuracy(heads_dir: Path, heldouts: dict[str, Path], args) -> dict[str, dict[str, float]]:
    """Per-head metrics of the heads in ``heads_dir`` on each held-out corpus (model loaded once)."""
    import numpy as np

    from multitoken.base.data import DataConfig
    from multitoken.pipeline.model.model import MultiTokenModel
    from multitoken.base.packing import PackedStream
    from multitoken.pipeline.train.train import evaluate

    model = MultiTokenModel.from_pretrained(None, heads_dir)
    tok = model.backbone.tokenizer
    results = {}
    for kind, path in heldouts.items():
        stream = PackedStream(DataConfig(data=str(path)), tok, args.seq_len, tok.bos_token_id, loop=False)
        rows = [seq for seq, _ in stream]
        batches = [np.stack(rows[i:i + args.batch_size]) for i in range(0, len(rows) - args.batch_size + 1, args.batch_size)]
        results[kind] = evaluate(model, batches)
        results[kind]["heldout_tokens"] = len(batches) * args.batch_size * args.seq_len
    return results


def main(argv=None) -> int:
    import torch

    from multitoken.pipeline.model.loading import BackboneConfig, load_backbone
    from multitoken.base.data import DataConfig
    from multitoken.pipeline.model.model import MultiTokenModel
    from multitoken.pipeline.train.train import train
    from multitoken.pipeline.train.trainer_config import TrainConfig

    args = parse_args(argv)
    if args.dest is None:
        if args.base is not None or args.n != 3:
            raise SystemExit("--base or --n given without --dest: only the embedded model's 3-token heads go into the package")
        args.dest = str(EMBEDDED_HEADS)
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    started = time.time()
    backbone = load_backbone(BackboneConfig() if args.base is None else BackboneConfig(base=args.base))
    corpora = distill_corpora(args, work, backbone)
    train_data = interleave([corpora["train"], corpora["greedy"]], work / "train_mixed.jsonl")
    untrained = work / "untrained"
    if not (untrained / "heads_config.json").is_file():
        torch.manual_seed(0)
        MultiTokenModel.attach(backbone, {"head_type": "replicated", "n_future": args.n, "init": "copy"}).save_heads(untrained)
    trained = work / "trained"
    cfg = TrainConfig(
        heads=str(untrained), out=str(trained), separator="bos", mode="heads", max_steps=args.steps,
        seq_len=args.seq_len, batch_size=args.batch_size, lr=args.lr, lr_warmup_steps=max(args.steps // 50, 1),
        eval_every=max(args.steps // 6, 1), eval_batches=args.eval_batches, save_every=max(args.steps // 4, 1),
        resume=True, seed=0,
    )
    train_started = time.time()
    train(cfg, DataConfig(data=str(train_data)))
    train_seconds = time.time() - train_started
    heldouts = {kind: path for kind, path in (("sampled", corpora["heldout"]), ("greedy", corpora["greedy_heldout"])) if path.is_file()}
    before = heldout_accuracy(untrained, heldouts, args)
    after = heldout_accuracy(trained, heldouts, args)
    dest = Path(args.dest)
    dest.mkdir(parents=True, exist_ok=True)  # files are replaced one by one: a README there stays
    for name in ("heads.safetensors", "heads_config.json"):  # the embedded base is recorded as embedded:stories260K
        shutil.copy(trained / name, dest / name)
    report = {
        "heldout_trained": after, "heldout_untrained": before, "train_steps": args.steps,
        "train_tokens_seen": args.steps * args.batch_size * args.seq_len, "train_seconds": round(train_seconds, 1),
        "total_seconds": round(time.time() - started, 1), "train_config": json.loads((trained / "train_config.json").read_text()),
        "corpus": {"train_tokens": args.train_tokens, "greedy_tokens": args.greedy_tokens, "greedy_after": args.greedy_after,
                   "heldout_tokens": args.heldout_tokens},
    }
    out = Path(args.json or work / "heads_report.json")
    out.write_text(json.dumps(report, indent=2) + "\n")
    (dest / "build_report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({kind: {k: v for k, v in m.items() if "/" in k} for kind, m in after.items()}, indent=2))
    if "greedy" in heldouts:
        rank_accuracy(dest, heldouts["greedy"], work, args)
    return 0


def rank_accuracy(dest: Path, corpus: Path, work: Path, args) -> None:
    """``multitoken eval --parts ppl`` on ``corpus``: its report goes to WORK_DIR/rank_eval and
    rank_accuracy.json beside the heads in ``dest`` (what ``--tree static`` reads)."""
    from multitoken.pipeline.cli import main as cli

    code = cli(["eval", "--heads", str(dest), "--data", str(corpus), "--parts", "ppl", "--seq-len", str(args.seq_len),
                "--out", str(work / "rank_eval"), "--overwrite", "--quiet"])
    if code:
        raise SystemExit(f"multitoken eval exited with {code}: no rank_accuracy.json beside {dest}")


if __name__ == "__main__":
    sys.exit(main())
