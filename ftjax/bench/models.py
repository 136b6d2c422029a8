"""Model folders that benchmarks derive from the embedded default model.

`default_model_with_context(n, folder)`: the default model's weights, tokenizer and chat
template with a declared context of n tokens (max_position_embeddings = n in a copy of
config.json; every other file linked). It was trained at 2,048 tokens: past that RoPE
extrapolates and the text gets worse, while the serving work — prefill, attention over
n keys, state sizes — is the real one. Long-history soaks and prompt-cost curves use it
so that they need nothing outside the repository.

`decode_weight_bytes(model)`: the weight bytes one decode step reads at least (dense
matrices, top-k experts per MoE layer), the floor of the read-ceiling and context benchmarks.
"""

from __future__ import annotations

import json
from pathlib import Path

from ftjax.model import DEFAULT_MODEL_DIR


def decode_weight_bytes(model) -> tuple[int, int]:
    """(dense, experts) bytes one decode step streams: every dense param but the embedding
    table, whose one row is gathered (unless tied: the LM head then reads all of it), and
    top_k experts of every MoE layer."""
    from ftjax.engine.memory import tree_bytes

    cfg = model.config
    dense = tree_bytes({k: v for k, v in model._params.items() if k != "embed" or cfg.tie_embeddings})
    return dense, cfg.top_k * cfg.num_moe_layers * model.checkpoint.pool.expert_bytes


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
