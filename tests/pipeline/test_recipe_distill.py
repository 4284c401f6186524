"""The recipe's throughput paths: its distillation (``recipe_data.Continuer``), our batched
engine's shards against transformers' ``generate``, their seeding and their sampled
distribution; and the arithmetic its training picks (``recipe_train.resolve_dtype``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from scipy.stats import chisquare

from multitoken.kernels import cpu_linear
from multitoken.pipeline.model.loading import BackboneConfig, load_backbone
from multitoken.pipeline.train import recipe_data
from multitoken.pipeline.train.recipe_data import SAMPLED, Continuer, distill_shards, row_seed

from ..conftest import fixture_path as fixture
from ..decoding.test_exactness import merge_small_cells


def backbone(name: str, stories_dir: Path, pythia_mini_dir: Path):
    return load_backbone(BackboneConfig(base=str(stories_dir if name == "stories" else pythia_mini_dir), threads=1))


def prompts(bb, count: int, length: int = 8) -> torch.Tensor:
    """``count`` windows of the Shakespeare fixture # [count, length]."""
    text = fixture("tinyshakespeare", "input.txt")
    return recipe_data.window_prompts(bb.tokenizer, [text], length, 7, seed=0)[:count]


def shards(folder: Path) -> list[dict]:
    return [load_file(str(p)) for p in sorted(folder.glob("shard-*.safetensors"))]


def same(a: list[dict], b: list[dict]) -> bool:
    return len(a) == len(b) and all(x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x) for x, y in zip(a, b))


@pytest.mark.parametrize("name", ["stories", "pythia-mini"])
def test_greedy_shards_are_transformers_greedy_text(name, stories_dir, pythia_mini_dir, tmp_path):
    """Greedy rows through our engine (packed linears) are transformers' greedy rows token for
    token, each cut at its first EOS and padded after it (never a target). The EOS is made a
    token the continuations often hold, so that rows end at different places."""
    bb = backbone(name, stories_dir, pythia_mini_dir)
    p = prompts(bb, 20)
    free = Continuer(bb)(p, 40, False, [0] * len(p))[0][:, 8:]
    counts = torch.bincount(free.flatten(), minlength=bb.vocab_size)
    bb.causal_lm.generation_config.eos_token_id = eos = int(counts.argmax())  # both engines read it
    for engine in recipe_data.ENGINES:
        distill_shards(Continuer(bb, engine), p, tmp_path / engine, 40, 8, 6, 0, seed=0, log=lambda m: None)
    ours, theirs = shards(tmp_path / "multitoken"), shards(tmp_path / "transformers")
    assert len(ours) == 3 and same(ours, theirs)
    ids = torch.cat([s["ids"] for s in ours]).long()
    valid = torch.cat([s["valid"] for s in ours]).bool()
    assert torch.equal(ids[:, :8], p) and not valid[:, :7].any() and valid[:, 7].all()
    ended = ids[:, 8:] == eos
    first = torch.where(ended.any(1), ended.float().argmax(1), torch.tensor(40))
    assert torch.equal(valid[:, 8:].sum(1), first)  # valid up to a row's first EOS only
    assert (first < 40).sum() > 2 and len(set(first.tolist())) > 2  # rows end, at different places
    # before its EOS a row is the text the base says with no EOS set; from it on, padding
    assert all(torch.equal(r[:f], q[:f]) and (r[f:] == eos).all() for r, q, f in zip(ids[:, 8:], free, first.tolist()))


def test_auto_distils_with_our_engine_on_the_cpu_and_transformers_on_a_gpu():
    assert recipe_data.resolve_engine("auto", torch.device("cpu")) == "multitoken"
    assert recipe_data.resolve_engine("auto", torch.device("cuda")) == "transformers"
    assert recipe_data.resolve_engine("transformers", torch.device("cpu")) == "transformers"


def test_sampled_rows_are_seeded_per_row_whatever_the_batch(stories_dir, pythia_mini_dir, tmp_path):
    """Each sampled row draws from its own seed (seed, shard, row): the shards are the same for
    any batch size, after a redo of a shard, and change with the seed."""
    bb = backbone("stories", stories_dir, pythia_mini_dir)
    p, quiet = prompts(bb, 14), (lambda m: None)
    distill_shards(Continuer(bb), p, tmp_path / "a", 16, 6, 6, 1, seed=3, log=quiet)
    distill_shards(Continuer(bb), p, tmp_path / "b", 16, 6, 4, 1, seed=3, log=quiet)
    distill_shards(Continuer(bb), p, tmp_path / "c", 16, 6, 6, 1, seed=4, log=quiet)
    a = shards(tmp_path / "a")
    assert len(a) == 3 and same(a, shards(tmp_path / "b")) and not same(a, shards(tmp_path / "c"))
    (tmp_path / "a" / recipe_data.SHARD.format(1)).unlink()  # as a kill during that shard leaves it
    distill_shards(Continuer(bb), p, tmp_path / "a", 16, 6, 6, 1, seed=3, log=quiet)
    assert same(a, shards(tmp_path / "a"))
    greedy = Continuer(bb)(p[:6], 16, False, [0] * 6)[0]
    assert not torch.equal(torch.cat([s["ids"] for s in a])[:6].long(), greedy)  # sampled, not argmax


def test_sampled_first_tokens_follow_the_bases_top_k_distribution(stories_dir, pythia_mini_dir):
    """The engine's sampled rows draw from softmax(top-50 logits / 0.7), transformers' sampling
    distribution (chi-square over 600 rows of one prompt)."""
    bb = backbone("stories", stories_dir, pythia_mini_dir)
    prompt = prompts(bb, 1)
    n = 600
    ids, _ = Continuer(bb)(prompt.expand(n, -1), 1, True, [row_seed(0, 0, r) for r in range(n)])
    counts = torch.bincount(ids[:, -1], minlength=bb.vocab_size)
    with torch.no_grad():
        logits = bb.model(prompt).logits[0, -1].float()
    top = torch.topk(logits, SAMPLED["top_k"])
    expected = torch.zeros_like(logits).scatter_(0, top.indices, torch.softmax(top.values / SAMPLED["temperature"], -1))
    assert counts[expected == 0].sum() == 0  # nothing outside the top-k
    assert chisquare(*merge_small_cells(counts.double(), expected * n)).pvalue > 1e-3


def test_training_runs_in_bfloat16_only_where_the_cpu_has_it_natively(monkeypatch):
    """``--compute-dtype auto``: bfloat16 autocast on a CPU with AVX512-BF16 / AMX, float32 on one
    that would emulate it (an AVX512 CPU without BF16, an AVX2 one); a dtype given is kept."""
    from multitoken.kernels import cpu_features
    from multitoken.pipeline.train.recipe_train import autocast, resolve_dtype

    cpu = torch.device("cpu")
    native = cpu_features.features().native_bf16
    assert resolve_dtype(cpu, "auto") == ("bfloat16" if native else "float32")
    for level in ("avx512", "avx2"):
        monkeypatch.setenv(cpu_features.ENV, level)
        assert resolve_dtype(cpu, "auto") == "float32" and resolve_dtype(cpu, "bfloat16") == "bfloat16"
        with autocast(cpu, "auto"):
            assert not torch.is_autocast_enabled("cpu")
    monkeypatch.delenv(cpu_features.ENV)
    with autocast(cpu, "auto"):
        x = torch.ones(2, 8) @ torch.ones(8, 2)
    assert x.dtype == (torch.bfloat16 if native else torch.float32)


@pytest.mark.parametrize("name", ["stories", "pythia-mini"])  # an unembedding tied to the embedding, one of its own
def test_the_frozen_trunk_is_held_in_bfloat16_while_training_and_restored_exactly(name, stories_dir, pythia_mini_dir):
    """Under ``trunk_in(bfloat16)`` the decoder's linears and the unembedding hold bf16 weights
    (autocast's casts, made once); the embedding's lookups keep float32 (a tied weight is untied
    for the while); after, every parameter is the float32 one it was, ties included."""
    from multitoken.pipeline.train.recipe_train import trunk_in

    bb = backbone(name, stories_dir, pythia_mini_dir)
    tied = bb.unembedding.weight is bb.embeddings.weight
    assert tied == (name == "stories")
    before = {n: p.detach().clone() for n, p in bb.model.named_parameters()}
    unembedding = bb.unembedding.weight.detach().clone()
    linears = [m for layer in bb.layers for m in layer.modules() if type(m) is torch.nn.Linear]
    with trunk_in(bb, "float32"):
        assert all(m.weight.dtype == torch.float32 for m in linears)
    with pytest.raises(RuntimeError, match="mid-run"), trunk_in(bb, "bfloat16"):
        assert linears and all(m.weight.dtype == torch.bfloat16 for m in linears)
        assert bb.unembedding.weight.dtype == torch.bfloat16 and not bb.unembedding.weight.requires_grad
        assert torch.equal(bb.unembedding.weight, unembedding.to(torch.bfloat16))
        assert bb.embeddings.weight.dtype == torch.float32
        raise RuntimeError("mid-run")  # a failed step restores them too
    after = dict(bb.model.named_parameters())
    assert all(after[n].dtype == torch.float32 and torch.equal(after[n], p) for n, p in before.items())
    assert (bb.unembedding.weight is bb.embeddings.weight) == tied


def test_distillation_runs_in_bfloat16_only_where_the_cpu_has_it_natively(monkeypatch, stories_dir, pythia_mini_dir):
    """``--distill-dtype auto``: bfloat16 on a CPU with AVX512-BF16 / AMX, float32 on one that
    would emulate it; a dtype given is kept; a quantized base cannot be copied into bfloat16."""
    from types import SimpleNamespace

    from multitoken.base.errors import UsageError
    from multitoken.kernels import cpu_features

    bb = backbone("stories", stories_dir, pythia_mini_dir)
    native = cpu_features.features().native_bf16
    assert recipe_data.resolve_dtype("auto", bb) == ("bfloat16" if native else "float32")
    for level in ("avx512", "avx2"):
        monkeypatch.setenv(cpu_features.ENV, level)
        assert recipe_data.resolve_dtype("auto", bb) == "float32" and recipe_data.resolve_dtype("bfloat16", bb) == "bfloat16"
    monkeypatch.delenv(cpu_features.ENV)
    quantized = SimpleNamespace(is_quantized=True, device=torch.device("cpu"))
    assert recipe_data.resolve_dtype("auto", quantized) == "float32"
    with pytest.raises(UsageError, match="quantized"):
        recipe_data.resolve_dtype("bfloat16", quantized)


@pytest.mark.parametrize("name", ["stories", "pythia-mini"])
def test_a_bfloat16_continuer_runs_a_bf16_copy_and_leaves_the_base_as_it_was(name, stories_dir, pythia_mini_dir):
    """The bf16 continuer decodes a bfloat16 copy of the base, its large linears packed where
    oneDNN's bf16 ops run (pythia-mini's unembedding; stories260K has none): the base keeps its float32 weights
    bit for bit (it still decodes its own text after), and the copy's greedy rows through our
    engine are transformers' greedy rows of the same bf16 copy, token for token."""
    bb = backbone(name, stories_dir, pythia_mini_dir)
    p = prompts(bb, 12)
    exact = Continuer(bb)(p, 24, False, [0] * len(p))[0]
    before = {n: t.detach().clone() for n, t in bb.model.state_dict().items()}
    fast = Continuer(bb, "multitoken", "bfloat16")
    assert fast.dtype == "bfloat16" and fast.backbone is not bb
    assert all(t.dtype == torch.bfloat16 for t in fast.backbone.model.parameters())
    ours = fast(p, 24, False, [0] * len(p))[0]
    big = [m for m in fast.backbone.model.modules() if getattr(m, "weight", None) is not None
           and m.weight.dim() == 2 and m.weight.numel() >= cpu_linear.MIN_WEIGHTS]
    if cpu_linear.usable(torch.bfloat16):  # its large linears decode on oneDNN's packed layout
        assert all(cpu_linear.format_of(m) == cpu_linear.ONEDNN for m in big if not isinstance(m, torch.nn.Embedding))
    theirs = Continuer(bb, "transformers", "bfloat16")(p, 24, False, [0])[0]
    assert torch.equal(ours, theirs)
    after = bb.model.state_dict()
    assert all(after[n].dtype == t.dtype and torch.equal(after[n], t) for n, t in before.items())
    assert torch.equal(Continuer(bb)(p, 24, False, [0] * len(p))[0], exact)
    assert (ours[:, 8:] == exact[:, 8:]).float().mean() > 0.5  # bf16 rounding moves some greedy picks, not most


def test_the_distill_batch_defaults_by_dtype_and_a_negative_one_is_refused(tmp_path):
    """``--distill-batch 0`` takes the dtype's default: float32's is the rows kernel's rows per call
    (a float32 base's rows past it would take another matmul, and its rounding), bf16's is larger."""
    from multitoken.base.errors import UsageError
    from multitoken.kernels import gemv_rows
    from multitoken.pipeline.train.recipe import RecipeConfig, validate

    assert recipe_data.BATCH["float32"] == gemv_rows.MAX_ROWS < recipe_data.BATCH["bfloat16"]
    text = str(fixture("tinyshakespeare", "input.txt"))
    validate(RecipeConfig(data=(text,), heldout=(text,), out=str(tmp_path)))
    with pytest.raises(UsageError, match="--distill-batch >= 0"):
        validate(RecipeConfig(data=(text,), heldout=(text,), out=str(tmp_path), distill_batch=-1))


def test_training_counts_hit_rates_only_on_the_steps_it_logs(monkeypatch, stories_dir):
    """The recipe's training takes the [C, V] top-k of hit rates only on the steps whose metrics
    it logs (every ``LOG_EVERY`` and the last; in micro-batches, their last part); those records
    carry every head's rates."""
    from multitoken.adapters.unembed import hits_counted
    from multitoken.pipeline.model.model import MultiTokenModel
    from multitoken.pipeline.train import recipe_train

    asked = []

    def recording(on):
        asked.append(on)
        return hits_counted(on)

    monkeypatch.setattr(recipe_train, "hits_counted", recording)
    bb = load_backbone(BackboneConfig(base=str(stories_dir), threads=1))
    torch.manual_seed(0)
    sets = [recipe_train.HeadSet(t, MultiTokenModel.attach(bb, {"head_type": t, "n_future": 3}), 1e-3)
            for t in ("medusa", "eagle3")]
    ids = torch.randint(3, bb.vocab_size, (8, 12), generator=torch.Generator().manual_seed(1))
    data = {"ids": ids, "valid": torch.ones_like(ids, dtype=torch.bool)}
    out = recipe_train.train_sets(bb, sets, data, epochs=62 / 4, batch_rows=2, warmup=2, seconds=None,
                                  dtype="float32", chunk=64, log=lambda rec: None)
    assert out["steps"] == 62 and asked == [s in (50, 62) for s in range(1, 63)]
    assert [r["step"] for r in out["history"]] == [50, 62]
    for rec in out["history"]:
        assert {f"{t}/head{h}/top{k}" for t in ("medusa", "eagle3") for h in (2, 3) for k in (1, 5)} <= set(rec)
    asked.clear()  # in parts: only a logged step's last part, whose metrics the record keeps
    out = recipe_train.train_sets(bb, sets, data, epochs=50 / 4, batch_rows=2, warmup=2, seconds=None,
                                  dtype="float32", chunk=64, micro_batches=2, log=lambda rec: None)
    assert out["steps"] == 50 and asked == [i == 99 for i in range(100)]
    assert {"medusa/head2/top1", "eagle3/head2/top1"} <= set(out["history"][-1])
