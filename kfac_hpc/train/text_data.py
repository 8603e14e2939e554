"""Byte-level text for the transformer workload: a UTF-8 file or folder of files
(``--dataset text --data-path PATH``), or a corpus generated here (``generated_text``).

Samples are windows of ``context + 1`` bytes addressed by index: window ``i`` starts at byte
``i * context`` (consecutive windows share one byte), its input is the first ``context`` bytes
and its target the ``context`` bytes after each, so an epoch predicts every training byte
once and the data a step sees depends only on the indices :class:`ShardedBatches` picks.

Splits are fixed: of the files (concatenated in sorted path order) the last tenth of the bytes
is the validation set, the rest training; of the generated corpus the validation windows are
the text after the training windows. The generated corpus comes from a small stochastic
grammar of seed 0 (every run sees the same text): sentences of invented words, so the next
byte is well predictable inside a word and less so at word and sentence boundaries (2.92 nats
per byte without context, 1.52 given the previous byte; a 2-block model's validation loss
falls from ln 256 ≈ 5.55 below 1.6 within a hundred steps: docs/train.md).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import torch

from kfac_hpc.train.data import DataSource

__all__ = ["VALIDATION_FRACTION", "generated_corpus", "generated_text", "text_files"]

VALIDATION_FRACTION = 0.1


def _source(name: str, train: torch.Tensor, test: torch.Tensor, context: int) -> DataSource:
    """Windows of ``context`` bytes of the uint8 tensors ``train`` and ``test``."""
    span = torch.arange(context + 1)  # a window's byte offsets

    def sampler(data: torch.Tensor) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
        def get(idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            window = data[idx.unsqueeze(1) * context + span].long()
            return window[:, :-1], window[:, 1:]

        return get

    n_train, n_test = ((len(part) - 1) // context for part in (train, test))
    return DataSource(
        name, (context,), 256, n_train, n_test, sampler(train), sampler(test), metric="loss"
    )


def _split(data: bytes, context: int, where: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Training and validation bytes; ValueError naming ``where`` when either holds no window."""
    cut = len(data) - int(len(data) * VALIDATION_FRACTION)
    need = (context + 1) / VALIDATION_FRACTION
    if len(data) < need:
        raise ValueError(
            f"{where} holds {len(data)} bytes; a context of {context} needs at least "
            f"{int(need)} (a tenth is the validation set)"
        )
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return raw[:cut], raw[cut:]


def text_files(path: Path, context: int) -> DataSource:
    """The bytes of the file ``path``, or of every file under the folder ``path`` (sorted,
    hidden files and folders left out), as windows of ``context`` bytes."""
    if path.is_file():
        files = [path]
    else:
        files = sorted(
            p
            for p in path.rglob("*")
            if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts)
        )
    if not files:
        raise FileNotFoundError(f"{str(path)!r} holds no files")
    data = b"".join(p.read_bytes() for p in files)
    train, test = _split(data, context, repr(str(path)))
    return _source("text", train, test, context)


# The grammar: sentences "Det (Adj) Noun Verb Det (Adj) Noun (Conj Det Noun)." of invented
# words drawn from fixed vocabularies (Zipf-like weights), 3-6 sentences to a paragraph.
_CONSONANTS = "bcdfghklmnprstvz"
_VOWELS = "aeiou"


def _words(rng: random.Random, count: int, syllables: tuple[int, int]) -> list[str]:
    words: set[str] = set()
    while len(words) < count:
        n = rng.randint(*syllables)
        words.add("".join(rng.choice(_CONSONANTS) + rng.choice(_VOWELS) for _ in range(n)))
    return sorted(words)


def generated_corpus(n_bytes: int, seed: int = 0) -> bytes:
    """At least ``n_bytes`` of text from the stochastic grammar of ``seed``."""
    rng = random.Random(seed)
    nouns = _words(rng, 24, (2, 3))
    verbs = [w + "s" for w in _words(rng, 12, (1, 2))]
    adjectives = _words(rng, 10, (2, 2))
    determiners = ["the", "a", "every", "no"]

    def pick(words: list[str]) -> str:  # Zipf-like: the k-th word with weight 1/(k+1)
        return rng.choices(words, weights=[1 / (k + 1) for k in range(len(words))])[0]

    def phrase() -> list[str]:
        adjective = [pick(adjectives)] if rng.random() < 0.4 else []
        return [pick(determiners), *adjective, pick(nouns)]

    out: list[str] = []
    size = 0
    while size < n_bytes:
        sentences = []
        for _ in range(rng.randint(3, 6)):
            words = [*phrase(), pick(verbs), *phrase()]
            if rng.random() < 0.3:
                words += ["and", *phrase()]
            sentence = " ".join(words)
            sentences.append(sentence[0].upper() + sentence[1:] + ".")
        paragraph = " ".join(sentences) + "\n"
        out.append(paragraph)
        size += len(paragraph)
    return "".join(out).encode()


def generated_text(train_windows: int, context: int) -> DataSource:
    """``train_windows`` training windows of ``context`` bytes of the generated corpus, then a
    ninth as many (at least one) validation windows of the text that follows."""
    cut = train_windows * context + 1
    n_test = max(1, train_windows // 9) * context + 1
    raw = torch.frombuffer(bytearray(generated_corpus(cut + n_test)), dtype=torch.uint8)
    return _source("generated_text", raw[:cut], raw[cut : cut + n_test], context)
