"""Pack documents into fixed-length training sequences, with a resumable position.

Documents (from ``data.iter_documents``) are concatenated, each followed by one EOS token,
and the stream is cut into sequences of ``seq_len`` tokens. The stream restarts at the first
document when it runs out (a new epoch), so training can run for any number of steps.

The position between two sequences is ``PackPosition(epoch, doc, offset)``: the next
sequence starts ``offset`` tokens into document ``doc`` (counting its trailing EOS). Saving it
in a checkpoint and passing it back resumes the exact same sequence order. All ranks of a
distributed job read the same global stream and take disjoint slices of each batch, so the
position is one value for the whole job.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace

import numpy as np

from multitoken.base.data import DataConfig, iter_documents
from multitoken.base.errors import DataError


@dataclass(frozen=True)
class PackPosition:
    epoch: int = 0
    doc: int = 0  # document index (as numbered by iter_documents)
    offset: int = 0  # tokens of that document (+ its EOS) already consumed
    consumed: int = 0  # tokens consumed in this epoch (bounds the epoch by max_tokens)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> PackPosition:
        return cls(**{k: int(d[k]) for k in ("epoch", "doc", "offset", "consumed")})


class PackedStream:
    """Endless iterator of ``(sequence # [seq_len] int64, position after it)``.

    ``max_tokens`` of the data config bounds one epoch's token stream (it is enforced here
    rather than in ``iter_documents`` so that a resumed stream keeps the same bound).
    """

    def __init__(self, cfg: DataConfig, tokenizer, seq_len: int, eos_id: int, *,
                 vocab_size: int | None = None, position: PackPosition | None = None, loop: bool = True,
                 epoch_start: PackPosition | None = None):
        if seq_len < 2:
            raise DataError(f"sequence length must be >= 2, got {seq_len}")
        self.cfg = replace(cfg, max_tokens=None)
        self.budget = cfg.max_tokens
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.eos_id = int(eos_id)
        self.vocab_size = vocab_size
        self.position = position or PackPosition()
        self.loop = loop
        # Where every epoch after the first begins (past a held-out head of the stream).
        self.epoch_start = epoch_start or PackPosition()

    def _epoch_pieces(self, pos: PackPosition) -> Iterator[tuple[int, np.ndarray, int]]:
        """``(doc index, ids with EOS # [len+1], start offset)`` for the rest of one epoch."""
        consumed = pos.consumed
        if self.budget is not None and consumed > self.budget:
            raise self._beyond(pos, f"{consumed:,} tokens consumed, the epoch holds {self.budget:,} (--max-tokens)")
        # Read from the document before the position: its presence proves the position lies
        # within the data (at most just past its last document) rather than silently wrapping.
        first = max(pos.doc - 1, 0)
        reached = pos.doc == 0 and pos.offset == 0
        for doc, ids in iter_documents(self.cfg, self.tokenizer, vocab_size=self.vocab_size, start=first):
            piece = np.concatenate([ids, np.array([self.eos_id], dtype=np.int64)])
            if doc < pos.doc:
                reached = pos.offset == 0  # the position is the start of the next document
                continue
            if doc == pos.doc and pos.offset > len(piece):
                raise self._beyond(pos, f"document {doc} holds {len(piece)} tokens with its separator")
            reached = True
            start = pos.offset if doc == pos.doc else 0
            if self.budget is not None:
                room = self.budget - consumed
                if room <= 0:
                    return
                piece = piece[: start + room]
            if start < len(piece):
                consumed += len(piece) - start
                yield doc, piece, start
        if not reached:
            raise self._beyond(pos, "the data ends before that document")

    @staticmethod
    def _beyond(pos: PackPosition, why: str) -> DataError:
        return DataError(f"the data position (document {pos.doc:,}, token {pos.offset:,}) lies beyond the data read: {why}",
                         "resume with the --data the checkpoint was made with, or start over with another --checkpoint-dir")

    def __iter__(self) -> Iterator[tuple[np.ndarray, PackPosition]]:
        pos = self.position
        buf: list[np.ndarray] = []
        have = 0
        while True:
            produced = False
            consumed = pos.consumed
            for doc, piece, start in self._epoch_pieces(pos):
                while start < len(piece):
                    take = min(len(piece) - start, self.seq_len - have)
                    buf.append(piece[start: start + take])
                    have += take
                    start += take
                    consumed += take
                    if have == self.seq_len:
                        # Position after this sequence: the rest of this document, or the next one.
                        nxt = PackPosition(pos.epoch, doc, start, consumed)
                        if start == len(piece):
                            nxt = PackPosition(pos.epoch, doc + 1, 0, consumed)
                        self.position = nxt
                        produced = True
                        yield np.concatenate(buf), nxt
                        buf, have = [], 0
            if not self.loop:
                return
            at_start = (pos.doc, pos.offset) == (self.epoch_start.doc, self.epoch_start.offset)
            if not produced and at_start:
                raise DataError(
                    f"the data holds fewer than {self.seq_len} tokens, not enough for one training sequence",
                    "pass more data or a smaller --seq-len",
                )
            # Next epoch; a partial sequence left over at the end of an epoch is dropped so that
            # every epoch starts at the same place (resumes never need the previous epoch's tail).
            buf, have = [], 0
            start = self.epoch_start
            pos = PackPosition(pos.epoch + 1, start.doc, start.offset, start.consumed)


def take_sequences(stream_iter: Iterator[tuple[np.ndarray, PackPosition]], count: int, seq_len: int):
    """The next ``count`` sequences as one array # [count, seq_len], plus the position after."""
    rows, pos = [], None
    for _ in range(count):
        seq, pos = next(stream_iter)
        rows.append(seq)
    return np.stack(rows).reshape(count, seq_len), pos
