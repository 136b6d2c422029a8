"""The corpus loads with its pinned checksums, splits deterministically, and fails loudly."""

import hashlib
import lzma
import shutil
from pathlib import Path

import pytest

from ftjax.data import corpus


@pytest.fixture(scope="module")
def texts():
    return {name: corpus.load_text(name) for name in corpus.names()}


def test_names():
    assert corpus.names() == ("austen", "shakespeare", "kjv")


def test_checksums(texts):
    for name, text in texts.items():
        data = text.encode("utf-8")
        assert hashlib.sha256(data).hexdigest() == corpus.CORPUS[name].sha256
        assert len(data) == corpus.CORPUS[name].text_bytes


def test_default_dir_is_inside_the_package(monkeypatch, tmp_path):
    import ftjax

    monkeypatch.delenv(corpus.ENV_VAR, raising=False)
    package = Path(ftjax.__file__).resolve().parent
    assert corpus.corpus_dir() == package / "data" / "texts"  # nothing outside the package is read
    for name in corpus.names():
        assert (corpus.corpus_dir() / f"{name}.txt.xz").is_file(), name
    assert (corpus.corpus_dir() / "SOURCES.md").is_file()
    monkeypatch.setenv(corpus.ENV_VAR, str(tmp_path))  # the override still wins
    assert corpus.corpus_dir() == tmp_path
    with pytest.raises(FileNotFoundError, match="not found"):
        corpus.load_text("kjv")


@pytest.mark.parametrize("name", corpus.names())
def test_split_partitions_text_at_a_paragraph(texts, name):
    train, valid = corpus.split(name)
    text = texts[name]
    assert train + valid == text  # disjoint and complete
    assert 0.015 < len(valid) / len(text) < 0.025
    assert valid.split("\n", 1)[0].strip()  # starts with a non-blank line
    if name == "kjv":  # one verse per line, no blank lines: cut at a line start
        assert train.endswith("\n")
    else:
        assert train.endswith("\n\n")
    assert corpus.split(name) == (train, valid)  # deterministic


def test_split_point_rule():
    para = "a\nb\n\nc\nd\n\n   e\nf\n"  # 17 characters
    # Starting inside the last paragraph (offset 13): no paragraph start follows -> next line.
    assert para[corpus.split_point(para, 3.5 / 17) :] == "f\n"
    # Starting just after "c" (offset 6): the next paragraph starts at the indented "   e".
    assert para[corpus.split_point(para, 10.5 / 17) :] == "   e\nf\n"
    # Starting at "c" itself (offset 5), a paragraph start.
    assert para[corpus.split_point(para, 11.5 / 17) :] == "c\nd\n\n   e\nf\n"
    assert corpus.split_point("abc\n" * 10, 0.1) == 36  # a line starting exactly at 90% counts
    assert corpus.split_point("a\n\nb\n\nc\n", 5 / 8) == 3  # so does a paragraph starting exactly there
    with pytest.raises(ValueError, match="no line start"):
        corpus.split_point("x" * 100, 0.02)
    with pytest.raises(ValueError, match="valid_fraction"):
        corpus.split_point("a\nb\n", 0.0)


def test_valid_fraction_parameter():
    train, valid = corpus.split("kjv", valid_fraction=0.1)
    assert 0.09 < len(valid) / (len(train) + len(valid)) < 0.11


def test_missing_file_names_path(tmp_path, monkeypatch):
    monkeypatch.setenv(corpus.ENV_VAR, str(tmp_path))
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "austen.txt.xz")):
        corpus.load_text("austen")
    with pytest.raises(FileNotFoundError):
        corpus.split("kjv")


def test_corrupt_file_names_path(tmp_path, monkeypatch):
    monkeypatch.setenv(corpus.ENV_VAR, str(tmp_path))
    (tmp_path / "kjv.txt.xz").write_bytes(b"not xz at all")
    with pytest.raises(corpus.CorpusError, match="kjv.txt.xz.*not valid xz"):
        corpus.load_text("kjv")


def test_wrong_contents_names_path_and_checksums(tmp_path, monkeypatch):
    src = corpus.corpus_dir() / "kjv.txt.xz"
    text = lzma.decompress(src.read_bytes())
    (tmp_path / "kjv.txt.xz").write_bytes(lzma.compress(text.replace(b"LORD", b"Lord", 1), preset=0))
    monkeypatch.setenv(corpus.ENV_VAR, str(tmp_path))
    with pytest.raises(ValueError, match=r"kjv\.txt\.xz has the wrong contents.*expected 859acf6e"):
        corpus.load_text("kjv")


def test_env_dir_with_good_copy(tmp_path, monkeypatch):
    shutil.copy(corpus.corpus_dir() / "kjv.txt.xz", tmp_path / "kjv.txt.xz")
    monkeypatch.setenv(corpus.ENV_VAR, str(tmp_path))
    assert corpus.load_text("kjv").startswith("In the beginning God created")
    assert corpus.load_text("kjv", tmp_path) == corpus.load_text("kjv")


def test_unknown_name():
    with pytest.raises(ValueError, match="unknown corpus text 'bible'"):
        corpus.load_text("bible")
