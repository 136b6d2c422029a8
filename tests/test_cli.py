"""The `ftjax` command line on a tiny random model that carries the default tokenizer."""

import io
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


# ---------------------------------------------------------------------------- options, help, errors


def help_text(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as info:
        cli.main([*argv, "--help"])
    assert info.value.code == 0
    return capsys.readouterr().out


def test_help_has_defaults_policies_and_greedy(capsys):
    from ftjax.experts.policy import POLICIES

    for command in ("generate", "chat"):
        text = " ".join(help_text(capsys, command).split())
        assert "0 = greedy" in text and "(default: 128)" in text and "(default: 0.0)" in text
        for name in POLICIES:
            assert name in text, name
        for option in ("--model", "--policy", "--cache-slots", "--cache-bytes", "--bandwidth", "--threads",
                       "--max-seq-len", "--max-new-tokens", "--temperature", "--top-k", "--top-p", "--seed",
                       "--stop", "--json"):
            assert option in text, option
        assert text.count("(default:") >= 13, text


def test_serve_defaults_are_the_schedulers():
    """The CLI states the scheduler's defaults without importing it (jax, at parse time)."""
    from ftjax.engine.scheduler import DEFAULT_MAX_QUEUE, DEFAULT_PREFILL_CHUNK

    args = cli.parser().parse_args(["serve"])
    assert (args.prefill_chunk, args.max_queue) == (DEFAULT_PREFILL_CHUNK, DEFAULT_MAX_QUEUE)


def test_version(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["--version"])
    assert info.value.code == 0
    out = capsys.readouterr().out.strip()
    assert out.startswith("ftjax ") and out != "ftjax "


@pytest.mark.parametrize("args,fragment", [
    (["--policy", "device", "--cache-slots", "4"], "policy 'device' has no expert cache"),
    (["--policy", "host", "--cache-bytes", "1e6"], "policy 'host' has no expert cache"),
    (["--policy", "lru", "--cache-slots", "0"], "--cache-slots must be positive"),
    (["--threads", "0"], "--threads must be in 1.."),
    (["--threads", "100000"], "--threads must be in 1.."),
    (["--temperature", "nan"], "--temperature must be a finite number, got nan"),
    (["--top-p", "nan"], "--top-p must be a finite number, got nan"),
    (["--top-p", "0"], "--top-p must be in (0, 1]"),
    (["--temperature", "-1"], "--temperature must be >= 0 (0 = greedy)"),
    (["--top-k", "-2"], "--top-k must be >= 0"),
    (["-n", "-1"], "--max-new-tokens must be >= 0"),
    (["--policy", "lru", "--cache-slots", "2", "--bandwidth", "nan", "3"], "--bandwidth B_P must be a finite"),
    (["--policy", "lru", "--cache-slots", "2", "--bandwidth", "1", "0"], "--bandwidth B_H must be positive"),
])
def test_bad_options_are_rejected_by_name(model_dir, capsys, args, fragment):
    assert cli.main(["generate", "--model", str(model_dir), "x", *args]) == 2
    assert fragment in capsys.readouterr().err


def test_unknown_policy_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["generate", "x", "--policy", "nope"])
    assert info.value.code == 2 and "lru-transfer-only" in capsys.readouterr().err


# ---------------------------------------------------------------------------- stdin, chat, summary, Ctrl-C


def test_prompt_from_stdin(model_dir, capsys, monkeypatch):
    from ftjax.tokenizer import Tokenizer

    prompt = "It is a truth universally acknowledged"
    monkeypatch.setattr("sys.stdin", io.StringIO(prompt))
    assert cli.main(["generate", "--model", str(model_dir), "-", "-n", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["prompt_tokens"] == len(Tokenizer.from_dir(model_dir).encode(prompt))


def test_summary_shows_fetched_and_host_split(model_dir, capsys):
    assert cli.main(["generate", "--model", str(model_dir), "Hello there", "-n", "4", "--policy", "lru",
                     "--cache-slots", "2", "--bandwidth", "1", "2"]) == 0
    err = capsys.readouterr().err
    assert "policy lru:" in err and " fetched, " in err and " on host" in err
    assert cli.main(["generate", "--model", str(model_dir), "Hello there", "-n", "2", "--json", "--policy", "host"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["fetched"] == 0 and out["host_computed"] > 0 and out["misses"] == out["host_computed"]


def test_interactive_chat_keeps_the_history(model_dir, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("Hi there\n\nTell me more\n"))
    assert cli.main(["chat", "--model", str(model_dir), "-n", "3", "--json", "--system", "Be brief."]) == 0
    turns = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    assert len(turns) == 2  # the blank line is skipped, EOF ends the chat
    assert turns[1]["prompt_tokens"] > turns[0]["prompt_tokens"] + turns[0]["new_tokens"]  # history included


class _InterruptedModel:
    """Yields two tokens, then the user presses Ctrl-C."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def reset_stats(self):
        pass

    def generate_stream(self, ids, max_new_tokens, **sampling):
        yield from self.tokenizer.encode(" Hello world")[:2]
        raise KeyboardInterrupt


def test_ctrl_c_stops_cleanly_with_130(model_dir, capsys, monkeypatch):
    from ftjax.tokenizer import Tokenizer

    fake = _InterruptedModel(Tokenizer.from_dir(model_dir))
    monkeypatch.setattr(cli, "_load", lambda args: (fake, 0.0))
    assert cli.main(["generate", "x", "-n", "50"]) == 130
    captured = capsys.readouterr()
    assert "interrupted" in captured.err and "Traceback" not in captured.err
    assert captured.out.endswith("\n") and "Hell" in captured.out  # what was generated stays, line ended
