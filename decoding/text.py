"""The text of a continuation, whole (``--json``, ``--prompts``) or streamed.

Tokens alone do not decode to the right text: SentencePiece drops the word-start space of the
first token it decodes ("upon" for "▁upon" after "Once"), and byte-level BPE splits a character
over tokens. So the text of new tokens is the decoding of prompt plus continuation, minus the
prompt's own decoding; the stream prints the part of it that can no longer change.
"""

from __future__ import annotations

from collections.abc import Sequence

REPLACEMENT = "\ufffd"  # what a decoder shows for the bytes of an incomplete UTF-8 character


def _decode(tok, ids: Sequence[int]) -> str:
    return tok.decode(list(ids), skip_special_tokens=True)


def continuation_text(tok, prompt_ids: Sequence[int], new_ids: Sequence[int], *, prompt_text: str | None = None) -> str:
    """``decode(prompt + new) - decode(prompt)``; ``prompt_text``: the prompt's decoding, when known.
    Should the prompt's text change with what follows (a tokenizer that merges across the
    boundary), the text after their common prefix."""
    head = _decode(tok, prompt_ids) if prompt_text is None else prompt_text
    full = _decode(tok, [*prompt_ids, *new_ids])
    if full.startswith(head):
        return full[len(head):]
    same = next((i for i, (a, b) in enumerate(zip(full, head)) if a != b), min(len(full), len(head)))
    return full[same:]


class TextStream:
    """Incremental ``continuation_text``: ``push(tokens)`` returns the newly stable text, ``finish()``
    the rest. As transformers' TextStreamer, it holds back a trailing incomplete character and the
    word in progress (a later token may still change how it decodes), and prints whole lines."""

    def __init__(self, tok, prompt_ids: Sequence[int]):
        self.tok, self.prompt = tok, list(prompt_ids)
        self.prompt_text = _decode(tok, self.prompt)
        self.new: list[int] = []
        self.shown = 0

    def _text(self) -> str:
        return continuation_text(self.tok, self.prompt, self.new, prompt_text=self.prompt_text)

    def push(self, tokens: Sequence[int]) -> str:
        self.new.extend(tokens)
        text = self._text()
        if text.endswith("\n"):
            stable = len(text)
        elif text.endswith(REPLACEMENT):  # an incomplete multi-byte character: wait for the rest
            stable = self.shown
        else:
            stable = text.rfind(" ") + 1  # up to the word in progress
        return self._emit(text, stable)

    def finish(self) -> str:
        text = self._text()
        return self._emit(text, len(text))

    def _emit(self, text: str, stable: int) -> str:
        if stable <= self.shown:
            return ""
        out, self.shown = text[self.shown:stable], stable
        return out
