"""Model geometry for the decode-time model: what one token reads, in bytes.

Dimension letters as in the rest of ftjax: L layers, E experts, K top-k,
D model dim, F expert FFN dim. One routed expert is three matrices
(gate, up [D, F]; down [F, D]), so it holds 3 D F weights and one token through it
costs 2 * 3 D F flops. Everything that is not a routed expert (attention, router,
dense and shared-expert MLPs, the embedding row, the LM head) is summed into
`non_expert_bytes` read per token; the KV cache adds `kv_bytes_per_token` for each
token of context. `from_hf_config` estimates both from a Hugging Face config.json.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping


@dataclasses.dataclass(frozen=True)
class ModelGeometry:
    num_layers: int  # L, all decoder layers
    num_moe_layers: int  # layers with routed experts
    num_experts: int  # E per MoE layer
    top_k: int  # K
    d_model: int  # D
    d_ff: int  # F, one routed expert's FFN dim
    bytes_per_weight: float  # 2 for bf16, ~0.56 for 4.5-bit quantisation
    non_expert_bytes: float  # weights read per token outside routed experts
    kv_bytes_per_token: float = 0.0  # KV bytes per context token, all layers

    @property
    def expert_bytes(self) -> float:
        """S: bytes of one routed expert."""
        return 3 * self.d_model * self.d_ff * self.bytes_per_weight

    @property
    def expert_flops(self) -> float:
        """Flops of one token through one expert."""
        return 2 * 3 * self.d_model * self.d_ff

    @property
    def num_expert_slots_total(self) -> int:
        """L_moe * E: every (layer, expert) pair."""
        return self.num_moe_layers * self.num_experts

    def slots_that_fit(self, device_mem_gib: float, reserved_gib: float = 0.0) -> int:
        """Cache slots left on a device after non-expert weights and a reserve (KV, scratch)."""
        free = device_mem_gib * 2**30 - self.non_expert_bytes - reserved_gib * 2**30
        return max(0, min(int(free // self.expert_bytes), self.num_expert_slots_total))

    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any], bytes_per_weight: float = 2.0) -> "ModelGeometry":
        """Estimate the geometry of a Qwen-/Mixtral-/OLMoE-style MoE config.json.

        Non-expert bytes per token: attention projections, router, shared experts,
        dense-layer MLPs, the LM head and one embedding row.
        """
        d = cfg["hidden_size"]
        num_layers = cfg["num_hidden_layers"]
        experts = cfg.get("num_experts") or cfg.get("num_local_experts") or cfg["n_routed_experts"]
        top_k = cfg["num_experts_per_tok"]
        d_ff = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
        heads = cfg["num_attention_heads"]
        kv_heads = cfg.get("num_key_value_heads", heads)
        head_dim = cfg.get("head_dim") or d // heads
        dense = set(cfg.get("mlp_only_layers", []))
        dense |= set(range(cfg.get("first_k_dense_replace", 0)))
        step = cfg.get("decoder_sparse_step", 1) or 1
        moe_layers = [l for l in range(num_layers) if l not in dense and (l + 1) % step == 0]
        shared_f = cfg.get("shared_expert_intermediate_size", 0) or 0
        shared_f += (cfg.get("n_shared_experts", 0) or 0) * d_ff

        attention = d * head_dim * (2 * heads + 2 * kv_heads)  # q, o, k, v
        per_moe_layer = attention + d * experts + 3 * d * shared_f
        per_dense_layer = attention + 3 * d * cfg.get("intermediate_size", d_ff)
        head = cfg["vocab_size"] * d + d  # LM head + the embedding row
        weights = (
            len(moe_layers) * per_moe_layer
            + (num_layers - len(moe_layers)) * per_dense_layer
            + head
        )
        return cls(
            num_layers=num_layers,
            num_moe_layers=len(moe_layers),
            num_experts=experts,
            top_k=top_k,
            d_model=d,
            d_ff=d_ff,
            bytes_per_weight=bytes_per_weight,
            non_expert_bytes=weights * bytes_per_weight,
            kv_bytes_per_token=num_layers * 2 * kv_heads * head_dim * bytes_per_weight,
        )


# Qwen3-30B-A3B (public config.json): 48 layers, all MoE, 128 experts, top-8,
# D 2048, F 768, 32 q / 4 kv heads of 128, vocab 151936, untied LM head.
QWEN3_30B_A3B_CONFIG = {
    "hidden_size": 2048,
    "num_hidden_layers": 48,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 768,
    "intermediate_size": 6144,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "vocab_size": 151936,
}


def qwen3_30b_a3b(bytes_per_weight: float = 2.0) -> ModelGeometry:
    return ModelGeometry.from_hf_config(QWEN3_30B_A3B_CONFIG, bytes_per_weight)
