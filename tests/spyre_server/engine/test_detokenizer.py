"""Incremental detokenization and stop strings (spyre_server/engine/detokenizer.py)."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from spyre_server.engine.detokenizer import IncrementalDetokenizer
from tests.conftest import default_model_missing
from tests.spyre_server.conftest import ByteTokenizer

TOK = ByteTokenizer()


def feed(
    detok: IncrementalDetokenizer, ids: Sequence[int], *, finish: bool = True
) -> list[tuple[str, bool]]:
    """Add ``ids`` one token per call (as the engine does); the last call says ``finished`` if
    ``finish``. Stops feeding once a stop string is found."""
    results = []
    for i, token_id in enumerate(ids):
        delta, stopped = detok.add_tokens([token_id], finished=finish and i == len(ids) - 1)
        results.append((delta, stopped))
        if stopped:
            break
    return results


def joined(results: list[tuple[str, bool]]) -> str:
    return "".join(delta for delta, _ in results)


# --- multi-byte characters ------------------------------------------------------------------------


def test_multibyte_characters_are_released_only_when_complete() -> None:
    text = "a\u20acb\U0001f600\u00e9"  # a, euro (3 bytes), b, emoji (4 bytes), e-acute (2 bytes)
    detok = IncrementalDetokenizer(TOK, TOK.encode("prompt"))
    deltas = [delta for delta, _ in feed(detok, TOK.encode(text), finish=False)]
    assert deltas == ["a", "", "", "\u20ac", "b", "", "", "", "\U0001f600", "", "\u00e9"]
    assert detok.text == text
    assert "\ufffd" not in "".join(deltas)


def test_several_tokens_in_one_call_and_a_final_empty_call() -> None:
    ids = TOK.encode("x\u65e5\u672c")  # CJK: 3 bytes each
    detok = IncrementalDetokenizer(TOK, [])
    assert detok.add_tokens(ids[:3], finished=False) == ("x", False)  # the first char is cut
    assert detok.add_tokens(ids[3:], finished=False) == ("\u65e5\u672c", False)
    assert detok.add_tokens([], finished=True) == ("", False)


@pytest.mark.parametrize(
    "text",
    [
        "plain ascii",
        "caf\u00e9 \u00fcber",
        "\U0001f600\U0001f44d\U0001f3fd ok",
        "\u65e5\u672c\u8a9e",
    ],
)
def test_deltas_add_up_to_the_full_decode(text: str) -> None:
    ids = TOK.encode(text)
    detok = IncrementalDetokenizer(TOK, TOK.encode("the prompt \u00e9"))
    assert joined(feed(detok, ids)) == TOK.decode(ids) == text


def test_invalid_bytes_in_the_middle_come_out_as_replacement_characters() -> None:
    ids = [*TOK.encode("a"), 0xE2, 0x82, *TOK.encode("b"), 0xFF, *TOK.encode("c")]
    detok = IncrementalDetokenizer(TOK, [])
    assert joined(feed(detok, ids)) == TOK.decode(ids) == "a\ufffdb\ufffdc"


def test_the_prompt_is_context_only() -> None:
    # the prompt's last tokens are decoded with the output, but never returned
    detok = IncrementalDetokenizer(TOK, TOK.encode("Say STOP then \u20ac"), stop=("STOP",))
    results = feed(detok, TOK.encode(" done"))
    assert joined(results) == " done"
    assert not any(stopped for _, stopped in results)


# --- stop strings ---------------------------------------------------------------------------------


def test_stop_string_spanning_several_tokens_is_cut() -> None:
    detok = IncrementalDetokenizer(TOK, TOK.encode("p"), stop=("STOP",))
    results = feed(detok, TOK.encode("hello STOP world"))
    assert results[-1][1] is True  # stopped ...
    assert len(results) == len("hello STOP")  # ... by the token that completed the stop string
    assert joined(results) == "hello "
    assert detok.text == "hello "


def test_stop_string_with_a_multibyte_character() -> None:
    detok = IncrementalDetokenizer(TOK, [], stop=("\u20ac!",))
    results = feed(detok, TOK.encode("costs 5\u20ac! more"))
    assert results[-1][1] is True
    assert joined(results) == "costs 5"


def test_stop_string_at_the_very_start_gives_empty_text() -> None:
    detok = IncrementalDetokenizer(TOK, [], stop=("ab",))
    results = feed(detok, TOK.encode("abc"))
    assert joined(results) == "" and results[-1] == ("", True)


def test_text_that_may_start_a_stop_string_is_held_back() -> None:
    detok = IncrementalDetokenizer(TOK, [], stop=("END",))
    assert joined(feed(detok, TOK.encode("xyzEN"), finish=False)) == "xyz"  # "EN" may be "END"
    assert detok.text == "xyzEN"
    # Once "EN" cannot be "END" any more it comes out. The rule is conservative: the last
    # len("END") - 1 = 2 characters are always held, whether or not they can start "END", so
    # "EN" is fully out two characters later.
    released = joined(feed(detok, TOK.encode("xy"), finish=False))
    assert released == "EN"
    assert detok.add_tokens(TOK.encode("!"), finished=True) == ("xy!", False)


def test_held_back_text_is_released_when_the_request_finishes() -> None:
    detok = IncrementalDetokenizer(TOK, [], stop=("LONG STOP STRING",))
    results = feed(detok, TOK.encode("short"), finish=False)
    assert joined(results) == ""  # all 5 chars could start the 16-char stop string
    assert detok.add_tokens([], finished=True) == ("short", False)


# --- min_tokens -------------------------------------------------------------------------------


def test_stop_strings_are_looked_for_only_after_min_tokens() -> None:
    """Byte tokens: "The" is the first 3 tokens, so its "e" cannot stop the request; the "e"
    of "tree" does."""
    detok = IncrementalDetokenizer(TOK, [], stop=("e",), min_tokens=3)
    results = feed(detok, TOK.encode("The tree"))
    assert detok.text == "The tr" and detok.stop_string == "e"
    assert results[-1][1] is True and joined(results) == "The tr"
    without = IncrementalDetokenizer(TOK, [], stop=("e",))
    assert joined(feed(without, TOK.encode("The tree"))) == "Th"


def test_a_stop_string_may_begin_in_the_first_min_tokens() -> None:
    """As vLLM: a stop string that ends in a later token's text counts, wherever it begins."""
    detok = IncrementalDetokenizer(TOK, [], stop=("ab",), min_tokens=1)
    results = feed(detok, TOK.encode("abc"))
    assert results[-1] == ("", True) and detok.text == ""


def test_a_stop_string_wholly_inside_the_first_min_tokens_never_stops() -> None:
    """A short stop string listed beside a long one: the long one's hold-back must not make the
    short one's match inside the first min_tokens tokens count later."""
    detok = IncrementalDetokenizer(TOK, [], stop=("xyz", "a"), min_tokens=2)
    results = feed(detok, TOK.encode("ab cd"))
    assert joined(results) == "ab cd" and detok.stop_string is None
    assert not any(stopped for _, stopped in results)


def test_min_tokens_covering_the_whole_output_finds_no_stop_string() -> None:
    detok = IncrementalDetokenizer(TOK, [], stop=("b",), min_tokens=4)
    results = feed(detok, TOK.encode("abab"))
    assert joined(results) == "abab" and detok.stop_string is None


def test_earliest_stop_string_wins() -> None:
    detok = IncrementalDetokenizer(TOK, [], stop=("world", "lo w", "zzz"))
    results = feed(detok, TOK.encode("hello world"))
    assert joined(results) == "hel"
    assert results[-1][1] is True


def test_earliest_stop_when_both_complete_on_the_same_token() -> None:
    detok = IncrementalDetokenizer(TOK, [], stop=("c!", "abc!"))
    assert joined(feed(detok, TOK.encode("xxabc!yy"))) == "xx"


def test_nothing_more_is_released_after_a_stop() -> None:
    detok = IncrementalDetokenizer(TOK, [], stop=("!",))
    assert detok.add_tokens(TOK.encode("hi! there"), finished=False) == ("hi", True)
    assert detok.text == "hi"


def reference_cut(text: str, stops: Sequence[str]) -> tuple[str, bool]:
    """The text the detokenizer must produce when fed one character per token: cut at the
    earliest start among the stop strings found once the first one completes."""
    for end in range(1, len(text) + 1):
        found = [i for s in stops if (i := text[:end].find(s)) >= 0]
        if found:
            return text[: min(found)], True
    return text, False


def test_random_streams_against_a_reference() -> None:
    rng = random.Random(0)
    for _ in range(300):
        stops = ["".join(rng.choices("ab", k=rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        text = "".join(rng.choices("abc", k=rng.randint(0, 20)))
        expected, expect_stop = reference_cut(text, stops)
        hold = max(len(s) for s in stops) - 1
        detok = IncrementalDetokenizer(TOK, TOK.encode("ab"), stop=stops)
        released = ""
        stopped = False
        for i, token_id in enumerate(TOK.encode(text)):
            delta, stopped = detok.add_tokens([token_id], finished=i == len(text) - 1)
            released += delta
            assert expected.startswith(released), (stops, text, released)  # never retracted
            if stopped:
                break
            if i < len(text) - 1:
                assert len(detok.text) - len(released) <= hold  # bounded hold-back
        if not text:
            released += detok.add_tokens([], finished=True)[0]
        assert (released, stopped) == (expected, expect_stop), (stops, text)


# --- the real tokenizer (SmolLM2, byte-level BPE) -------------------------------------------------

REAL_TEXTS = [
    "Hello, world! This is a plain English sentence with punctuation , and 's n't.",
    "   leading spaces, then\n\n\ttabs and  double  spaces   ",
    "Emoji: \U0001f600\U0001f44d\U0001f3fd\U0001f468\u200d\U0001f469\u200d\U0001f467 flags "
    "\U0001f1e9\U0001f1ea and more \U0001f680",
    "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8\u3068\u4e2d\u6587\u6587\u672c\uff0c"
    "\ud55c\uad6d\uc5b4 \u0627\u0644\u0639\u0631\u0628\u064a\u0629",
    "def f(x):\n    return {'a': [1, 2, 3]}  # code \u00e9\u00e8\u00ea \u2014 \u201cquotes\u201d",
]


@pytest.fixture(scope="module")
def smollm2_tokenizer(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    """SmolLM2's tokenizer from ``prepare_default_model(default_cache_dir())`` (through the
    suite-wide ``smollm2_path`` fixture when tests/conftest.py has it: preparing hashes the GGUF)."""
    transformers = pytest.importorskip("transformers")
    try:
        path = request.getfixturevalue("smollm2_path")
    except pytest.FixtureLookupError:
        from spyre_server.model.store import (
            ModelStoreError,
            default_cache_dir,
            prepare_default_model,
        )

        try:
            path = prepare_default_model(default_cache_dir())
        except ModelStoreError as exc:
            default_model_missing(str(exc))
    return transformers.AutoTokenizer.from_pretrained(str(path))


@pytest.mark.slow
@pytest.mark.parametrize("text", REAL_TEXTS)
def test_real_tokenizer_incremental_equals_full_decode(smollm2_tokenizer, text: str) -> None:  # type: ignore[no-untyped-def]
    tok = smollm2_tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    prompt_ids = tok.encode(prompt, add_special_tokens=False)
    ids = tok.encode(text, add_special_tokens=False)
    long_ids = ids * 3  # a longer stream, the text repeated without separator
    detok = IncrementalDetokenizer(tok, prompt_ids)
    assert joined(feed(detok, long_ids)) == tok.decode(long_ids, skip_special_tokens=True)
    assert detok.text == tok.decode(long_ids, skip_special_tokens=True)


@pytest.mark.slow
def test_real_tokenizer_random_ids_and_special_tokens(smollm2_tokenizer) -> None:  # type: ignore[no-untyped-def]
    tok = smollm2_tokenizer
    rng = random.Random(1)
    end = tok.encode(" end.", add_special_tokens=False)
    for _ in range(20):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randint(1, 60))]
        ids += [tok.eos_token_id, *end]  # special tokens are skipped; end on a whole character
        detok = IncrementalDetokenizer(tok, tok.encode("Q:", add_special_tokens=False))
        assert joined(feed(detok, ids)) == tok.decode(ids, skip_special_tokens=True), ids


@pytest.mark.slow
def test_real_tokenizer_stop_string_across_tokens(smollm2_tokenizer) -> None:  # type: ignore[no-untyped-def]
    tok = smollm2_tokenizer
    ids = tok.encode("The answer is 42.\n### Next question", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], stop=("\n###",))
    results = feed(detok, ids)
    assert results[-1][1] is True
    assert joined(results) == "The answer is 42."


# --- finishing inside an undecodable byte sequence ------------------------------------------------


@pytest.mark.parametrize(
    "ids",
    [
        [*TOK.encode("ok "), 0xE2, 0x82],  # ends inside the 3-byte euro sign
        [0x89, 0xF0, 0xF0],  # bytes that are no UTF-8 at all (the micro model generates these)
    ],
)
def test_trailing_undecodable_bytes_are_flushed_at_finish(ids: list[int]) -> None:
    """BUG: at finish the text must be the full decode of the output (undecodable bytes as
    U+FFFD, as tokenizer.decode and HF's TextStreamer.end() give). Now the tokens after the last
    decodable point are silently dropped: a request reports completion tokens whose text is
    missing (``[0x89, 0xF0, 0xF0]`` gives the text "")."""
    detok = IncrementalDetokenizer(TOK, TOK.encode("prompt"))
    text = joined(feed(detok, ids))
    assert text == TOK.decode(ids)
    assert detok.text == TOK.decode(ids)
