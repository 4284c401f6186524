"""The in-place KV cache (pipeline/runtime/kv_cache.py) gives ``DynamicCache``'s bits: every
logit and head state of long decoding runs (its buffers regrow several times) through every cache
operation decoding makes (one-token steps, chains cropped after rejected drafts, tree paths kept
in place, ragged batched rows, batched tree paths gathered, rows leaving), and the same cache
entries; plus the layer's own semantics (crop, views, reset, a step of the wrong batch)."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from multitoken.pipeline.model.loading import BackboneConfig, load_backbone
from multitoken.pipeline.model.model import MultiTokenModel
from multitoken.pipeline.runtime.incremental import DecodeCaches
from multitoken.pipeline.runtime.kv_cache import MIN_CAPACITY, GrowingCache, GrowingLayer, capacity_for

TREE_ATTEND = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
TREE_OFFSETS = torch.tensor([0, 1, 1, 2])


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


@pytest.fixture(scope="module")
def model(tiny_llama_q_dir) -> MultiTokenModel:
    bb = load_backbone(BackboneConfig(base=str(tiny_llama_q_dir), cpu_linear="rows"))
    torch.manual_seed(0)
    m = MultiTokenModel.attach(bb, {"head_type": "replicated", "n_future": 3, "init": "copy"})
    m.prepare_linears()
    return m


def _dynamic(model) -> DecodeCaches:
    return DecodeCaches(backbone=DynamicCache(), heads=[DynamicCache() for _ in range(model.heads.num_head_layers)])


def _single_row(model, caches, seen: list) -> None:
    """A prompt, then rounds of one-token steps, a chain with rejected drafts and a tree with one
    path kept, past several doublings of the buffers."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 500, (1, 300), generator=gen)

    def step(new, **kw):
        out = model.step(new, caches, **kw)
        seen.extend([out.base_logits(), *out.hiddens.values()])

    step(ids[:, :37])
    at = 37
    while caches.length < 2 * MIN_CAPACITY + 10:  # two doublings
        for _ in range(3):
            step(ids[:, at:at + 1])
            at += 1
        start = caches.length
        step(ids[:, at:at + 5])  # a chain: two of its five kept
        caches.keep(start, [[0, 1]])
        start = caches.length
        step(ids[:, at + 5:at + 9], attend=TREE_ATTEND, offsets=TREE_OFFSETS)  # a tree: root, 1, 3 kept
        caches.keep(start, [[0, 1, 3]])
        at += 9
    seen.extend(x for cache in (caches.backbone, *caches.heads) for layer in cache.layers
                for x in (layer.keys, layer.values) if x is not None)


def _batched(model, caches, seen: list) -> None:
    """Ragged rows: prompts of different lengths, chains whose rows keep different numbers of
    slots (holes), batched trees (paths gathered), a row leaving, compactions."""
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(3, 500, (3, 200), generator=gen)
    tree = TREE_ATTEND[None].repeat(3, 1, 1)

    def step(new, **kw):
        out = model.step(new, caches, **kw)
        seen.extend([out.base_logits(), *out.hiddens.values()])

    step(ids[:, :20], lengths=[20, 13, 7])
    for r in range(12):
        rows = ids.shape[0] if r < 6 else 2
        start = caches.length
        step(ids[:rows, 20 + 5 * r:25 + 5 * r], lengths=[5, 4, 2][:rows])
        caches.keep(start, [[0, 1, 2], [0], [0, 1]][:rows])  # each row its committed prefix
        start = caches.length
        step(ids[:rows, 100 + 4 * r:104 + 4 * r], lengths=[4] * rows, attend=tree[:rows],
             offsets=TREE_OFFSETS[None].repeat(rows, 1))
        caches.keep(start, [[0, 1, 3], [0, 2], [0]][:rows])
        if r == 5:
            caches.keep_rows([0, 2])  # the middle row is done
            ids = ids[[0, 2]]
    seen.extend(x for layer in caches.backbone.layers for x in (layer.keys, layer.values))


@pytest.mark.parametrize("drive", [_single_row, _batched])
@torch.inference_mode()
def test_growing_cache_gives_dynamic_cache_bits(model, drive):
    grown, plain = model.new_caches(), _dynamic(model)
    assert isinstance(grown.backbone, GrowingCache) and all(isinstance(c, GrowingCache) for c in grown.heads)
    a, b = [], []
    drive(model, grown, a)
    drive(model, plain, b)
    assert grown.length == plain.length and len(a) == len(b) > 50
    for i, (x, y) in enumerate(zip(a, b)):
        assert x.shape == y.shape and torch.equal(_bits(x), _bits(y)), i
    layer = grown.backbone.layers[0]
    assert layer._k.shape[2] >= 2 * MIN_CAPACITY  # regrown on the way (the single row: twice)


def test_a_step_writes_in_place_and_crops_move_the_length():
    layer = GrowingLayer()
    k, v = torch.randn(2, 3, 5, 4), torch.randn(2, 3, 5, 4)
    keys, values = layer.update(k, v)
    buffer = layer._k
    assert buffer.shape == (2, 3, MIN_CAPACITY, 4) and keys.data_ptr() == buffer.data_ptr()
    assert torch.equal(keys, k) and torch.equal(values, v) and layer.get_seq_length() == 5
    step = torch.randn(2, 3, 1, 4)
    keys, _ = layer.update(step, step)
    assert layer._k is buffer and keys.shape[2] == 6 and torch.equal(keys[:, :, 5:], step)  # no copy of the cache
    layer.crop(-2)
    assert layer._k is buffer and layer.get_seq_length() == 4 and torch.equal(layer.keys, k[:, :, :4])
    with pytest.raises(ValueError, match="negative"):
        layer.crop(3)  # transformers' legacy meaning (a length to keep) is refused, as DynamicLayer does
    layer.keys, layer.values = layer.keys[1:], layer.values[1:]  # a row selection: new contents, own buffer
    assert layer._k is not buffer and layer.keys.shape == (1, 3, 4, 4) and torch.equal(layer.keys, k[1:, :, :4])
    with pytest.raises(ValueError, match="rows"):
        layer.update(step, step)  # two rows on a cache of one
    layer.reset()
    assert layer.keys is None and layer.get_seq_length() == 0 and not layer.is_initialized


def test_rows_kept_move_in_place_and_the_cache_goes_on():
    """Rows kept stay in the same buffers (no new one), each its own keys and values; steps after
    write the kept rows' next slots and grow the buffers as before."""
    layer = GrowingLayer()
    k, v = torch.randn(5, 2, 7, 4), torch.randn(5, 2, 7, 4)
    layer.update(k, v)
    buffer = layer._k
    layer.keep_rows([0, 1, 3])
    assert layer._k.data_ptr() == buffer.data_ptr() and layer.keys.shape == (3, 2, 7, 4)
    assert torch.equal(layer.keys, k[[0, 1, 3]]) and torch.equal(layer.values, v[[0, 1, 3]])
    layer.keep_rows([1, 2])  # the first row leaves: both others move
    assert torch.equal(layer.keys, k[[1, 3]]) and torch.equal(layer.values, v[[1, 3]])
    more_k, more_v = torch.randn(2, 2, 2 * MIN_CAPACITY, 4), torch.randn(2, 2, 2 * MIN_CAPACITY, 4)
    out_k, out_v = layer.update(more_k, more_v)  # past the capacity: regrown with the kept rows
    assert torch.equal(out_k, torch.cat([k[[1, 3]], more_k], 2)) and torch.equal(out_v, torch.cat([v[[1, 3]], more_v], 2))
    layer.keep_rows([1, 0])  # any order: the two swap
    assert torch.equal(layer.keys, torch.cat([k[[3, 1]], more_k[[1, 0]]], 2))
    layer.keep_rows([1])  # the last row into the first's place
    assert torch.equal(layer.values, torch.cat([v[[1]], more_v[[0]]], 2)) and layer.keys.shape[0] == 1
    with pytest.raises(ValueError, match="distinct"):
        layer.keep_rows([0, 0])


def test_the_buffers_double_and_keep_their_prefix():
    layer = GrowingLayer()
    seq = torch.randn(1, 2, 3 * MIN_CAPACITY, 4)
    for t in range(seq.shape[2]):
        keys, values = layer.update(seq[:, :, t:t + 1], -seq[:, :, t:t + 1])
    assert layer._k.shape[2] == 4 * MIN_CAPACITY and torch.equal(keys, seq) and torch.equal(values, -seq)
    assert [capacity_for(n) for n in (0, 1, MIN_CAPACITY, MIN_CAPACITY + 1, 1000)] == [
        MIN_CAPACITY, MIN_CAPACITY, MIN_CAPACITY, 2 * MIN_CAPACITY, 1024]


def test_a_row_slot_grows_the_buffers_where_a_step_would_not_fit():
    """The row ops' slot (lean_rows.py): always given once a prompt is cached, grown first where the
    rows do not fit, so a step's path (row op or Python) never depends on the room left."""
    layer = GrowingLayer()
    assert layer.row_slot(1) is None  # nothing cached yet: the prompt takes ``update``
    seq = torch.randn(1, 2, MIN_CAPACITY - 1, 4)
    layer.update(seq, -seq)
    k, v, n = layer.row_slot(3)
    assert n == MIN_CAPACITY - 1 and k.shape[2] == 2 * MIN_CAPACITY and layer._k is k and layer._v is v
    assert torch.equal(k[:, :, :n], seq) and torch.equal(v[:, :, :n], -seq)  # the prefix kept
    assert layer.row_slot(2)[0] is k  # room: the same buffers


def test_off_the_lean_path_caches_stay_dynamic(tiny_neox_dir):
    bb = load_backbone(BackboneConfig(base=str(tiny_neox_dir)))
    model = MultiTokenModel.attach(bb, {"head_type": "replicated", "n_future": 2, "init": "copy"})
    caches = model.new_caches()
    assert type(caches.backbone) is DynamicCache and all(type(c) is DynamicCache for c in caches.heads)
