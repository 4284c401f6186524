"""The text of a continuation equals decode(prompt + new) - decode(prompt), whole and streamed,
for the three tokenizer families: SentencePiece (stories260K, its word-start marker on the
first new token), GPT-NeoX (the real Pythia tokenizer) and a byte-level BPE built here."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from multitoken.decoding.text import TextStream, continuation_text
from multitoken.embedded import EMBEDDED_DIR

from ..conftest import fixture_path

PROMPT, REST = "Once", " upon a time, the café served 日本 tea.\nThe end"


def _byte_level_bpe() -> PreTrainedTokenizerFast:
    """A small Llama-3 / SmolLM-style byte-level BPE, trained on a few sentences."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([PROMPT + REST, "Once upon a time there was a cat.", "a café"] * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


@pytest.fixture(scope="module", params=["sentencepiece", "gpt_neox", "byte_level_bpe"])
def tok(request):
    if request.param == "sentencepiece":
        return AutoTokenizer.from_pretrained(str(EMBEDDED_DIR / "stories260K"))
    if request.param == "gpt_neox":
        return PreTrainedTokenizerFast(tokenizer_file=str(fixture_path("gpt_neox_20b_tokenizer", "tokenizer.json")))
    return _byte_level_bpe()


def _split(tok):
    """(prompt ids, continuation ids) of PROMPT + REST, cut at the prompt's own tokens."""
    prompt = tok(PROMPT).input_ids
    full = tok(PROMPT + REST).input_ids
    assert full[:len(prompt)] == prompt  # the boundary is a token boundary in all three
    return prompt, full[len(prompt):]


def test_the_space_at_the_prompt_boundary_is_kept(tok):
    prompt, new = _split(tok)
    expected = tok.decode(prompt + new, skip_special_tokens=True)[len(tok.decode(prompt, skip_special_tokens=True)):]
    assert continuation_text(tok, prompt, new) == expected == REST
    assert continuation_text(tok, prompt, new[:1]).startswith(" ")  # "Onceupon" was printed before


@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_the_stream_is_incremental_and_adds_up_to_the_whole(tok, chunk):
    prompt, new = _split(tok)
    stream, pieces = TextStream(tok, prompt), []
    for i in range(0, len(new), chunk):
        piece = stream.push(new[i:i + chunk])
        pieces.append(piece)
        assert "\ufffd" not in piece  # an incomplete character is held back, never printed
        assert REST.startswith("".join(pieces))  # what is printed never changes
    assert any(pieces[:-1])  # text comes out while decoding, not only at the end
    pieces.append(stream.finish())
    assert "".join(pieces) == continuation_text(tok, prompt, new) == REST


def test_a_character_split_over_byte_tokens_waits_for_its_last_byte():
    tok = _byte_level_bpe()
    ids = tok("日", add_special_tokens=False).input_ids
    if len(ids) < 2:
        ids = [tok.convert_tokens_to_ids(t) for t in tok.convert_ids_to_tokens(ids)[0]]  # one token per byte
    assert len(ids) >= 2 and tok.decode(ids[:1]).endswith("\ufffd")
    stream = TextStream(tok, tok("a").input_ids)
    assert [stream.push([i]) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert stream.push(ids[-1:]) + stream.finish() == "日"


def test_generate_prints_what_json_reports():
    """The embedded SentencePiece model: stdout is the prompt, then --json's text."""
    args = [sys.executable, "-m", "multitoken.pipeline.cli", "generate", PROMPT, "--max-new-tokens", "6", "--greedy"]
    streamed = subprocess.run(args, capture_output=True, text=True, check=True).stdout
    record = json.loads(subprocess.run([*args, "--json"], capture_output=True, text=True, check=True).stdout)
    assert streamed == PROMPT + record["text"] + "\n"
    assert record["text"].startswith(" ")
