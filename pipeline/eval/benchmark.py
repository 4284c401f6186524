"""The harness every benchmark under ``scripts/`` shares: one record of where and how a run was
made, one way to repeat timed runs and keep the best, one ``--out`` JSON writer; and the inputs
several benchmarks read (fixture paths, prompts, random-weight models of named shapes, a model
with heads).

A record (``Bench.record``) names the machine (CPU model, the feature probe's answer and the CPU
flags the fast paths look for, cores, torch threads, accelerator), the load average before and
after the run, the command line, the git commit (and whether the tree had local changes) and the
versions of Python and the libraries that decide speed. Figures from two records are comparable
only where these agree, which is why each docs table names one machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict
from importlib import metadata
from pathlib import Path
from typing import Callable

import torch

from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, LlamaConfig, LlamaForCausalLM

from multitoken.base.atomic import atomic_write_text
from multitoken.base.quiet import quiet_dependencies
from multitoken.decoding.config import DecodeConfig
from multitoken.decoding.engine import generate
from multitoken.embedded import EMBEDDED_HEADS, EMBEDDED_STATS
from multitoken.kernels import cpu_features
from multitoken.kernels.cpu_linear import CPU_LINEARS, ROWS
from multitoken.pipeline.model.loading import BackboneConfig, load_backbone
from multitoken.pipeline.model.model import MultiTokenModel
from multitoken.stats.table import CooccurrenceTable

REPO = Path(__file__).resolve().parents[2]  # the checkout (an editable install) the scripts run from
FIXTURES = Path(os.environ.get("MULTITOKEN_FIXTURES", REPO.parent / "shared" / "fixtures"))
PROMPTS = {
    "stories": ["Once upon a time", "The little dog ran to the park and", "Lily and Ben were playing with a ball. Then"],
    "pile": ["The results of the study show that", "In computer science, a hash table is", "She walked into the room and"],
}
# CPU flags that choose a fast path somewhere (kernels/cpu_features.py, oneDNN, bitsandbytes)
SPEED_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx512_bf16",
               "amx_tile", "amx_bf16", "amx_int8", "avx_ne_convert", "asimd", "sve")
VERSIONS = ("torch", "transformers", "numpy", "numba", "safetensors")
# Random-weight model shapes (config only, no download): cost, not quality
SHAPES = {"160m": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12),
          "410m": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16),
          "smol135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                           num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True)}
PYTHIA_SHAPES = ("160m", "410m")


# The record ----------------------------------------------------------------------------------
def load_average() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:  # a platform without one
        return []


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        name = ""
    return name or platform.processor() or platform.machine()


def machine(device: str = "cpu") -> dict:
    """Where the run is made: CPU model, the feature probe's answer, the speed-relevant flags
    present, cores, torch threads, the accelerator (if ``device`` names one), platform."""
    have = set(cpu_features.cpu_flags().split())
    out = {"cpu": cpu_model(), "cpu_features": asdict(cpu_features.features()),
           "cpu_flags": [f for f in SPEED_FLAGS if f in have], "cores": os.cpu_count(),
           "torch_threads": torch.get_num_threads(), "device": device, "platform": platform.platform()}
    if device.startswith("cuda") and torch.cuda.is_available():
        out["device_name"] = torch.cuda.get_device_name(torch.device(device))
    return out


def versions() -> dict:
    out = {"python": platform.python_version()}
    for name in VERSIONS:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def git_commit(repo: Path = REPO) -> dict:
    """The checkout's commit and whether it had local changes (None where it is no git tree)."""
    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no") if commit else None
    return {"commit": commit, "dirty": bool(status) if status is not None else None}


def command(argv: list[str] | None = None) -> str:
    """The command line as typed from the checkout (the script's path relative to it)."""
    argv = list(sys.argv if argv is None else argv)
    script = Path(argv[0]) if argv else Path("?")
    try:
        script = script.resolve().relative_to(REPO)
    except ValueError:
        pass
    return " ".join(["python", str(script), *argv[1:]])


# --out ---------------------------------------------------------------------------------------
def add_out(parser: argparse.ArgumentParser, default: str | None) -> None:
    """``--out`` (the JSON record) and ``--overwrite`` (replace an existing one)."""
    parser.add_argument("--out", default=default, help=f"JSON record of the run (default: {default}); an existing "
                        "file is kept unless --overwrite")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out file")


def check_out(path: str | Path | None, overwrite: bool) -> Path | None:
    """Fail before any work where ``--out`` would replace a file without ``--overwrite``."""
    if path is None:
        return None
    out = Path(path)
    if out.is_dir():
        raise SystemExit(f"error: --out {out} is a directory; pass a JSON file path")
    if out.exists() and not overwrite:
        raise SystemExit(f"error: --out {out} already exists; pass --overwrite to replace it, or another path")
    if not out.parent.is_dir():
        raise SystemExit(f"error: --out {out}: its folder {out.parent} does not exist; create it or pass another path")
    return out


def plain(obj):
    """JSON fallback for numpy / torch scalars and arrays, and paths."""
    if hasattr(obj, "tolist"):
        return obj.tolist()
    return str(obj)


class Bench:
    """One benchmark run: its record from the start (machine, load before, command, commit,
    versions, settings), written to ``--out`` by ``save`` as often as the script likes (a long run
    stopped keeps what it measured), each time with the load average at that moment."""

    def __init__(self, name: str, args: argparse.Namespace | None = None, *, device: str = "cpu", **settings):
        quiet_dependencies()  # dependencies' progress bars and notices off, as in the CLI
        self.out = check_out(getattr(args, "out", None), getattr(args, "overwrite", False))
        self.started = time.perf_counter()
        self.record: dict = {"benchmark": name, "command": command(), "git": git_commit(), "versions": versions(),
                             "machine": machine(device), "load_before": load_average(), "settings": settings}

    def save(self) -> dict:
        self.record["load_after"] = load_average()
        self.record["wall_s"] = round(time.perf_counter() - self.started, 2)
        if self.out is not None:
            atomic_write_text(self.out, json.dumps(self.record, indent=2, default=plain) + "\n")
        return self.record

    def __setitem__(self, key: str, value) -> None:
        self.record[key] = value

    def __getitem__(self, key: str):
        return self.record[key]


# Repeat and keep the best ----------------------------------------------------------------------
def best_of(runs: dict, reps: int, *, warm_up: bool = True, before: Callable[[object], None] = lambda label: None,
            sync: Callable[[], None] = lambda: None, after: Callable[[], dict] = dict,
            score: Callable[[dict], float] | None = None) -> dict:
    """Each method's best of ``reps`` timed repetitions, as its run's dict plus ``wall_s``.

    One untimed warm-up run of every method comes first (allocations, kernel and plan caches,
    numba, a tree's auto budget), so that even ``--reps 1`` times a warm run; the repetitions
    then interleave the methods, so a load spike hits every method alike. ``before`` runs off the
    clock before each run (given its label), ``sync`` on the clock after it (an accelerator's
    queue), and ``after`` off the clock, its dict merged into the kept record (e.g. peak memory).
    ``score`` (default: the wall time) is what "best" minimises, e.g. a time the run measured
    itself over the part that matters."""
    score = score or (lambda r: r["wall_s"])
    if warm_up:
        for label, run in runs.items():
            before(label)
            run()
            sync()
    best: dict = {}
    for _ in range(reps):
        for label, run in runs.items():
            before(label)
            start = time.perf_counter()
            result = run()
            sync()
            kept = {**result, **after(), "wall_s": time.perf_counter() - start}
            if label not in best or score(kept) < score(best[label]):
                best[label] = kept
    return best


# Inputs several benchmarks read ----------------------------------------------------------------
def fixture(name: str) -> Path:
    """A shared fixture's path, or a one-line error naming the fix."""
    path = FIXTURES / name
    if not path.exists():
        raise SystemExit(f"error: the fixture {path} is absent: clone ../shared beside the repository "
                         "or set MULTITOKEN_FIXTURES")
    return path


def load(base: str, heads: str | None, device: str = "cpu", dtype: str = "float32", cpu_linear: str = "rows"):
    """(model, heads label): ``base`` with the heads dir ``heads``, or untrained copy-initialised
    replicated heads where there is none; linears as ``cpu_linear`` asks from the start, so that
    transformers' rows (the same model object) run the kernels ours do from the first repetition."""
    quiet_dependencies()
    config = BackboneConfig(base=base, device=device, dtype=dtype, cpu_linear=cpu_linear)
    if heads and Path(heads).is_dir():
        model, label = MultiTokenModel.from_pretrained(config, heads), heads
    else:
        bb = load_backbone(config)
        model = MultiTokenModel.attach(bb, {"head_type": "replicated", "n_future": 3, "init": "copy"})
        label = "untrained (copy-initialised replicated, n=3)"
    model.prepare_linears()
    return model, label


def open_table(path: str | None, tokenizer) -> CooccurrenceTable | None:
    if not path or not Path(path).is_dir():
        return None
    return CooccurrenceTable.for_tokenizer(path, tokenizer)


def random_lm(shape: str, dtype: str = "float32"):
    """A random-weight causal LM of a named shape (``SHAPES``; seed 0), in eval mode without grads."""
    torch.manual_seed(0)
    if shape == "smol135m":
        model = LlamaForCausalLM(LlamaConfig(max_position_embeddings=2048, **SHAPES[shape]))
    else:
        dims = SHAPES[shape]
        model = GPTNeoXForCausalLM(GPTNeoXConfig(vocab_size=50304, intermediate_size=4 * dims["hidden_size"],
                                                 max_position_embeddings=2048, rotary_pct=0.25, use_parallel_residual=True,
                                                 tie_word_embeddings=False, **dims))
    return model.to(getattr(torch, dtype)).eval().requires_grad_(False)


# Decoding benchmarks' settings and runners ---------------------------------------------------
def decode_arguments(p: argparse.ArgumentParser, max_new_tokens: int | None) -> None:
    """The settings every decoding benchmark takes alike: repetitions, threads, device, dtype,
    CPU linears, the models and their heads / stats, and the one sampling setting of its rows."""
    p.add_argument("--max-new-tokens", type=int, default=max_new_tokens, help="tokens per prompt")
    p.add_argument("--reps", type=int, default=3, help="timed repetitions (the fastest kept), after one untimed warm-up run of each method")
    p.add_argument("--threads", type=int, default=1, help="torch threads (the same for every method)")
    p.add_argument("--device", default="cpu", help="where the models run: cpu, cuda, cuda:1")
    p.add_argument("--dtype", default="float32", help="weights dtype of the models (float32, bfloat16, float16)")
    p.add_argument("--cpu-linear", default=ROWS, choices=CPU_LINEARS,
                   help="CPU linears of every row, transformers' included (scripts/bench_linear.py compares them)")
    p.add_argument("--embedded-heads", default=str(EMBEDDED_HEADS))
    p.add_argument("--embedded-stats", default=str(EMBEDDED_STATS))
    p.add_argument("--pythia-mini", default=str(FIXTURES / "pythia-mini"))
    p.add_argument("--pythia-heads", "--heads", dest="pythia_heads", default=None,
                   help="heads trained for pythia-mini (default: untrained copies)")
    p.add_argument("--pythia-stats", default=None, help="stats dir with the pythia tokenizer (dynamic masking on pythia-mini)")
    p.add_argument("--temperature", type=float, default=0.7, help="sampled rows (DynaMo: 0.7)")
    p.add_argument("--top-k", type=int, default=50, help="sampled rows (DynaMo: 50)")
    p.add_argument("--repetition-penalty", type=float, default=1.1,
                   help="sampled rows (DynaMo: 1.1; transformers' rows: its logit form)")


def sampling(args) -> dict:
    return dict(temperature=args.temperature, top_k=args.top_k, repetition_penalty=args.repetition_penalty)


def hf_runner(model, prompt_lookup: bool, max_new: int, sample: dict | None = None):
    """transformers' ``generate`` on one prompt: greedy (optionally prompt lookup), or sampling
    with ``sample`` = {temperature, top_k, repetition_penalty} (seed 0 through torch's global
    generator) -> (new token ids, None)."""
    bb = model.backbone
    extra = {"prompt_lookup_num_tokens": 10} if prompt_lookup else {}
    if sample:
        extra.update(top_p=1.0, **sample)

    def run(ids):
        ids = ids.to(bb.device)
        if sample:
            torch.manual_seed(0)
        out = bb.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                                do_sample=bool(sample), pad_token_id=bb.tokenizer.eos_token_id, **extra)
        return out[0, ids.shape[1]:].tolist(), None
    return run


def our_runner(model, cfg: DecodeConfig, table):
    """Our ``generate`` on one prompt -> (new token ids, its trace); profiled, so that the model
    / logic split is exact on any device."""
    def run(ids):
        res = generate(model, ids, cfg, table=table, profile=True)
        return res.token_ids, res.trace
    return run


def over_prompts(run, ids: list) -> dict:
    """One method over every prompt: its outputs, traces and token count."""
    outputs, traces = [], []
    for x in ids:
        out, trace = run(x)
        outputs.append(out)
        traces.append(trace)
    return {"outputs": outputs, "traces": traces, "tokens": sum(map(len, outputs))}
