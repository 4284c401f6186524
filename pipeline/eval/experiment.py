"""The harness every experiment script (``scripts/experiments/``) shares: data splits, seeds,
step budgets, timing, and the JSON + PNG each script writes, with the benchmark harness's record
of the machine, load, command, commit and versions (``benchmark.py``).

Everything model-side goes through the package's public functions (``train``, ``evaluate``,
``generate``, ``sweep``, ``distill``); nothing here trains or scores on its own.

Held-out text, by model:
- pythia-mini: tinyshakespeare is cut at 90% of its characters; heads train on the first part
  and are scored on the tail (the base model itself saw all of tinyshakespeare in its own
  training, see ``../shared/fixtures/pythia-mini/TRAINING.md``; no head did).
- the embedded stories260K: no TinyStories text ships here, so training and held-out text are
  the base model's own samples (``distill``), held-out ones drawn with ``HELDOUT_SEED``, a seed
  no training corpus here (nor ``scripts/build_heads.py``'s, seeds 0..3) uses.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from multitoken.base.atomic import atomic_write_text
from multitoken.base.data import DataConfig
from multitoken.base.quiet import quiet_dependencies
from multitoken.pipeline.eval.benchmark import FIXTURES, REPO, git_commit, load_average, machine, plain, versions
from multitoken.pipeline.eval.benchmark import command as command_line
from multitoken.pipeline.eval.evaluate import EvalConfig, evaluate
from multitoken.pipeline.eval.plotting import pyplot, save_figure  # pyplot: the scripts draw through it
from multitoken.pipeline.model.loading import BackboneConfig, load_backbone
from multitoken.pipeline.model.model import MultiTokenModel
from multitoken.pipeline.train.distill import DistillConfig, distill
from multitoken.pipeline.train.train import train
from multitoken.pipeline.train.trainer_config import TrainConfig

PYTHIA_MINI = FIXTURES / "pythia-mini"
SHAKESPEARE = FIXTURES / "tinyshakespeare" / "input.txt"
TRAIN_SEED = 0  # distilled training text of the embedded model
HELDOUT_SEED = 1001  # distilled held-out text: a seed no training corpus uses
TRAIN_FRACTION = 0.9  # tinyshakespeare: heads train on the first 90% of the characters
STORY_PROMPTS = ("Once upon a time", "The little dog ran to the park and", "Lily and Ben were playing with a ball. Then",
                 "One day, a girl named Sue", "Tom had a big red", "The sun was shining and the birds")


@dataclass
class Budget:
    """What one run may spend; a script keeps a FULL and a QUICK (CI smoke test) instance."""

    steps: int = 100  # optimizer steps per trained model (the same for every model of a comparison)
    batch_size: int = 8
    seq_len: int = 128
    lr: float = 1e-3
    train_tokens: int = 100_000  # distilled training text (embedded model)
    eval_tokens: int = 8192  # held-out tokens scored
    eval_batches: int = 2  # held-out batches of the trainer's own end-of-training evaluation
    new_tokens: int = 64  # tokens generated per run
    prompts: int = 6
    seeds: int = 2


# Command line ------------------------------------------------------------------------------------
def parser(doc: str, name: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(REPO / "out" / "experiments" / name), help="output directory (NAME.json, NAME.png)")
    p.add_argument("--quick", action="store_true", help="tiny budgets: a smoke test (CI), not a result")
    p.add_argument("--seed", type=int, default=0, help="seed of head initialisation, training order and sampling")
    p.add_argument("--steps", type=int, default=None, help="override the optimizer steps per trained model")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, one per core)")
    p.add_argument("--work-dir", default=None, help="keep corpora and trained heads here: a new or empty dir, or one these experiments used before (default: a temporary dir, removed)")
    p.add_argument("--overwrite", action="store_true", help="replace this experiment's own earlier output in --out")
    return p


class Run:
    """One experiment run: output checks, seeds, the budget, timing and the final write."""

    def __init__(self, name: str, args, full: Budget, quick: Budget):
        quiet_dependencies()  # dependencies' progress bars and notices off, as in the CLI
        self.name, self.args = name, args
        self.out = Path(args.out)
        _check_out(self.out, name, args.overwrite)
        self.budget = quick if args.quick else full
        if args.steps is not None:
            self.budget = replace(self.budget, steps=args.steps)
        if args.threads:
            torch.set_num_threads(args.threads)
        torch.manual_seed(args.seed)
        self._tmp = None if args.work_dir else tempfile.TemporaryDirectory(prefix=f"mt-{name}-")
        self.work = Path(args.work_dir or self._tmp.name)
        _claim_work(self.work)
        self.machine = {**machine(), "load_before": load_average()}
        self.started, self.cpu0 = time.perf_counter(), time.process_time()
        self.parts: dict[str, dict[str, float]] = {}

    def timed(self, part: str):
        """``with run.timed("train rank 4"):`` adds wall and CPU seconds to ``parts``."""
        return _Timed(self.parts, part)

    def finish(self, result: dict, fig) -> dict:
        """Write NAME.json (result + budget + machine + timing + command) and NAME.png."""
        self.out.mkdir(parents=True, exist_ok=True)
        record = {"experiment": self.name, "quick": bool(self.args.quick), "seed": self.args.seed,
                  "budget": asdict(self.budget), **result,
                  "timing": {"wall_s": round(time.perf_counter() - self.started, 1),
                             "cpu_s": round(time.process_time() - self.cpu0, 1), "parts": self.parts},
                  "machine": {**self.machine, "load_after": load_average()},
                  "command": command_line(), "git": git_commit(), "versions": versions()}
        save_figure(fig, self.out / f"{self.name}.png")
        atomic_write_text(self.out / f"{self.name}.json", json.dumps(record, indent=2, default=plain) + "\n")
        if self._tmp is not None:
            self._tmp.cleanup()
        print(f"{self.name}: {self.out / (self.name + '.json')} and .png ({record['timing']['wall_s']} s)", file=sys.stderr)
        return record


class _Timed:
    def __init__(self, parts: dict, part: str):
        self.parts, self.part = parts, part

    def __enter__(self):
        self.t, self.c = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc):
        self.parts[self.part] = {"wall_s": round(time.perf_counter() - self.t, 2), "cpu_s": round(time.process_time() - self.c, 2)}
        return False


WORK_MARKER = ".multitoken-experiments-work"  # marks a --work-dir as ours: its scratch may be replaced


def _claim_work(work: Path) -> None:
    """--work-dir is new, empty or an experiments work dir from before (its marker file): runs
    replace their own scratch there (trained heads, checkpoints), so a folder of the user's is
    refused up front."""
    if work.exists() and not work.is_dir():
        raise SystemExit(f"error: --work-dir {work} is a file; pass a new or empty directory")
    if work.is_dir() and any(work.iterdir()) and not (work / WORK_MARKER).is_file():
        raise SystemExit(f"error: --work-dir {work} holds files not written by these experiments; pass a new or empty directory")
    work.mkdir(parents=True, exist_ok=True)
    (work / WORK_MARKER).touch()


def _check_out(out: Path, name: str, overwrite: bool) -> None:
    """New or empty dir, or this experiment's own earlier output with --overwrite (its files
    are replaced one by one; nothing else there is touched)."""
    if out.exists() and not out.is_dir():
        raise SystemExit(f"error: --out {out} is a file; pass a directory")
    if out.is_dir() and any(out.iterdir()):
        ours = (out / f"{name}.json").is_file()
        if not ours:
            raise SystemExit(f"error: --out {out} is not empty and holds no {name}.json; pass a new or empty directory")
        if not overwrite:
            raise SystemExit(f"error: --out {out} already holds {name}.json; pass --overwrite to replace it")


# Data ----------------------------------------------------------------------------------------
def shakespeare_split(work: Path, quick: bool = False) -> tuple[str, str]:
    """(train file, held-out file): tinyshakespeare's first 90% and its tail, each one document.
    ``quick``: the first 40k characters only (smoke tests: tokenizing 1 MB costs seconds)."""
    text = SHAKESPEARE.read_text(encoding="utf-8")
    if quick:
        text = text[:40_000]
    cut = text.rfind("\n\n", 0, int(len(text) * TRAIN_FRACTION)) + 2  # at a speech boundary
    paths = (work / "shakespeare_train.txt", work / "shakespeare_heldout.txt")
    for path, part in zip(paths, (text[:cut], text[cut:])):
        if not path.is_file():
            path.write_text(part, encoding="utf-8")
    return str(paths[0]), str(paths[1])


def story_samples(work: Path, backbone, tokens: int, seed: int, name: str) -> str:
    """``tokens`` tokens sampled from the embedded base (temperature 1, full vocabulary) with ``seed``."""
    path = work / f"{name}.jsonl"
    # a batch of 64 stories of up to 256 tokens yields ~10k tokens (most end at EOS earlier);
    # small requests take short, narrow batches so a smoke test does not sample 16k tokens
    batch, length = (64, 256) if tokens >= 8192 else (max(2, min(32, tokens // 48)), 64)
    if not path.is_file():
        distill(backbone, DistillConfig(num_tokens=tokens, out=str(path), batch_size=batch, max_new_tokens=length,
                                        seed=seed, progress=False))
    return str(path)


def story_prompts(count: int) -> list[str]:
    return list(STORY_PROMPTS[:count])


# Models --------------------------------------------------------------------------------------
def load_base(base: str | None):
    return load_backbone(BackboneConfig() if base is None else BackboneConfig(base=str(base)))


def train_heads(run: Run, name: str, backbone, head_config: dict, data: str, heldout: str, *,
                separator: str = "eos", **train_fields) -> dict:
    """Attach fresh heads (seeded), train them with ``pipeline.train.train`` on ``data`` for the
    run's step budget, scored at the end on ``heldout`` by the trainer's own evaluation.
    ``train_fields``: other ``TrainConfig`` fields (mode, head_lr_mult, loss_balance, ...).
    Returns {"heads": trained dir, "train_eval": final held-out metrics, "seconds": ...}."""
    b = run.budget
    init, out, ckpt = (run.work / f"{name}-{kind}" for kind in ("init", "trained", "ckpt"))
    for path in (init, out, ckpt):
        shutil.rmtree(path, ignore_errors=True)  # our own scratch from an earlier run in --work-dir
    torch.manual_seed(run.args.seed)
    MultiTokenModel.attach(backbone, head_config).save_heads(init)
    fields = {"lr": b.lr, "lr_warmup_steps": max(b.steps // 20, 1), **train_fields}
    cfg = TrainConfig(heads=str(init), out=str(out), checkpoint_dir=str(ckpt), max_steps=b.steps, seq_len=b.seq_len,
                      batch_size=b.batch_size, eval_every=0, eval_batches=b.eval_batches, eval_data=heldout,
                      save_every=0, save_every_minutes=0, keep_checkpoints=1, seed=run.args.seed, progress=False,
                      separator=separator, **fields)
    cfg.backbone.threads = run.args.threads  # the base and dtype stay the heads dir's record
    with run.timed(f"train {name}") as t:
        summary = train(cfg, DataConfig(data=data))
    shutil.rmtree(ckpt, ignore_errors=True)
    return {"heads": str(out), "init": str(init), "train_eval": summary["eval"], "steps": summary["step"],
            "train_seconds": run.parts[t.part]}


def load_heads(heads_dir: str):
    """A trained heads dir on the base recorded in it (its LoRA included)."""
    model = MultiTokenModel.from_pretrained(None, heads_dir)
    model.train(False)
    return model


def evaluate_on(run: Run, label: str, model, data: str, parts=("ppl",), **eval_fields) -> dict:
    """``pipeline.eval.evaluate`` of ``model`` on the first ``eval_tokens`` tokens of ``data``."""
    b = run.budget
    cfg = EvalConfig(seq_len=b.seq_len, batch_size=b.batch_size, parts=tuple(parts), quiet=True, beside_heads=False,
                     **{"stats": "none", **eval_fields})
    with run.timed(f"eval {label}"):
        return evaluate(model, cfg, DataConfig(data=data, max_tokens=b.eval_tokens))


def head_rows(report: dict) -> list[dict]:
    """Per head: PPL_n, top-1, top-5 from an evaluate() report."""
    return [{k: h[k] for k in ("head", "ppl", "top1", "top5")} for h in report["heads"]]

