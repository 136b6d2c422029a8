"""The shipped default model (`ftjax/default_model/`): size, `ftjax.load()` with no path,
agreement with transformers, and readable greedy text."""

from __future__ import annotations

import json
import re
from collections import Counter

import numpy as np
import pytest

import ftjax
from ftjax.model import DEFAULT_MODEL_DIR

WEIGHTS = DEFAULT_MODEL_DIR / "model.safetensors"
pytestmark = pytest.mark.skipif(
    not WEIGHTS.is_file(),
    reason=f"{WEIGHTS} is absent: train and export it with scripts/train_default_model.py")
MAX_BYTES = 25_000_000


@pytest.fixture(scope="module")
def model():
    return ftjax.load()


def test_size_and_config():
    assert WEIGHTS.stat().st_size <= MAX_BYTES
    hf = json.loads((DEFAULT_MODEL_DIR / "config.json").read_text())
    assert hf["model_type"] == "qwen3_moe" and hf["tie_word_embeddings"] and hf["bos_token_id"] is None
    assert set(hf["eos_token_id"]) == {4087, 4089}


def test_load_without_a_path(model):
    assert model.config.model_type == "qwen3_moe"
    assert model.tokenizer is not None and model.tokenizer.vocab_size == model.config.vocab_size
    assert {4087, 4089} <= set(model.config.eos_token_ids)


def test_transformers_agrees(model):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    ids = model.tokenizer.encode("To be, or not to be, that is the question:")
    ours = ftjax.load(numerics="exact").logits(ids)  # the parity suite's numerics (f32 K/V)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(DEFAULT_MODEL_DIR), dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits[0].numpy()
    err = np.abs(ours - theirs).max() / np.abs(theirs).max()
    assert err <= 1e-3, err


def test_greedy_text_is_words(model):
    tok = model.tokenizer
    new = model.generate(tok.encode("To be, or not to be"), 48)
    text = tok.decode(new)
    words = re.findall(r"[A-Za-z]+", text)
    assert len(words) >= 8, text
    assert len(set(w.lower() for w in words)) >= 5, text
    assert Counter(new).most_common(1)[0][1] <= len(new) // 2, text
