"""Prompt text of a given length: seeded word salad sized in tokens when a tokenizer is at hand, in words
otherwise. The tokenizer is found from --tokenizer, else from the target's /get_model_info when that folder
exists on this machine."""
from __future__ import annotations

import json
import logging
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from benchmarks.serving.config import ConfigError
from benchmarks.serving.scrape import fetch_text

log = logging.getLogger(__name__)

# Plain English words; prompts are random sequences of them (readable, and tokenized like ordinary text).
WORDS = tuple("""
the of and to in is was for on that with as by at from his her an which are be this had not but were or
have one all their they has been would more when there who can time will into its about only other new some
could these two may first then any like now my over such our man me even most made after also did many before
must through back years where much your way well down should because each just those people how too little
state good very make world still own see men work long get here between both life being under never day same
another know while last might us great old year off come since against go came right used take three states
himself few house use during without again place around however home small found thought went say part once
general high upon school every don does got united left number course war until always away something fact
though water less public put think almost hand enough far took head yet government system better set told
nothing night end why called didn eyes find going look asked later knew point next program city business give
group toward young days let room president side social given present several order national possible rather
second face per among form important often things looking early white case john become large big need four
within felt children along saw best church ever least power development light thing family interest want
members mind country area others done turned although open god service problem certain kind different thus
began door help means sense whole matter perhaps itself york times law human line above name example action
company hands local show whether five history gave today either act feet across taken past quite anything
seen having death experience body word half really week field car words already themselves information tell
together college shall money period held keep sure real probably free seemed political air question office
brought whose special heard major problems ago became federal moment study available known result street
economic boy position reason change south board individual job areas society west close turn love community
true court force full seems cost wife future age wanted department voice center woman control common policy
necessary following front sometimes six girl clear further land run students provide feel party able mother
music education university child effect level stood military town short morning total outside rate figure
""".split())


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...


class _HFTokenizers:
    """A ``tokenizers`` tokenizer.json (fast, no transformers import)."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer as Tok
        self._tok = Tok.from_file(str(path))

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)


class _Transformers:
    def __init__(self, path: Path) -> None:
        from transformers import AutoTokenizer
        self._tok = AutoTokenizer.from_pretrained(str(path))

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return str(self._tok.decode(ids))


def load_tokenizer(path: str | Path) -> Tokenizer:
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"--tokenizer {path}: no tokenizer.json file or Hugging Face folder there")
    try:
        if p.is_file():
            return _HFTokenizers(p)
        if (p / "tokenizer.json").is_file():
            return _HFTokenizers(p / "tokenizer.json")
        return _Transformers(p)
    except Exception as e:  # noqa: BLE001 - tokenizers/transformers raise many kinds; all mean "cannot load"
        raise ConfigError(f"--tokenizer {path}: cannot load it ({type(e).__name__}: {e})") from None


@dataclass(frozen=True)
class TokenizerChoice:
    tokenizer: Tokenizer | None
    source: str  # "flag", "server", or "none"
    path: str | None

    def describe(self) -> dict[str, Any]:
        unit = "tokens" if self.tokenizer is not None else "words"
        return {"source": self.source, "path": self.path, "length_unit": unit}


def resolve_tokenizer(flag: str | None, base_url: str, headers: dict[str, str], timeout: float = 10.0
                      ) -> TokenizerChoice:
    if flag:
        return TokenizerChoice(load_tokenizer(flag), "flag", flag)
    try:
        info = json.loads(fetch_text(base_url.rstrip("/") + "/get_model_info", headers, timeout))
        path = info.get("tokenizer_path") or info.get("model_path")
    except (OSError, ValueError, AttributeError):
        path = None
    if isinstance(path, str) and Path(path).is_dir():
        try:
            return TokenizerChoice(load_tokenizer(path), "server", path)
        except ConfigError as e:
            log.warning("the target's model folder %s has no usable tokenizer (%s); sizing prompts in words", path, e)
    return TokenizerChoice(None, "none", None)


class TextMaker:
    """Random text of ``n`` tokens (or words without a tokenizer), reproducible from the caller's rng."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self._ratio = 1.0
        if tokenizer is not None:
            sample = " ".join(random.Random(0).choices(WORDS, k=400))
            self._ratio = len(tokenizer.encode(sample)) / 400  # tokens per word

    def make(self, rng: random.Random, n: int) -> str:
        if self.tokenizer is None:
            return " ".join(rng.choices(WORDS, k=n))
        words = rng.choices(WORDS, k=int(n / self._ratio) + 8)
        ids = self.tokenizer.encode(" ".join(words))
        while len(ids) < n:  # rare: the sample ratio underestimated this draw
            words += rng.choices(WORDS, k=8)
            ids = self.tokenizer.encode(" ".join(words))
        return self.tokenizer.decode(ids[:n])

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text)) if self.tokenizer is not None else len(text.split())
