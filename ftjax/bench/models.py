"""Model folders that benchmarks derive from the embedded default model.

`default_model_with_context(n, folder)`: the default model's weights, tokenizer and chat
template with a declared context of n tokens (max_position_embeddings = n in a copy of
config.json; every other file linked). It was trained at 2,048 tokens: past that RoPE
extrapolates and the text gets worse, while the serving work — prefill, attention over
n keys, state sizes — is the real one. Long-history soaks and prompt-cost curves use it
so that they need nothing outside the repository.

`default_model_with_layers(n, folder)`: the default model made n layers deep, layer i
holding layer i mod 6's weights (the outputs mean nothing; the programs are those of an
n-layer model of the default model's widths). The compile benchmark measures how
compile time grows with depth on it.

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


def _variant(folder: Path, config_changes: dict, own_files: tuple[str, ...] = ()) -> Path:
    """A new (or empty) folder linking the default model's files but config.json (written
    with `config_changes`) and `own_files` (the caller writes them) -> its path."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for f in DEFAULT_MODEL_DIR.iterdir():
        if f.name != "config.json" and f.name not in own_files:
            (folder / f.name).symlink_to(f)
    config = json.loads((DEFAULT_MODEL_DIR / "config.json").read_text()) | config_changes
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return folder


def default_model_with_context(context: int, folder: Path) -> Path:
    """Write the folder (new or empty) -> its path."""
    if not isinstance(context, int) or context < 2:
        raise ValueError(f"context must be an integer >= 2, got {context!r}")
    return _variant(folder, {"max_position_embeddings": context})


def default_model_with_layers(layers: int, folder: Path) -> Path:
    """Write the folder (new or empty): the default model with `layers` decoder layers,
    layer i a copy of layer i mod L0 (L0: the default model's own count) -> its path."""
    import ml_dtypes  # noqa: F401  (registers numpy's bfloat16 for safetensors)
    from safetensors.numpy import load_file, save_file

    if not isinstance(layers, int) or layers < 1:
        raise ValueError(f"layers must be an integer >= 1, got {layers!r}")
    base = json.loads((DEFAULT_MODEL_DIR / "config.json").read_text())["num_hidden_layers"]
    folder = _variant(folder, {"num_hidden_layers": layers}, own_files=("model.safetensors",))
    tensors = {}
    for name, value in load_file(DEFAULT_MODEL_DIR / "model.safetensors").items():
        prefix, _, rest = name.partition("model.layers.")
        if not rest:
            tensors[name] = value
            continue
        index, _, suffix = rest.partition(".")
        for i in range(int(index), layers, base):  # every layer i with i mod base == index
            tensors[f"model.layers.{i}.{suffix}"] = value
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder
