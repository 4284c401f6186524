"""``sweep``: dynamic decoding over prompts x seeds x an eps_b grid, against ``ar`` sampling.

Every (configuration, eps_b) point generates a continuation of each prompt with each seed,
and ``ar`` does the same once at exactly the same sampling settings (temperature, top-k,
repetition penalty, budget, seeds: ``decode_configs``); so does transformers' own sampling
``generate`` (``hf-sample``: same top-k, temperature and penalty value, but transformers'
penalty is its logit form -- a seen token's logit divided by the penalty when positive,
multiplied when negative, before temperature and top-k -- where ours divides the probability
after them, as DynaMo does). Per run:
tokens per forward (the trace), wall and CPU seconds per generated token, and quality measured without an
external judge: the base model's mean NLL of the continuation given the prompt (temperature
1, full vocabulary), distinct-2/3 and the repetition rate (share of repeated 4-grams). Each
point reports means with 95% Student-t intervals over the prompt x seed runs; the wall-clock
speed-up of a run is ar's seconds per token over the point's, on the same prompt and seed
(ar runs just before and after that prompt and seed's points; the mean of the two is used; the
points' order rotates from one prompt x seed to the next, so no point always runs first after ar);
the CPU-time speed-up (process time, one thread by default) is the same ratio measured in a
way other processes on a shared machine cannot inflate. ``--batch-size B`` decodes B prompt x
seed runs of a point together (``decoding.engine``): every run's tokens, hence every quality
figure and tokens per forward, are those of the one-at-a-time sweep; the timings are then the
batch's (seconds per token = the batch's time over its tokens, the same for its runs), ar's
batched the same way.

``same_quality_speedup``: among the points of ar's quality, the one with the most tokens per
forward (its wall-clock speed-up is reported beside it). Of ar's quality = for each of NLL,
repetition rate, distinct-2 and distinct-3, the paired difference from ar (point - ar on the same
prompt and seed) has a 95% bootstrap interval over prompts within the metric's equivalence margin
(``pipeline.eval.equivalence``: the rule, the margins and the power each verdict reports): a point
whose text loops fails on repetition / distinct-n even when the base model finds its loops
likely (low NLL). Each point reports, per metric, the difference, its interval, the smallest
difference the data could detect (mde) and the verdict (same, worse, better or undetermined).
"""

from __future__ import annotations

import json
import stat
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from multitoken.pipeline.eval import metrics as M
from multitoken.pipeline.eval.equivalence import CRITERIA, SAME_QUALITY_RULE, compare_to_ar, settings
from multitoken.pipeline.eval.speedup import acceptance_from_tokens, draft_cost_ratio, walltime_improvement
from multitoken.decoding.config import DYNAMO_PENALTY, DecodeConfig
from multitoken.decoding.engine import generate, generate_batch
from multitoken.base.config_io import expand_range, nested
from multitoken.base.data_formats import json_kind
from multitoken.base.errors import DataError, UsageError
from multitoken.pipeline.sources.assets import NO_STATS

# DynaMo's Table 7: the sentence-completion benchmark.
TABLE7_PROMPTS = (
    "I am a student at the", "This is going to be a very", "He wanted to play, but", "How can we", "What will",
    "Will you", "Please explain", "Do not", "Wow! I can't believe that", "This is amazing! We",
)
# DynaMo's Table 8 ablations: CO = co-occurrence mask (alpha_c), AT = adaptive (Otsu)
# thresholding, G-3 = Gaussian blur with kernel 3 before Otsu.
TABLE8 = {
    "CO+AT+G-3": {"alpha_c": 1.0, "adaptive_threshold": True, "blur_kernel": 3},
    "CO+AT": {"alpha_c": 1.0, "adaptive_threshold": True, "blur_kernel": 0},
    "CO": {"alpha_c": 1.0, "adaptive_threshold": False, "blur_kernel": 0},
    "CO-0.5+AT+G-3": {"alpha_c": 0.5, "adaptive_threshold": True, "blur_kernel": 3},
    "AT+G-3": {"alpha_c": 0.0, "adaptive_threshold": True, "blur_kernel": 3},
}
DEFAULT_CONFIG = "CO+AT+G-3"
MAX_SEEDS = 1000
DEFAULT_GRID = tuple(i / 10 for i in range(11))  # eps_b 0:1:0.1
QUALITY = ("nll", "distinct2", "distinct3", "repetition")


# The sampling settings every run shares (sweep reads them as they apply to it: no --greedy).
SAMPLING_FLAGS = ("max_new_tokens", "temperature", "top_k", "repetition_penalty")
SAMPLING_HELP = {
    "max_new_tokens": {"help": "tokens generated per run"},
    "temperature": {"help": "sampling temperature (DynaMo: 0.7)"},
    "top_k": {"help": "top-k per head (DynaMo: 50)"},
    "repetition_penalty": {"help": "repetition penalty of every run, ar and hf-sample included (DynaMo: 1.1)",
                           "default_help": f"{DYNAMO_PENALTY:g}"},
    "n": {"help": "dynamic points: tokens per forward at most (default: every head)"},
    "dynamic_joint": {"help": "dynamic points: conditional (the base's t+1, then the heads' conditionals given it: conditioned "
                              "and eagle3 heads) or outer (the heads' marginals); auto: conditional where the heads condition"},
}
DYNAMIC_FLAGS = ("n", "dynamic_joint")  # settings only the dynamic points read (ar emits one token, from the base)


@dataclass
class SweepConfig:
    """A sweep; the model is loaded apart (``BackboneConfig``). ``decode``: ar's settings, which
    every point shares but for mode, eps_b and the Table 8 switches (``decode_configs``)."""

    heads: str | None = field(default=None, metadata={"help": "heads dir, or embedded:NAME for one the package ships (default: the embedded trained heads)"})
    stats: str | None = field(default=None, metadata={"help": "co-occurrence stats dir (or embedded:NAME) (default: the embedded stats for the embedded base; 'none': no mask)"})
    prompts: str | None = field(default=None, metadata={"help": "prompts file: one per line, or jsonl with a 'prompt'/'text' field (default: DynaMo's Table 7)"})
    eps_b: tuple[float, ...] = field(default=DEFAULT_GRID, metadata={"help": "eps_b values: e.g. 0 0.5 1, or a range start:stop:step (stop included)", "default_help": "0:1:0.1"})
    seeds: int = field(default=3, metadata={"help": "sampling seeds per prompt"})
    decode: DecodeConfig = nested(DecodeConfig, flags=SAMPLING_FLAGS + DYNAMIC_FLAGS, help=SAMPLING_HELP, mode="ar")
    hf_sample: bool = field(default=True, metadata={"help": "also time transformers' sampling generate (the hf-sample reference row)"})
    ablations: bool = field(default=False, metadata={"help": f"also run DynaMo's Table 8 ablations ({', '.join(TABLE8)})"})
    out: str | None = field(default=None, metadata={"help": "output directory (sweep.json, sweep.csv, sweep.png, sweep_config.json)"})
    batch_size: int = field(default=1, metadata={"help": "prompt x seed runs decoded together (same tokens as 1; timings per batch)"})
    quiet: bool = field(default=False, metadata={"help": "no progress lines"})

    def validate(self) -> None:
        """The flags alone, before a model loads; the sampling settings are DecodeConfig's
        (validated there, as for generate)."""
        if not 1 <= self.seeds <= MAX_SEEDS:  # every seed is a run per prompt and point: a million never ends
            raise UsageError(f"--seeds must be in [1, {MAX_SEEDS}], got {self.seeds}",
                             "a few seeds per prompt; more prompts (--prompts FILE) tell points apart better")
        self.decode.validate()
        if self.batch_size < 1:
            raise UsageError(f"--batch-size must be >= 1, got {self.batch_size}")

    def configs(self) -> list[str]:
        names = list(TABLE8) if self.ablations else [DEFAULT_CONFIG]
        if self.stats == NO_STATS:  # no table, no co-occurrence mask: only the CO-free rows apply
            names = [n for n in names if TABLE8[n]["alpha_c"] == 0.0] or ["AT+G-3"]
        return names


def parse_grid(spec) -> list[float]:
    """eps_b values -> sorted unique values in [0, 1]. ``spec``: numbers, or tokens each a value
    or a ``start:stop:step`` range (stop included), as ``--eps-b`` takes them: ``[0, 0.5, 1]``,
    ``["0:1:0.1"]``, or one such string (``"0:1:0.1"``, ``"0 0.5 1"``)."""
    tokens = spec.split() if isinstance(spec, str) else list(spec)
    try:
        values = [v for t in tokens for v in expand_range(t)]
    except ValueError as err:
        raise UsageError(f"bad --eps-b ({err})", "give values like --eps-b 0 0.5 1 or a range like --eps-b 0:1:0.1") from err
    if not values or any(not 0 <= v <= 1 for v in values):
        raise UsageError(f"--eps-b {' '.join(map(str, tokens))} must give values in [0, 1]")
    return sorted(set(values))


def read_prompts(path: str) -> list[str]:
    """Prompts from a text file (one per non-empty line) or jsonl (``prompt`` or ``text``)."""

    if not path:
        return list(TABLE7_PROMPTS)
    p = Path(path)
    fix = "pass a UTF-8 text file with one prompt per line, or jsonl with a 'prompt' or 'text' field"
    if not p.exists():
        raise DataError(f"prompts file {path!r} not found", fix)
    mode = p.stat().st_mode
    if not (stat.S_ISREG(mode) or stat.S_ISFIFO(mode)):  # a pipe: <(...); a device could never end
        raise DataError(f"prompts file {path!r} is {'a directory' if p.is_dir() else 'not a regular file'}", fix)
    try:
        text = p.read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:
        raise DataError(f"prompts file {path!r} is not UTF-8 text (byte offset {err.start})", fix) from err
    lines = [(i, line) for i, line in enumerate(text.splitlines(), 1) if line.strip()]
    if p.suffix in (".jsonl", ".json"):
        lines = [(i, _json_prompt(line, f"{path}:{i}")) for i, line in lines]
    prompts = [line for _, line in lines if line.strip()]
    if not prompts:
        raise DataError(f"prompts file {path!r} holds no prompt{'' if text.strip() else ' (it is empty)'}", fix)
    return prompts


def _json_prompt(line: str, where: str) -> str:
    """The ``prompt`` (or ``text``) string of one jsonl line."""


    fix = 'each line must be a JSON object such as {"prompt": "Once upon a time"}'
    try:
        row = json.loads(line)
    except json.JSONDecodeError as err:
        raise DataError(f"{where}: not valid JSON ({err.msg})", fix) from err
    value = row.get("prompt", row.get("text")) if isinstance(row, dict) else None
    if not isinstance(value, str):
        got = f"a JSON {json_kind(row)}, not an object" if not isinstance(row, dict) else "no 'prompt' or 'text' string"
        raise DataError(f"{where}: holds {got}", fix)
    return value


def continuation_nll(backbone, prompt_ids: list[int], new_ids: list[int]) -> float:
    """Base model's mean -log p(x_t | x_<t) over the continuation (temperature 1, full vocab)."""
    if not new_ids:
        return float("nan")
    ids = torch.tensor([prompt_ids + new_ids], device=backbone.device)  # [1, P + N]
    with torch.no_grad():
        logits = backbone.causal_lm(input_ids=ids).logits[0, len(prompt_ids) - 1:-1].float()  # [N, V]
    logp = torch.log_softmax(logits, -1)
    target = torch.tensor(new_ids, device=logp.device)
    return float(-logp.gather(-1, target[:, None]).mean())


class NllMemo:
    """``continuation_nll`` scoring each (prompt, continuation) once: ar's second run of a batch and
    grid points that produce the same tokens reuse the value (same input, same forward, same float)."""

    def __init__(self):
        self.memo = {}

    def __call__(self, backbone, prompt_ids: list[int], new_ids: list[int]) -> float:
        key = (tuple(prompt_ids), tuple(new_ids))
        if key not in self.memo:
            self.memo[key] = continuation_nll(backbone, prompt_ids, new_ids)
        return self.memo[key]


def _no_nll(backbone, prompt_ids: list[int], new_ids: list[int]) -> float:
    """Warm-up runs are discarded: no quality forward for them."""
    return float("nan")


def run_once(model, prompt_ids: list[int], decode_cfg, table, nll=continuation_nll) -> dict:
    """One generation and its per-run measurements (``nll``: the scorer, default ``continuation_nll``)."""
    cpu = time.process_time()
    result = generate(model, prompt_ids, decode_cfg, table=table)
    cpu = time.process_time() - cpu  # immune to other processes' load, unlike wall time
    new, trace = result.token_ids, result.trace
    return {
        "tokens": len(new), "tokens_per_forward": trace.tokens_per_forward,
        "sec_per_token": trace.wall_s / max(len(new), 1), "cpu_per_token": cpu / max(len(new), 1),
        "nll": nll(model.backbone, prompt_ids, new),
        "distinct2": M.distinct_n(new, 2), "distinct3": M.distinct_n(new, 3), "repetition": M.repetition_rate(new, 4),
    }


def run_batch(model, runs: list[tuple[list[int], int]], decode_cfg, table, nll=continuation_nll) -> list[dict]:
    """``run_once`` for (prompt ids, seed) runs decoded as one batch: each run's tokens are its
    one-at-a-time tokens; the timings are the batch's per token."""
    if len(runs) == 1:
        return [run_once(model, runs[0][0], replace(decode_cfg, seed=runs[0][1]), table, nll)]
    cpu, wall = time.process_time(), time.perf_counter()
    results = generate_batch(model, [p for p, _ in runs], decode_cfg, seeds=[s for _, s in runs], table=table)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    tokens = max(sum(len(r.token_ids) for r in results), 1)
    return [{"tokens": len(r.token_ids), "tokens_per_forward": r.trace.tokens_per_forward,
             "sec_per_token": wall / tokens, "cpu_per_token": cpu / tokens,
             "nll": nll(model.backbone, p, r.token_ids), "distinct2": M.distinct_n(r.token_ids, 2),
             "distinct3": M.distinct_n(r.token_ids, 3), "repetition": M.repetition_rate(r.token_ids, 4)}
            for (p, _), r in zip(runs, results)]


def _warm_up(model, runs: list[tuple[list[int], int]], ar_cfg, grid_cfgs, table) -> None:
    """A few untimed tokens of ar and of each config's first point at the sweep's batch size:
    one-time costs (compiled kernels loading, first allocations of a batch shape) would otherwise
    land on whichever run comes first."""
    firsts = {name: dcfg for name, _, dcfg in reversed(grid_cfgs)}
    for dcfg in (ar_cfg, *firsts.values()):
        run_batch(model, runs, replace(dcfg, max_new_tokens=min(4, dcfg.max_new_tokens)), table, _no_nll)


def _average_timing(a: dict, b: dict) -> dict:
    """Two runs of the same (deterministic) generation: same tokens, mean of the timings."""
    return {**a, **{k: (a[k] + b[k]) / 2 for k in ("sec_per_token", "cpu_per_token")}}


def _summarise(runs: list[dict], ar_runs: list[dict] | None) -> dict:
    point = {key: M.mean_ci([r[key] for r in runs]) for key in ("tokens_per_forward",) + QUALITY}
    if ar_runs is not None:
        for key, per_token in (("wall_speedup", "sec_per_token"), ("cpu_speedup", "cpu_per_token")):
            ratios = [a[per_token] / r[per_token] for a, r in zip(ar_runs, runs) if r[per_token] > 0]
            point[key] = M.mean_ci(ratios)
    point["sec_per_token"] = M.mean_ci([r["sec_per_token"] for r in runs])
    return point


def theory(point: dict, n_future: int, c: float) -> dict:
    """Acceptance implied by the measured tokens per forward, and speculative sampling's wall-time speed-up (Leviathan et al.)
    predicted from it with the draft cost ratio c (decoding logic costs nothing in the model)."""
    g = n_future - 1
    tpf = min(max(point["tokens_per_forward"]["mean"], 1.0), g + 1.0)
    if g < 1:
        return {"implied_acceptance": 0.0, "predicted_wall_speedup": 1.0}
    a = acceptance_from_tokens(tpf, g)
    return {"implied_acceptance": a, "predicted_wall_speedup": walltime_improvement(a, g, c)}


def same_quality(points: list[dict], ar: dict) -> dict | None:
    """The point with the most tokens per forward of ar's quality (``same_quality``: all four
    verdicts ``same``, ``SAME_QUALITY_RULE``), with its paired differences from ar."""
    ok = [p for p in points if p["same_quality"]]
    if not ok:
        return None
    best = max(ok, key=lambda p: p["tokens_per_forward"]["mean"])
    tests = {k: {x: best["vs_ar"][k][x] for x in ("diff", "lo", "hi", "mde", "margin", "verdict")} for k in CRITERIA}
    return {"config": best["config"], "eps_b": best["eps_b"], "tokens_per_forward": best["tokens_per_forward"]["mean"],
            "wall_clock": best["wall_speedup"]["mean"], "cpu_time": best["cpu_speedup"]["mean"], "nll": best["nll"]["mean"],
            "ar_nll": ar["nll"]["mean"], "rule": SAME_QUALITY_RULE,
            "metrics": {k: {"point": best[k]["mean"], "ar": ar[k]["mean"], **tests[k]} for k in CRITERIA}}


def decode_configs(cfg: SweepConfig, grid: list[float]):
    """ar's config and every (config name, eps_b, dynamic config): the dynamic points differ from
    ar only in mode, eps_b and the Table 8 switches, never in a sampling setting (seeds are set
    per run, the same for all)."""
    ar = replace(cfg.decode, mode="ar").resolved()
    return ar, [(name, eps, replace(ar, mode="dynamic", eps_b=eps, **TABLE8[name])) for name in cfg.configs() for eps in grid]


def run_hf_sample(backbone, prompt_ids: list[int], decode_cfg, nll=continuation_nll) -> dict:
    """transformers' sampling ``generate`` at ``decode_cfg``'s settings and seed, measured like
    ``run_once``. Its repetition penalty is transformers' logit form (see the module docstring)."""
    ids = torch.tensor([prompt_ids], device=backbone.device)
    tok = backbone.tokenizer
    torch.manual_seed(decode_cfg.sampling.seed)  # transformers draws from torch's global generator
    cpu, wall = time.process_time(), time.perf_counter()
    out = backbone.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, num_beams=1,
                                  max_new_tokens=decode_cfg.max_new_tokens, temperature=decode_cfg.sampling.temperature,
                                  top_k=decode_cfg.sampling.top_k, top_p=1.0, repetition_penalty=decode_cfg.sampling.penalty,
                                  pad_token_id=getattr(tok, "eos_token_id", None))
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    new = out[0, ids.shape[1]:].tolist()
    return {
        "tokens": len(new), "tokens_per_forward": 1.0,
        "sec_per_token": wall / max(len(new), 1), "cpu_per_token": cpu / max(len(new), 1),
        "nll": nll(backbone, prompt_ids, new),
        "distinct2": M.distinct_n(new, 2), "distinct3": M.distinct_n(new, 3), "repetition": M.repetition_rate(new, 4),
    }


def sweep(model, cfg: SweepConfig, prompts: list[str], grid: list[float], table=None, log=print) -> dict:
    """Run the whole grid; returns the JSON-ready result (``points``, ``ar``, ``hf_sample``,
    ``same_quality_speedup``)."""
    tok = model.backbone.tokenizer
    prompt_ids = [tok(p, add_special_tokens=True)["input_ids"] for p in prompts]
    base_cfg, grid_cfgs = decode_configs(cfg, grid)
    pairs = [(i, s) for i in range(len(prompts)) for s in range(cfg.seeds)]
    clusters = [i for i, _ in pairs]  # run k of every point, ar and hf-sample: prompt clusters[k]
    started = time.perf_counter()
    # Pair-major order: a prompt/seed's ar reference runs just before and just after its grid
    # points and hf-sample, so on a shared machine the load the timings see changes little between them.
    # Batches of pairs (--batch-size) keep that order: ar before and after each batch's points.
    ar_runs, hf_runs, point_runs = [], [], [[] for _ in grid_cfgs]
    nll = NllMemo()
    log(f"{len(pairs)} prompt x seed runs of {len(grid_cfgs)} points, ar before and after each"
        f"{' and hf-sample' if cfg.hf_sample else ''}, {base_cfg.max_new_tokens} tokens per run; warming up")
    _warm_up(model, [(prompt_ids[i], s) for i, s in pairs[:cfg.batch_size]], base_cfg, grid_cfgs, table)
    log(f"warmed up ({time.perf_counter() - started:.0f} s)")
    for first in range(0, len(pairs), cfg.batch_size):
        chunk = pairs[first:first + cfg.batch_size]
        runs_in = [(prompt_ids[i], s) for i, s in chunk]
        before = run_batch(model, runs_in, base_cfg, table, nll)
        # the point run first after ar pays the switch of code paths (cold caches): rotate the
        # grid's order from one batch to the next so that no point always runs first
        shift = (first // cfg.batch_size) % len(grid_cfgs) if grid_cfgs else 0
        for j in [*range(shift, len(grid_cfgs)), *range(shift)]:
            point_runs[j].extend(run_batch(model, runs_in, grid_cfgs[j][2], table, nll))
        if cfg.hf_sample:
            hf_runs.extend(run_hf_sample(model.backbone, p, replace(base_cfg, seed=s), nll) for p, s in runs_in)
        ar_runs.extend(map(_average_timing, before, run_batch(model, runs_in, base_cfg, table, nll)))
        (i, s), done = chunk[-1], first + len(chunk)
        log(f"prompt {i + 1}/{len(prompts)} seed {s}: done ({done}/{len(pairs)}, {time.perf_counter() - started:.0f} s)")
    ar = {"config": "ar", **_summarise(ar_runs, None)}
    c = draft_cost_ratio(model)
    points = []
    for runs, (name, eps, _) in zip(point_runs, grid_cfgs):
        point = {"config": name, "eps_b": eps, **_summarise(runs, ar_runs)}
        point["theory"] = theory(point, model.n_future, c)
        points.append(_judged(point, runs, ar_runs, clusters))
    hf = _judged({"config": "hf-sample", **_summarise(hf_runs, ar_runs)}, hf_runs, ar_runs, clusters) if hf_runs else None
    sampling = {"temperature": base_cfg.sampling.temperature, "top_k": base_cfg.sampling.top_k, "repetition_penalty": base_cfg.sampling.penalty,
                "max_new_tokens": base_cfg.max_new_tokens, "seeds": list(range(cfg.seeds))}
    return {"prompts": prompts, "seeds": cfg.seeds, "eps_b": grid, "n_future": model.n_future, "draft_cost_ratio": c,
            "sampling": sampling, "ar": ar, "hf_sample": hf, "points": points, "same_quality_rule": SAME_QUALITY_RULE,
            "quality_test": settings(), "same_quality_speedup": same_quality(points, ar), "seconds": round(time.perf_counter() - started, 2)}


def _judged(point: dict, runs: list[dict], ar_runs: list[dict], clusters: list[int]) -> dict:
    """The point with its comparison to ar: ``vs_ar`` (criterion -> paired difference, interval,
    mde, margin, verdict: ``compare_to_ar``) and ``same_quality`` (every verdict ``same``)."""
    vs = compare_to_ar(runs, ar_runs, clusters)
    return {**point, "vs_ar": vs, "same_quality": all(v["verdict"] == "same" for v in vs.values())}
