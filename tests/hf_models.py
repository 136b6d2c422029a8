"""Tiny random Hugging Face MoE checkpoints built offline with transformers (test-only).

Random init routes almost uniformly and tends to repeat one token, so weights are
drawn with a larger `initializer_range` and norm weights are perturbed: routing then
differs per token and greedy continuations are informative.
"""

from __future__ import annotations

import contextlib
import copy
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

BASE = dict(vocab_size=96, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=256, initializer_range=0.2, eos_token_id=None, bos_token_id=None,
            pad_token_id=None)

HYBRID = dict(num_hidden_layers=4, num_experts=6, moe_intermediate_size=16, num_experts_per_tok=2, head_dim=8,
              shared_expert_intermediate_size=24, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=8, linear_value_head_dim=6, linear_conv_kernel_dim=4)

FAMILY_CONFIGS = {
    "qwen3_moe": dict(num_experts=6, moe_intermediate_size=16, num_experts_per_tok=2, head_dim=8,
                      intermediate_size=40, norm_topk_prob=True, mlp_only_layers=[1]),
    "qwen2_moe": dict(num_experts=5, moe_intermediate_size=16, num_experts_per_tok=2, intermediate_size=40,
                      shared_expert_intermediate_size=24, decoder_sparse_step=1),
    "mixtral": dict(num_local_experts=4, intermediate_size=16, num_experts_per_tok=2),
    "olmoe": dict(num_experts=6, intermediate_size=16, num_experts_per_tok=3, clip_qkv=4.0),
    # Gated DeltaNet hybrids: layers 0-2 linear attention, layer 3 gated full attention
    "qwen3_next": dict(HYBRID, intermediate_size=40, mlp_only_layers=[1]),
    "qwen3_5_moe_text": dict(HYBRID),
    # DeepSeek-style routing: 8 experts in 2 groups, the best group eligible; a dense first layer
    "glm4_moe": dict(n_routed_experts=8, n_group=2, topk_group=1, num_experts_per_tok=3, moe_intermediate_size=16,
                     intermediate_size=40, n_shared_experts=1, first_k_dense_replace=1, head_dim=8,
                     partial_rotary_factor=0.5, use_qk_norm=True, attention_bias=True, routed_scaling_factor=1.5),
    # multi-head latent attention (q through a rank-12 bottleneck, a 16-wide latent), 4 groups of 2 experts
    "deepseek_v3": dict(num_key_value_heads=4, q_lora_rank=12, kv_lora_rank=16, qk_nope_head_dim=8,
                        qk_rope_head_dim=4, v_head_dim=6, n_routed_experts=8, n_group=4, topk_group=2,
                        num_experts_per_tok=3, moe_intermediate_size=16, intermediate_size=40, n_shared_experts=1,
                        first_k_dense_replace=1, routed_scaling_factor=2.5),
    # DeepSeek sparse attention (GLM-5): MLA as above, plus an indexer of 8 heads x 12 (4 of them rotated)
    # keeping the top 6 keys per query, so every prompt past 6 tokens drops keys
    "glm_moe_dsa": dict(num_key_value_heads=4, q_lora_rank=12, kv_lora_rank=16, qk_nope_head_dim=8,
                        qk_rope_head_dim=4, v_head_dim=6, n_routed_experts=8, n_group=4, topk_group=2,
                        num_experts_per_tok=3, moe_intermediate_size=16, intermediate_size=40, n_shared_experts=1,
                        first_k_dense_replace=1, routed_scaling_factor=2.5, index_n_heads=8, index_head_dim=12,
                        index_topk=6),
}


def build(model_type: str, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    kwargs = {**BASE, **FAMILY_CONFIGS[model_type], **overrides}
    cfg = AutoConfig.for_model(model_type, **kwargs)
    model = AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
        for name, b in model.named_buffers():  # DeepSeek-style routers: a non-zero selection bias, bf16-exact
            if name.endswith("e_score_correction_bias"):
                b.copy_((0.1 * torch.randn_like(b)).to(torch.bfloat16).float())
    return model


def save(model, path: Path, *, fused: bool = False, dtype=None, max_shard_size=None) -> Path:
    """save_pretrained (per-expert tensors) or the raw state_dict (fused experts)."""
    path = Path(path)
    if dtype is not None:
        model = copy.deepcopy(model).to(dtype)  # the caller's model keeps its f32 buffers
    if fused:
        from safetensors.torch import save_file
        path.mkdir(parents=True, exist_ok=True)
        model.config.save_pretrained(path)
        sd = {k: v.contiguous() for k, v in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            sd.pop("lm_head.weight", None)
        save_file(sd, str(path / "model.safetensors"))
    else:
        kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
        model.save_pretrained(path, **kw)
    return path


@contextlib.contextmanager
def stable_topk():
    """torch's topk with equal values kept lowest index first (a stable descending sort),
    the rule ftjax's DSA selection follows (`models.dsa.top_k_keep`); torch's own order
    among equal values is whatever its algorithm gives. Yields a list that collects, per
    call, whether the k-th value was tied with one left out (so a test can check that
    its reference met ties at all)."""
    original = torch.Tensor.topk
    ties: list[bool] = []

    def topk(self, k, dim=-1, largest=True, sorted=True):
        values, idx = torch.sort(self, dim=dim, descending=largest, stable=True)
        kept = values.narrow(dim, 0, k)
        if k < self.shape[dim]:
            kth, nxt = kept.narrow(dim, k - 1, 1), values.narrow(dim, k, 1)
            ties.append(bool(((kth == nxt) & torch.isfinite(kth)).any()))
        return torch.return_types.topk((kept, idx.narrow(dim, 0, k)))

    torch.Tensor.topk = topk
    try:
        yield ties
    finally:
        torch.Tensor.topk = original


def hf_logits(model, ids) -> "torch.Tensor":
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def hf_greedy(model, ids, n: int) -> list[int]:
    with torch.no_grad():
        # an explicit mask: without one, generate treats every token equal to pad_token_id as padding
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=n, do_sample=False, min_new_tokens=n, pad_token_id=0, eos_token_id=None)
    return out[0, len(ids):].tolist()


def bf16_rounded(model):
    """The model with its parameters rounded to bf16 (kept f32), buffers untouched: the
    exact reference for a bf16 checkpoint (`.to(bfloat16)` would also round RoPE's
    inv_freq buffer and shift every position > 0)."""
    rounded = copy.deepcopy(model)
    with torch.no_grad():
        for p in rounded.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    return rounded


def check_against(model, reference, prompt, tol=2e-4):
    """A loaded ftjax model against transformers' (logits of prompt, its greedy tokens):
    the logits, the greedy continuation, and each decode step's logits against the full
    forward (relative error <= tol)."""
    import numpy as np

    from test_parity import rel_err

    want_logits, want_tokens = reference
    assert rel_err(model.logits(prompt), want_logits) <= tol
    steps = []
    new = list(model.generate_stream(prompt, len(want_tokens), step_logits=steps))
    assert new == want_tokens
    assert rel_err(np.stack(steps), model.logits(prompt + new[:-1])[len(prompt) - 1:]) <= tol


def check_sessions(model, reference, prompt, tmp_path):
    """Sessions against transformers' (logits of prompt, greedy tokens): appending the
    prompt in two pieces gives its logits after each piece, and a snapshot (in memory and
    saved to disk) resumes with the same next 8 tokens."""
    import numpy as np

    from ftjax.engine.session import Snapshot

    ref_logits, ref_tokens = reference[0], reference[1][:8]
    tol = 2e-5 * np.abs(ref_logits).max()
    s = model.session()
    pieces = [prompt[:3], prompt[3:]]  # the second one's bucket is the prompt's: one compile less
    for i, piece in enumerate(pieces):
        end = sum(map(len, pieces[:i + 1]))
        np.testing.assert_allclose(s.append(piece), ref_logits[end - 1], atol=tol, rtol=0)
    snap = s.snapshot()
    assert s.generate(8) == ref_tokens
    for restored in (model.session(snap), model.session(Snapshot.load(snap.save(tmp_path / "s")))):
        assert restored.position == len(prompt) and restored.ids == prompt
        assert restored.generate(8) == ref_tokens
