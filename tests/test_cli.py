"""The `ftjax` command line on a tiny random model that carries the default tokenizer."""

import json
import shutil
from pathlib import Path

import pytest

import hf_models
from ftjax import cli

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
DEFAULT_DIR = Path(__file__).parents[1] / "ftjax" / "default_model"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from ftjax.tokenizer import Tokenizer

    vocab = Tokenizer.from_dir(DEFAULT_DIR).vocab_size
    path = hf_models.save(hf_models.build("qwen3_moe", seed=7, vocab_size=vocab), tmp_path_factory.mktemp("cli"))
    for f in TOKENIZER_FILES:
        shutil.copy(DEFAULT_DIR / f, path / f)
    return path


def test_generate_json(model_dir, capsys):
    assert cli.main(["generate", "--model", str(model_dir), "To be, or not to be", "-n", "6", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["new_tokens"] == 6 and out["prompt_tokens"] > 3
    assert out["ttft_s"] > 0 and isinstance(out["text"], str)
    assert out["hits"] > 0 and out["misses"] == 0  # policy "device": every expert resident


def test_generate_streams_text_and_summary(model_dir, capsys):
    assert cli.main(["generate", "--model", str(model_dir), "Hello", "-n", "5", "--temperature", "0.8", "--seed", "3"]) == 0
    captured = capsys.readouterr()
    assert "prompt tokens" in captured.err and "tok/s decode" in captured.err
    assert captured.out.endswith("\n")


def test_chat_and_errors(model_dir, capsys):
    assert cli.main(["chat", "--model", str(model_dir), "Hi there", "-n", "4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip())["new_tokens"] <= 4
    assert cli.main(["generate", "--model", str(model_dir / "missing"), "x"]) == 2
    assert "model folder not found" in capsys.readouterr().err
