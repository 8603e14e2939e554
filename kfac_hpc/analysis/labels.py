"""Names for people, made from the tables' machine labels.

A configuration's ``group`` (``cnn1d mnist1d sgd+kfac strong bs=1024 gwf=1.0``) is what the
files hold; the report and the terminal show what tells the configurations apart, in words:
``K-FAC, grad workers 1/1`` beside ``SGD`` (``SGD+K-FAC`` when other configurations use
another first-order optimizer).
"""

from __future__ import annotations

from collections.abc import Sequence
from fractions import Fraction

from kfac_hpc.contracts.options import SCALINGS

OPTIMIZERS = {"sgd": "SGD", "adam": "Adam", "adamw": "AdamW"}
METHODS = {"kfac": "K-FAC", "fosi": "FOSI"}
# group-label keys (tables.group_label) -> words
_KEYS = {"bs": "batch", "gwf": "grad workers", "rpn": "ranks per node"}


def optimizer_name(label: str) -> str:
    """``sgd+kfac`` -> ``SGD+K-FAC``, ``adam`` -> ``Adam``: an optimizer label in words."""
    base, _, method = label.partition("+")
    name = OPTIMIZERS.get(base, base)
    return f"{name}+{METHODS.get(method, method)}" if method else name


def method_name(method: str) -> str:
    """``kfac`` -> ``K-FAC``; a method without a known name keeps its own."""
    return METHODS.get(method, method)


def _is_optimizer(word: str) -> bool:
    base, _, method = word.partition("+")
    return base in OPTIMIZERS and (not method or method in METHODS)


def _fraction(value: str) -> str:
    """``1.0`` -> ``1/1``, ``0.5`` -> ``1/2``; a name (``mem-opt``) as it is."""
    try:
        share = Fraction(float(value)).limit_denominator(1024)
    except (ValueError, OverflowError):
        return value
    return f"{share.numerator}/{share.denominator}"


def _phrase(word: str, base: str | None = None) -> str:
    key, sep, value = word.partition("=")
    if not sep:
        if word in SCALINGS:
            return f"{word} scaling"
        if not _is_optimizer(word):
            return word
        first, _, method = word.partition("+")
        # every configuration builds on ``base``: a method is named alone (K-FAC beside SGD)
        return method_name(method) if method and first == base else optimizer_name(word)
    if key == "gwf":
        return f"grad workers {_fraction(value)}"
    return f"{_KEYS.get(key, key.replace('_', ' '))} {value}"


def readable(words: Sequence[str], base: str | None = None) -> str:
    """The words of a group label as phrases, the optimizer first: ``SGD+K-FAC, grad workers
    1/1, batch 128``; ``K-FAC, ...`` when ``base`` is ``sgd`` (every configuration's)."""
    first = [w for w in words if _is_optimizer(w)]
    rest = [w for w in words if w not in first]
    return ", ".join(_phrase(w, base) for w in [*first, *rest])


def _common_base(words: Sequence[Sequence[str]]) -> str | None:
    """The first-order optimizer every group builds on, when they all build on one and it
    runs on its own in one of them (the baseline the methods are compared with)."""
    optimizers = {w for ws in words for w in ws if _is_optimizer(w)}
    bases = {w.partition("+")[0] for w in optimizers}
    return bases.pop() if len(bases) == 1 and bases <= optimizers else None


def people_labels(groups: Sequence[str]) -> dict[str, str]:
    """Each group in words, without the words every group shares (``SGD`` vs ``K-FAC, grad
    workers 1/1`` when every configuration is SGD's); all of it when all its words are shared.
    Labels that would read alike keep their full text."""
    words = [g.split() for g in groups]
    common = set.intersection(*(set(w) for w in words)) if words else set()
    base = _common_base(words)
    out = {
        g: readable([x for x in w if x not in common] or w, base)
        for g, w in zip(groups, words, strict=True)
    }
    if len(set(out.values())) < len(out):
        return {g: readable(w) for g, w in zip(groups, words, strict=True)}
    return out
