"""The generation loop: one forward pass per step over the tokens decided in the previous step
(plus any drafts), then propose -> accept -> commit -> crop caches.

State between steps: ``out`` (the last pass), ``anchor`` (its position whose heads predict the
next tokens) and ``forced`` (a token already decided by the last verification). Batch size 1;
the state is per sequence, so a batch version keeps one of each per row.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from .accept import greedy_accept, speculative_accept, typical_rule
from .config import DecodeConfig, check_context
from .dynamo import always_backs_off, dynamic_propose, prepare_kernel
from .proposal import Drafts, HeadScores, joint_drafts, pick_drafter
from .sampling import Sampler, penalised_logits, rows_seen
from .text import continuation_text
from .timing import clock_for
from .trace import Trace
from .tree_step import TreeSteps
from multitoken.base.errors import UsageError


@dataclass
class RunState:
    """What proposal and acceptance functions may read."""

    model: object
    cfg: DecodeConfig
    sampler: Sampler
    table: object  # co-occurrence table with .mask(cands, alpha), or None
    seen: torch.Tensor  # [V] bool on the logits' device: tokens in the context (repetition penalty)
    rng: np.random.Generator | None  # grid sampling; None = greedy
    vocab_size: int
    draft_cfg: DecodeConfig | None = None  # the joint drafter's grid: no thresholds (set once)
    kernels: Counter = field(default_factory=Counter)  # grids built per path (sparse.py), for the trace
    seen_host: np.ndarray | None = None  # ``seen`` for the numpy grids, kept in step by ``mark``
    candidates: list | None = None  # heads 1..g's top-k, read for a whole batch at once (decoding.batch; joint drafts take them once)

    def seen_array(self) -> np.ndarray:
        """``seen`` for the numpy grids: copied from the device once, then updated on the host
        alongside it (``mark``), so a step's only reads of the device stay its own."""
        if self.seen_host is None:
            self.seen_host = self.seen.cpu().numpy().copy()
        return self.seen_host

    def mark(self, tokens: list[int]) -> None:
        """Tokens now in the context (host ids): the device mask and its host mirror."""
        self.seen[tokens] = True
        if self.seen_host is not None:
            self.seen_host[tokens] = True


@dataclass
class DecodeResult:
    token_ids: list[int]  # the generated tokens (prompt excluded)
    text: str
    trace: Trace
    prompt_ids: list[int] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"token_ids": self.token_ids, "text": self.text, "trace": self.trace.as_dict()}


def _eos_ids(model) -> set[int]:
    eos = getattr(model.backbone.causal_lm.generation_config, "eos_token_id", None)
    if eos is None:
        eos = model.backbone.config.eos_token_id
    return set(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])


def stats_order_cap(cfg: DecodeConfig, n_heads: int, table, joint_drafter: bool) -> int | None:
    """The stats' highest order when decoding would mask more positions than it holds (dynamic
    or joint drafts, e.g. 4 heads with order-3 stats): only that many heads are read then."""
    top = getattr(table, "max_order", None)  # a table with only .mask() masks any order
    masks = top is not None and cfg.alpha_c > 0 and (cfg.mode == "dynamic" or joint_drafter)
    return top if masks and cfg.order(n_heads) > top else None


def _acceptor(cfg: DecodeConfig):
    if cfg.mode == "typical":
        return typical_rule(cfg.typical_eps, cfg.typical_delta)
    return greedy_accept if cfg.greedy else speculative_accept


@torch.inference_mode()  # cheaper than no_grad per op: a small model's step is mostly op overhead
def generate(model, prompt_ids, cfg: DecodeConfig | None = None, *, table=None, on_tokens=None,
             drafter=None, acceptor=None, profile: bool = False, tree_accuracies=None) -> DecodeResult:
    """Continue ``prompt_ids`` (list or [1, T] tensor) with ``model`` (a ``MultiTokenModel``).

    ``table``: co-occurrence stats for dynamic masking; ``on_tokens(list[int])`` is called as
    tokens become final (streaming). ``drafter`` / ``acceptor`` override the proposal and
    acceptance functions (same signatures as in ``proposal`` / ``accept``). ``profile``: make
    the trace's model / logic split exact on an accelerator (synchronise at every clock reading;
    off by default: the waits cost time). Per step, the host reads the device once: the
    committed ids (dynamic's grid reads its candidates, built on the host).
    ``tree_accuracies``: a ``tree.Accuracies`` for ``--tree static`` (default: the file beside
    the heads, ``model.heads_dir``, else the fallback prior).
    """
    cfg = cfg or DecodeConfig()
    vocab = model.backbone.vocab_size
    cfg.validate(vocab_size=vocab, n_heads=model.n_future, max_order=stats_order_cap(cfg, model.n_future, table, False),
                 table=table)
    cfg = cfg.resolved()  # the repetition penalty's default depends on --greedy
    ids = torch.as_tensor(prompt_ids, dtype=torch.long).reshape(1, -1).to(model.backbone.device)
    if ids.shape[1] == 0:
        raise UsageError("the prompt is empty", "pass at least one token")
    check_context(ids.shape[1], cfg.max_new_tokens, model.backbone.config.max_position_embeddings)
    speculative = cfg.mode in ("speculative", "typical")
    sampler = Sampler(cfg.greedy, cfg.temperature, cfg.top_k, cfg.seed, penalty=cfg.penalty, device=ids.device)
    run = RunState(model, cfg, sampler, table, torch.zeros(vocab, dtype=torch.bool, device=ids.device),
                   None if cfg.greedy else np.random.default_rng(cfg.seed), vocab)
    run.seen[ids[0]] = True
    run.draft_cfg = replace(cfg, static_threshold=False, adaptive_threshold=False)
    custom = drafter is not None or acceptor is not None
    drafter = drafter or (pick_drafter(cfg.drafter, model.heads, table) if speculative else None)
    acceptor = acceptor or _acceptor(cfg)
    order, eos = cfg.order(model.n_future), _eos_ids(model)
    cap = stats_order_cap(cfg, model.n_future, table, drafter is joint_drafts and cfg.tree == "chain")
    order = cap or order  # the mask covers only the stats' orders: read that many heads
    heads_read = 1 if cfg.mode == "dynamic" and always_backs_off(cfg) else order
    # greedy ar / speculative read only the base argmax: raw logits, no softmax over V per step
    argmax_only = cfg.greedy and acceptor in (greedy_accept, speculative_accept)
    wants_rule = getattr(acceptor, "wants_rule_probs", False) and not cfg.greedy

    def next_token(pos: int) -> int:
        """A token from the base's target after position ``pos`` (top-k first: k-sized work);
        read on the host: it is committed."""
        return int(run.sampler.sample(out.base_logits()[0, pos - out.first], run.seen))

    def verify_rows(pos: int, drafts: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """The base's targets after ``pos`` and after each draft # [g + 1, V] (greedy: penalised
        logits), row i seeing drafts[:i] as context too; plus typical's whole-vocabulary rows."""
        logits = out.base_logits()[0, pos - out.first:]  # [g + 1, V]
        seen = rows_seen(run.seen, drafts, logits.shape[0]) if cfg.penalty != 1 else run.seen
        if argmax_only:
            return penalised_logits(logits, seen, cfg.penalty), {}
        if wants_rule:  # rows judging drafts only, not the bonus row
            rule = {"rule_probs": run.sampler.full(logits[:-1], seen[:-1] if seen.dim() == 2 else seen)}
        else:
            rule = {}
        return run.sampler.target(logits, seen), rule

    trace = Trace(mode=cfg.mode, prompt_tokens=ids.shape[1], repetition_penalty=cfg.penalty,
                  stats_order_cap=cap or 0, device=str(ids.device), synchronised=profile)
    clock = clock_for(ids.device, profile)
    out_ids = []

    def emit(tokens: list[int]) -> bool:
        """Commit final tokens; True when generation is over (budget or end of sequence)."""
        tokens = tokens[: cfg.max_new_tokens - len(out_ids)]
        if cfg.stop_at_eos:
            stop = next((i for i, t in enumerate(tokens) if t in eos), None)
            tokens = tokens if stop is None else tokens[: stop + 1]
        out_ids.extend(tokens)
        run.mark(tokens)
        if on_tokens and tokens:
            on_tokens(tokens)
        return len(out_ids) >= cfg.max_new_tokens or (cfg.stop_at_eos and bool(tokens) and tokens[-1] in eos)

    def forward(new: torch.Tensor, read_from: int, **tree):
        start = clock()
        # heads past heads_read and positions before read_from are never read; tree: attend + offsets
        result = model.step(new.reshape(1, -1), caches, heads_upto=heads_read, read_from=read_from, **tree)
        result.clock, result.unembed_rows = clock, trace.unembed_rows  # its lazy unembeddings report here
        trace.model_s += clock() - start
        trace.forward_passes += 1
        return result

    if cfg.mode == "dynamic" or drafter is joint_drafts:
        prepare_kernel(cfg, table, order)  # numba compiles / loads its cache here, off the clock
    # issue 17 hook: a candidate tree per step instead of a chain (decoding/tree_step.py)
    if cfg.tree != "chain" and custom:
        raise UsageError("--tree static / dynamic build their own candidates and acceptance", "pass --tree chain with a custom drafter or acceptor")
    trees = TreeSteps(model, cfg, run, order, trace, tree_accuracies) if cfg.tree != "chain" else None
    t0 = clock()
    caches = model.new_caches()
    out = forward(ids, ids.shape[1] - 1)
    trace.prefill_s = trace.model_s
    anchor, forced = ids.shape[1] - 1, None
    while True:
        # propose: the tokens decided for the next positions (+ drafts to verify)
        if cfg.mode == "dynamic":
            heads = HeadScores(out, anchor, order)  # read on demand: eps_b = 1 reads head 1 only
            choice = dynamic_propose(heads, cfg, table, run.seen_array(), run.rng)
            commit, drafts = choice.tokens, Drafts.empty(ids.device)
            trace.orders[choice.order] += 1
            trace.backoffs.update(choice.backed_off)
            run.kernels.update(choice.kernels)
        else:
            # the next token comes from the base model itself (head 1 may differ: WHS all_heads)
            commit = [forced if forced is not None else next_token(anchor)]
            budget = cfg.max_new_tokens - len(out_ids) - 1
            g = min(order - 1, budget) if speculative else 0
            drafts = drafter(out, anchor, commit[0], g, run) if g > 0 and trees is None else Drafts.empty(ids.device)
            if drafts.tokens.device != ids.device:  # a custom drafter's host tensors: moved once
                drafts = Drafts(drafts.tokens.to(ids.device), None if drafts.probs is None else drafts.probs.to(ids.device))
        trace.model_s, out.model_s = trace.model_s + out.model_s, 0.0  # head distributions: model time
        if emit(commit):
            break
        if trees is not None:  # issue 17 hook: verify a tree, keep its accepted path
            out, anchor, forced, done = trees.step(out, anchor, commit[0], g, caches, forward, emit)
            if done:
                break
            continue
        # one forward pass over the decided tokens and the drafts
        new = torch.cat([torch.tensor(commit, dtype=torch.long, device=ids.device), drafts.tokens])
        out = forward(new, len(commit) - 1)
        anchor, forced = len(commit) - 1, None
        if drafts.tokens.numel():
            # accept: the base judges draft i by its distribution after position anchor + i
            target, rule = verify_rows(anchor, drafts.tokens)  # [g + 1, V]
            verdict = acceptor(drafts.tokens, drafts.probs, target, run.sampler, **rule)
            # the step's one host read: [accepted, next token, drafts...]
            accepted, forced, *drafted = torch.cat([verdict.packed, drafts.tokens]).tolist()
            trace.accepted_lengths[accepted] += 1
            caches.crop(len(drafted) - accepted)  # commit: forget rejected drafts
            anchor += accepted
            if emit(drafted[:accepted]):
                break
    trace.model_s += out.model_s
    trace.wall_s = clock() - t0
    trace.dynamic_kernel = run.kernels
    trace.new_tokens = len(out_ids)
    tok = model.backbone.tokenizer
    prompt = ids[0].tolist()  # once per call, after the loop
    text = continuation_text(tok, prompt, out_ids) if tok is not None else ""
    return DecodeResult(out_ids, text, trace, prompt)
