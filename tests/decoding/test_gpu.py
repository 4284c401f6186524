"""The GPU suite (``make test-gpu`` = ``pytest -m gpu``): the exactness tests on CUDA -- greedy (chain and tree)
== transformers' ``generate`` for every head type, both architectures, float32 / bfloat16 and
4 / 8-bit backbones; the chi-square tests of sampled speculative decoding; same seed, same
output; ``bench_decode.py --device cuda``. Without CUDA every test here is skipped, saying so
(the device-placement logic is checked on every CPU by test_device.py, on ``meta``).
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from multitoken.decoding.config import DecodeConfig
from multitoken.decoding.engine import generate
from multitoken.decoding.proposal import Drafts
from multitoken.pipeline.model.backbone import Backbone
from multitoken.pipeline.model.loading import BackboneConfig, load_backbone

from .conftest import RatioTable, attach, build_small_vocab
from .test_exactness import PROMPTS, exact_pairs, merge_small_cells, sampled_pairs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (torch.cuda.is_available() is False)"),
]
CUDA = "cuda"


def hf_greedy(backbone, ids: torch.Tensor, new: int) -> list[int]:
    ids = ids.to(backbone.device)
    out = backbone.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                                  pad_token_id=backbone.tokenizer.eos_token_id)
    return out[0, ids.shape[1]:].tolist()


@pytest.fixture(scope="module")
def cuda_backbones(tiny_neox_dir, tiny_llama_dir) -> dict:
    dirs = {"gpt_neox": tiny_neox_dir, "llama": tiny_llama_dir}
    return {(arch, dtype): load_backbone(BackboneConfig(base=str(d), device=CUDA, dtype=dtype))
            for arch, d in dirs.items() for dtype in ("float32", "bfloat16")}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_speculative_and_ar_equal_generate_on_cuda(cuda_backbones, arch, chain_head_type, dtype):
    backbone = cuda_backbones[(arch, dtype)]
    model = attach(backbone, chain_head_type)
    for prompt in PROMPTS:
        ids = backbone.tokenizer(prompt, return_tensors="pt").input_ids
        ref = hf_greedy(backbone, ids, 24)
        for mode in ("speculative", "ar"):
            res = generate(model, ids, DecodeConfig(mode=mode, greedy=True, max_new_tokens=24))
            assert res.token_ids == ref, (mode, prompt)
            assert res.trace.device.startswith("cuda")


@pytest.mark.parametrize("head_type", ["replicated", "medusa"])
def test_greedy_joint_drafts_equal_generate_on_cuda(cuda_backbones, arch, head_type):
    backbone = cuda_backbones[(arch, "float32")]
    model = attach(backbone, head_type)
    ids = backbone.tokenizer(PROMPTS[1], return_tensors="pt").input_ids
    res = generate(model, ids, DecodeConfig(mode="speculative", greedy=True, max_new_tokens=24, drafter="joint"),
                   table=RatioTable())
    assert res.token_ids == hf_greedy(backbone, ids, 24)


@pytest.mark.parametrize("quantization", ["4bit", "8bit"])
def test_quantized_greedy_equals_its_own_generate_on_cuda(tiny_neox_q_dir, tiny_llama_q_dir, arch, quantization):
    base = {"llama": tiny_llama_q_dir, "gpt_neox": tiny_neox_q_dir}[arch]
    bb = load_backbone(BackboneConfig(base=str(base), quantization=quantization, device=CUDA))
    model = attach(bb, "replicated")
    ids = bb.tokenizer("Once upon a time", return_tensors="pt").input_ids
    ref = hf_greedy(bb, ids, 12)
    for mode in ("ar", "speculative"):
        assert generate(model, ids, DecodeConfig(mode=mode, greedy=True, max_new_tokens=12)).token_ids == ref
    assert len(generate(model, ids, DecodeConfig(mode="dynamic", eps_b=0.0, max_new_tokens=12)).token_ids) == 12


@pytest.fixture(scope="module")
def small_vocab_pair(tmp_path_factory) -> tuple[Backbone, Backbone]:
    """The enumerable-vocabulary model on the CPU (exact distributions) and the same weights on CUDA."""
    from transformers import LlamaForCausalLM

    out = tmp_path_factory.mktemp("small_vocab_gpu")
    cpu = build_small_vocab(out)
    model = LlamaForCausalLM.from_pretrained(out).eval().to(CUDA)
    for p in model.parameters():
        p.requires_grad_(False)
    return cpu, Backbone(model, None, str(out), BackboneConfig(base=str(out), device=CUDA))


@pytest.mark.parametrize("head_type,drafter", [("medusa", "heads"), ("medusa", "rigged"), ("medusa", "joint"), ("cp", "cp")])
def test_sampled_speculative_matches_base_distribution_on_cuda(small_vocab_pair, head_type, drafter):
    cpu, gpu = small_vocab_pair
    model = attach(gpu, head_type, n_future=2)
    if head_type == "medusa":
        with torch.no_grad():  # a head clearly different from the base: q != p
            model.heads.blocks[0][0].linear.weight.normal_(0, 1.0)
    prompt = [0, 3, 1]
    kwargs = {"rigged": {"drafter": rigged_on_device}, "joint": {"table": RatioTable()}}.get(drafter, {})
    counts, accepted = sampled_pairs(model, prompt, 400, **kwargs)
    expected = exact_pairs(cpu, prompt) * counts.sum()
    stat = chisquare(*merge_small_cells(counts.flatten(), expected.flatten()))
    assert stat.pvalue > 1e-3, (counts, expected)
    assert accepted[0] > 20 and accepted[1] > 20


def rigged_on_device(heads, first, g, row, run):
    """test_exactness's rigged drafter (blind, prefers token 0), its q on the model's device."""
    q = torch.tensor([0.7, 0.1, 0.1, 0.1], device=row.seen.device).expand(g, 4)
    tokens = torch.multinomial(q, 1, generator=row.sampler.gen).reshape(-1)
    return Drafts(tokens, q.clone())


@pytest.mark.parametrize("mode", ["speculative", "dynamic", "ar"])
def test_same_seed_same_output_on_cuda(cuda_backbones, mode):
    model = attach(cuda_backbones[("llama", "float32")], "replicated")
    cfg = DecodeConfig(mode=mode, max_new_tokens=20, seed=3, stop_at_eos=False)
    runs = [generate(model, [1, 5, 9, 4], cfg).token_ids for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) == 20


def test_bench_decode_runs_on_cuda(tmp_path, pythia_mini_dir):
    from ..test_scripts import SCRIPTS, load_script

    bench_decode = load_script(SCRIPTS / "bench_decode.py")
    record = bench_decode.main(["--device", CUDA, "--dtype", "bfloat16", "--max-new-tokens", "8", "--reps", "1",
                                "--out", str(tmp_path / "bench.json")])
    assert record["machine"]["device"] == CUDA and record["settings"]["dtype"] == "bfloat16"
    assert record["machine"]["device_name"] == torch.cuda.get_device_name(0)
    for key in ("embedded", "pythia_mini"):
        assert record[key]["methods"]["speculative_greedy"]["tokens"] > 0


def test_batched_rows_equal_generate_and_their_runs_alone_on_cuda(cuda_backbones, arch):
    """Batches on the device: greedy rows == transformers (float32), sampled rows == alone."""
    from multitoken.decoding.engine import generate_batch

    backbone = cuda_backbones[(arch, "float32")]
    model = attach(backbone, "replicated")
    prompts = [backbone.tokenizer(p).input_ids for p in PROMPTS]
    refs = [hf_greedy(backbone, torch.tensor([p]), 16) for p in prompts]
    for mode in ("ar", "speculative"):
        got = generate_batch(model, prompts, DecodeConfig(mode=mode, greedy=True, max_new_tokens=16, stop_at_eos=False))
        assert [r.token_ids for r in got] == refs, mode
    for mode in ("speculative", "dynamic"):
        cfg = DecodeConfig(mode=mode, max_new_tokens=16, eps_b=0.1, stop_at_eos=False)
        got = generate_batch(model, prompts, cfg, seeds=[5, 6, 7], table=RatioTable())
        alone = [generate(model, p, DecodeConfig(**{**cfg.__dict__, "seed": s}), table=RatioTable()).token_ids
                 for p, s in zip(prompts, [5, 6, 7])]
        assert [r.token_ids for r in got] == alone, mode


@pytest.mark.parametrize("tree", ["static", "dynamic"])
def test_batched_tree_rows_equal_generate_and_their_runs_alone_on_cuda(cuda_backbones, arch, tree):
    """Batched trees on the device: greedy rows == transformers (float32), sampled and typical
    rows == each row alone with its seed."""
    from multitoken.decoding.engine import generate_batch

    backbone = cuda_backbones[(arch, "float32")]
    model = attach(backbone, "replicated")
    prompts = [backbone.tokenizer(p).input_ids for p in PROMPTS]
    refs = [hf_greedy(backbone, torch.tensor([p]), 16) for p in prompts]
    got = generate_batch(model, prompts, DecodeConfig(mode="speculative", greedy=True, max_new_tokens=16,
                                                      stop_at_eos=False, tree=tree, tree_nodes="8"))
    assert [r.token_ids for r in got] == refs
    for mode in ("speculative", "typical"):
        cfg = DecodeConfig(mode=mode, max_new_tokens=16, stop_at_eos=False, tree=tree, tree_nodes="8")
        got = generate_batch(model, prompts, cfg, seeds=[5, 6, 7])
        alone = [generate(model, p, DecodeConfig(**{**cfg.__dict__, "seed": s})).token_ids for p, s in zip(prompts, [5, 6, 7])]
        assert [r.token_ids for r in got] == alone, mode


@pytest.mark.parametrize("tree", ["static", "dynamic", "joint"])
def test_greedy_tree_equals_generate_and_sampled_tree_is_seeded_on_cuda(cuda_backbones, arch, head_type, tree):
    """Tree verification on the device: greedy == transformers (float32, every head type),
    sampled and typical trees give the same output for the same seed (joint: a dynamic tree
    ranked under a co-occurrence mask)."""
    backbone = cuda_backbones[(arch, "float32")]
    model = attach(backbone, head_type)
    table = RatioTable() if tree == "joint" else None
    opts = dict(tree="dynamic", drafter="joint") if tree == "joint" else dict(tree=tree)
    for prompt in PROMPTS:
        ids = backbone.tokenizer(prompt, return_tensors="pt").input_ids
        got = generate(model, ids, DecodeConfig(mode="speculative", greedy=True, max_new_tokens=20, tree_nodes="8", **opts),
                       table=table)
        assert got.token_ids == hf_greedy(backbone, ids, 20), prompt
        assert got.trace.device.startswith("cuda") and got.trace.tree == opts["tree"]
    for mode in ("speculative", "typical"):
        cfg = DecodeConfig(mode=mode, max_new_tokens=20, seed=3, stop_at_eos=False, tree_nodes="8", **opts)
        runs = [generate(model, [1, 5, 9, 4], cfg, table=table).token_ids for _ in range(2)]
        assert runs[0] == runs[1] and len(runs[0]) == 20, mode
