"""A streamed answer's text (``dllm.serve.server._Text``): the pieces sent add up to one decode of the answer's ids,
cut at the first EOS and the first stop string, for every way the ids arrive and for the decoder families of the
published checkpoints (byte-level BPE as the bundled tokenizer, LLaDA's and Qwen's; SentencePiece-style with byte
fallback as Llama's; WordPiece with clean-up); and each arriving piece decodes a bounded number of ids, so a long
answer streamed one token at a time costs its length, not its square."""

from __future__ import annotations

import random

import pytest

pytest.importorskip("fastapi")

from tokenizers import Tokenizer, decoders, models  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402

import dllm  # noqa: E402
from dllm.serve.server import _Text  # noqa: E402


def _bundled():
    return dllm.load_model("llada-tiny").tokenizer


def _sentencepiece():
    """Llama's decoder chain: the word marker as a space, bytes as <0xNN> pieces fused into characters, the first
    space stripped."""
    pieces = ["<unk>", "</s>", "▁", "▁the", "▁answer", "▁is", "for", "ty", "▁two", ",", ".", "n't", "▁do", "▁€"]
    pieces += [f"<0x{b:02X}>" for b in dict.fromkeys("€é中🙂".encode())]
    t = Tokenizer(models.WordLevel({p: i for i, p in enumerate(pieces)}, unk_token="<unk>"))
    t.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                   decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=t, unk_token="<unk>", eos_token="</s>")


def _wordpiece():
    """BERT's decoder: ``##`` pieces join the word before them; the clean-up joins "do n't" and " ." across ids."""
    pieces = ["[UNK]", "[SEP]", "the", "answer", "is", "for", "##ty", "two", ",", ".", "do", "n", "'", "t", "##s"]
    t = Tokenizer(models.WordPiece({p: i for i, p in enumerate(pieces)}, unk_token="[UNK]"))
    t.decoder = decoders.WordPiece()
    return PreTrainedTokenizerFast(tokenizer_object=t, unk_token="[UNK]", sep_token="[SEP]",
                                   clean_up_tokenization_spaces=True)


TOKENIZERS = {"byte-level BPE": _bundled, "sentencepiece": _sentencepiece, "wordpiece": _wordpiece}


def _ids(tok, rng: random.Random, n: int) -> list[int]:
    """Random ids: mostly words of the vocabulary, with special tokens and, for byte-level and byte-fallback
    vocabularies, the bytes of multi-byte characters, whole or cut."""
    vocab = len(tok)
    words = [i for i in range(vocab) if i not in tok.all_special_ids]
    multibyte = tok.encode("é中🙂 €", add_special_tokens=False)
    out: list[int] = []
    while len(out) < n:
        r = rng.random()
        if r < 0.1:
            out += multibyte[: rng.randrange(1, len(multibyte) + 1)]
        elif r < 0.15:
            out.append(rng.choice(tok.all_special_ids))
        else:
            out.append(rng.choice(words))
    return out[:n]


def _stream(tok, text: _Text, ids: list[int], stops: list[str], eos: set, rng: random.Random) -> str:
    """Feeds ``ids`` in random pieces; after each, the text so far is one decode of the ids fed (up to the first
    EOS), cut at the first stop string."""
    sent, i = "", 0
    while i < len(ids) and not text.stopped:
        k = rng.choice([1, 1, 1, 2, 3, 8])
        sent += text.feed(ids[i:i + k])
        i += k
        fed = ids[:i]
        end = next((j for j, t in enumerate(fed) if t in eos), len(fed))
        assert text.text == _cut(tok.decode(fed[:end], skip_special_tokens=True), stops), (fed, stops)
    if not text.stopped:
        sent += text.feed([], True)
    return sent


def _cut(text: str, stops: list[str]) -> str:
    hits = [text.find(s) for s in stops if s in text]
    return text[: min(hits)] if hits else text


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_the_text_is_one_decode_of_the_answer_at_every_piece(name):
    """Every family: the text after each piece is the whole decode's. The pieces sent add up to it where the
    decoder never rewrites text it gave for fewer ids (byte-level BPE: every checkpoint the project loads);
    WordPiece's clean-up and a byte fallback across an invalid byte do, and what was sent stays sent."""
    tok = TOKENIZERS[name]()
    rng = random.Random(0)
    eos = {tok.eos_token_id} if tok.eos_token_id is not None else set()
    for trial in range(60):
        ids = _ids(tok, rng, rng.randrange(0, 90))
        end = next((i for i, t in enumerate(ids) if t in eos), len(ids))
        whole = tok.decode(ids[:end], skip_special_tokens=True)
        stops = [whole[a:a + rng.randrange(1, 4)] for a in [rng.randrange(len(whole))]] if whole and trial % 3 else []
        text = _Text(tok, eos, stops)
        got = _stream(tok, text, ids, stops, eos, rng)
        want = _cut(whole, stops)
        if name == "byte-level BPE":
            assert (got, text.text, text.stopped) == (want, want, want != whole), (trial, ids, stops)
        elif not text.stopped:  # (a rewriting decoder may show a stop string in fewer ids' text only)
            assert text.text == whole
            if not _long_byte_run(tok, ids):
                assert got == whole, (trial, ids)


def _long_byte_run(tok, ids: list[int]) -> bool:
    """Whether ``ids`` hold more byte pieces (``<0xNN>``) in a row than a stream holds back: a byte fallback decodes
    a run of bytes as one, so a late byte can rewrite the whole run's text."""
    run = 0
    for piece in tok.convert_ids_to_tokens(ids):
        run = run + 1 if piece.startswith("<0x") else 0
        if run > 4:
            return True
    return False


@pytest.mark.parametrize("name,ids", [
    ("wordpiece", ["do", "n", "'", "t", "two", "."]),  # clean-up: "do n ' t" -> "don't", " ." -> "."
    ("sentencepiece", ["▁the", "<0xC3>", "<0xA9>", "<0x82>", "▁two"]),  # "é" then a byte that makes it invalid
])
def test_a_decoder_that_rewrites_the_last_ids_text_streams_the_whole_text(name, ids):
    """The stream holds back the last few ids' text where the decoder may still rewrite it: what was sent is never
    taken back, and the pieces add up to the whole answer's decode."""
    tok = TOKENIZERS[name]()
    ids = tok.convert_tokens_to_ids(ids)
    whole = tok.decode(ids, skip_special_tokens=True)
    assert any(tok.decode(ids[:i], skip_special_tokens=True) not in whole for i in range(1, len(ids)))  # rewrites
    text = _Text(tok, set(), [])
    got = "".join(text.feed([t]) for t in ids) + text.feed([], True)
    assert got == whole


class _Counting:
    """A tokenizer that counts the ids it is asked to decode."""

    def __init__(self, tok):
        self.tok, self.decoded = tok, 0

    def decode(self, ids, **kw):
        self.decoded += len(ids)
        return self.tok.decode(ids, **kw)


def test_a_long_answer_streamed_one_token_at_a_time_decodes_each_id_a_bounded_number_of_times():
    tok = _bundled()
    rng = random.Random(1)
    ids = _ids(tok, rng, 3000)
    ids = [t for t in ids if t not in tok.all_special_ids]  # no EOS: the whole answer streams
    counting = _Counting(tok)
    text = _Text(counting, set(), ["never in the answer \x00"])
    sent = "".join(text.feed([t]) for t in ids) + text.feed([], True)
    assert sent == tok.decode(ids, skip_special_tokens=True)
    # decoding the whole answer at each token would be about 4.5 million ids
    assert counting.decoded < 40 * len(ids), counting.decoded
