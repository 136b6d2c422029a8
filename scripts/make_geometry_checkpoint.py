"""A random-weight bf16 Hugging Face `qwen3_moe` checkpoint with Qwen3-30B-A3B shapes.

Same tensor shapes, names and config as the real model (D 2048, F 768, E 128, K 8,
H 32, G 4, hd 128, V 151936, untied LM head), but only `--layers` decoder layers
(4..8, all MoE), so decode reads the same bytes per layer as the real model and the
benchmarks of ftjax, llama.cpp and transformers can run on the same file on a small
machine. No tokenizer: benchmarks feed token ids.

Weights are drawn with numpy (std 0.02; router std 0.05 so top-8 routing varies per
token; norm weights 1 +- 0.1; experts: 8 drawn per layer, the other 120 are random
rotations of their flattened weights), rounded to bf16 and written with safetensors as torch
bf16 tensors under the names `save_pretrained` uses (per-expert
`mlp.experts.{e}.gate_proj.weight`), one shard per layer plus one for the embedding
and one for the LM head, with `model.safetensors.index.json`.

    python scripts/make_geometry_checkpoint.py --out /tmp/ftjax-geom [--layers 4]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

D, F, E, K, H, G, HD, V = 2048, 768, 128, 8, 32, 4, 128, 151936
BASE = 8  # experts per layer drawn from the RNG; the others are rotations of these


def hf_config(num_layers: int) -> dict:
    return {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "hidden_size": D, "intermediate_size": 6144, "moe_intermediate_size": F,
        "num_experts": E, "num_local_experts": E, "num_experts_per_tok": K, "norm_topk_prob": True,
        "num_hidden_layers": num_layers, "num_attention_heads": H, "num_key_value_heads": G, "head_dim": HD,
        "vocab_size": V, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
        "rope_theta": 1e6, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
        "rope_scaling": None, "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "tie_word_embeddings": False,
        "use_sliding_window": False, "sliding_window": None, "max_window_layers": num_layers,
        "output_router_logits": False, "router_aux_loss_coef": 0.001, "initializer_range": 0.02,
        "bos_token_id": 151643, "eos_token_id": 151645, "torch_dtype": "bfloat16", "dtype": "bfloat16",
        "use_cache": True,
    }


class Rng:
    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)

    def bf16(self, shape, std: float, mean: float = 0.0) -> torch.Tensor:
        """Normal(mean, std) rounded to bf16 (round to nearest even) as a torch bf16 tensor."""
        a = self.rng.standard_normal(shape, dtype=np.float32)
        a *= std
        a += mean
        bits = a.view(np.uint32)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        return torch.from_numpy(bits).view(torch.bfloat16)


def layer_tensors(rng: Rng, i: int) -> dict[str, torch.Tensor]:
    p = f"model.layers.{i}."
    t = {
        p + "input_layernorm.weight": rng.bf16((D,), 0.1, 1.0),
        p + "post_attention_layernorm.weight": rng.bf16((D,), 0.1, 1.0),
        p + "self_attn.q_proj.weight": rng.bf16((H * HD, D), 0.02),
        p + "self_attn.k_proj.weight": rng.bf16((G * HD, D), 0.02),
        p + "self_attn.v_proj.weight": rng.bf16((G * HD, D), 0.02),
        p + "self_attn.o_proj.weight": rng.bf16((D, H * HD), 0.02),
        p + "self_attn.q_norm.weight": rng.bf16((HD,), 0.1, 1.0),
        p + "self_attn.k_norm.weight": rng.bf16((HD,), 0.1, 1.0),
        p + "mlp.gate.weight": rng.bf16((E, D), 0.05),
    }
    # Drawing 150M normals per layer is slow on a busy 2-core machine: draw BASE experts
    # and derive the rest by rotating a base expert's flat weights by a random offset
    # (distinct values per expert, same distribution, memory-bound).
    base = [[rng.bf16(s, 0.02) for s in ((F, D), (F, D), (D, F))] for _ in range(BASE)]
    for e in range(E):
        q = f"{p}mlp.experts.{e}."
        for name, w in zip(("gate_proj", "up_proj", "down_proj"), base[e % BASE]):
            shift = int(rng.rng.integers(1, w.numel())) if e >= BASE else 0
            t[q + name + ".weight"] = torch.roll(w.reshape(-1), shift).reshape(w.shape)
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="/tmp/ftjax-geom")
    ap.add_argument("--layers", type=int, default=4, choices=range(4, 9), metavar="4..8")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rng = Rng(args.seed)
    t0 = time.perf_counter()
    shards: list[tuple[str, dict]] = []
    n = args.layers + 2

    def write(idx: int, tensors: dict) -> None:
        name = f"model-{idx:05d}-of-{n:05d}.safetensors"
        save_file(tensors, str(out / name), metadata={"format": "pt"})
        shards.append((name, {k: v.numel() * 2 for k, v in tensors.items()}))
        print(f"wrote {name} ({sum(shards[-1][1].values()) / 1e9:.2f} GB, {time.perf_counter() - t0:.0f} s)", flush=True)

    write(1, {"model.embed_tokens.weight": rng.bf16((V, D), 0.02), "model.norm.weight": rng.bf16((D,), 0.1, 1.0)})
    for i in range(args.layers):
        write(i + 2, layer_tensors(rng, i))
    write(n, {"lm_head.weight": rng.bf16((V, D), 0.02)})

    weight_map = {k: name for name, sizes in shards for k in sizes}
    total = sum(s for _, sizes in shards for s in sizes.values())
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (out / "config.json").write_text(json.dumps(hf_config(args.layers), indent=2))
    (out / "generation_config.json").write_text(json.dumps({"do_sample": False, "eos_token_id": 151645}))
    print(json.dumps({"out": str(out), "layers": args.layers, "total_bytes": total, "tensors": len(weight_map),
                      "seconds": round(time.perf_counter() - t0, 1)}))


if __name__ == "__main__":
    main()
