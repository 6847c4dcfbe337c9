"""StopChecker: incremental detokenization equals tokenizer.decode, and every stop condition."""

from __future__ import annotations

import random
import string
from typing import Any

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from tokenizers.decoders import DecodeStream
from transformers import PreTrainedTokenizerFast

from batchgen.engine.api.params import SamplingParams
from batchgen.engine.sampling import stopping
from batchgen.engine.sampling.stopping import REPLACEMENT_CHAR, StopChecker

SENTENCES = [
    "hello world, the café is naïve",
    "smile 😀 and wave 👋 at the crème brûlée",
    "日本語のテキスト and ascii",
    "Ünïcödé everywhere: ñ ø å ß",
]


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerFast:
    """Byte-level BPE with a small vocab, so accented letters and emoji split across tokens."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=330, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train_from_iterator(SENTENCES * 5, trainer)
    backend.add_tokens(["abcdef"])  # one token holding several characters
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", clean_up_tokenization_spaces=False)


def byte_ids(tok: PreTrainedTokenizerFast, text: str) -> list[int]:
    """One token per UTF-8 byte: the finest split a byte-level model can produce."""
    alphabet = {b: c for b, c in zip(range(256), _bytes_to_unicode())}
    return [tok.convert_tokens_to_ids(alphabet[b]) for b in text.encode("utf-8")]


def _bytes_to_unicode() -> list[str]:
    """GPT-2's byte -> printable character table, indexed by byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


def run(tok: Any, ids: list[int], prompt: list[int] | None = None, **params: Any) -> tuple[StopChecker, int]:
    """Feed ids until finished; return the checker and how many ids it consumed."""
    params.setdefault("max_tokens", max(len(ids), 1))
    checker = StopChecker(tok, SamplingParams(**params), {tok.eos_token_id}, prompt_token_ids=prompt)
    for n, token_id in enumerate(ids, start=1):
        if checker.append(token_id):
            return checker, n
    return checker, len(ids)


def reference(tok: Any, ids: list[int], stops: list[str], include: bool) -> tuple[str, int, str | None]:
    """Slow model of the rules: re-decode every prefix; text is visible once its characters are whole."""
    seen = 0
    for k in range(1, len(ids) + 1):
        text = tok.decode(ids[:k], skip_special_tokens=True)
        last = k == len(ids)
        if not last and (text.endswith(REPLACEMENT_CHAR) or len(text) <= seen):
            continue
        hits = [(text.find(s, max(0, seen - len(s) + 1)), s) for s in stops]
        hits = [(i + len(s), i, s) for i, s in hits if i >= 0]
        if hits:
            end, start, stop = min(hits)
            return (text[:end] if include else text[:start]), k, stop
        seen = len(text)
    return tok.decode(ids, skip_special_tokens=True), len(ids), None


def random_ids(tok: Any, rng: random.Random) -> list[int]:
    kind = rng.randrange(3)
    if kind == 0:
        return [rng.randrange(len(tok)) for _ in range(rng.randint(1, 40))]
    text = rng.choice(SENTENCES)[rng.randrange(5) :]
    return byte_ids(tok, text) if kind == 1 else tok.encode(text)


@pytest.mark.parametrize("skip", [True, False])
def test_text_equals_decode_on_random_sequences(tok: Any, skip: bool) -> None:
    rng = random.Random(0)
    for _ in range(300):
        ids = random_ids(tok, rng)
        checker, used = run(tok, ids, skip_special_tokens=skip, ignore_eos=True)
        assert (used, checker.finish_reason, checker.stop_reason) == (len(ids), "length", None)
        assert checker.text == tok.decode(ids, skip_special_tokens=skip)
        assert checker.text == tok.backend_tokenizer.decode(ids, skip_special_tokens=skip)


def test_stop_strings_on_random_sequences_match_reference(tok: Any) -> None:
    rng = random.Random(1)
    for _ in range(300):
        ids = random_ids(tok, rng)
        full = tok.decode(ids, skip_special_tokens=True).replace(REPLACEMENT_CHAR, "")
        if not full:
            continue
        stops = []
        for _ in range(rng.randint(1, 3)):
            start = rng.randrange(len(full))
            stops.append(full[start : start + rng.randint(1, 4)])
        include = rng.random() < 0.5
        checker, used = run(tok, ids, stop=stops, include_stop_str_in_output=include, ignore_eos=True)
        text, k, stop = reference(tok, ids, stops, include)
        assert (checker.text, used, checker.stop_reason) == (text, k, stop), (ids, stops)
        assert checker.finish_reason == ("stop" if stop else "length")


class FlakyStream:
    """A DecodeStream that raises on every 3rd step, as tokenizers does on an invalid prefix."""

    steps = 0

    def __init__(self, ids: list[int] | None = None, skip_special_tokens: bool = False) -> None:
        self._inner = DecodeStream(ids=ids, skip_special_tokens=skip_special_tokens)

    def step(self, tokenizer: Any, token_id: int) -> str | None:
        FlakyStream.steps += 1
        if FlakyStream.steps % 3 == 0:
            raise Exception("Invalid prefix encountered")
        return self._inner.step(tokenizer, token_id)


def test_a_failing_stream_is_replaced_without_changing_the_text(tok: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stopping, "DecodeStream", FlakyStream)
    rng = random.Random(3)
    for _ in range(150):
        ids, prompt = random_ids(tok, rng), random_ids(tok, rng)
        checker, _ = run(tok, ids, prompt=prompt, ignore_eos=True)
        assert checker.text == tok.decode(ids, skip_special_tokens=True)
        stops = [tok.decode(ids[:3], skip_special_tokens=True).replace(REPLACEMENT_CHAR, "")[-2:] or "x"]
        checker, used = run(tok, ids, stop=stops, ignore_eos=True)
        assert (checker.text, used, checker.stop_reason) == reference(tok, ids, stops, include=False)
    assert FlakyStream.steps > 1000


def test_multibyte_characters_come_out_whole(tok: Any) -> None:
    text = "café 😀 日本 ñ!"
    ids = byte_ids(tok, text)
    checker = StopChecker(tok, SamplingParams(max_tokens=len(ids)), {tok.eos_token_id})
    visible = []
    for token_id in ids:
        checker.append(token_id)
        assert REPLACEMENT_CHAR not in checker.text
        assert text.startswith(checker.text)
        visible.append(checker.text)
    assert checker.text == text and checker.finish_reason == "length"
    emoji_at = len(byte_ids(tok, "café "))
    assert visible[emoji_at : emoji_at + 3] == ["café "] * 3  # 4 byte tokens: nothing until the last
    assert visible[emoji_at + 3] == "café 😀"


def test_stop_string_spanning_token_boundaries(tok: Any) -> None:
    checker, used = run(tok, byte_ids(tok, "hello world"), stop=["lo w"])
    assert (checker.text, checker.finish_reason, checker.stop_reason) == ("hel", "stop", "lo w")
    assert used == checker.num_output_tokens == 7


def test_stop_string_that_is_a_split_multibyte_character(tok: Any) -> None:
    checker, used = run(tok, byte_ids(tok, "café 😀 more"), stop=["😀"])
    assert (checker.text, checker.stop_reason, used) == ("café ", "😀", len(byte_ids(tok, "café 😀")))


def test_several_stop_strings_first_completed_wins(tok: Any) -> None:
    abcdef = tok.convert_tokens_to_ids("abcdef")
    checker, _ = run(tok, byte_ids(tok, "hello world"), stop=["world", "lo"])
    assert (checker.text, checker.stop_reason) == ("hel", "lo")
    checker, _ = run(tok, [abcdef], stop=["bcde", "cd"])  # same token: "cd" ends first
    assert (checker.text, checker.stop_reason) == ("ab", "cd")
    checker, _ = run(tok, [abcdef], stop=["cd", "bcd"])  # same end: the earlier start
    assert (checker.text, checker.stop_reason) == ("a", "bcd")


def test_stop_at_the_first_token_and_include_stop_str(tok: Any) -> None:
    abcdef = tok.convert_tokens_to_ids("abcdef")
    checker, used = run(tok, [abcdef, abcdef], stop=["ab"])
    assert (checker.text, checker.finish_reason, used, checker.num_output_tokens) == ("", "stop", 1, 1)
    checker, _ = run(tok, [abcdef], stop=["cd"], include_stop_str_in_output=True)
    assert (checker.text, checker.stop_reason) == ("abcd", "cd")  # the rest of the token is dropped
    checker, _ = run(tok, byte_ids(tok, "hello world"), stop=["lo w"], include_stop_str_in_output=True)
    assert checker.text == "hello w"


def test_eos_stops_and_never_appears_in_text(tok: Any) -> None:
    eos = tok.eos_token_id
    for skip in (True, False):
        checker, used = run(tok, byte_ids(tok, "hi") + [eos] + byte_ids(tok, "x"), skip_special_tokens=skip)
        # stop_reason is None on EOS, as in vLLM (only stop_token_ids and stop strings name one)
        assert (checker.text, checker.finish_reason, checker.stop_reason, used) == ("hi", "stop", None, 3)
    checker, used = run(tok, byte_ids(tok, "é")[:1] + [eos])  # a dangling byte before EOS
    assert checker.text == tok.decode(byte_ids(tok, "é")[:1]) == REPLACEMENT_CHAR


def test_ignore_eos_keeps_going(tok: Any) -> None:
    eos = tok.eos_token_id
    ids = byte_ids(tok, "hi") + [eos] + byte_ids(tok, "x")
    checker, used = run(tok, ids, ignore_eos=True)
    assert (checker.text, checker.finish_reason, used) == ("hix", "length", 4)
    checker, _ = run(tok, ids, ignore_eos=True, skip_special_tokens=False)
    assert checker.text == "hi<eos>x"


def test_stop_token_ids(tok: Any) -> None:
    x = byte_ids(tok, "x")[0]
    checker, used = run(tok, byte_ids(tok, "abxcd"), stop_token_ids=[x])
    assert (checker.text, checker.finish_reason, checker.stop_reason, used) == ("ab", "stop", x, 3)
    checker, _ = run(tok, byte_ids(tok, "abxcd"), stop_token_ids=[x], include_stop_str_in_output=True)
    assert checker.text == "abx"


def test_min_tokens_holds_back_eos_stop_ids_and_stop_strings(tok: Any) -> None:
    eos, x = tok.eos_token_id, byte_ids(tok, "x")[0]
    checker, used = run(tok, [byte_ids(tok, "a")[0], eos, eos], min_tokens=3)
    assert (used, checker.finish_reason, checker.stop_reason) == (3, "stop", None)
    checker, used = run(tok, byte_ids(tok, "xaxb"), stop_token_ids=[x], min_tokens=2)
    assert (checker.text, used) == ("xa", 3)
    checker, used = run(tok, byte_ids(tok, "abcabz"), stop=["ab"], min_tokens=3)
    assert (checker.text, checker.stop_reason, used) == ("abc", "ab", 5)


def test_max_tokens_is_length_unless_the_last_token_completes_a_stop(tok: Any) -> None:
    checker, used = run(tok, byte_ids(tok, "hello"), max_tokens=3)
    assert (checker.text, checker.finish_reason, checker.stop_reason, used) == ("hel", "length", None, 3)
    checker, used = run(tok, byte_ids(tok, "hello"), max_tokens=5, stop=["llo"])
    assert (checker.text, checker.finish_reason, checker.stop_reason, used) == ("he", "stop", "llo", 5)


def test_append_after_finish_raises(tok: Any) -> None:
    checker, _ = run(tok, byte_ids(tok, "ab"), max_tokens=1)
    with pytest.raises(RuntimeError, match="after the request finished"):
        checker.append(byte_ids(tok, "c")[0])


def test_prompt_priming_is_invisible_for_byte_level(tok: Any) -> None:
    rng = random.Random(2)
    for _ in range(100):
        prompt, ids = random_ids(tok, rng), random_ids(tok, rng)
        checker, _ = run(tok, ids, prompt=prompt, ignore_eos=True)
        assert checker.text == tok.decode(ids, skip_special_tokens=True)


def test_metaspace_keeps_the_leading_space_when_primed() -> None:
    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    backend.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    backend.train_from_iterator(
        ["hello world the quick brown fox"] * 5, trainers.BpeTrainer(vocab_size=80, special_tokens=["<unk>", "</s>"])
    )
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>", clean_up_tokenization_spaces=False)
    prompt, out = backend.encode("hello world").ids, backend.encode("the fox").ids
    assert tok.decode(out) == "the fox"  # decoding the output alone drops its leading "▁"
    assert tok.decode(prompt + out) == "hello world the fox"
    assert run(tok, out, prompt=prompt)[0].text == " the fox"  # the completion of the prompt
    assert run(tok, out)[0].text == "the fox"


def test_llama_style_byte_fallback_text_is_the_continuation_of_the_prompt() -> None:
    """Metaspace + byte fallback (Llama 2 / Mistral style): characters outside the vocab are byte tokens."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in ["▁", *string.ascii_lowercase, ".", "▁the", "▁fox", "he"]:
        vocab[piece] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>", clean_up_tokenization_spaces=False)
    rng = random.Random(4)
    words = ["é", "😀", "日本", "the", "fox", "ñandú", "ok."]
    for _ in range(200):
        out = backend.encode(" ".join(rng.choice(words) for _ in range(rng.randint(1, 6)))).ids
        prompt = backend.encode(rng.choice(["hello world", "the fox", "café"])).ids
        checker, _ = run(tok, out, prompt=prompt)
        full, head = tok.decode(prompt + out), tok.decode(prompt)
        assert checker.text == full[len(head) :] == " " + tok.decode(out)
        assert REPLACEMENT_CHAR not in checker.text
