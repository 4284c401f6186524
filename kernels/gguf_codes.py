"""GGUF's Q4_1 / Q8_0 codes (and 16-bit floats) as exact narrow storage for float32 weights: a
weight whose values all lie on a Q4_1 or Q8_0 grid (a GGUF base once transformers has dequantized
it) or are all bfloat16 / float16 values (a 16-bit checkpoint or heads loaded in float32) is kept
in that format (formats.py), and the compiled GEMV (gemv_rows.py) decodes it on the fly.

Why: a decoding step is bound by reading the weights. transformers loads a quantized GGUF by
dequantizing it to float32, and every step then reads 32 bits per weight where the file held 5
(Q4_1) or 8.5 (Q8_0); a bfloat16 checkpoint in float32 reads twice its bits. Each block of 32
weights of an output is ``d * q + m`` (Q4_1: codes q in 0..15, d and m float16) or ``d * q``
(Q8_0: q in -127..127, d float16). ``d * q`` is exact in float32 (11 + 8 significant bits), so
decoding is one rounding, the very one the dequantization made; 16-bit floats widen exactly.
The kernel thus sees the same float32 weights and adds the same fused multiply-adds in the same
order as the float32 blocks: its logits are bit-identical to theirs
(tests/kernels/test_gguf_codes.py).

Greedy steps read only the argmax of the unembedding: on a Q8_0 grid (a GGUF's tied embedding)
``q8_argmax`` takes it from int16 dot products and recounts exactly only the outputs that can
reach the best (argmax_prefilter.cpp), the same argmax as the logits'.

Where the base's GGUF is on disk, the codes are read from it (gguf_file.py); otherwise
``find_codes`` recovers ``d``, ``m`` and the codes from the float32 values and keeps them only if
they reproduce every weight bit for bit; any other weight (float32 values, a LoRA-merged one)
keeps its float32 blocks.
"""

from __future__ import annotations

import torch

from multitoken.kernels import gemv_rows
from multitoken.kernels.formats import QK, Format

Q4, Q8, BF16, F16 = Format.Q4_1, Format.Q8_0, Format.BF16, Format.F16
HALVES = {BF16: torch.bfloat16, F16: torch.float16}  # 16-bit floats: the float blocks' layout, 2 bytes each
CHUNK_ROWS = 4096  # outputs checked at a time (bounds the peak memory of the search)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (a -0.0 is not a 0.0): one comparison in C++, no element-wise mask."""
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


def _half_steps(d: torch.Tensor, steps: int) -> torch.Tensor:
    """``d`` (float16, >= 0) moved ``steps`` representable values up (negative: down), floored at 0."""
    bits = d.view(torch.int16).to(torch.int32) + steps
    return bits.clamp(0, 0x7BFF).to(torch.int16).view(torch.float16)


def _q8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """w [R, T, QK] fp32 -> (d [R, T] fp16, q [R, T, QK] int8) reproducing every bit, or None."""
    d = (w.abs().amax(-1, keepdim=True) / 127).half()  # [R, T, 1]: d * 127 where the largest code is +-127
    scale = d.float()
    t = w.mul(_inverse(scale)).round_()  # a block of zeros: codes 0
    if not bool(t.abs().amax() <= 127):
        return None
    q = t.to(torch.int8)
    return (d.squeeze(-1), q) if _same(q.float().mul_(scale), w) else None  # checked as stored (a -0.0 weight is no code's)


def _inverse(scale: torch.Tensor) -> torch.Tensor:
    """1 / scale (1 where 0): codes are found by multiplying, a quarter of a division's time.
    ``x * (1 / d)`` and ``x / d`` differ by an ulp or two, far less than the half step that would
    round a weight on the grid to another code; every code is checked by rebuilding the weight
    bit for bit either way."""
    return scale.masked_fill(scale == 0, 1.0).reciprocal_()


def _q4_codes(w: torch.Tensor, m: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes of the blocks w [R, T, QK] for m, d [R, T, 1] and whether each block is reproduced # [R, T]."""
    scale = d.float()
    q = torch.sub(w, m).mul_(_inverse(scale)).round_().clamp_(0, 15).to(torch.uint8)  # in place: one temporary
    rec = q.float().mul_(scale).add_(m)  # from the codes as stored; d q exact: one rounding, as the dequantization's
    if _same(rec, w):
        return q, torch.ones(w.shape[:-1], dtype=torch.bool)
    return q, (rec.view(torch.int32) == w.view(torch.int32)).all(-1)


def _q4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """w [R, T, QK] fp32 -> (d, m [R, T] fp16, q [R, T, QK] uint8 in 0..15) reproducing every
    bit, or None. m is the block's least weight (its code 0); d is float16 next to
    (max - m) / 15 (its code 15): that value, else the neighbour below or above it that
    reproduces the block."""
    m = w.amin(-1, keepdim=True)  # [R, T, 1]
    if not _same(m.half().float(), m):
        return None
    d = ((w.amax(-1, keepdim=True) - m) / 15).half()
    q, ok = _q4_codes(w, m, d)
    for steps in (-1, 1):
        if bool(ok.all()):
            break
        bad = (~ok).nonzero(as_tuple=True)  # the blocks to try again
        d_try = _half_steps(d[bad], steps)  # [n, 1]
        q_try, ok_try = _q4_codes(w[bad], m[bad], d_try)
        fixed = tuple(i[ok_try] for i in bad)
        d[fixed], q[fixed], ok[fixed] = d_try[ok_try], q_try[ok_try], True
    return (d.squeeze(-1), m.squeeze(-1).half(), q) if bool(ok.all()) else None


GRIDS = {Q4: _q4, Q8: _q8}


def _blocks_of(weight: torch.Tensor, start: int, rows: int) -> torch.Tensor:
    return weight[start:start + rows].reshape(-1, weight.shape[1] // QK, QK)  # [R, T, QK]


def codes_in(weight: torch.Tensor, kind: Format) -> list | None:
    """The codes of a float32 ``weight`` [N, K] in ``kind`` (parts per chunk of ``CHUNK_ROWS``
    outputs; BF16 / F16: the weight itself), or None where not every weight is reproduced bit for
    bit. A float checkpoint fails early, at little cost: its blocks' least weights are not float16
    values (past one chunk, its first 64 rows say so)."""
    n, k = weight.shape
    if weight.dtype != torch.float32 or weight.device.type != "cpu" or not n:
        return None
    if kind in HALVES:
        dtype = HALVES[kind]
        same = _same(weight[:64].to(dtype).float(), weight[:64]) and _same(weight.to(dtype).float(), weight)
        return [weight] if same else None
    if k % QK or (n > CHUNK_ROWS and GRIDS[kind](_blocks_of(weight, 0, 64)) is None):  # a big weight off the grid: said early
        return None
    parts = []
    for start in range(0, n, CHUNK_ROWS):
        if (found := GRIDS[kind](_blocks_of(weight, start, CHUNK_ROWS))) is None:
            return None
        parts.append(found)
    return parts


def find_codes(weight: torch.Tensor) -> tuple[Format, list] | None:
    """The narrowest format that holds a float32 ``weight`` [N, K] exactly (Q4_1, Q8_0, then
    bfloat16, float16) and its codes, or None."""
    for kind in (Q4, Q8, BF16, F16):
        if (parts := codes_in(weight, kind)) is not None:
            return kind, parts
    return None


def _by_blocks(t: torch.Tensor, width: int) -> torch.Tensor:
    """[N, ...] per output, zero-padded to whole column blocks -> [B, width, ...]."""
    pad = -t.shape[0] % width
    if pad:
        t = torch.cat([t, t.new_zeros(pad, *t.shape[1:])])
    return t.reshape(-1, width, *t.shape[1:])


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def pack(kind: Format, parts: list[tuple]) -> torch.Tensor:
    """The codes of ``find_codes`` in the kernel's chunks # -> [B, K / QK, bytes] uint8: per column
    block of L outputs and QK inputs, d [L] fp16, (Q4) m [L] fp16, then the codes: Q4, per input
    L / 2 bytes (output j in byte j's low nibble, output j + L / 2 in its high one); Q8, L int8."""
    if kind in HALVES:
        return _as_bytes(gemv_rows.block_weight(parts[0]).to(HALVES[kind])).flatten(2)  # [B, K, 2L]
    width = gemv_rows.lanes()
    fields = [torch.cat(f) for f in zip(*parts)]  # d [N, T], (m [N, T],) q [N, T, QK]
    scales = [_as_bytes(_by_blocks(f, width).transpose(1, 2)) for f in fields[:-1]]  # [B, T, L] fp16 -> [B, T, 2L]
    codes = _by_blocks(fields[-1], width).permute(0, 2, 3, 1)  # [B, T, QK, L]
    if kind == Q4:
        half = width // 2
        codes = codes[..., :half] | (codes[..., half:] << 4)  # [B, T, QK, L / 2]
    codes = _as_bytes(codes).flatten(2)  # [B, T, QK * bytes per input]
    return torch.cat([*scales, codes], dim=-1).contiguous()


def dense(packed: torch.Tensor, kind: Format, n: int) -> torch.Tensor:
    """The float32 weight [N, K] back from ``pack``'s chunks, exactly (d q + m: d q is exact)."""
    if kind in HALVES:
        return gemv_rows.dense_weight(packed.view(HALVES[kind]).float(), n)
    blocks, chunks, _ = packed.shape
    d, m, q = _fields(packed, kind)
    w = q.float() * d.unsqueeze(2) + m.unsqueeze(2)  # [B, T, QK, L]
    return w.permute(0, 3, 1, 2).reshape(blocks * d.shape[-1], chunks * QK)[:n].contiguous()


def _fields(packed: torch.Tensor, kind: Format) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Q4_1 / Q8_0 ``pack``'s d, m [B, T, L] (float32, exact) and codes q [B, T, QK, L] (as stored:
    uint8 / int8)."""
    blocks, chunks, _ = packed.shape
    width = gemv_rows.lanes()
    d = packed[..., :2 * width].contiguous().view(torch.float16).float()  # [B, T, L]
    if kind == Q4:
        m = packed[..., 2 * width:4 * width].contiguous().view(torch.float16).float()
        codes = packed[..., 4 * width:].reshape(blocks, chunks, QK, width // 2)
        return d, m, torch.cat([codes & 15, codes >> 4], dim=-1)
    return d, torch.zeros_like(d), packed[..., 2 * width:].contiguous().view(torch.int8).reshape(blocks, chunks, QK, width)


def linear(x: torch.Tensor, packed: torch.Tensor, kind: Format, n: int, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] fp32 -> [..., N] from the codes, ``gemv_rows.MAX_ROWS`` rows per kernel call
    (a prompt's pass too: no dense copy is ever made, and every row's logits are a step's)."""
    x = x if x.is_contiguous() else x.contiguous()  # rows [M, K] in memory
    return gemv_rows.library().gemv(x, packed, kind, n, bias)


# The exact argmax of Q8_0 codes (argmax_prefilter.cpp): greedy steps need only the argmax of the
# unembedding, and the int16 screen finds it from integer dot products, recounting exactly only
# the outputs within the screen's bound of the best.
def l1_norms(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Per output of a Q8_0 ``pack``, sum_k |w_kv| rounded up # -> [N] fp32: the screen's bound
    scales with it."""
    d, _, q = _fields(packed, Q8)
    # integer sums of 32 codes of at most 127 each: exact in int16, the narrowest (fastest) sum
    l1 = (d.double().abs() * q.abs().sum(2, dtype=torch.int16)).sum(1).reshape(-1)[:n]  # [N]
    return torch.nextafter(l1.float(), torch.tensor(float("inf")))


def prefilter_built() -> bool:
    """Whether the kernel has the int16 prefilter (built with AVX512-VNNI: cpu_features.py)."""
    return bool(gemv_rows.library().prefilter_built())


def q8_argmax(x: torch.Tensor, packed: torch.Tensor, n: int, l1: torch.Tensor) -> torch.Tensor | None:
    """``linear(x, packed, Q8, n, None).argmax(-1)`` exactly (the first on ties) # [..., K] ->
    [...] long; None where the prefilter does not apply here (no AVX512-VNNI, more than
    ``MAX_ROWS`` rows, a non-finite input or logit): then take that argmax."""
    k = x.shape[-1]
    rows = x.reshape(-1, k).contiguous()  # [M, K]
    if not (0 < rows.shape[0] <= gemv_rows.MAX_ROWS and prefilter_built()):
        return None
    best, picked = gemv_rows.library().q8_argmax(rows, packed, l1, n)
    return None if picked < 0 else best.reshape(x.shape[:-1])


def probe() -> bool:
    """Whether the kernel's narrow formats reproduce the float32 blocks bit for bit here (a weight of
    each kind with a partial last block, 1 and 13 rows); once per process, from cpu_linear."""
    gen = torch.Generator().manual_seed(0)
    d = torch.rand(40, 2, 1, generator=gen).half().float() / 64
    m = -torch.rand(40, 2, 1, generator=gen).half().float()
    q4 = torch.randint(0, 16, (40, 2, QK), generator=gen).float()
    q8 = torch.randint(-127, 128, (40, 2, QK), generator=gen).float()
    q4[..., :2], q8[..., 0] = torch.tensor([0.0, 15.0]), 127.0  # each block's extreme codes
    half = torch.randn(40, 2 * QK, generator=gen)
    for kind, w in ((Q4, (q4 * d + m).reshape(40, 2 * QK)), (Q8, (q8 * d).reshape(40, 2 * QK)),
                    (BF16, half.bfloat16().float()), (F16, half.half().float())):
        found = find_codes(w)
        if found is None or found[0] != kind:
            return False
        packed = pack(*found)
        for rows in (1, 13):
            x = torch.randn(rows, 2 * QK, generator=gen)
            got = linear(x, packed, found[0], 40, None)
            if not torch.equal(got.view(torch.int32), gemv_rows.linear(x, gemv_rows.block_weight(w), 40, None).view(torch.int32)):
                return False
    return True
