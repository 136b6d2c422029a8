"""Model folders that benchmarks derive from the embedded default model.

`default_model_with_context(n, folder)`: the default model's weights, tokenizer and chat
template with a declared context of n tokens (max_position_embeddings = n in a copy of
config.json; every other file linked). It was trained at 2,048 tokens: past that RoPE
extrapolates and the text gets worse, while the serving work — prefill, attention over
n keys, state sizes — is the real one. Long-history soaks and prompt-cost curves use it
so that they need nothing outside the repository.
"""

from __future__ import annotations

import json
from pathlib import Path

from ftjax.model import DEFAULT_MODEL_DIR


def default_model_with_context(context: int, folder: Path) -> Path:
    """Write the folder (new or empty) -> its path."""
    if not isinstance(context, int) or context < 2:
        raise ValueError(f"context must be an integer >= 2, got {context!r}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for f in DEFAULT_MODEL_DIR.iterdir():
        if f.name != "config.json":
            (folder / f.name).symlink_to(f)
    config = json.loads((DEFAULT_MODEL_DIR / "config.json").read_text())
    config["max_position_embeddings"] = context
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return folder
