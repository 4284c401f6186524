"""The Q4_1 / Q8_0 codes a GGUF file holds, handed to cpu_linear for the weights they dequantize to.

Why: a base converted from a GGUF (``multitoken fetch``) holds float32 weights, and
``gguf_codes.find_codes`` recovers their codes by searching the floats in every process. The
GGUF beside the conversion has them as stored: per block of 32 inputs, Q4_1 is fp16 ``d``, fp16
``m`` and 16 bytes of nibbles (value j in byte j's low nibble, value j + 16 in its high one);
Q8_0 is fp16 ``d`` and 32 int8 codes.

Which tensor is which weight: transformers names and row-permutes the GGUF's tensors (llama's
q / k rows are interleaved per head in a GGUF), so nothing is assumed from names. A tensor is
matched to a float weight by its shape and its rows' first blocks (a key per row from the
dequantized values, sorted: the same multiset), the row order taken from the keys (from whole
rows where two rows begin alike), and the codes kept only where ``d q + m`` rebuilds every weight
bit for bit, as ``find_codes`` requires. Any other weight (a LoRA-merged one, a GGUF tensor of
another type) gets None, and so does every weight where the file cannot be read as a GGUF: the
caller searches the floats. Reading codes rather than searching also keeps a block whose codes
the search cannot recover (its largest code below 15, say)."""

from __future__ import annotations

import functools
import struct
from pathlib import Path

import numpy as np
import torch

from multitoken.kernels import pack_cache
from multitoken.kernels.formats import QK, Format

KEY_ROWS = 1024  # rows keyed or checked at a time (their temporaries stay in cache)
_BLOCK_BYTES = {Format.Q4_1: 4 + QK // 2, Format.Q8_0: 2 + QK}  # per 32 inputs


def _multipliers(k: int) -> torch.Tensor:
    """Fixed odd int64 per input: a row's key is the wrapped sum of its bits times these."""
    gen = torch.Generator().manual_seed(0x6775)
    return torch.randint(1, 2**62, (k,), generator=gen, dtype=torch.int64) | 1


def row_keys(weight: torch.Tensor) -> torch.Tensor:
    """A key per row of a float32 ``weight`` [N, K] from its bits # -> [N] int64 (equal rows: equal keys)."""
    mult = _multipliers(weight.shape[1])
    bits = weight.view(torch.int32)
    return torch.cat([(bits[i:i + KEY_ROWS].to(torch.int64) * mult).sum(-1) for i in range(0, len(bits), KEY_ROWS)])


def fields(kind: Format, raw: torch.Tensor) -> tuple:
    """A GGUF tensor's blocks ``raw`` [N, T * bytes] uint8 -> ``find_codes``' parts: Q4_1 (d, m [N, T]
    fp16, q [N, T, QK] uint8 in 0..15), Q8_0 (d [N, T] fp16, q [N, T, QK] int8)."""
    n = raw.shape[0]
    blocks = raw.reshape(n, -1, _BLOCK_BYTES[kind])  # [N, T, bytes]
    d = blocks[..., 0:2].contiguous().view(torch.float16).squeeze(-1)  # [N, T]
    if kind == Format.Q8_0:
        return d, blocks[..., 2:].contiguous().view(torch.int8)
    m = blocks[..., 2:4].contiguous().view(torch.float16).squeeze(-1)
    nibbles = blocks[..., 4:]  # [N, T, QK / 2]
    return d, m, torch.cat([nibbles & 15, nibbles >> 4], dim=-1)


def dequantized(kind: Format, parts: tuple) -> torch.Tensor:
    """The float32 weight [N, K] the codes stand for (``d q + m``: ``d q`` exact, one rounding)."""
    w = parts[-1].float().mul_(parts[0].float().unsqueeze(-1))  # in place: one temporary
    if kind == Format.Q4_1:
        w.add_(parts[1].float().unsqueeze(-1))
    return w.reshape(w.shape[0], -1)


# The GGUF layout (gguf-py's constants): a header, key-value metadata, tensor infos, then the
# tensors at an aligned offset. Only the tensor infos are needed; gguf.GGUFReader would also build
# an object per metadata item (a vocabulary's every token), seconds for a small model.
Q4_1_TYPE, Q8_0_TYPE = 3, 8  # GGMLQuantizationType
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


def tensor_infos(data: np.ndarray) -> tuple[int, list[tuple[list[int], int, int]]]:
    """A GGUF file's bytes -> (where its tensor data starts, [(dims innermost first, type, offset)]);
    ValueError or struct.error where it is not one."""
    buf, at = memoryview(data), 0

    def read(fmt: str) -> tuple:
        nonlocal at
        values = struct.unpack_from("<" + fmt, buf, at)
        at += struct.calcsize("<" + fmt)
        return values

    def string() -> bytes:
        nonlocal at
        size = read("Q")[0]
        if size > len(buf) - at:
            raise ValueError("a string runs past the end of the file")
        at += size
        return bytes(buf[at - size:at])

    def value(kind: int):
        if kind == _STRING:
            return string()
        if kind == _ARRAY:
            item, count = read("IQ")
            if count > len(buf) - at:  # every item takes a byte at least
                raise ValueError("an array runs past the end of the file")
            return [value(item) for _ in range(count)] if item in (_STRING, _ARRAY) else read(f"{count}{_SCALARS[item]}")
        return read(_SCALARS[kind])[0]

    magic, version, n_tensors, n_kv = read("4sIQQ")
    if magic != b"GGUF" or version < 2:
        raise ValueError("not a GGUF file of version 2 or later")
    align = 32
    for _ in range(n_kv):
        key, kind = string(), read("I")[0]
        found = value(kind)
        align = found if key == b"general.alignment" else align
    infos = []
    for _ in range(n_tensors):
        string()
        dims = list(read(f"{read('I')[0]}Q"))
        infos.append((dims, *read("IQ")))
    return at + -at % align, infos


class GGUFCodes:
    """The codes of one GGUF file, looked up by a float weight: ``codes(weight)`` -> (Format, parts)
    as ``gguf_codes.find_codes`` gives them, or None. The file is indexed on the first lookup."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._index: dict | None = None

    def identity(self) -> str:
        """The file's content digest (pack_cache.py keys packed weights by it: a changed file is
        another key)."""
        return pack_cache.file_digest(self.path)

    def _tensors(self):
        """(kind, where its blocks start, rows, bytes per row, its rows' first blocks [N, QK] fp32)
        per Q4_1 / Q8_0 matrix; the file is mapped only while it is indexed."""
        kinds = {Q4_1_TYPE: Format.Q4_1, Q8_0_TYPE: Format.Q8_0}
        data = np.memmap(self.path, dtype=np.uint8, mode="r")
        start, infos = tensor_infos(data)
        for dims, kind, offset in infos:
            if kind in kinds and len(dims) == 2:
                n, row = dims[1], dims[0] // QK * _BLOCK_BYTES[kinds[kind]]  # GGUF lists dims innermost first
                at = start + offset
                first = np.ascontiguousarray(data[at:at + n * row].reshape(n, row)[:, :_BLOCK_BYTES[kinds[kind]]])
                yield kinds[kind], at, n, row, dequantized(kinds[kind], fields(kinds[kind], torch.from_numpy(first)))

    def index(self) -> dict:
        """(N, K, sorted keys of the rows' first blocks) -> [(kind, offset, N, bytes per row, first
        blocks' keys)] of every Q4_1 / Q8_0 matrix: one block per row is decoded to index a file."""
        if self._index is None:
            index: dict = {}
            try:
                for kind, at, n, row, first in self._tensors():
                    keys = row_keys(first)
                    index.setdefault((n, row // _BLOCK_BYTES[kind] * QK, _sorted(keys)), []).append((kind, at, n, row, keys))
            except (ValueError, KeyError, struct.error):  # not a GGUF this reader knows: no codes, the floats are searched
                index = {}
            self._index = index
        return self._index

    def _raw(self, at: int, n: int, row: int) -> torch.Tensor:
        """A tensor's blocks, read into memory # -> [N, T * bytes] uint8."""
        return torch.from_numpy(np.fromfile(self.path, dtype=np.uint8, count=n * row, offset=at).reshape(n, row))

    def __call__(self, weight: torch.Tensor) -> tuple[Format, list] | None:
        if not (weight.dtype == torch.float32 and weight.device.type == "cpu" and weight.dim() == 2):
            return None
        if not weight.numel() or weight.shape[1] % QK:
            return None
        keys = row_keys(weight[:, :QK])
        for kind, at, n, row, first_keys in self.index().get((*weight.shape, _sorted(keys)), []):
            parts = fields(kind, self._raw(at, n, row))
            ours = _whole_where_tied(keys, lambda rows: weight[rows])
            theirs = _whole_where_tied(first_keys, lambda rows: dequantized(kind, tuple(f[rows] for f in parts)))
            order = torch.empty_like(ours)
            order[ours.argsort()] = theirs.argsort()  # our row i is their row order[i]
            if not torch.equal(order, torch.arange(len(order))):  # q / k rows: transformers' order
                parts = tuple(f[order] for f in parts)
            if _rebuilds(kind, parts, weight):
                return kind, [parts]
        return None


def _rebuilds(kind: Format, parts: tuple, weight: torch.Tensor) -> bool:
    """Whether the codes rebuild ``weight`` [N, K] bit for bit, as ``find_codes`` requires (a
    chunk of rows at a time: its temporaries stay in cache)."""
    bits = weight.view(torch.int32)
    for i in range(0, len(bits), KEY_ROWS):
        chunk = dequantized(kind, tuple(f[i:i + KEY_ROWS] for f in parts))
        if not torch.equal(chunk.view(torch.int32), bits[i:i + KEY_ROWS]):
            return False
    return True


def _whole_where_tied(keys: torch.Tensor, rows_of) -> torch.Tensor:
    """``keys`` [N] of the rows' first blocks, those shared by several rows replaced by keys of the
    whole rows (``rows_of(mask)`` -> those rows [n, K] fp32): rows that begin alike ordered by all
    their values; rows alike throughout are the same weights in either order."""
    _, inverse, counts = keys.unique(return_inverse=True, return_counts=True)
    tied = counts[inverse] > 1
    if not bool(tied.any()):
        return keys
    keys = keys.clone()
    keys[tied] = row_keys(rows_of(tied))
    return keys


def _sorted(keys: torch.Tensor) -> bytes:
    return keys.sort().values.numpy().tobytes()


@functools.lru_cache(maxsize=4)
def _opened(path: str, size: int, mtime_ns: int) -> GGUFCodes:
    return GGUFCodes(Path(path))


def codes_of(path: Path | None) -> GGUFCodes | None:
    """The codes of the GGUF at ``path`` (None: no file there), one index per file version and process."""
    if path is None or not Path(path).is_file():
        return None
    st = Path(path).stat()
    return _opened(str(path), st.st_size, st.st_mtime_ns)
