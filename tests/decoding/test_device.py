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

from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from multitoken.decoding.accept import greedy_accept, speculative_accept, typical_accept, typical_rule
from multitoken.decoding.batch_steps import Row
from multitoken.decoding.batch_tree import BatchTrees
from multitoken.decoding.config import DecodeConfig
from multitoken.decoding.loop import RunState
from multitoken.decoding.dynamo import dynamic_propose, head_candidates
from multitoken.decoding.proposal import HeadScores, cp_drafts, independent_drafts, joint_drafts
from multitoken.decoding.sampling import Sampler, penalised_logits, processed_probs, rows_seen, top_probs, with_tokens
from multitoken.decoding.trace import Trace
from multitoken.decoding.tree import fallback_accuracies
from multitoken.decoding.tree_step import TreeSteps
from multitoken.pipeline.model.backbone import BackboneConfig, load_backbone

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


def fake_out(n_heads: int, layer_heads: bool = False):
    """A ``StepOutput`` stand-in whose head distributions live on meta (``layer_heads``: heads
    1.. read as raw logits, as replicated / WHS heads are)."""
    return SimpleNamespace(head_log_probs=lambda i, pos: torch.randn(1, V, device=META), model_s=0.0,
                           hiddens=dict.fromkeys(range(1, n_heads)) if layer_heads else {},
                           _head_row=lambda i, pos: torch.randn(1, V, device=META))


def meta_run(model, greedy: bool, vocab: int = V) -> RunState:
    cfg = DecodeConfig(mode="speculative", greedy=greedy, top_k=min(4, vocab))
    return RunState(model, cfg, sampler(greedy, top_k=min(4, vocab)), None,
                    torch.zeros(vocab, dtype=torch.bool, device=META), None, vocab)


@pytest.mark.parametrize("layer_heads", [True, False])
@pytest.mark.parametrize("greedy", [True, False])
def test_independent_drafts_stay_on_the_device(only_meta, greedy, layer_heads):
    drafts = independent_drafts(fake_out(3, layer_heads), 0, 5, 2, meta_run(None, greedy))
    assert drafts.tokens.shape == (2,) and on_meta(drafts.tokens)
    assert drafts.probs is None if greedy else on_meta(drafts.probs) and drafts.probs.shape == (2, V)


@pytest.fixture(scope="module")
def meta_models(tiny_llama_dir):
    """CP and replicated heads on a tiny Llama, everything moved to meta (a fresh backbone: the
    shared one stays usable)."""
    models = {}
    for head_type in ("cp", "replicated"):
        model = attach(load_backbone(BackboneConfig(base=str(tiny_llama_dir))), head_type)
        models[head_type] = model.to(META)
    return models


def meta_step(model, tokens: int, read_from: int):
    """A real incremental pass on meta (prompt, or commit + drafts)."""
    caches = model.new_caches()
    return model.step(torch.zeros(1, tokens, dtype=torch.long, device=META), caches, read_from=read_from)


@pytest.mark.parametrize("greedy", [True, False])
def test_cp_drafts_stay_on_the_device(meta_models, greedy):
    model = meta_models["cp"]
    out = meta_step(model, 4, 3)
    mode = OnlyOn(META)
    with mode:
        drafts = cp_drafts(out, 3, 5, 2, meta_run(model, greedy, model.backbone.vocab_size))
    assert not mode.bad, mode.bad
    assert drafts.tokens.shape == (2,) and on_meta(drafts.tokens)
    assert drafts.probs is None if greedy else on_meta(drafts.probs)


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
        if func.overloadpacket.__name__ == "_to_copy" and isinstance(src, torch.Tensor) and src.device == self.device \
                and torch.device(kwargs.get("device", self.device)).type == "cpu":
            self.reads.append(tuple(src.shape))
            return fake_host(tuple(src.shape), kwargs.get("dtype") or src.dtype)
        if func.overloadpacket.__name__ == "_local_scalar_dense" and isinstance(src, torch.Tensor) \
                and src.device == self.device:  # int() / float() / .item() of a device scalar
            self.reads.append(())
            return 0.0 if src.dtype.is_floating_point else 0
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if tensors and all(t.device.type == "cpu" for t in tensors):
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


@pytest.mark.parametrize("eps_b", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("greedy", [True, False])
def test_a_dynamic_step_reads_the_device_once(meta_models, eps_b, greedy):
    """The whole proposal on meta-device heads: one transfer (the top-k of the heads the step
    reads); eps_b = 1 backs off every order unread, so only head 1 is unembedded and read."""
    model = meta_models["replicated"]
    out = meta_step(model, 4, 3)
    heads = HeadScores(out, 3, 3)
    cfg = DecodeConfig(mode="dynamic", greedy=greedy, top_k=4, eps_b=eps_b)
    seen = np.zeros(model.backbone.vocab_size, dtype=bool)
    mode = HostReads(META)
    with mode:
        choice = dynamic_propose(heads, cfg, None, seen, None if greedy else np.random.default_rng(0))
    assert not mode.bad, mode.bad
    assert mode.reads == [(1 if eps_b == 1 else 3, 2, 4)]
    assert sorted(heads.cache) == ([0] if eps_b == 1 else [0, 1, 2])
    assert all(on_meta(t) for t in heads.cache.values())
    assert 1 <= choice.order <= 3 and all(0 <= t < 4 for t in choice.tokens)


@pytest.mark.parametrize("greedy", [True, False])
def test_joint_drafts_read_the_device_once(meta_models, greedy):
    """Joint drafts: the heads' top-k cross in one read, the draws happen on the host, and the
    drafts and their q go back to the device."""
    model = meta_models["replicated"]
    vocab = model.backbone.vocab_size
    out = meta_step(model, 4, 3)
    run = meta_run(model, greedy, vocab)
    run.rng = None if greedy else np.random.default_rng(0)
    run.draft_cfg = replace(run.cfg, static_threshold=False, adaptive_threshold=False)  # the loop's
    run.seen_host = np.zeros(vocab, dtype=bool)  # the loop's host mirror, read once per run
    mode = HostReads(META)
    with mode:
        drafts = joint_drafts(out, 3, 5, 2, run)
    assert not mode.bad, mode.bad
    assert mode.reads == [(2, 2, 4)]
    assert drafts.tokens.shape == (2,) and on_meta(drafts.tokens)
    assert drafts.probs is None if greedy else on_meta(drafts.probs) and drafts.probs.shape == (2, vocab)


@pytest.mark.parametrize("tree", ["static", "dynamic"])
@pytest.mark.parametrize("mode,greedy", [("speculative", True), ("speculative", False), ("typical", False)])
def test_a_tree_step_stays_on_the_device_and_reads_it_boundedly(meta_models, tree, mode, greedy):
    """A tree step on meta-device heads: the guesses in one read (ids, and scores for the
    dynamic tree), the verdict in one read (argmax per node; or children's probabilities,
    masses and uniforms; or which nodes pass the rule) plus, sampled or typical, one for the
    token drawn after the path."""
    model = meta_models["replicated"]
    vocab = model.backbone.vocab_size
    cfg = DecodeConfig(mode=mode, greedy=greedy, top_k=4, tree=tree, tree_nodes="4").resolved()
    run = RunState(model, cfg, Sampler(greedy, 0.7, 4, seed=0, penalty=cfg.penalty, device=META), None,
                   torch.zeros(vocab, dtype=torch.bool, device=META), None, vocab)
    steps = TreeSteps(model, cfg, run, 3, Trace(), fallback_accuracies(2))
    out = meta_step(model, 4, 3)
    mode_ = HostReads(META)
    with mode_:
        guesses = steps.propose(out, 3, 5, 2)
    assert not mode_.bad, mode_.bad
    assert len(guesses) == 5 and len(mode_.reads) == 1
    caches = model.new_caches()
    attend = guesses.attend(META)
    tree_out = model.step(torch.zeros(1, len(guesses), dtype=torch.long, device=META), caches,
                          attend=attend, offsets=guesses.offsets(META))
    mode_ = HostReads(META)
    with mode_:
        verdict = steps.verify(tree_out, guesses, attend)
    assert not mode_.bad, mode_.bad
    assert len(mode_.reads) == (1 if greedy else 2) and verdict.path[0] == 0


@pytest.mark.parametrize("penalty", [1.0, 1.3])
def test_a_static_greedy_tree_step_reads_the_device_once(meta_models, penalty):
    """The whole step of a static tree under greedy verification: tokens gathered from the
    guesses on the device, the path judged there, one read (tokens, the token after the path,
    its last node); the next step's root is that verdict's device copy."""
    model = meta_models["replicated"]
    vocab = model.backbone.vocab_size
    cfg = DecodeConfig(mode="speculative", greedy=True, top_k=4, tree="static", tree_nodes="4",
                       repetition_penalty=penalty).resolved()
    run = RunState(model, cfg, Sampler(True, 0.7, 4, seed=0, penalty=cfg.penalty, device=META), None,
                   torch.zeros(vocab, dtype=torch.bool, device=META), None, vocab)
    steps = TreeSteps(model, cfg, run, 3, Trace(), fallback_accuracies(2))
    caches = model.new_caches()
    out = model.step(torch.zeros(1, 4, dtype=torch.long, device=META), caches, read_from=3)

    def forward(new, read_from, **tree):
        return model.step(new.reshape(1, -1), caches, read_from=read_from, **tree)

    anchor, root = 3, 5
    for step in range(2):
        mode = HostReads(META)
        with mode:
            out, anchor, root, done = steps.step(out, anchor, root, 2, caches, forward, lambda tokens: False)
        assert not mode.bad, mode.bad
        assert mode.reads == [(len(steps.shape) + 2,)] and not done


def meta_tree_batch(model, cfg):
    """Two rows of a batched tree run on meta-device heads after a 4-token pass, each with the
    committed token 5 # -> rows, BatchTrees, caches, the pass's output."""
    vocab = model.backbone.vocab_size
    rows = [Row(b, [1, 2], RunState(model, cfg, Sampler(cfg.greedy, 0.7, 4, seed=b, penalty=cfg.penalty, device=META), None,
                                    torch.zeros(vocab, dtype=torch.bool, device=META), None, vocab), Trace()) for b in range(2)]
    trees = BatchTrees(TreeSteps(model, cfg, rows[0].run, 3, rows[0].trace, fallback_accuracies(2)), rows, 3)
    caches = model.new_caches()
    out = model.step(torch.zeros(2, 4, dtype=torch.long, device=META), caches, read_from=3)
    for row in rows:
        row.commit = [5]
    return rows, trees, caches, out


@pytest.mark.parametrize("tree", ["static", "dynamic"])
@pytest.mark.parametrize("penalty", [1.0, 1.3])
@pytest.mark.parametrize("rule,greedy,verdict_reads", [("speculative", True, 1), ("speculative", False, 2),
                                                       ("typical", False, 2)])
def test_a_batched_tree_step_stays_on_the_device_and_reads_it_a_fixed_number_of_times(meta_models, tree, penalty, rule,
                                                                                      greedy, verdict_reads):
    """Two rows with trees of different depths on meta-device heads: every row's guesses in
    one read, the forward pass and the kept paths on the device, every row's verdict in one
    (greedy) or two (sampled / typical: every row's walk inputs, then every row's final token)."""
    model = meta_models["replicated"]
    cfg = DecodeConfig(mode=rule, greedy=greedy, top_k=4, tree=tree, tree_nodes="4", repetition_penalty=penalty).resolved()
    rows, trees, caches, out = meta_tree_batch(model, cfg)
    mode = HostReads(META)
    with mode:
        step_trees = trees.propose(out, rows, [0, 1], (3, 3), {0: 2, 1: 1})
    assert not mode.bad, mode.bad
    assert len(mode.reads) == 1 and max(step_trees[0].depths) <= 2 and max(step_trees[1].depths) == 1

    def forward(batch, ids, read_from, lengths, **tree_args):
        return model.step(ids, caches, read_from=read_from, lengths=lengths, **tree_args)

    mode = HostReads(META)  # host-built ids, mask, positions and validity go to the device: no reads back
    with mode:
        out, width, attend = trees.forward(forward, rows, step_trees, META)
    assert not mode.bad and not mode.reads, (mode.bad, mode.reads)
    mode = HostReads(META)
    with mode:
        verdicts = trees.verify(out, rows, step_trees, width, attend)
    assert not mode.bad, mode.bad
    assert len(mode.reads) == verdict_reads and all(v.path[0] == 0 for v in verdicts)
    mode = HostReads(META)
    with mode:
        caches.keep_paths(4, [[width - len(t) + i for i in v.path] for t, v in zip(step_trees, verdicts)])
    assert not mode.bad and not mode.reads, (mode.bad, mode.reads)


@pytest.mark.parametrize("penalty", [1.0, 1.3])
def test_a_batched_static_greedy_step_reads_the_device_once(meta_models, penalty):
    """Two rows' static trees at full depth: tokens gathered on the device (no read), one pass,
    every row's kept path and next token judged there, one read for both rows."""
    model = meta_models["replicated"]
    cfg = DecodeConfig(mode="speculative", greedy=True, top_k=4, tree="static", tree_nodes="4",
                       repetition_penalty=penalty).resolved()
    rows, trees, caches, out = meta_tree_batch(model, cfg)
    assert trees.on_device([0, 1], {0: 2, 1: 2}) and not trees.on_device([0, 1], {0: 2, 1: 1})

    def forward(batch, ids, read_from, lengths, **tree_args):
        return model.step(ids, caches, read_from=read_from, lengths=lengths, **tree_args)

    mode = HostReads(META)
    with mode:
        tokens = trees.static_tokens(out, rows, [0, 1], (3, 3))
        out, width, step_trees, verdicts = trees.static_step(forward, rows, tokens)
    assert not mode.bad, mode.bad
    assert mode.reads == [(2, len(trees.steps.shape) + 2)] and width == len(trees.steps.shape) == len(step_trees[1])
    assert all(v.path[0] == 0 for v in verdicts)
