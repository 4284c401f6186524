"""Device placement of decoding, checked on the CPU: every proposal, acceptance and sampling
function runs with its target tensors on ``meta`` (the stand-in for an accelerator: shapes and
devices, no values). Under ``OnlyOn`` every aten op must read and write tensors of that device
only (0-d CPU scalars aside), so a CPU tensor mixed in, a CPU index, or a host read (``int()``,
``.tolist()``: meta has no values to read) fails the test. Host ids may travel *to* the device
(copies). DynaMo's grids (the dynamic step, ``joint_drafts``) are built on the host from the
heads' top-k: ``HostReads`` lets those functions read the device, hands them a plausible top-k,
and counts the reads (one per step). Exempt: the loop's one host read per step (the committed ids).
"""

from __future__ import annotations

import time
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from multitoken.decoding.rules import greedy_accept, speculative_accept, typical_accept, typical_rule
from multitoken.decoding.config import DecodeConfig
from multitoken.decoding.engine import generate_batch
from multitoken.decoding.drafts import cp_drafts, independent_drafts, joint_drafts
from multitoken.decoding.plan import resolve
from multitoken.decoding.proposal import RowHeads
from multitoken.decoding.dynamo import head_candidates
from multitoken.decoding.sampling import Sampler, penalised_logits, processed_probs, rows_seen, top_probs, with_tokens
from multitoken.decoding.trace import Trace
from multitoken.decoding.trees import fallback_accuracies
from multitoken.pipeline.model.loading import BackboneConfig, load_backbone
from multitoken.pipeline.model.draft_vocab import read_ranking

from ..conftest import rank_odd_tokens
from .conftest import attach

META = torch.device("meta")
V = 11
COPIES = {"_to_copy", "copy_", "lift_fresh", "lift_fresh_copy"}  # host data moving to the device


class OnlyOn(TorchDispatchMode):
    """Records every aten op that touches a tensor off ``device`` (inputs or outputs); copies
    onto the device are allowed (a host id becoming a device tensor), copies off it are not."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device, self.bad = device, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        inputs = [] if name in COPIES else tree_leaves((args, kwargs))
        out = func(*args, **kwargs)
        for t in inputs + tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device != self.device and not (t.dim() == 0 and t.device.type == "cpu"):
                self.bad.append(f"{name}: a tensor on {t.device}")
        return out


@pytest.fixture
def only_meta():
    mode = OnlyOn(META)
    with mode:
        yield mode
    assert not mode.bad, mode.bad


def on_meta(*tensors) -> bool:
    return all(t.device == META for t in tensors)


def sampler(greedy: bool, penalty: float = 1.1, top_k: int = 4) -> Sampler:
    return Sampler(greedy, 0.7, top_k, seed=0, penalty=penalty, device=META)


def test_the_checker_catches_mixing_and_host_reads():
    """The stand-in works: a CPU tensor in an op, or a host read, fails on meta."""
    x = torch.zeros(V, device=META)
    mode = OnlyOn(META)
    with mode:
        x[torch.tensor([1, 2])]  # a CPU index into a device tensor: an implicit transfer
    assert mode.bad
    with pytest.raises(RuntimeError, match="meta"):
        x + torch.zeros(V)
    with pytest.raises(RuntimeError):
        int(x.argmax())


@pytest.mark.parametrize("top_k", [0, 4])
def test_target_functions_stay_on_the_device(only_meta, top_k):
    logits, seen = torch.randn(3, V, device=META), torch.zeros(V, dtype=torch.bool, device=META)
    ids, probs = top_probs(logits, 0.7, top_k, seen, 1.1)
    assert on_meta(probs) and (ids is None or on_meta(ids))
    assert on_meta(processed_probs(logits, 0.7, top_k, seen, 1.1), penalised_logits(logits, seen, 1.1))
    rows = rows_seen(seen, torch.zeros(2, dtype=torch.long, device=META), 3)
    assert rows.shape == (3, V) and on_meta(rows)
    assert on_meta(with_tokens(seen, torch.tensor([1, 4], device=META)), with_tokens(seen, [1, 4]))


@pytest.mark.parametrize("greedy", [True, False])
def test_sampler_methods_stay_on_the_device(only_meta, greedy):
    s, logits = sampler(greedy), torch.randn(V, device=META)
    seen = torch.zeros(V, dtype=torch.bool, device=META)
    tok = s.sample(logits, seen)
    assert tok.shape == () and tok.dtype == torch.long and on_meta(tok)
    tok, q = s.draft(logits, seen)
    assert on_meta(tok) and (q is None if greedy else on_meta(q) and q.shape == (V,))
    assert on_meta(s.target(logits[None], seen), s.full(logits[None], seen), s.draw(torch.rand(V, device=META)), s.uniform(3))


@pytest.mark.parametrize("rule", ["greedy", "speculative", "typical"])
def test_acceptance_stays_on_the_device(only_meta, rule):
    g = 2
    drafts = torch.zeros(g, dtype=torch.long, device=META)
    target = torch.rand(g + 1, V, device=META)
    q = None if rule == "greedy" else torch.rand(g, V, device=META)
    s = sampler(greedy=rule == "greedy")
    if rule == "typical":
        verdict = typical_accept(drafts, q, target, s)
        verdict2 = typical_rule(0.09, 0.3)(drafts, q, target, s, rule_probs=torch.rand(g, V, device=META))
        assert on_meta(verdict2.packed)
    else:
        verdict = (greedy_accept if rule == "greedy" else speculative_accept)(drafts, q, target, s)
    assert on_meta(verdict.packed) and verdict.packed.shape == (2,)


def meta_heads(n_heads: int, layer_heads: bool = False):
    """A row's head scores at its anchor on meta (``layer_heads``: heads 1.. read as raw logits,
    as replicated / WHS heads are; the drafters read them alike)."""
    return [torch.randn(V, device=META) for _ in range(n_heads)]


def meta_row(greedy: bool, vocab: int = V):
    """A row's decoding state with its context mask and sampler on meta."""
    return SimpleNamespace(seen=torch.zeros(vocab, dtype=torch.bool, device=META), seen_host=np.zeros(vocab, dtype=bool),
                           sampler=sampler(greedy, top_k=min(4, vocab)), rng=None if greedy else np.random.default_rng(0),
                           trace=Trace())


def meta_run(model, greedy: bool, vocab: int = V):
    cfg = DecodeConfig(mode="speculative", greedy=greedy, top_k=min(4, vocab)).resolved()
    plan = resolve(cfg, model or SimpleNamespace(n_future=3, heads=None))
    return SimpleNamespace(model=model, cfg=cfg, plan=plan, table=None, vocab=vocab, device=META, clock=time.perf_counter,
                           draft_cfg=replace(cfg, static_threshold=False, adaptive_threshold=False))


@pytest.mark.parametrize("layer_heads", [True, False])
@pytest.mark.parametrize("greedy", [True, False])
def test_independent_drafts_stay_on_the_device(only_meta, greedy, layer_heads):
    drafts = independent_drafts(meta_heads(3, layer_heads), 5, 2, meta_row(greedy), meta_run(None, greedy))
    assert drafts.tokens.shape == (2,) and on_meta(drafts.tokens)
    assert drafts.probs is None if greedy else on_meta(drafts.probs) and drafts.probs.shape == (2, V)


@pytest.fixture(scope="module")
def meta_models(tiny_llama_dir):
    """CP, replicated and eagle3 heads on a tiny Llama, everything moved to meta (a fresh backbone: the
    shared one stays usable)."""
    models = {}
    for head_type in ("cp", "replicated", "eagle3"):
        model = attach(load_backbone(BackboneConfig(base=str(tiny_llama_dir))), head_type)
        models[head_type] = model.to(META)
    return models


def meta_step(model, tokens: int, read_from: int):
    """A real incremental pass on meta (prompt, or commit + drafts)."""
    caches = model.new_caches()
    return model.step(torch.zeros(1, tokens, dtype=torch.long, device=META), caches, read_from=read_from)


def test_a_verification_pass_unembeds_only_the_rows_read_on_the_device(meta_models):
    """Layer heads on meta: the base rows of every position, then the heads at one position.
    On meta (an accelerator stand-in: any row count runs at the 1-row rate) everything goes in
    one call; the CPU rule is tested with real values in test_incremental."""
    model = meta_models["replicated"]
    out = meta_step(model, 3, 0)  # commit + 2 drafts
    mode = OnlyOn(META)
    with mode:
        base = out.base_logits()
        head = out.head_log_probs(1, 2)
    assert not mode.bad, mode.bad
    assert base.shape[:2] == (1, 3) and on_meta(base, head)
    assert dict(out.unembed_rows) == {3 * 3: 1}  # base + 2 head layers at 3 positions, one call


@pytest.mark.parametrize("greedy", [True, False])
def test_cp_drafts_stay_on_the_device(meta_models, greedy):
    model = meta_models["cp"]
    vocab = model.backbone.vocab_size
    out = meta_step(model, 4, 3)
    mode = OnlyOn(META)
    with mode:
        drafts = cp_drafts(RowHeads(out, 0, (3,), 3), 5, 2, meta_row(greedy, vocab), meta_run(model, greedy, vocab))
    assert not mode.bad, mode.bad
    assert drafts.tokens.shape == (2,) and on_meta(drafts.tokens)
    assert drafts.probs is None if greedy else on_meta(drafts.probs)


class HostReads(OnlyOn):
    """``OnlyOn`` that also allows copies off the device (and scalar reads), counts them, and
    answers them with host data (meta has none): a packed top-k [m, 2, k] gets ids 0..k-1 and probabilities
    falling from the first, anything else zeros. Ops on host tensors alone are the host's work
    on what it read (numpy views): allowed; an op mixing host and device tensors is not."""

    def __init__(self, device: torch.device):
        super().__init__(device)
        self.reads = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        src = args[0] if args else None
        if func.overloadpacket.__name__ in ("_to_copy", "to") and isinstance(src, torch.Tensor) and src.device == self.device \
                and torch.device(kwargs.get("device", self.device)).type == "cpu":
            self.reads.append(tuple(src.shape))
            return fake_host(tuple(src.shape), kwargs.get("dtype") or src.dtype)
        if func.overloadpacket.__name__ == "_local_scalar_dense" and isinstance(src, torch.Tensor) \
                and src.device == self.device:  # int() / float() / .item() of a device scalar
            self.reads.append(())
            return 0.0 if src.dtype.is_floating_point else 0
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        on_host = all(t.device.type == "cpu" for t in tensors) and (tensors or kwargs.get("device") in (None, "cpu", torch.device("cpu")))
        if on_host:  # the host's own work (what it read, ids it builds): allowed
            return func(*args, **kwargs)
        return super().__torch_dispatch__(func, types, args, kwargs)


def fake_host(shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    out = torch.zeros(shape, dtype=dtype)
    if len(shape) == 3 and shape[1] == 2:
        k = shape[2]
        out[:, 0] = torch.arange(k, dtype=dtype)
        weights = torch.arange(k, 0, -1, dtype=torch.float64)
        out[:, 1] = (weights / weights.sum()).float().to(dtype)
    return out


@pytest.fixture
def host_reads():
    mode = HostReads(META)
    with mode:
        yield mode
    assert not mode.bad, mode.bad


def test_dynamic_top_k_of_all_heads_is_one_device_call_and_one_read(host_reads):
    scores = torch.randn(3, V, device=META)  # raw logits of 3 heads
    cands = head_candidates(scores, 4, 0.7)
    assert host_reads.reads == [(3, 2, 4)]  # ids and probabilities of every head together
    assert [c.ids.tolist() for c in cands] == [[0, 1, 2, 3]] * 3
    assert all(c.ids.dtype == np.int64 and c.probs.dtype == np.float32 for c in cands)


@pytest.mark.parametrize("greedy", [True, False])
def test_joint_drafts_read_the_device_once(meta_models, greedy):
    """Joint drafts: the heads' top-k cross in one read, the draws happen on the host, and the
    drafts and their q go back to the device."""
    model = meta_models["replicated"]
    vocab = model.backbone.vocab_size
    out = meta_step(model, 4, 3)
    mode = HostReads(META)
    with mode:
        drafts = joint_drafts(RowHeads(out, 0, (3,), 3), 5, 2, meta_row(greedy, vocab), meta_run(model, greedy, vocab))
    assert not mode.bad, mode.bad
    assert mode.reads == [(2, 2, 4)]
    assert drafts.tokens.shape == (2,) and on_meta(drafts.tokens)
    assert drafts.probs is None if greedy else on_meta(drafts.probs) and drafts.probs.shape == (2, vocab)


@pytest.mark.parametrize("name", ["speculative greedy", "speculative sampled", "dynamic tree greedy"])
def test_draft_vocabulary_runs_stay_on_the_device_with_the_same_reads(meta_models, monkeypatch, tmp_path, name):
    """Draft rows over a draft vocabulary (its sub-matrix built on the model's device): the run
    mixes no devices and reads the device as often per step as with the whole vocabulary."""
    model = meta_models["replicated"]
    monkeypatch.setattr(model, "heads_dir", None)
    rank_odd_tokens(model, tmp_path, 20)
    # the model's cached ranking and sub-matrices: this test's alone (undone after it)
    monkeypatch.setitem(model.__dict__, "_ranking", read_ranking(tmp_path))
    monkeypatch.setitem(model.__dict__, "_draft_unembeds", {})
    settings, after_prompt, per_step = RUNS[name]
    cfg = DecodeConfig(top_k=4, max_new_tokens=8, stop_at_eos=False, draft_vocab=20, **settings)
    mode = StepReads(META, model)
    monkeypatch.setattr(model, "step", mode.step)
    with mode:
        got = generate_batch(model, [[1, 2, 3], [4, 5]], cfg, seeds=[0, 1], tree_accuracies=fallback_accuracies(2))
    assert not mode.bad, mode.bad
    assert all(len(r.token_ids) == 8 for r in got)
    first, *later = mode.steps
    assert len(first) == after_prompt and all(len(reads) == per_step for reads in later[:-2]), mode.steps
    (draft,) = model.__dict__["_draft_unembeds"].values()
    assert draft.size == 20 and draft.proj.weight.device == META and draft.ids.device == META


class StepReads(HostReads):
    """``HostReads`` over a whole run, the reads grouped by the forward pass they follow."""

    def __init__(self, device: torch.device, model):
        super().__init__(device)
        self.steps: list[list] = []
        plain = model.step

        def step(*args, **kwargs):
            self.steps.append([])
            return plain(*args, **kwargs)
        self.step = step

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = len(self.reads)
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if len(self.reads) > before and self.steps:
            self.steps[-1].append(self.reads[-1])
        return out


RUNS = {  # settings -> host reads after the prompts' pass (the first token; a tree's first guesses), after each later pass
    "ar greedy": (dict(mode="ar", greedy=True), 1, 1),
    "dynamic": (dict(mode="dynamic", eps_b=0.5), 1, 1),
    "dynamic eps_b 1": (dict(mode="dynamic", eps_b=1.0), 1, 1),
    "speculative greedy": (dict(mode="speculative", greedy=True), 1, 1),
    "speculative sampled": (dict(mode="speculative"), 1, 1),
    "speculative penalised greedy": (dict(mode="speculative", greedy=True, repetition_penalty=1.3), 1, 1),
    "typical": (dict(mode="typical"), 1, 1),
    "static tree greedy": (dict(mode="speculative", greedy=True, tree="static", tree_nodes="4"), 1, 1),
    "static tree penalised greedy": (dict(mode="speculative", greedy=True, tree="static", tree_nodes="4", repetition_penalty=1.3), 1, 1),
    "dynamic tree greedy": (dict(mode="speculative", greedy=True, tree="dynamic", tree_nodes="4"), 2, 2),
    "chain greedy with lookup": (dict(mode="speculative", greedy=True, lookup=3), 2, 2),  # host trees: guesses, verdict
    "static tree greedy with lookup": (dict(mode="speculative", greedy=True, tree="static", tree_nodes="4", lookup=3), 2, 2),
    "static tree sampled": (dict(mode="speculative", tree="static", tree_nodes="4"), 2, 3),
    "dynamic tree typical": (dict(mode="typical", tree="dynamic", tree_nodes="4"), 2, 3),
    "chain sampled with lookup": (dict(mode="speculative", lookup=3), 2, 3),  # the lookup branch reads no device data
    "dynamic tree typical with lookup": (dict(mode="typical", tree="dynamic", tree_nodes="4", lookup=3), 2, 3),
}


@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("name", sorted(RUNS))
def test_a_whole_run_stays_on_the_device_and_reads_it_a_fixed_number_of_times_per_step(meta_models, monkeypatch, name, rows):
    """The engine end to end on meta-device heads: no op mixes devices, and every step reads
    the device a fixed number of times whatever the batch size: the committed ids with the
    verdict (chains, static greedy trees: tokens and verdict together); a tree's guesses, then
    its verdict (greedy), or its walk inputs and the token drawn after its path (sampled,
    typical), with the next step's guesses; DynaMo's top-k of the heads it reads."""
    model = meta_models["replicated"]
    settings, after_prompt, per_step = RUNS[name]
    cfg = DecodeConfig(top_k=4, max_new_tokens=8, stop_at_eos=False, **settings)
    mode = StepReads(META, model)
    monkeypatch.setattr(model, "step", mode.step)
    with mode:
        got = generate_batch(model, [[1, 2, 3], [4, 5]][:rows], cfg, seeds=list(range(rows)), tree_accuracies=fallback_accuracies(2))
    assert not mode.bad, mode.bad
    assert all(len(r.token_ids) == 8 for r in got)
    first, *later = mode.steps
    later = later[:-2]  # the last steps: shallower trees as the budget runs out, no next step
    assert len(first) == after_prompt and len(later) >= 3, mode.steps
    assert all(len(reads) == per_step for reads in later), mode.steps
    if cfg.mode == "dynamic":  # the top-k of every row's heads it reads, in one read: eps_b = 1 reads head 1 only
        assert all(reads == [(rows * (1 if cfg.dynamo.eps_b == 1 else 3), 2, 4)] for reads in later), mode.steps


EAGLE3_RUNS = ("speculative greedy", "speculative sampled", "speculative penalised greedy", "typical", "dynamic tree greedy",
               "dynamic tree typical")


@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("name", EAGLE3_RUNS)
def test_eagle3_chains_stay_on_the_device_with_one_read_per_step(meta_models, monkeypatch, name, rows):
    """The eagle3 drafter catches up and drafts on the device (its cache, its draws, the text's
    ids copied to it): a chain still reads the device once per step, the verdict with the
    drafts; a dynamic tree as the heads' do (every row's tree in one read, then its verdict)."""
    model = meta_models["eagle3"]
    settings, after_prompt, per_step = RUNS[name]
    cfg = DecodeConfig(top_k=4, max_new_tokens=8, stop_at_eos=False, **settings)
    mode = StepReads(META, model)
    monkeypatch.setattr(model, "step", mode.step)
    with mode:
        got = generate_batch(model, [[1, 2, 3], [4, 5]][:rows], cfg, seeds=list(range(rows)))
    assert not mode.bad, mode.bad
    assert all(len(r.token_ids) == 8 for r in got) and "eagle3" in got[0].trace.plan
    first, *later = mode.steps
    assert len(first) == after_prompt and len(later) >= 3, mode.steps
    assert all(len(reads) == per_step for reads in later[:-2]), mode.steps
