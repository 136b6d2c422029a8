"""Random-weight bf16 Hugging Face checkpoints with the shapes of the paper's models.

`--family qwen3_moe` (default): Qwen3-30B-A3B. `--family qwen3_5_moe`: Qwen3.6-35B-A3B
(= Qwen3.5-35B-A3B shapes: D 2048, E 256, K 8, F 512 + a 512-wide gated shared expert,
V 248320; three Gated DeltaNet layers (16 key / 32 value heads of 128, conv 4) to one
gated full-attention layer (16 heads, 2 KV heads of 256, quarter rotary)), in the
released multimodal layout (`text_config`, tensors under `model.language_model.`) minus
the vision tower. Zero-centred norms are drawn around 0, A_log = log U(1, 16).

`--family olmoe_attention`: OLMoE-1B-7B's attention (D 2048, 16 heads x 128, no GQA,
full q/k norms) with tiny experts (8 x 64, top-2), vocab 1024, 2 layers, 40960 positions:
the long-context benchmarks' model, where attention is nearly all of the work (built with
transformers' own initialisation, rounded to bf16).

`--family olmoe`: OLMoE-1B-7B (D 2048, 16 heads x 128, E 64 x F 1024, K 8, V 50304),
`--layers` of its 16 layers: the quantised-expert benchmarks' model (transformers'
initialisation, rounded to bf16; 0.8 GB of experts per layer).

`--family glm4_moe`: GLM-4.5-Air (D 4096, 96 heads / 8 KV heads of 128, half rotary, qkv
biases, E 128 x F 1408, K 8, one shared expert, sigmoid routing with a correction bias,
dense layer F 10944, V 151552). `--family deepseek_v3`: DeepSeek-V3 (D 7168, 128 heads of
MLA: q rank 1536, latent 512, dn 128 / dr 64 / dv 128, interleaved RoPE, YaRN x40; E 256 x
F 2048 in 8 groups (4 kept), K 8, one shared expert, scaling 2.5, dense layer F 18432,
V 129280; one MoE layer is 22.5 GB of bf16 experts). `--family glm_moe_dsa`: GLM-5 (D 6144,
64 heads of MLA: q rank 2048, latent 512, dn 192 / dr 64 / dv 256, interleaved RoPE,
theta 1e6, no YaRN; the DeepSeek sparse-attention indexer: 32 heads x 128, LayerNorm'd
key, top 2048 keys; E 256 x F 2048 in one group, K 8, one shared expert, scaling 2.5,
dense layer F 12288, V 154880; one MoE layer is 19.3 GB of bf16 experts): the shapes of
transformers' GlmMoeDsaConfig defaults, which are GLM-5's config.json. All three: layer 0
dense (`first_k_dense_replace` 1, the real models have 1, 3 and 3), the rest MoE, the
routers' e_score_correction_bias in float32 as released, no MTP layer.

`--family deepseek_v4`: DeepSeek-V4-Flash (D 4096, 64 query heads of 512 sharing one KV
head, q rank 1024, 64 interleaved RoPE dims, a grouped output projection of 8 groups x
1024, sliding window 128, compressed entries every 4 (CSA, with the lightning indexer:
64 heads x 128, top 512) or 128 (HCA) tokens, compress RoPE theta 160000 with YaRN x16;
4 hyper-connection streams, 20 Sinkhorn steps; E 256 x F 2048, K 6, one shared expert,
sqrtsoftplus scores, scaling 1.5, SwiGLU clamped at 10; V 129280; one MoE layer is 12.9 GB
of bf16 experts): the shapes of transformers' DeepseekV4Config defaults. Layers are
sliding, CSA, HCA, CSA, ... (every kind from 3 layers on), the first 3 hash-routed
(`tid2eid`, int64, distinct experts per token), the rest top-k with a float32 correction
bias; mHC parameters, sinks, position biases and norms in float32 as transformers keeps
them; tensors under transformers' module names (the routed experts under the original
`mlp.experts.{e}.w1 / w2 / w3`, which transformers merges at load); no MTP module.

The Qwen3-30B-A3B checkpoint:

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

    python scripts/make_geometry_checkpoint.py --out /tmp/ftjax-geom [--layers 4] [--family qwen3_5_moe]
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

D, F, E, K, H, G, HD, V = 2048, 768, 128, 8, 32, 4, 128, 151936
BASE = 8  # experts per layer drawn from the RNG; the others are rotations of these

# Qwen3.6-35B-A3B (qwen3_5_moe)
Q35 = dict(E=256, F=512, SHARED=512, H=16, G=2, HD=256, V=248320, HK=16, HV=32, DK=128, DV=128, CONV=4)


# GLM-4.5-Air (glm4_moe) and DeepSeek-V3 (deepseek_v3): the shapes of the released configs
GLM = dict(D=4096, H=96, G=8, HD=128, FD=10944, F=1408, E=128, V=151552)
DSV3 = dict(D=7168, H=128, QR=1536, R=512, DN=128, DR=64, DV=128, FD=18432, F=2048, E=256, V=129280)
# GLM-5 (glm_moe_dsa): MLA as DeepSeek-V3 with other sizes, plus the sparse-attention indexer (HI heads x DI, TOPK)
GLM5 = dict(D=6144, H=64, QR=2048, R=512, DN=192, DR=64, DV=256, FD=12288, F=2048, E=256, V=154880, HI=32, DI=128,
            TOPK=2048)


def hf_config_glm(num_layers: int) -> dict:
    c = GLM
    return {
        "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "hidden_size": c["D"],
        "num_hidden_layers": num_layers, "num_attention_heads": c["H"], "num_key_value_heads": c["G"],
        "head_dim": c["HD"], "intermediate_size": c["FD"], "moe_intermediate_size": c["F"],
        "n_routed_experts": c["E"], "num_experts_per_tok": K, "n_shared_experts": 1, "n_group": 1, "topk_group": 1,
        "routed_scaling_factor": 1.0, "norm_topk_prob": True, "first_k_dense_replace": 1, "use_qk_norm": False,
        "attention_bias": True, "partial_rotary_factor": 0.5, "rope_theta": 1e6, "rope_scaling": None,
        "vocab_size": c["V"], "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "hidden_act": "silu",
        "tie_word_embeddings": False, "num_nextn_predict_layers": 0, "bos_token_id": None,
        "eos_token_id": [151329, 151336, 151338], "pad_token_id": 151329, "dtype": "bfloat16",
    }


def mla_moe_fields(c: dict, num_layers: int) -> dict:
    """The config.json keys DeepSeek-V3 and GLM-5 share: MLA sizes and DeepSeek-style MoE
    (one shared expert, routed scaling 2.5, top-k renormalised, one dense first layer)."""
    return {
        "hidden_size": c["D"], "num_hidden_layers": num_layers, "num_attention_heads": c["H"],
        "num_key_value_heads": c["H"], "q_lora_rank": c["QR"], "kv_lora_rank": c["R"],
        "qk_nope_head_dim": c["DN"], "qk_rope_head_dim": c["DR"], "v_head_dim": c["DV"],
        "intermediate_size": c["FD"], "moe_intermediate_size": c["F"], "n_routed_experts": c["E"],
        "num_experts_per_tok": K, "n_shared_experts": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
        "first_k_dense_replace": 1,
    }


def hf_config_dsv3(num_layers: int) -> dict:
    c = DSV3
    return {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", **mla_moe_fields(c, num_layers),
        "n_group": 8, "topk_group": 4, "moe_layer_freq": 1,
        "topk_method": "noaux_tc", "scoring_func": "sigmoid", "rope_theta": 10000, "rope_interleave": True,
        "rope_scaling": {"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                         "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096},
        "vocab_size": c["V"], "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "hidden_act": "silu",
        "attention_bias": False, "tie_word_embeddings": False, "num_nextn_predict_layers": 0, "bos_token_id": 0,
        "eos_token_id": 1, "dtype": "bfloat16",
    }


def hf_config_glm5(num_layers: int) -> dict:
    c = GLM5
    return {
        "architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa", **mla_moe_fields(c, num_layers),
        "head_dim": c["DR"], "n_group": 1, "topk_group": 1,
        "index_n_heads": c["HI"], "index_head_dim": c["DI"], "index_topk": c["TOPK"],
        "indexer_types": ["full"] * num_layers, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
        "vocab_size": c["V"], "max_position_embeddings": 202752, "rms_norm_eps": 1e-5, "hidden_act": "silu",
        "attention_bias": False, "tie_word_embeddings": False, "num_nextn_predict_layers": 0, "bos_token_id": 0,
        "eos_token_id": [154820, 154827, 154829], "pad_token_id": 154820, "dtype": "bfloat16",
    }


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


def hf_config_q35(num_layers: int) -> dict:
    c = Q35
    text = {
        "model_type": "qwen3_5_moe_text", "hidden_size": D, "num_hidden_layers": num_layers,
        "num_attention_heads": c["H"], "num_key_value_heads": c["G"], "head_dim": c["HD"],
        "moe_intermediate_size": c["F"], "shared_expert_intermediate_size": c["SHARED"],
        "num_experts": c["E"], "num_experts_per_tok": K, "vocab_size": c["V"],
        "linear_num_key_heads": c["HK"], "linear_num_value_heads": c["HV"], "linear_key_head_dim": c["DK"],
        "linear_value_head_dim": c["DV"], "linear_conv_kernel_dim": c["CONV"],
        "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(num_layers)],
        "full_attention_interval": 4, "max_position_embeddings": 262144, "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                            "mrope_interleaved": True, "mrope_section": [11, 11, 10]},
        "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False,
        "bos_token_id": None, "eos_token_id": 248046, "dtype": "bfloat16",
    }
    return {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
            "text_config": text, "tie_word_embeddings": False, "dtype": "bfloat16"}


def experts(rng: Rng, p: str, n: int, f: int, d: int = D) -> dict[str, torch.Tensor]:
    """Per-expert tensors of one layer (BASE drawn, the rest rotations of them)."""
    # Drawing 150M normals per layer is slow on a busy 2-core machine: draw BASE experts
    # and derive the rest by rotating a base expert's flat weights by a random offset
    # (distinct values per expert, same distribution, memory-bound).
    t = {}
    base = [[rng.bf16(s, 0.02) for s in ((f, d), (f, d), (d, f))] for _ in range(BASE)]
    for e in range(n):
        q = f"{p}mlp.experts.{e}."
        for name, w in zip(("gate_proj", "up_proj", "down_proj"), base[e % BASE]):
            shift = int(rng.rng.integers(1, w.numel())) if e >= BASE else 0
            t[q + name + ".weight"] = torch.roll(w.reshape(-1), shift).reshape(w.shape)
    return t


def layer_tensors_q35(rng: Rng, i: int) -> dict[str, torch.Tensor]:
    c = Q35
    p = f"model.language_model.layers.{i}."
    t = {p + "input_layernorm.weight": rng.bf16((D,), 0.1), p + "post_attention_layernorm.weight": rng.bf16((D,), 0.1)}
    if (i + 1) % 4:  # Gated DeltaNet
        key, value = c["HK"] * c["DK"], c["HV"] * c["DV"]
        a = p + "linear_attn."
        t.update({
            a + "in_proj_qkv.weight": rng.bf16((2 * key + value, D), 0.02),
            a + "in_proj_z.weight": rng.bf16((value, D), 0.02),
            a + "in_proj_b.weight": rng.bf16((c["HV"], D), 0.02),
            a + "in_proj_a.weight": rng.bf16((c["HV"], D), 0.02),
            a + "conv1d.weight": rng.bf16((2 * key + value, 1, c["CONV"]), 0.2),
            a + "dt_bias": rng.bf16((c["HV"],), 0.0, 1.0),
            a + "A_log": torch.log(torch.from_numpy(rng.rng.uniform(1, 16, c["HV"]).astype(np.float32))).bfloat16(),
            a + "norm.weight": rng.bf16((c["DV"],), 0.1, 1.0),
            a + "out_proj.weight": rng.bf16((D, value), 0.02),
        })
    else:  # gated full attention
        a, h, g, hd = p + "self_attn.", c["H"], c["G"], c["HD"]
        t.update({
            a + "q_proj.weight": rng.bf16((2 * h * hd, D), 0.02), a + "k_proj.weight": rng.bf16((g * hd, D), 0.02),
            a + "v_proj.weight": rng.bf16((g * hd, D), 0.02), a + "o_proj.weight": rng.bf16((D, h * hd), 0.02),
            a + "q_norm.weight": rng.bf16((hd,), 0.1), a + "k_norm.weight": rng.bf16((hd,), 0.1),
        })
    m = p + "mlp."
    t.update({
        m + "gate.weight": rng.bf16((c["E"], D), 0.05),
        m + "shared_expert.gate_proj.weight": rng.bf16((c["SHARED"], D), 0.02),
        m + "shared_expert.up_proj.weight": rng.bf16((c["SHARED"], D), 0.02),
        m + "shared_expert.down_proj.weight": rng.bf16((D, c["SHARED"]), 0.02),
        m + "shared_expert_gate.weight": rng.bf16((1, D), 0.02),
    })
    t.update(experts(rng, p, c["E"], c["F"]))
    return t


def mlp_tensors(rng: Rng, p: str, c: dict, moe: bool, groups: int = 1) -> dict[str, torch.Tensor]:
    """Layer 0's dense MLP, or a DeepSeek-style MoE block: router + float32 correction
    bias (distinct per group, so group selection varies), one shared expert, experts."""
    d, m = c["D"], p + "mlp."
    if not moe:
        return {m + "gate_proj.weight": rng.bf16((c["FD"], d), 0.02), m + "up_proj.weight": rng.bf16((c["FD"], d), 0.02),
                m + "down_proj.weight": rng.bf16((d, c["FD"]), 0.02)}
    t = {m + "gate.weight": rng.bf16((c["E"], d), 0.05),
         m + "gate.e_score_correction_bias": torch.from_numpy(rng.rng.normal(0, 0.01, c["E"]).astype(np.float32)),
         m + "shared_experts.gate_proj.weight": rng.bf16((c["F"], d), 0.02),
         m + "shared_experts.up_proj.weight": rng.bf16((c["F"], d), 0.02),
         m + "shared_experts.down_proj.weight": rng.bf16((d, c["F"]), 0.02)}
    t.update(experts(rng, p, c["E"], c["F"], d))
    return t


def layer_tensors_glm(rng: Rng, i: int) -> dict[str, torch.Tensor]:
    c, p = GLM, f"model.layers.{i}."
    a, h, g, hd, d = p + "self_attn.", c["H"], c["G"], c["HD"], c["D"]
    t = {p + "input_layernorm.weight": rng.bf16((d,), 0.1, 1.0),
         p + "post_attention_layernorm.weight": rng.bf16((d,), 0.1, 1.0),
         a + "q_proj.weight": rng.bf16((h * hd, d), 0.02), a + "q_proj.bias": rng.bf16((h * hd,), 0.02),
         a + "k_proj.weight": rng.bf16((g * hd, d), 0.02), a + "k_proj.bias": rng.bf16((g * hd,), 0.02),
         a + "v_proj.weight": rng.bf16((g * hd, d), 0.02), a + "v_proj.bias": rng.bf16((g * hd,), 0.02),
         a + "o_proj.weight": rng.bf16((d, h * hd), 0.02)}
    t.update(mlp_tensors(rng, p, c, moe=i >= 1))
    return t


def layer_tensors_dsv3(rng: Rng, i: int) -> dict[str, torch.Tensor]:
    c, p = DSV3, f"model.layers.{i}."
    d = c["D"]
    t = {p + "input_layernorm.weight": rng.bf16((d,), 0.1, 1.0),
         p + "post_attention_layernorm.weight": rng.bf16((d,), 0.1, 1.0)}
    t.update(mla_tensors(rng, p + "self_attn.", c))
    t.update(mlp_tensors(rng, p, c, moe=i >= 1))
    return t


def mla_tensors(rng: Rng, a: str, c: dict) -> dict[str, torch.Tensor]:
    """Multi-head latent attention's tensors (DeepSeek-V3 / GLM-5 names) under prefix `a`."""
    h, d = c["H"], c["D"]
    return {a + "q_a_proj.weight": rng.bf16((c["QR"], d), 0.02), a + "q_a_layernorm.weight": rng.bf16((c["QR"],), 0.1, 1.0),
            a + "q_b_proj.weight": rng.bf16((h * (c["DN"] + c["DR"]), c["QR"]), 0.02),
            a + "kv_a_proj_with_mqa.weight": rng.bf16((c["R"] + c["DR"], d), 0.02),
            a + "kv_a_layernorm.weight": rng.bf16((c["R"],), 0.1, 1.0),
            a + "kv_b_proj.weight": rng.bf16((h * (c["DN"] + c["DV"]), c["R"]), 0.02),
            a + "o_proj.weight": rng.bf16((d, h * c["DV"]), 0.02)}


def layer_tensors_glm5(rng: Rng, i: int) -> dict[str, torch.Tensor]:
    c, p = GLM5, f"model.layers.{i}."
    a, d = p + "self_attn.", c["D"]
    t = {p + "input_layernorm.weight": rng.bf16((d,), 0.1, 1.0),
         p + "post_attention_layernorm.weight": rng.bf16((d,), 0.1, 1.0)}
    t.update(mla_tensors(rng, a, c))
    x = a + "indexer."  # the lightning indexer: queries from the q latent, one LayerNorm'd key per token
    t.update({x + "wq_b.weight": rng.bf16((c["HI"] * c["DI"], c["QR"]), 0.02), x + "wk.weight": rng.bf16((c["DI"], d), 0.02),
              x + "k_norm.weight": rng.bf16((c["DI"],), 0.1, 1.0), x + "k_norm.bias": rng.bf16((c["DI"],), 0.02),
              x + "weights_proj.weight": rng.bf16((c["HI"], d), 0.02)})
    t.update(mlp_tensors(rng, p, c, moe=i >= 1))
    return t


# DeepSeek-V4-Flash (deepseek_v4): transformers' DeepseekV4Config defaults
DSV4 = dict(D=4096, H=64, HD=512, DR=64, QR=1024, OG=8, OR=1024, F=2048, E=256, K=6, V=129280, WIN=128, CSA=4,
            HCA=128, HI=64, DI=128, TOPK=512, HC=4, HASH=3)
DSV4_KINDS = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
              "compressed_sparse_attention")


def dsv4_layer_type(i: int) -> str:
    return DSV4_KINDS[i % len(DSV4_KINDS)]


def hf_config_dsv4(num_layers: int) -> dict:
    c = DSV4
    return {
        "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "hidden_size": c["D"],
        "num_hidden_layers": num_layers, "num_attention_heads": c["H"], "num_key_value_heads": 1, "head_dim": c["HD"],
        "partial_rotary_factor": c["DR"] / c["HD"], "q_lora_rank": c["QR"], "o_groups": c["OG"], "o_lora_rank": c["OR"],
        "moe_intermediate_size": c["F"], "n_routed_experts": c["E"], "num_experts_per_tok": c["K"],
        "n_shared_experts": 1, "scoring_func": "sqrtsoftplus", "routed_scaling_factor": 1.5, "swiglu_limit": 10.0,
        "sliding_window": c["WIN"], "layer_types": [dsv4_layer_type(i) for i in range(num_layers)],
        "compress_rates": {"compressed_sparse_attention": c["CSA"], "heavily_compressed_attention": c["HCA"]},
        "mlp_layer_types": ["hash_moe" if i < c["HASH"] else "moe" for i in range(num_layers)],
        "index_n_heads": c["HI"], "index_head_dim": c["DI"], "index_topk": c["TOPK"], "hc_mult": c["HC"],
        "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "rope_theta": 10000.0, "compress_rope_theta": 160000.0,
        "rope_parameters": {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536,
                            "beta_fast": 32, "beta_slow": 1},
        "vocab_size": c["V"], "max_position_embeddings": 1048576, "rms_norm_eps": 1e-6, "hidden_act": "silu",
        "tie_word_embeddings": False, "num_nextn_predict_layers": 0, "bos_token_id": 0, "eos_token_id": 1,
        "dtype": "bfloat16",
    }


def f32(rng: Rng, shape, std: float, mean: float = 0.0) -> torch.Tensor:
    return torch.from_numpy((rng.rng.standard_normal(shape, dtype=np.float32) * std + mean).astype(np.float32))


def dsv4_compressor(rng: Rng, x: str, width: int, rate: int, overlap: bool) -> dict[str, torch.Tensor]:
    d, out = DSV4["D"], (2 if overlap else 1) * width
    return {x + "kv_proj.weight": rng.bf16((out, d), 0.02), x + "gate_proj.weight": rng.bf16((out, d), 0.02),
            x + "position_bias": f32(rng, (rate, out), 0.1), x + "kv_norm.weight": f32(rng, (width,), 0.1, 1.0)}


def layer_tensors_dsv4(rng: Rng, i: int) -> dict[str, torch.Tensor]:
    """One V4 layer (layer 0 also carries the model's hc_head: one shard less)."""
    c, p = DSV4, f"model.layers.{i}."
    d, h, hd, hc = c["D"], c["H"], c["HD"], c["HC"]
    a, m = p + "self_attn.", p + "mlp."
    t = {p + "input_layernorm.weight": f32(rng, (d,), 0.1, 1.0),
         p + "post_attention_layernorm.weight": f32(rng, (d,), 0.1, 1.0)}
    for hcn in ("attn_hc", "ffn_hc"):
        t.update({f"{p}{hcn}.fn": f32(rng, ((2 + hc) * hc, hc * d), 0.02), f"{p}{hcn}.base": f32(rng, ((2 + hc) * hc,), 0.1),
                  f"{p}{hcn}.scale": f32(rng, (3,), 0.1, 1.0)})
    t.update({a + "q_a_proj.weight": rng.bf16((c["QR"], d), 0.02), a + "q_a_norm.weight": f32(rng, (c["QR"],), 0.1, 1.0),
              a + "q_b_proj.weight": rng.bf16((h * hd, c["QR"]), 0.02), a + "kv_proj.weight": rng.bf16((hd, d), 0.02),
              a + "kv_norm.weight": f32(rng, (hd,), 0.1, 1.0),
              a + "o_a_proj.weight": rng.bf16((c["OG"] * c["OR"], h * hd // c["OG"]), 0.02),
              a + "o_b_proj.weight": rng.bf16((d, c["OG"] * c["OR"]), 0.02), a + "sinks": f32(rng, (h,), 0.5)})
    kind = dsv4_layer_type(i)
    if kind != "sliding_attention":
        csa = kind == "compressed_sparse_attention"
        t.update(dsv4_compressor(rng, a + "compressor.", hd, c["CSA"] if csa else c["HCA"], csa))
        if csa:
            x = a + "compressor.indexer."
            t.update(dsv4_compressor(rng, x, c["DI"], c["CSA"], True))
            t.update({x + "q_b_proj.weight": rng.bf16((c["HI"] * c["DI"], c["QR"]), 0.02),
                      x + "scorer.weights_proj.weight": rng.bf16((c["HI"], d), 0.02)})
    t[m + "gate.weight"] = rng.bf16((c["E"], d), 0.05)
    if i < c["HASH"]:  # a frozen token -> experts table: K distinct experts per token
        t[m + "gate.tid2eid"] = torch.from_numpy(np.ascontiguousarray(np.argsort(rng.rng.random((c["V"], c["E"])), axis=1)[:, :c["K"]]))
    else:
        t[m + "gate.e_score_correction_bias"] = f32(rng, (c["E"],), 0.01)
    t.update({m + "shared_experts.gate_proj.weight": rng.bf16((c["F"], d), 0.02),
              m + "shared_experts.up_proj.weight": rng.bf16((c["F"], d), 0.02),
              m + "shared_experts.down_proj.weight": rng.bf16((d, c["F"]), 0.02)})
    names = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}  # transformers reads V4's experts by these names
    t.update({re.sub(r"(gate|down|up)_proj", lambda g: names[g.group(0)], k): v
              for k, v in experts(rng, p, c["E"], c["F"], d).items()})
    if i == 0:
        t.update({"model.hc_head.hc_fn": f32(rng, (hc, hc * d), 0.02), "model.hc_head.hc_base": f32(rng, (hc,), 0.1),
                  "model.hc_head.hc_scale": f32(rng, (1,), 0.1, 1.0)})
    return t


FAMILIES = {  # --family -> (config, layer tensors, vocab, D, final norm mean, eos)
    "glm4_moe": (hf_config_glm, layer_tensors_glm, GLM["V"], GLM["D"], 1.0, 151329),
    "deepseek_v3": (hf_config_dsv3, layer_tensors_dsv3, DSV3["V"], DSV3["D"], 1.0, 1),
    "glm_moe_dsa": (hf_config_glm5, layer_tensors_glm5, GLM5["V"], GLM5["D"], 1.0, 154820),
    "deepseek_v4": (hf_config_dsv4, layer_tensors_dsv4, DSV4["V"], DSV4["D"], 1.0, 1),
}


EXPERT_SHAPES = {"glm4_moe": GLM, "deepseek_v3": DSV3, "glm_moe_dsa": GLM5, "deepseek_v4": DSV4}  # --experts


def olmoe_attention(out: Path, num_layers: int, seed: int) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = AutoConfig.for_model("olmoe", vocab_size=1024, hidden_size=D, num_hidden_layers=num_layers,
                               num_attention_heads=16, num_key_value_heads=16, intermediate_size=64, num_experts=8,
                               num_experts_per_tok=2, max_position_embeddings=40960, eos_token_id=None,
                               bos_token_id=None, pad_token_id=None)
    AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).save_pretrained(out)
    print(json.dumps({"out": str(out), "family": "olmoe_attention", "layers": num_layers}))


def olmoe(out: Path, num_layers: int, seed: int) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = AutoConfig.for_model("olmoe", vocab_size=50304, hidden_size=D, num_hidden_layers=num_layers,
                               num_attention_heads=16, num_key_value_heads=16, intermediate_size=1024, num_experts=64,
                               num_experts_per_tok=8, max_position_embeddings=4096, eos_token_id=50279,
                               bos_token_id=None, pad_token_id=1)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(out)
    print(json.dumps({"out": str(out), "family": "olmoe", "layers": num_layers}))


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
    t.update(experts(rng, p, E, F))
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="/tmp/ftjax-geom")
    ap.add_argument("--layers", type=int, default=4, choices=range(2, 9), metavar="2..8")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--family", default="qwen3_moe",
                    choices=["qwen3_moe", "qwen3_5_moe", "olmoe_attention", "olmoe", *FAMILIES])
    ap.add_argument("--experts", type=int, default=None,
                    help=f"routed experts per MoE layer ({', '.join(EXPERT_SHAPES)}): fewer than the real "
                         "model's, each of the real shape, so a few layers fit a small machine (decode reads "
                         "the same bytes per token: top-k experts of the real size)")
    args = ap.parse_args()
    if args.experts is not None:
        if args.family not in EXPERT_SHAPES:
            ap.error(f"--experts applies to {', '.join(EXPERT_SHAPES)}")
        shape = EXPERT_SHAPES[args.family]
        groups = 8 if args.family == "deepseek_v3" else 1  # n_group of the config (4 groups kept of 8)
        if args.experts % groups or args.experts < max(shape.get("K", K), 2 * groups):
            ap.error(f"--experts for {args.family} must be a multiple of {groups} and at least "
                     f"{max(shape.get('K', K), 2 * groups)}")
        shape["E"] = args.experts
    if args.family in ("olmoe_attention", "olmoe"):
        return (olmoe_attention if args.family == "olmoe_attention" else olmoe)(Path(args.out), args.layers, args.seed)
    q35 = args.family == "qwen3_5_moe"
    prefix = "model.language_model." if q35 else "model."
    vocab, d, norm_mean, eos = (Q35["V"], D, 0.0, 248046) if q35 else (V, D, 1.0, 151645)
    config_fn, layer_fn = (hf_config_q35, layer_tensors_q35) if q35 else (hf_config, layer_tensors)
    if args.family in FAMILIES:
        config_fn, layer_fn, vocab, d, norm_mean, eos = FAMILIES[args.family]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rng = Rng(args.seed)
    t0 = time.perf_counter()
    shards: list[tuple[str, dict]] = []
    n = args.layers + 2

    def write(idx: int, tensors: dict) -> None:
        name = f"model-{idx:05d}-of-{n:05d}.safetensors"
        save_file(tensors, str(out / name), metadata={"format": "pt"})
        shards.append((name, {k: v.numel() * v.element_size() for k, v in tensors.items()}))
        print(f"wrote {name} ({sum(shards[-1][1].values()) / 1e9:.2f} GB, {time.perf_counter() - t0:.0f} s)", flush=True)

    write(1, {prefix + "embed_tokens.weight": rng.bf16((vocab, d), 0.02),
              prefix + "norm.weight": rng.bf16((d,), 0.1, norm_mean)})
    for i in range(args.layers):
        write(i + 2, layer_fn(rng, i))
    write(n, {"lm_head.weight": rng.bf16((vocab, d), 0.02)})

    weight_map = {k: name for name, sizes in shards for k in sizes}
    total = sum(s for _, sizes in shards for s in sizes.values())
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (out / "config.json").write_text(json.dumps(config_fn(args.layers), indent=2))
    (out / "generation_config.json").write_text(json.dumps({"do_sample": False, "eos_token_id": eos}))
    print(json.dumps({"out": str(out), "family": args.family, "layers": args.layers, "total_bytes": total, "tensors": len(weight_map),
                      "seconds": round(time.perf_counter() - t0, 1)}))


if __name__ == "__main__":
    main()
