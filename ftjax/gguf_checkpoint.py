"""GGUF checkpoints: `load_gguf(path) -> Checkpoint` (what `ftjax.load("model.gguf")`
runs) and `write_gguf(hf_dir, out_path, expert_type)` (an HF folder -> a GGUF that
llama.cpp itself can load; for tests and benchmarks).

Design
- The `gguf` package (llama.cpp's own Python library) reads and writes the file:
  `GGUFReader` parses the header and memory-maps the tensor data, `gguf.quants`
  (de)quantises, and the tensor-name and metadata-key tables (`gguf.TENSOR_NAMES`,
  `gguf.MODEL_TENSORS`, `gguf.Keys`) are llama.cpp's. Nothing here parses bytes.
- Architectures (llama.cpp name -> ftjax family): qwen3moe -> qwen3_moe, qwen2moe ->
  qwen2_moe, olmoe -> olmoe. llama.cpp's converter does not permute Q/K rows for these
  (only its LLaMA-style archs do), so attention weights are used as stored.
- Config: the metadata below becomes an HF-style config dict that goes through
  `ftjax.models.config_from_hf` + `config.validate` like any config.json (errors are a
  ConfigError naming the file):

      {arch}.block_count                    num_hidden_layers
      {arch}.embedding_length               hidden_size
      {arch}.attention.head_count[_kv]      num_attention_heads, num_key_value_heads
      {arch}.attention.key_length           head_dim (default hidden_size / heads)
      {arch}.expert_count / expert_used_count          num_experts, num_experts_per_tok
      {arch}.expert_feed_forward_length     moe_intermediate_size (olmoe: intermediate_size;
                                            it falls back to feed_forward_length)
      {arch}.feed_forward_length            intermediate_size (dense layers)
      {arch}.expert_shared_feed_forward_length         shared_expert_intermediate_size
      {arch}.rope.freq_base                 rope_theta (rope.scaling.type other than none: error)
      {arch}.attention.layer_norm_rms_epsilon          rms_norm_eps
      {arch}.context_length                 max_position_embeddings
      {arch}.attention.clamp_kqv            clip_qkv (olmoe)
      {arch}.expert_weights_norm            norm_topk_prob (absent: llama.cpp's behaviour,
                                            true for qwen3moe, false otherwise)
      token_embd rows                       vocab_size
      no output.weight                      tie_word_embeddings
      blk.N without ffn_gate_inp            N in mlp_only_layers (a dense MLP layer)
      blk.0.attn_q.bias present             qkv / attention bias
      tokenizer.ggml.bos/eos/eot/eom ids    bos_token_id, eos_token_id (+ control tokens
                                            llama.cpp also ends generation on, `EOG_TEXTS`)

- Tensors: a llama.cpp name (`blk.N.attn_q.weight`, matched against the arch's
  `gguf.MODEL_TENSORS` entries via `gguf.TENSOR_NAMES`) is translated to the HF name
  (`HF_NAMES`) and then classified by the folder loader's own table
  (`checkpoint.classify`), so GGUF and safetensors land on the same parameter paths.
  GGUF's numpy view of a matrix is [rows, cols] = HF's [out, in] (ggml's ne order
  reversed; a quantised type's last axis is bytes), so the folder loader's transpose
  rule applies unchanged. ffn_{gate,up,down}_shexp are the qwen2moe shared expert,
  ffn_gate_inp_shexp its gate; ffn_{gate,up,down} (dense layers) are read although
  llama.cpp's MoE archs do not load them.
- Experts (ffn_gate_exps / ffn_up_exps [E, F, D], ffn_down_exps [E, D, F], or the fused
  ffn_gate_up_exps [E, 2F, D]) go into the `HostExpertPool` as stored: Q8_0 / Q4_0 /
  Q4_K / Q6_K / MXFP4 bytes are copied into a pool of that block format (no float
  expansion: ftjax's q8_0 / q4_0 / q4_k / q6_k / mxfp4 *are* GGUF's blocks), BF16 into a
  bfloat16 pool, F32 / F16 into a float32 pool. The pool keeps one format per expert part:
  gate / up (or gate_up) in one, down in another, so a Q4_K_M file whose experts are Q4_K
  gate / up and Q6_K down loads as a 'q4_k/q6_k' pool. Within a part the layers may mix
  Q4_K and Q6_K, as llama.cpp's Q4_K_M does to ffn_down_exps (Q6_K on the first and last
  eighth of the layers and every third between, `use_more_bits`): neither format holds the
  other's blocks (Q4_K's per-sub-block min is off Q6_K's grid; only float32 holds both
  exactly, at 4 bytes a weight), so that part is stored as `q4_k_or_q6_k`, each block as
  stored behind a tag byte (212 bytes per 256 weights: a Q4_K layer pays Q6_K's width).
  Any other mix within a part, or another type (Q5_K, IQ*, ...), is a CheckpointError
  naming the tensors, their types and the llama-quantize command that makes a usable file
  (`--pure`). `expert_dtype=` must name the stored format, if given.
- Dense matrices in a block type the host kernels read (Q8_0, Q4_0, Q4_K, Q6_K, MXFP4:
  `DENSE_KEPT`) are kept as stored, as `models.ops.QuantMatrix` [out, row bytes] params,
  where `checkpoint.quantisable` allows (attention projections, dense and shared-expert
  MLPs, LM head): a Q8_0 file's decode then streams 1.06 bytes per dense weight, as
  llama.cpp does, instead of 4 (float32) or 2 (bf16). Other dense tensors (embedding,
  norms, router, ...) of any type `gguf.quants.dequantize` knows become float32 params
  ([in, out] where the folder loader transposes); when every one of those matrices is
  BF16 and dense_dtype allows (default for such files), they stay bf16 bits in the HF
  layout (packed), as for bf16 folders. An F32 matrix whose every value is a bf16 counts
  as BF16 (llama.cpp's converter writes a bf16 checkpoint's MoE router, ffn_gate_inp, as
  F32: widened, so its high halves are the bf16 bits, losslessly); one with any other
  value keeps the whole model in float32, as before. dense_dtype="float32" dequantises
  every matrix.
- Tokenizer: `tokenizer.ggml.model == "gpt2"` (byte-level BPE) is rebuilt as a
  `tokenizers.Tokenizer` from tokens / merges / token_type (CONTROL -> special added
  token, USER_DEFINED -> added token) with the pre-tokenizer of `tokenizer.ggml.pre`
  (`PRE_TOKENIZERS`: qwen2, olmo, gpt-2) and wrapped with the chat template(s) in
  `ftjax.tokenizer.Tokenizer`. No tokenizer metadata: no tokenizer (model.tokenizer is
  None, as for a folder without tokenizer.json); another tokenizer model or pre-tokenizer:
  a CheckpointError.
- Checks before anything is allocated: the file parses (a truncated or corrupt file is a
  CheckpointError naming it), every tensor lies inside the file, every name maps, every
  expected tensor is there once, every shape matches the config.

Dimension letters as in `ftjax.models.common`: V vocab, D model dim, F expert FFN dim,
E experts, L layers, Lm MoE layers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QType
from gguf import Keys
from gguf import MODEL_TENSOR as T

from ftjax.checkpoint import DENSE_BLOCK_FORMATS, Checkpoint, CheckpointError, classify, dense_formats, expected_param_shapes, hf_name, \
    load_checkpoint, model_config, quantisable
from ftjax.config import ConfigError, ModelConfig
from ftjax.experts.pool import HostExpertPool, fill_rows
from ftjax.experts.storage import (BLOCK_FORMATS, FORMATS, QUANTISED_ALIASES, canonical_dtype, part_formats,
                                   pool_format, tagged_k_blocks)
from ftjax.models.ops import QuantMatrix

# llama.cpp architecture -> ftjax model_type
ARCHS = {"qwen3moe": "qwen3_moe", "qwen2moe": "qwen2_moe", "olmoe": "olmoe"}
# what llama.cpp does when {arch}.expert_weights_norm is absent
NORM_TOPK_DEFAULT = {"qwen3moe": True, "qwen2moe": False, "olmoe": False}

# llama.cpp tensor -> HF name (without .weight / .bias); experts are handled apart
_B = "model.layers.{bid}."
HF_NAMES: dict[T, str] = {
    T.TOKEN_EMBD: "model.embed_tokens", T.OUTPUT_NORM: "model.norm", T.OUTPUT: "lm_head",
    T.ATTN_NORM: _B + "input_layernorm", T.FFN_NORM: _B + "post_attention_layernorm",
    T.ATTN_Q: _B + "self_attn.q_proj", T.ATTN_K: _B + "self_attn.k_proj", T.ATTN_V: _B + "self_attn.v_proj",
    T.ATTN_OUT: _B + "self_attn.o_proj", T.ATTN_Q_NORM: _B + "self_attn.q_norm", T.ATTN_K_NORM: _B + "self_attn.k_norm",
    T.FFN_GATE_INP: _B + "mlp.gate",
    T.FFN_GATE: _B + "mlp.gate_proj", T.FFN_UP: _B + "mlp.up_proj", T.FFN_DOWN: _B + "mlp.down_proj",
    T.FFN_GATE_SHEXP: _B + "mlp.shared_expert.gate_proj", T.FFN_UP_SHEXP: _B + "mlp.shared_expert.up_proj",
    T.FFN_DOWN_SHEXP: _B + "mlp.shared_expert.down_proj", T.FFN_GATE_INP_SHEXP: _B + "mlp.shared_expert_gate",
}
EXPERT_PARTS: dict[T, str] = {T.FFN_GATE_EXP: "gate", T.FFN_UP_EXP: "up", T.FFN_DOWN_EXP: "down",
                              T.FFN_GATE_UP_EXP: "gate_up"}
DENSE_MLP = (T.FFN_GATE, T.FFN_UP, T.FFN_DOWN)  # mlp_only layers: not in llama.cpp's MoE arch lists

# GGUF expert type -> pool format (experts are kept as stored)
EXPERT_FORMATS = {"Q8_0": "q8_0", "Q4_0": "q4_0", "Q4_K": "q4_k", "Q6_K": "q6_k", "MXFP4": "mxfp4",
                  "BF16": "bfloat16", "F32": "float32", "F16": "float32"}
WRITE_DENSE_TYPES = ("F32", "F16", "BF16", "Q8_0")
# dense matrices of these types stay as stored (QuantMatrix): the block formats of EXPERT_FORMATS
DENSE_KEPT = {t: f for t, f in EXPERT_FORMATS.items() if f in DENSE_BLOCK_FORMATS}
TAGGED_K = ("q4_k", "q6_k")  # a part whose layers mix these is stored as storage's q4_k_or_q6_k

# tokenizer.ggml.pre -> the Split regex before ByteLevel (None: ByteLevel's own GPT-2 regex)
QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS: dict[str, str | None] = {"qwen2": QWEN2_REGEX, "olmo": None, "gpt-2": None}
# control tokens llama.cpp ends generation on besides eos / eot / eom (llama-vocab.cpp)
EOG_TEXTS = frozenset({"<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>",
                       "<|return|>", "<|call|>", "<EOT>"})
FINGERPRINT_EDGE = 1 << 16  # bytes of tensor data hashed at each end


@dataclass
class GGUFCheckpoint(Checkpoint):
    """A Checkpoint read from one .gguf file, with what only the file carries."""

    tokenizer: Any = None  # ftjax.tokenizer.Tokenizer or None
    header_bytes: int = 0  # offset of the tensor data: header, metadata and tensor infos


# ---- reading: file, names, config ------------------------------------------------------------

def open_gguf(path: Path) -> gguf.GGUFReader:
    """Parse the file with the gguf package; a truncated or corrupt file is a CheckpointError
    naming it, and so is a tensor whose bytes would lie past the end of the file."""
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # the reader raises ValueError, IndexError, KeyError, struct.error ...
        raise CheckpointError(f"{path}: not a readable GGUF file (truncated or corrupt?): "
                              f"{type(e).__name__}: {e}") from None
    size = path.stat().st_size
    for t in reader.tensors:
        if int(t.data_offset) + int(t.n_bytes) > size:
            raise CheckpointError(f"{path}: truncated: tensor {t.name} ends at byte {int(t.data_offset) + int(t.n_bytes)} "
                                  f"of a {size}-byte file")
    if reader.endianess != gguf.GGUFEndian.LITTLE:
        raise CheckpointError(f"{path}: a big-endian GGUF; ftjax reads little-endian files")
    return reader


def metadata(reader: gguf.GGUFReader) -> Callable[..., Any]:
    """get(key, default=REQUIRED): the value of one metadata key, decoded by the gguf package."""
    missing = object()

    def get(key: str, default: Any = missing) -> Any:
        field = reader.get_field(key)
        if field is None:
            if default is missing:
                raise ConfigError(f"{reader.data.filename}: no metadata key {key}")
            return default
        return field.contents()

    return get


def name_table(arch: str) -> list[tuple[re.Pattern, T]]:
    """(regex over a GGUF tensor name, llama.cpp tensor) for every tensor ftjax reads of `arch`."""
    arch_enum = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)
    known = [t for t in (*gguf.MODEL_TENSORS[arch_enum], *DENSE_MLP, T.FFN_GATE_UP_EXP)
             if t in HF_NAMES or t in EXPERT_PARTS]
    table = []
    for t in dict.fromkeys(known):
        stem = re.escape(gguf.TENSOR_NAMES[t]).replace(r"\{bid\}", r"(?P<bid>\d+)")
        table.append((re.compile(stem + r"\.(?P<kind>weight|bias)"), t))
    return table


def parse_name(name: str, table) -> tuple[T, int, str] | None:
    """blk.3.attn_q.weight -> (ATTN_Q, 3, "weight"); bid -1 for tensors outside blocks."""
    for pattern, t in table:
        m = pattern.fullmatch(name)
        if m:
            return t, int(m.groupdict().get("bid") or -1), m["kind"]
    return None


def to_float(v: Any) -> float:
    """A float32 metadata value as the decimal it was written from (1e-06, not 9.99e-07)."""
    return float(str(np.float32(v)))


def scalar(get, key: str, *default: Any) -> Any:
    """A per-model value (required unless a default is given); a per-layer array is
    accepted only when every layer agrees."""
    v = get(key, *default)
    if isinstance(v, list):
        if len(set(v)) != 1:
            raise ConfigError(f"{key} differs per layer ({v}); ftjax needs one value for every layer")
        v = v[0]
    return v


def hf_config(arch: str, get, names: dict[str, tuple[T, int, str]], shapes: dict[str, tuple[int, ...]]) -> dict:
    """The GGUF metadata as an HF config.json dict for `config_from_hf` (table in the module doc)."""
    k = lambda key: key.format(arch=arch)  # noqa: E731
    L = int(scalar(get, k(Keys.LLM.BLOCK_COUNT)))
    if "token_embd.weight" not in shapes:
        raise ConfigError("missing tensor token_embd.weight")
    vocab, d_model = shapes["token_embd.weight"]
    heads = int(scalar(get, k(Keys.Attention.HEAD_COUNT)))
    expert_ff = scalar(get, k(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH), None)
    dense_ff = scalar(get, k(Keys.LLM.FEED_FORWARD_LENGTH), None)
    moe_blocks = {bid for t, bid, _ in names.values() if t == T.FFN_GATE_INP}
    bias = any(t == T.ATTN_Q and kind == "bias" for t, _, kind in names.values())
    rope_scaling = get(k(Keys.Rope.SCALING_TYPE), "none")
    if rope_scaling not in ("none", None):
        raise ConfigError(f"{k(Keys.Rope.SCALING_TYPE)} {rope_scaling!r} is not supported for {arch} (only plain RoPE)")
    clip = get(k(Keys.Attention.CLAMP_KQV), None)
    eos = eos_ids(get)
    hf = {
        "model_type": ARCHS[arch],
        "vocab_size": vocab,
        "hidden_size": int(scalar(get, k(Keys.LLM.EMBEDDING_LENGTH))),
        "num_hidden_layers": L,
        "num_attention_heads": heads,
        "num_key_value_heads": int(scalar(get, k(Keys.Attention.HEAD_COUNT_KV), heads)),
        "head_dim": scalar(get, k(Keys.Attention.KEY_LENGTH), None),
        "num_experts": int(scalar(get, k(Keys.LLM.EXPERT_COUNT))),
        "num_experts_per_tok": int(scalar(get, k(Keys.LLM.EXPERT_USED_COUNT))),
        "norm_topk_prob": bool(get(k(Keys.LLM.EXPERT_WEIGHTS_NORM), NORM_TOPK_DEFAULT[arch])),
        "rope_theta": to_float(get(k(Keys.Rope.FREQ_BASE), 10000.0)),
        "rms_norm_eps": to_float(get(k(Keys.Attention.LAYERNORM_RMS_EPS), 1e-6)),
        "max_position_embeddings": int(get(k(Keys.LLM.CONTEXT_LENGTH), 4096)),
        "tie_word_embeddings": "output.weight" not in names,
        "mlp_only_layers": [i for i in range(L) if i not in moe_blocks],
        "decoder_sparse_step": 1,
        "attention_bias": bias,
        "qkv_bias": bias,
        "use_sliding_window": False,
        "hidden_act": "silu",
        "bos_token_id": get(Keys.Tokenizer.BOS_ID, None),
        "eos_token_id": eos or None,
    }
    if d_model != hf["hidden_size"]:
        raise ConfigError(f"token_embd.weight is [{vocab}, {d_model}] but {k(Keys.LLM.EMBEDDING_LENGTH)} "
                          f"is {hf['hidden_size']}")
    if arch == "olmoe":
        hf["intermediate_size"] = int(expert_ff if expert_ff is not None else dense_ff)
        hf["clip_qkv"] = to_float(clip) if clip else None
    else:
        if expert_ff is None:
            raise ConfigError(f"no metadata key {k(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH)}")
        hf["moe_intermediate_size"] = int(expert_ff)
        hf["intermediate_size"] = int(dense_ff or 0)
        hf["shared_expert_intermediate_size"] = int(scalar(get, k(Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH), 0))
    return hf


def eos_ids(get) -> list[int]:
    """eos / eot / eom ids, then the control tokens llama.cpp also stops on (`EOG_TEXTS`)."""
    ids = [get(key, None) for key in (Keys.Tokenizer.EOS_ID, Keys.Tokenizer.EOT_ID, Keys.Tokenizer.EOM_ID)]
    tokens, types = get(Keys.Tokenizer.LIST, None), get(Keys.Tokenizer.TOKEN_TYPE, None)
    if tokens is not None and types is not None:
        ids += [i for i, (tok, typ) in enumerate(zip(tokens, types))
                if typ == gguf.TokenType.CONTROL and tok in EOG_TEXTS]
    return list(dict.fromkeys(int(i) for i in ids if i is not None))


# ---- reading: tensors ------------------------------------------------------------------------------

def logical_shape(t) -> tuple[int, ...]:
    """A tensor's shape in numpy order in weights (ggml's ne reversed; not bytes)."""
    return tuple(int(n) for n in reversed(t.shape))


def dense_f32(t, path: Path) -> np.ndarray:
    """Any type the gguf package can dequantise -> float32 in numpy order [rows, cols]."""
    try:
        return np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32).reshape(logical_shape(t))
    except (NotImplementedError, ValueError) as e:
        raise CheckpointError(f"{path}: tensor {t.name} is {t.tensor_type.name}, which the gguf package cannot "
                              f"dequantise ({e})") from None


def expert_storage(t, pool_dtype: str) -> np.ndarray:
    """An expert tensor in the pool's storage, as stored: block bytes (q4_k_or_q6_k: each
    Q4_K / Q6_K block behind its tag), bf16 bits or float32."""
    if pool_dtype == "q4_k_or_q6_k":
        return tagged_k_blocks(t.data, EXPERT_FORMATS[t.tensor_type.name])
    if pool_dtype in BLOCK_FORMATS:
        return t.data  # uint8 [E, rows, bytes(row)]: GGUF's blocks are the pool's
    if pool_dtype == "bfloat16":
        return t.data.view(np.uint16)  # uint8 [..., 2n] little-endian -> bf16 bits [..., n]
    return np.asarray(t.data, np.float32)


def expert_format(path: Path, expert_refs: list) -> str:
    """The pool format of the expert tensors [(tensor, moe layer, part)]: one format per part
    (gate / up / gate_up, and down; `storage.pool_format`: 'q4_k/q6_k' when they differ),
    or a CheckpointError naming the tensor and saying how to get a file ftjax reads."""
    fix = ("re-quantise with `llama-quantize --pure IN.gguf OUT.gguf Q4_K` (or Q8_0, Q4_0, Q6_K), which gives every "
           "tensor one type")
    for t, _, _ in expert_refs:
        if t.tensor_type.name not in EXPERT_FORMATS:
            raise CheckpointError(f"{path}: {t.name} is {t.tensor_type.name}: ftjax keeps GGUF experts as stored, "
                                  f"as {', '.join(EXPERT_FORMATS)}; {fix}")
    first: dict[str, dict[str, Any]] = {"gate_up": {}, "down": {}}  # part -> pool format -> its first tensor
    for t, _, part in expert_refs:
        first["down" if part == "down" else "gate_up"].setdefault(EXPERT_FORMATS[t.tensor_type.name], t)
    names: dict[str, str | None] = {}
    for part, formats in first.items():
        if set(formats) == set(TAGGED_K):  # layers mix Q4_K and Q6_K (llama.cpp's Q4_K_M ffn_down_exps)
            names[part] = "q4_k_or_q6_k"
        elif len(formats) > 1:
            a, b = list(formats.values())[:2]
            raise CheckpointError(
                f"{path}: {a.name} is {a.tensor_type.name} but {b.name} is {b.tensor_type.name}: ftjax stores each "
                f"expert part (gate/up, down) of every layer in one format (the two parts may differ; layers of "
                f"Q4_K and Q6_K share a tagged one) and re-encodes nothing; {fix}")
        else:
            names[part] = next(iter(formats), None)
    return pool_format(names["gate_up"] or names["down"] or "float32", names["down"] or names["gate_up"] or "float32")


def load_gguf(path: str | Path, expert_dtype: str | None = None, dense_dtype: str | None = None,
              experts=None) -> GGUFCheckpoint:
    """Read and check a GGUF checkpoint (see the module docstring).

    expert_dtype: None, or the format the experts are stored in ("int8" / "q8_0" for Q8_0,
    "int4" / "q4_0", "q4_k", "q6_k", "mxfp4", "bfloat16", "float32" for F32 / F16; "q4_k/q6_k"
    for Q4_K gate / up and Q6_K down): GGUF experts are never converted.
    dense_dtype: None / "bfloat16" (keep BF16 matrices as bf16 bits, block-type ones as
    stored) or "float32" (dequantise every matrix to float32). experts: as
    `checkpoint.load_checkpoint`'s (the experts this process reads; None: all)."""
    if dense_dtype not in (None, "bfloat16", "float32"):
        raise ValueError(f"dense_dtype must be 'bfloat16' or 'float32', got {dense_dtype!r}")
    wanted = (canonical_dtype("/".join(QUANTISED_ALIASES.get(n, n) for n in expert_dtype.split("/")))
              if expert_dtype is not None else None)
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: GGUF file not found")
    reader = open_gguf(path)
    get = metadata(reader)
    arch = get(Keys.General.ARCHITECTURE, None)
    if arch not in ARCHS:
        raise CheckpointError(f"{path}: architecture {arch!r} is not supported (ftjax reads GGUF "
                              f"{', '.join(ARCHS)})")
    table = name_table(arch)
    tensors = {}
    names: dict[str, tuple[T, int, str]] = {}
    for t in reader.tensors:
        parsed = parse_name(t.name, table)
        if parsed is None:
            raise CheckpointError(f"{path}: unexpected tensor {t.name} (not part of a {arch} model ftjax reads)")
        if t.name in tensors:
            raise CheckpointError(f"{path}: tensor {t.name} appears twice")
        tensors[t.name], names[t.name] = t, parsed
    shapes_in_file = {name: logical_shape(t) for name, t in tensors.items()}
    try:
        hf = hf_config(arch, get, names, shapes_in_file)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}" if str(path) not in str(e) else str(e)) from None
    cfg = model_config(hf, path)
    try:
        shapes = expected_param_shapes(cfg)
    except (TypeError, ValueError, OverflowError) as e:  # sizes the model cannot even describe
        raise ConfigError(f"{path}: the model its metadata describes cannot be built ({type(e).__name__}: {e})") from None
    param_refs, expert_refs = plan(path, cfg, shapes, tensors, names)

    pool_dtype = expert_format(path, expert_refs)
    if wanted is not None and wanted != pool_dtype:
        raise CheckpointError(f"{path}: expert_dtype {expert_dtype!r} does not match the experts stored in the file "
                              f"({pool_dtype}); GGUF experts are used as stored, leave expert_dtype unset")
    kept = {p for p, (t, target) in param_refs.items()  # dense matrices kept in their block type
            if dense_dtype != "float32" and t.tensor_type.name in DENSE_KEPT and quantisable(p, target)}
    matrices = [t for p, (t, target) in param_refs.items() if packs(target) and p not in kept]
    bf16_file = all(t.tensor_type == QType.BF16 or widened_bf16(t) for t in matrices)
    packed = bf16_file and (dense_dtype or "bfloat16") == "bfloat16"
    stored = {t.tensor_type.name for t in reader.tensors if len(t.shape) >= 2}
    ckpt_dtype = "bfloat16" if stored == {"BF16"} else ("float16" if "F16" in stored else "float32")

    Lm, E, D, F = cfg.num_moe_layers, cfg.num_experts, cfg.d_model, cfg.d_ff_expert
    pool = HostExpertPool.allocate(Lm, E, D, F, pool_dtype)
    fmts = part_formats(pool_dtype)
    mask = None if experts is None else np.asarray(experts(E), bool)  # as `load_checkpoint`'s
    for t, m, part in expert_refs:
        data = expert_storage(t, fmts["down" if part == "down" else "gate_up"].name)  # [E, ...], as stored
        dst = {"gate": pool.gate_up[m, :, :F], "up": pool.gate_up[m, :, F:], "gate_up": pool.gate_up[m]}.get(
            part, pool.down[m])
        fill_rows(dst, data, mask)
    pool.freeze()
    params: dict[str, np.ndarray] = {}
    for p, (t, target) in param_refs.items():
        want = expected_shape(shapes, p, target)
        if p in kept:  # block rows [out, row bytes] as stored: a copy, not the file
            params[p] = QuantMatrix(np.array(t.data).reshape(want[0], -1), DENSE_KEPT[t.tensor_type.name])
        elif packed and packs(target):  # bf16 bits [out, in]: a copy
            params[p] = bf16_bits(t).reshape(want)
        else:
            arr = dense_f32(t, path).reshape(want)
            params[p] = np.ascontiguousarray(arr.T if target[2] else arr)
    tokenizer = gguf_tokenizer(reader, path)
    return GGUFCheckpoint(cfg, params, pool, ckpt_dtype, path, "bfloat16" if packed else "float32",
                          dense_formats(params), mask, tokenizer=tokenizer,
                          header_bytes=int(reader.data_offset))


def widened_bf16(t) -> bool:
    """Whether tensor t is F32 holding bf16 values only (every low half zero)."""
    return t.tensor_type == QType.F32 and not (np.asarray(t.data).view(np.uint32) & 0xFFFF).any()


def bf16_bits(t) -> np.ndarray:
    """A BF16 tensor's bits, or a `widened_bf16` F32 tensor's high halves, as a uint16 copy."""
    if t.tensor_type == QType.F32:
        return (np.asarray(t.data).view(np.uint32) >> 16).astype(np.uint16)
    return np.array(t.data.view(np.uint16))


def packs(target: tuple) -> bool:
    """Whether a param target is a matrix kept as bf16 bits when packing (the folder rule:
    every transposed Linear weight, and the embedding)."""
    return target[2] or target[1] == "embed"


def expected_shape(shapes: dict, p: str, target: tuple) -> tuple[int, ...]:
    """Shape of a param in the file's (= HF's) layout: [out, in] for transposed targets."""
    return shapes[p][::-1] if target[2] else shapes[p]


def plan(path: Path, cfg: ModelConfig, shapes: dict, tensors: dict, names: dict):
    """Every tensor mapped and shape-checked, every expected one found, before any is read.
    shapes: `expected_param_shapes(cfg)`. -> ({param path: (tensor, target)},
    [(tensor, moe layer, part)])."""
    E, D, F = cfg.num_experts, cfg.d_model, cfg.d_ff_expert
    expert_want = {"gate": (E, F, D), "up": (E, F, D), "down": (E, D, F), "gate_up": (E, 2 * F, D)}
    param_refs: dict[str, tuple[Any, tuple]] = {}
    expert_refs: list[tuple[Any, int, str]] = []
    for name, t in sorted(tensors.items()):
        kind_t, bid, kind = names[name]
        if bid >= cfg.num_layers:
            raise CheckpointError(f"{path}: tensor {name} is for block {bid}, but the file has {cfg.num_layers} blocks")
        shape = logical_shape(t)
        if kind_t in EXPERT_PARTS:
            if not cfg.moe_layers[bid]:
                raise CheckpointError(f"{path}: tensor {name}: block {bid} has no ffn_gate_inp (router)")
            part = EXPERT_PARTS[kind_t]
            if shape != expert_want[part]:
                raise CheckpointError(f"{path}: tensor {name} has shape {list(shape)}, expected {list(expert_want[part])}")
            expert_refs.append((t, cfg.moe_index(bid), part))
            continue
        hit = classify(HF_NAMES[kind_t].format(bid=bid) + "." + kind)
        target, groups = hit
        p = target[1].format(**groups)
        if p not in shapes and cfg.shared_expert_d_ff == 0 and re.search(r"\.moe\.(shared\.|w_shared_gate)", p):
            continue  # a zero-width shared expert contributes nothing
        if p not in shapes:
            raise CheckpointError(f"{path}: unexpected tensor {name} (the config has no {p})")
        want = expected_shape(shapes, p, target)
        if tuple(n for n in shape if n != 1) != tuple(n for n in want if n != 1):
            raise CheckpointError(f"{path}: tensor {name} has shape {list(shape)}, expected {list(want)}")
        param_refs[p] = (t, target)
    missing = [gguf_name(hf_name(p)) for p in shapes if p not in param_refs]
    if missing:
        raise CheckpointError(f"{path}: missing tensors {', '.join(missing[:8])}"
                              + (f" ... ({len(missing)} in all)" if len(missing) > 8 else ""))
    seen = {(m, part) for _, m, part in expert_refs}
    for m, bid in enumerate(cfg.moe_layer_ids):
        parts = {part for mm, part in seen if mm == m}
        if parts not in ({"gate", "up", "down"}, {"gate_up", "down"}):
            need = "ffn_gate_exps, ffn_up_exps and ffn_down_exps (or ffn_gate_up_exps and ffn_down_exps)"
            raise CheckpointError(f"{path}: block {bid} has expert tensors {sorted(parts)}; needs {need}")
    if len(expert_refs) != len(seen):
        raise CheckpointError(f"{path}: an expert tensor appears twice")
    return param_refs, expert_refs


# ---- tokenizer ---------------------------------------------------------------------------------------

def gguf_tokenizer(reader: gguf.GGUFReader, path: Path):
    """`ftjax.tokenizer.Tokenizer` from the tokenizer.ggml.* metadata; None without any
    (or with llama.cpp's "none" model: a file converted from a folder without a tokenizer)."""
    import tokenizers
    from tokenizers import AddedToken, decoders, pre_tokenizers, processors

    from ftjax.tokenizer import Tokenizer

    get = metadata(reader)
    model = get(Keys.Tokenizer.MODEL, None)
    if model in (None, "none"):
        return None
    if model != "gpt2":
        raise CheckpointError(f"{path}: tokenizer.ggml.model {model!r} is not supported: ftjax rebuilds byte-level "
                              f"BPE ('gpt2') tokenizers from GGUF")
    pre = get(Keys.Tokenizer.PRE, None)
    if pre not in PRE_TOKENIZERS:
        raise CheckpointError(f"{path}: tokenizer.ggml.pre {pre!r} is not supported "
                              f"(known: {', '.join(PRE_TOKENIZERS)})")
    tokens = get(Keys.Tokenizer.LIST)
    types = get(Keys.Tokenizer.TOKEN_TYPE, None) or [gguf.TokenType.NORMAL] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in get(Keys.Tokenizer.MERGES, [])]
    if len(types) != len(tokens) or any(len(m) != 2 for m in merges):
        raise CheckpointError(f"{path}: malformed tokenizer metadata (token_type / merges)")
    vocab = {tok: i for i, tok in reversed(list(enumerate(tokens)))}  # the first id of a repeated token
    backend = tokenizers.Tokenizer(tokenizers.models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
    regex = PRE_TOKENIZERS[pre]
    if regex is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(tokenizers.Regex(regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    # every token sits in the BPE vocab at its id; added ones are also matched whole in text
    added = [(i, tok, typ) for i, (tok, typ) in enumerate(zip(tokens, types))
             if typ in (gguf.TokenType.CONTROL, gguf.TokenType.USER_DEFINED)]
    for i, tok, typ in added:
        special = typ == gguf.TokenType.CONTROL
        token = AddedToken(tok, special=special, normalized=False)
        (backend.add_special_tokens if special else backend.add_tokens)([token])
    named = {"bos_token": Keys.Tokenizer.BOS_ID, "eos_token": Keys.Tokenizer.EOS_ID,
             "pad_token": Keys.Tokenizer.PAD_ID, "unk_token": Keys.Tokenizer.UNK_ID}
    config = {attr: tokens[i] for attr, key in named.items()
              if (i := get(key, None)) is not None and 0 <= i < len(tokens)}
    templates = {}
    if (default := get(Keys.Tokenizer.CHAT_TEMPLATE, None)) is not None:
        templates["default"] = default
    for name in get(Keys.Tokenizer.CHAT_TEMPLATES, []) or []:
        templates[name] = get(Keys.Tokenizer.CHAT_TEMPLATE_N.format(name=name))
    return Tokenizer(backend, config, templates, eos_ids(get), name=str(path))


def update_fingerprint(h, ckpt: GGUFCheckpoint) -> None:
    """Identity of the file for snapshots: its name and size, the whole header (metadata and
    tensor infos) and the first and last 64 KiB of tensor data."""
    size = ckpt.path.stat().st_size
    h.update(f"{ckpt.path.name}:{size}".encode())
    with open(ckpt.path, "rb") as f:
        h.update(f.read(ckpt.header_bytes + FINGERPRINT_EDGE))
        f.seek(max(ckpt.header_bytes, size - FINGERPRINT_EDGE))
        h.update(f.read())


# ---- writing -------------------------------------------------------------------------------------------

_HF_TO_GGUF = [(re.compile(re.escape(hf).replace(r"\{bid\}", r"(?P<bid>\d+)") + r"\.(?P<kind>weight|bias)"), t)
               for t, hf in HF_NAMES.items()]


def gguf_name(hf: str) -> str:
    """HF tensor name -> llama.cpp's (model.layers.3.self_attn.q_proj.weight -> blk.3.attn_q.weight)."""
    for pattern, t in _HF_TO_GGUF:
        m = pattern.fullmatch(hf)
        if m:
            return gguf.TENSOR_NAMES[t].format(bid=m.groupdict().get("bid")) + "." + m["kind"]
    return hf


def add_tensor(w: gguf.GGUFWriter, name: str, a: np.ndarray, qtype: str) -> None:
    """float32 [..., n] (numpy order, HF layout) -> tensor `name` of type qtype: a block type
    quantised by its pool format's quantiser (gguf's for Q8_0 / Q4_0 / MXFP4; Q4_K and Q6_K,
    which the gguf package cannot quantise, by `storage.quantise_q4_k` / `quantise_q6_k`), any
    other type by gguf's."""
    q = QType[qtype]
    a = np.ascontiguousarray(a, np.float32)
    fmt = EXPERT_FORMATS.get(qtype)
    data = FORMATS[fmt].from_f32_numpy(a) if fmt in BLOCK_FORMATS else gguf.quants.quantize(a, q)
    w.add_tensor(name, data, raw_dtype=q)


def write_gguf(hf_dir: str | Path, out_path: str | Path, expert_type: str = "Q8_0",
               dense_type: str | None = None, down_type: str | None = None) -> Path:
    """Write an HF checkpoint folder of a supported family as a GGUF with llama.cpp's
    metadata keys and tensor names, and its tokenizer when the folder has tokenizer.json.

    expert_type: Q8_0 | Q4_0 | Q4_K | Q6_K | MXFP4 | BF16 | F16 | F32 (the pool formats'
    quantisers, so the block types equal ftjax's int8 / int4 / q4_k / q6_k / mxfp4 pools of
    the same weights byte for byte); down_type: the type of ffn_down_exps (default:
    expert_type; Q4_K with down_type Q6_K is the expert part of llama.cpp's Q4_K_M);
    dense_type: the type of the dense matrices (F32 | F16 | BF16 | Q8_0; default BF16 for a
    bf16 folder, else F32); 1-D tensors (norms, biases) are always F32, as llama.cpp writes
    them. The whole model is held in memory while writing (meant for tests and benchmarks)."""
    hf_dir, out_path = Path(hf_dir), Path(out_path)
    expert_type = expert_type.upper()
    down_type = (down_type or expert_type).upper()
    for what, qtype in (("expert_type", expert_type), ("down_type", down_type)):
        if qtype not in EXPERT_FORMATS:
            raise ValueError(f"{what} must be one of {', '.join(EXPERT_FORMATS)}, got {qtype!r}")
    ckpt = load_checkpoint(hf_dir, expert_dtype="float32", dense_dtype="float32")
    cfg = ckpt.config
    dense_type = (dense_type or ("BF16" if ckpt.dtype == "bfloat16" else "F32")).upper()
    if dense_type not in WRITE_DENSE_TYPES:
        raise ValueError(f"dense_type must be one of {', '.join(WRITE_DENSE_TYPES)}, got {dense_type!r}")
    arch = next((a for a, mt in ARCHS.items() if mt == cfg.model_type), None)
    if arch is None:
        raise CheckpointError(f"{hf_dir}: model_type {cfg.model_type!r} has no GGUF architecture ftjax writes "
                              f"({', '.join(ARCHS.values())})")
    if any(cfg.sliding_windows) or cfg.rope_scaling is not None:
        raise CheckpointError(f"{hf_dir}: sliding-window attention and rope scaling are not written to GGUF")
    tokenizer = None
    if (hf_dir / "tokenizer.json").is_file():
        from ftjax.tokenizer import Tokenizer
        tokenizer = Tokenizer.from_dir(hf_dir)

    w = gguf.GGUFWriter(out_path, arch)
    write_metadata(w, cfg, arch, hf_dir.name, expert_type, down_type)
    if tokenizer is not None:
        write_tokenizer(w, tokenizer, cfg, arch, hf_dir)
    for p, arr in sorted(ckpt.params.items()):
        (target, _) = classify(hf_name(p))
        data = arr.T if target[2] else arr  # HF layout [out, in]
        add_tensor(w, gguf_name(hf_name(p)), data, dense_type if data.ndim == 2 else "F32")
    F = cfg.d_ff_expert
    for m, bid in enumerate(cfg.moe_layer_ids):
        gate_up, down = ckpt.pool.gate_up[m], ckpt.pool.down[m]  # [E, 2F, D], [E, D, F] float32
        for t, a in ((T.FFN_GATE_EXP, gate_up[:, :F]), (T.FFN_UP_EXP, gate_up[:, F:]), (T.FFN_DOWN_EXP, down)):
            add_tensor(w, gguf.TENSOR_NAMES[t].format(bid=bid) + ".weight", a,
                       down_type if t == T.FFN_DOWN_EXP else expert_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out_path


def write_metadata(w: gguf.GGUFWriter, cfg: ModelConfig, arch: str, name: str, expert_type: str,
                   down_type: str | None = None) -> None:
    """The hyperparameters under llama.cpp's keys (the inverse of `hf_config`)."""
    file_types = {"Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
                  "Q4_K": gguf.LlamaFileType.MOSTLY_Q4_K_S, "Q4_K/Q6_K": gguf.LlamaFileType.MOSTLY_Q4_K_M,
                  "Q6_K": gguf.LlamaFileType.MOSTLY_Q6_K, "MXFP4": gguf.LlamaFileType.MOSTLY_MXFP4_MOE,
                  "BF16": gguf.LlamaFileType.MOSTLY_BF16, "F16": gguf.LlamaFileType.MOSTLY_F16,
                  "F32": gguf.LlamaFileType.ALL_F32}
    w.add_name(name)
    w.add_block_count(cfg.num_layers)
    w.add_context_length(cfg.max_position)
    w.add_embedding_length(cfg.d_model)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_expert_count(cfg.num_experts)
    w.add_expert_used_count(cfg.top_k)
    w.add_expert_weights_norm(cfg.norm_topk_prob)
    if arch == "olmoe":
        w.add_feed_forward_length(cfg.d_ff_expert)  # OLMoE's intermediate_size is the expert width
    else:
        w.add_expert_feed_forward_length(cfg.d_ff_expert)
        if cfg.d_ff:
            w.add_feed_forward_length(cfg.d_ff)
        if cfg.shared_expert_d_ff:
            w.add_expert_shared_feed_forward_length(cfg.shared_expert_d_ff)
    if cfg.clip_qkv is not None:
        w.add_clamp_kqv(cfg.clip_qkv)
    key = expert_type if down_type in (None, expert_type) else f"{expert_type}/{down_type}"
    if key in file_types:  # a mix llama.cpp names no file type for is written without one
        w.add_file_type(file_types[key])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)


def write_tokenizer(w: gguf.GGUFWriter, tok, cfg: ModelConfig, arch: str, hf_dir: Path) -> None:
    """A byte-level BPE tokenizer.json as tokenizer.ggml.* (the inverse of `gguf_tokenizer`)."""
    import json

    spec = json.loads((hf_dir / "tokenizer.json").read_text(encoding="utf-8"))
    model, pre = spec.get("model") or {}, spec.get("pre_tokenizer") or {}
    where = f"{hf_dir / 'tokenizer.json'}"
    if model.get("type") != "BPE" or (spec.get("decoder") or {}).get("type") != "ByteLevel":
        raise CheckpointError(f"{where}: only byte-level BPE tokenizers are written to GGUF")
    if spec.get("normalizer") not in (None, {"type": "NFC"}):
        raise CheckpointError(f"{where}: normalizer {spec['normalizer'].get('type')!r} cannot be written to GGUF")
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
        pre_name = "olmo" if arch == "olmoe" else "gpt-2"
    else:
        steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else []
        regex = [s.get("pattern", {}).get("Regex") for s in steps if s.get("type") == "Split"]
        pre_name = next((n for n, r in PRE_TOKENIZERS.items() if r is not None and regex == [r]), None)
        if pre_name is None or [s.get("type") for s in steps] != ["Split", "ByteLevel"]:
            raise CheckpointError(f"{where}: its pre-tokenizer is none of the GGUF ones ftjax knows "
                                  f"({', '.join(PRE_TOKENIZERS)})")
    V = cfg.vocab_size  # llama.cpp wants one token per embedding row
    if tok.vocab_size > V:
        raise CheckpointError(f"{where}: {tok.vocab_size} tokens for a model of {V} embedding rows")
    added = tok.backend.get_added_tokens_decoder()
    tokens, types = [], []
    for i in range(V):
        text = tok.id_to_token(i)
        if text is None:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        else:
            tokens.append(text)
            types.append(gguf.TokenType.NORMAL if i not in added else
                         gguf.TokenType.CONTROL if added[i].special else gguf.TokenType.USER_DEFINED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre_name)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    eos = tok.token_to_id(tok.special_tokens_map["eos_token"]) if "eos_token" in tok.special_tokens_map else None
    ids = {"bos": tok.bos_token_id if tok.bos_token_id is not None else cfg.bos_token_id,
           "eos": eos if eos is not None else (cfg.eos_token_ids[0] if cfg.eos_token_ids else None),
           "pad": tok.pad_token_id}
    for what, i in ids.items():
        if i is not None:
            getattr(w, f"add_{what}_token_id")(i)
    w.add_add_bos_token(False)
    if tok.chat_templates:
        w.add_chat_template([{"name": n, "template": t} for n, t in tok.chat_templates.items()])
