"""The one text path (minisrv/engine/text.py): stop strings, held-back partial stops, and the same text for a prompt
whether it runs alone or in a batch, with a tokenizer that cleans up spaces (" ." -> ".")."""
from __future__ import annotations


import pytest

from minisrv import SamplingParams
from minisrv.engine.text import TextStream, find_stop, partial_stop_len

from .helpers import build_tiny_model, make_llm

PUNCT = [".", ",", "!", "?", "'s", "n't", "'m", "'ve", "'re", "'"]


def write_spaced_tokenizer(path: str, vocab_size: int) -> None:
    """Words and punctuation joined by spaces when decoded (no decoder), with clean_up_tokenization_spaces on:
    the decoded text depends on the clean-up, as with BERT-style tokenizers."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2}
    for p in PUNCT:
        vocab[p] = len(vocab)
    while len(vocab) < vocab_size:
        vocab[f"w{len(vocab)}"] = len(vocab)
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                   clean_up_tokenization_spaces=True)
    fast.save_pretrained(path)


@pytest.fixture(scope="module")
def spaced_model(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("spaced"))
    build_tiny_model(path, "llama", seed=3, vocab_size=16)  # a small vocabulary: punctuation comes up often
    write_spaced_tokenizer(path, 16)
    return path


def test_same_text_alone_and_in_a_batch_with_space_clean_up(spaced_model):
    llm = make_llm(spaced_model)
    tok = llm.tokenizer
    assert tok.clean_up_tokenization_spaces
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    prompts = [[13, 14, 4, 15], [12, 15, 15]]
    alone = [llm.generate(p, params, use_tqdm=False)[0] for p in prompts]
    batch = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(alone, batch):
        assert a.token_ids == b.token_ids
        assert a.text == b.text
    # the text is the clean-up of what the output adds to the prompt's tail, and the clean-up mattered
    for p, a in zip(prompts, alone):
        raw_ctx = tok.decode(p, clean_up_tokenization_spaces=False, skip_special_tokens=True)
        raw = tok.decode(p + a.token_ids, clean_up_tokenization_spaces=False, skip_special_tokens=True)[len(raw_ctx):]
        assert a.text == tok.clean_up_tokenization(raw)
    assert any(a.text != tok.decode(p + a.token_ids, clean_up_tokenization_spaces=False, skip_special_tokens=True)[
        len(tok.decode(p, clean_up_tokenization_spaces=False, skip_special_tokens=True)):]
        for p, a in zip(prompts, alone)), \
        "no clean-up pattern came up: pick other prompts"


class _Chars:
    """A tokenizer stand-in without a streaming decoder: token i is chr(i); decode joins."""

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):
        return "".join(chr(i) for i in ids)


def _feed(stream: TextStream, text: str):
    shown = []
    for ch in text:
        stop = stream.add(ord(ch))
        shown.append(stream.take())
        if stop is not None:
            break
    stream.finish()
    shown.append(stream.take())
    return shown


def test_stop_string_cut_and_partial_stop_held_back():
    s = TextStream(_Chars(), [], ["END", "xyz"])
    shown = _feed(s, "abcENxENDtail")
    assert s.text == "abcENx" and s.stop_str == "END"
    assert "".join(shown) == "abcENx"
    # "EN" was held back while it could still become "END"
    assert shown[:6] == ["a", "b", "c", "", "", "EN"]  # then "x" is held: it may start "xyz"


def test_partial_stop_released_at_the_end():
    s = TextStream(_Chars(), [], ["END"])
    shown = _feed(s, "abEN")
    assert s.stop_str is None and s.text == "abEN" and "".join(shown) == "abEN" and shown[-1] == "EN"


def test_find_stop_and_partial_stop_len():
    assert find_stop("hello world", 8, ["wor", "o"]) == (6, "wor")  # an "o" ending before 8 was seen before
    assert find_stop("hello world", 0, ["wor", "o"]) == (4, "o")
    assert find_stop("abc", 0, ["x"]) is None
    assert partial_stop_len("abcE", ["END"]) == 1 and partial_stop_len("abcEN", ["END", "N!"]) == 2
    assert partial_stop_len("abc", ["END"]) == 0


class _FlagOnlyTokenizer:
    """A tokenizer whose config says clean_up_tokenization_spaces but whose decode does not clean up (as some
    transformers 5 tokenizers do): the flag alone must not change the text."""

    clean_up_tokenization_spaces = True

    def __init__(self, inner):
        self.inner = inner

    def encode(self, text, add_special_tokens=True):
        return self.inner.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)


@pytest.mark.parametrize("flag_only", [False, True])
def test_text_is_the_installed_tokenizers_decode(spaced_model, flag_only):
    """Streamed token by token, the text equals tokenizer.decode(ids, skip_special_tokens=True), whether that
    decode cleans up spaces (the flag honoured) or not (the flag set, decode ignoring it)."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(spaced_model)
    if flag_only:
        tok = _FlagOnlyTokenizer(tok)
    ids = tok.encode("w13 w14 . w15 , w13 ! w14 n't w15 's w13 ?", add_special_tokens=False)
    stream = TextStream(tok, [], ())
    shown = []
    for t in ids:
        stream.add(t)
        shown.append(stream.take())
    stream.finish()
    shown.append(stream.take())
    want = tok.decode(ids, skip_special_tokens=True)
    assert stream.text == "".join(shown) == want
    assert (" ." in want) == flag_only


def test_a_long_output_streams_in_linear_time_with_the_right_text():
    """200,000 tokens through a stream with stop strings: the text and what take() hands out are the whole input
    (no stop string occurs), in well under the time a copy of the text per token would take."""
    import time
    text = "".join(chr(0x61 + (i * 7) % 26) for i in range(200_000))
    stream = TextStream(_Chars(), [], ["zzzz", "#"])
    t0 = time.perf_counter()
    shown = _feed(stream, text)
    took = time.perf_counter() - t0
    assert stream.stop_str is None and stream.text == text and "".join(shown) == text
    assert took < 5.0, f"{took:.1f} s"


def test_a_stop_string_that_began_in_earlier_tokens_cuts_the_text_there():
    stream = TextStream(_Chars(), [], ["cdef"])
    shown = _feed(stream, "abcdefgh")
    assert stream.stop_str == "cdef" and stream.text == "ab" and "".join(shown) == "ab"
