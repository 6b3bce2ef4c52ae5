"""Incremental detokenization: chunks are never broken UTF-8 and add up to the full text; stop strings match
across token boundaries and are not emitted."""
from __future__ import annotations

from pathlib import Path

from engine.detokenizer import IncrementalDetokenizer
from engine.tokenizer import Tokenizer

TEXT = "naïve café — 你好，世界! 🙂🚀 plain ascii and more 日本語のテキスト end"


def feed(tok: Tokenizer, ids: list[int], stop: list[str]) -> tuple[list[str], str | None, str]:
    d = IncrementalDetokenizer(tok, [1, 2, 3], True, stop)
    chunks, hit = [], None
    for t in ids:
        out, hit = d.add([t])
        chunks.append(out)
        if hit:
            break
    if hit is None:
        chunks.append(d.flush())
    return chunks, hit, d.text


def test_multibyte_characters_split_across_tokens_are_never_emitted_broken(tiny_model_dir: Path) -> None:
    tok = Tokenizer(tiny_model_dir)
    ids = tok.encode(TEXT, add_special_tokens=False)
    assert len(ids) > len(TEXT.split())  # byte-level BPE splits the CJK and emoji characters
    chunks, _, text = feed(tok, ids, [])
    assert all("\ufffd" not in c for c in chunks)
    assert "".join(chunks) == text == TEXT


def test_stop_string_across_token_boundaries_ends_the_text_before_it(tiny_model_dir: Path) -> None:
    tok = Tokenizer(tiny_model_dir)
    ids = tok.encode(TEXT, add_special_tokens=False)
    chunks, hit, text = feed(tok, ids, ["界! 🙂"])
    assert hit == "界! 🙂"
    assert text == "naïve café — 你好，世" and "".join(chunks) == text


def test_held_back_prefix_of_a_stop_string_is_released_when_it_does_not_match(tiny_model_dir: Path) -> None:
    tok = Tokenizer(tiny_model_dir)
    ids = tok.encode("the cat sat on the mat", add_special_tokens=False)
    chunks, hit, text = feed(tok, ids, ["the dog"])
    assert hit is None and text == "the cat sat on the mat" and "".join(chunks) == text


def test_an_incomplete_utf8_tail_is_emitted_when_the_request_ends(tiny_model_dir: Path) -> None:
    tok = Tokenizer(tiny_model_dir)
    ids = tok.encode("ok 🙂", add_special_tokens=False)
    d = IncrementalDetokenizer(tok, [], True, [])
    emitted = "".join(d.add([t])[0] for t in ids[:-1])  # stop before the emoji's last byte
    tail = d.flush()
    assert "\ufffd" not in emitted and tail.endswith("\ufffd") and d.text == emitted + tail
