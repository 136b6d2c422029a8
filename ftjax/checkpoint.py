"""Hugging Face checkpoint folder -> (ModelConfig, device parameters, host expert pool).

Design
- Tensor names are normalised in two steps: the family's `KEY_ALIASES` (e.g. Mixtral's
  `block_sparse_moe.experts.{e}.w1` -> `mlp.experts.{e}.gate_proj`), then one canonical
  table of regexes (`CANONICAL`) mapping each HF name to either a parameter path of the
  Flax model (with a transpose: HF Linear weights are [out, in], ours [in, out]) or a
  slice of the host expert pool.
- Routed experts go straight into the `HostExpertPool` (layer-contiguous, 64-byte
  aligned, HF fused layout gate_up [Lm, E, 2F, D], down [Lm, E, D, F]) in their stored
  precision (bf16 as uint16, else float32): the pool is the source of truth the expert
  executor serves from. Per-expert (`experts.{e}.gate_proj`) and fused
  (`experts.gate_up_proj`) layouts are both accepted, per layer.
- Everything is checked before it is used: safetensors headers are validated by the
  `safetensors` library (truncated or corrupt files fail there and are reported with
  the file name), every tensor name must map somewhere, every expected tensor must be
  present exactly once, and every shape must match the config. Errors name the file
  and the tensor. Nothing is written to disk.
- Dense (non-expert) matrices of a bf16 checkpoint stay bf16 by default, as uint16 bits
  in the HF layout [out, in] (and the embedding [V, D]): that is what the host GEMV
  kernel streams (`models.common.linear`), and it halves device memory. Converting them
  to float32 [in, out] (`dense_dtype="float32"`) is exact, only bigger and slower.
- Dense matrices may also be block-quantised at load (`dense_dtype="int8"` = "q8_0",
  "int4" = "q4_0", "q4_k", "q6_k", "mxfp4"): each HF Linear weight that `quantisable`
  allows, whose input width is whole blocks, becomes a `models.ops.QuantMatrix` [out, row
  bytes] that the host kernel reads with int8 activations (half of bf16's bytes for Q8_0:
  decode streams every dense matrix once per token). The rest keep the default storage
  (bf16 bits for a bf16 checkpoint, else float32).
- Data is read through `np.memmap` at the offsets of the safetensors header, so bf16
  needs no numpy dtype support and large shards are not read twice.
- FP8 checkpoints (DeepSeek-V3's release: config `quantization_config: {quant_method: fp8,
  fmt: e4m3, weight_block_size: [128, 128]}`): a float8_e4m3fn `X.weight` comes with an f32
  `X.weight_scale_inv` [ceil(out/128), ceil(in/128)], w = fp8 * scale_inv per 128 x 128
  tile. Routed experts stored so are kept as stored in an `fp8_e4m3` pool (the e4m3 bytes
  as read, each tile's scale copied to its rows: `storage.fp8_blocks`, a relayout, not a
  dequantisation); another expert_dtype dequantises them first. Dense FP8 matrices
  (attention, shared experts, dense MLPs) are dequantised at load to float32 params (the
  products e4m3 * f32 scale rounded once to f32; no bf16 packing: that would round them
  again). Every FP8 weight needs its scale and every scale its weight, with the tile shape.
"""

from __future__ import annotations

import json
import re
import struct
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import SafetensorError, safe_open

from ftjax.config import ConfigError, ModelConfig, read_config_json, validate
from ftjax.experts.pool import HostExpertPool, fill_rows
from ftjax.experts.storage import (BLOCK_FORMATS, FP8_BLOCK, FORMATS, QUANTISED_ALIASES, fp8_blocks, part_formats,
                                   pool_format)
from ftjax.models import config_from_hf, family


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be loaded; the message names the file and tensor."""


# safetensors dtype -> (numpy storage dtype, pool/param dtype name)
_DTYPES = {"F32": (np.float32, "float32"), "BF16": (np.uint16, "bfloat16"), "F16": (np.float16, "float16"),
           "I64": (np.int64, "int64"), "I32": (np.int32, "int32")}  # integer tables (DeepSeek-V4's tid2eid)
_DTYPES["F8_E4M3"] = (np.uint8, "float8_e4m3")  # FP8: e4m3fn bits, with a weight_scale_inv tensor
FP8_SCALE = ".weight_scale_inv"  # suffix of an FP8 weight's 128 x 128 tile scales

# Canonical HF name -> target. Targets: ("param", path-template, transpose) or
# ("expert", part) where part is gate / up / down (per expert) or gate_up / down_fused.
_L = r"model\.layers\.(?P<layer>\d+)\."
CANONICAL: list[tuple[re.Pattern, tuple]] = [
    (re.compile(r"model\.embed_tokens\.weight"), ("param", "embed", False)),
    (re.compile(r"model\.norm\.weight"), ("param", "norm.weight", False)),
    (re.compile(r"lm_head\.weight"), ("param", "lm_head", True)),
    (re.compile(_L + r"input_layernorm\.weight"), ("param", "layers.{layer}.attn_norm.weight", False)),
    (re.compile(_L + r"post_attention_layernorm\.weight"), ("param", "layers.{layer}.mlp_norm.weight", False)),
    (re.compile(_L + r"self_attn\.(?P<p>[qkvo])_proj\.weight"), ("param", "layers.{layer}.attn.w{p}", True)),
    (re.compile(_L + r"self_attn\.(?P<p>[qkvo])_proj\.bias"), ("param", "layers.{layer}.attn.b{p}", False)),
    (re.compile(_L + r"self_attn\.(?P<p>[qk])_norm\.weight"), ("param", "layers.{layer}.attn.{p}_norm.weight", False)),
    (re.compile(_L + r"mlp\.(?P<p>gate|up|down)_proj\.weight"), ("param", "layers.{layer}.mlp.w_{p}", True)),
    (re.compile(_L + r"mlp\.gate\.weight"), ("param", "layers.{layer}.moe.w_router", True)),
    (re.compile(_L + r"mlp\.shared_expert\.(?P<p>gate|up|down)_proj\.weight"), ("param", "layers.{layer}.moe.shared.w_{p}", True)),
    (re.compile(_L + r"mlp\.shared_expert_gate\.weight"), ("param", "layers.{layer}.moe.w_shared_gate", True)),
    (re.compile(_L + r"mlp\.gate\.e_score_correction_bias"), ("param", "layers.{layer}.moe.router_bias", False)),
    # multi-head latent attention (DeepSeek-V3; `models.mla`): q_proj and o_proj are the rows above
    (re.compile(_L + r"self_attn\.(?P<p>q_a|q_b|kv_b)_proj\.weight"), ("param", "layers.{layer}.attn.w_{p}", True)),
    (re.compile(_L + r"self_attn\.kv_a_proj_with_mqa\.weight"), ("param", "layers.{layer}.attn.w_kv_a", True)),
    (re.compile(_L + r"self_attn\.q_a_proj\.bias"), ("param", "layers.{layer}.attn.b_q_a", False)),
    (re.compile(_L + r"self_attn\.kv_a_proj_with_mqa\.bias"), ("param", "layers.{layer}.attn.b_kv_a", False)),
    (re.compile(_L + r"self_attn\.(?P<p>q_a|kv_a)_layernorm\.weight"), ("param", "layers.{layer}.attn.{p}_norm.weight", False)),
    # DeepSeek-V4 (`models.deepseek_v4`, `models.dsv4_attention`): hyper-connections, hash tables, attention kinds
    (re.compile(r"model\.hc_head\.(?P<p>hc_fn|hc_base|hc_scale)"), ("param", "hc_head.{p}", False)),
    (re.compile(_L + r"(?P<hc>attn|ffn)_hc\.(?P<p>fn|base|scale)"), ("param", "layers.{layer}.{hc}_hc.{p}", False)),
    (re.compile(_L + r"mlp\.gate\.tid2eid"), ("param", "layers.{layer}.moe.tid2eid", False)),
    (re.compile(_L + r"self_attn\.(?P<p>kv|o_a|o_b)_proj\.weight"), ("param", "layers.{layer}.attn.w_{p}", True)),
    (re.compile(_L + r"self_attn\.(?P<p>q_a_norm|kv_norm)\.weight"), ("param", "layers.{layer}.attn.{p}.weight", False)),
    (re.compile(_L + r"self_attn\.sinks"), ("param", "layers.{layer}.attn.sinks", False)),
    (re.compile(_L + r"self_attn\.compressor\.(?P<p>kv|gate)_proj\.weight"), ("param", "layers.{layer}.attn.compressor.w_{p}", True)),
    (re.compile(_L + r"self_attn\.compressor\.position_bias"), ("param", "layers.{layer}.attn.compressor.position_bias", False)),
    (re.compile(_L + r"self_attn\.compressor\.kv_norm\.weight"), ("param", "layers.{layer}.attn.compressor.kv_norm.weight", False)),
    (re.compile(_L + r"self_attn\.compressor\.indexer\.(?P<p>kv|gate)_proj\.weight"), ("param", "layers.{layer}.attn.compressor.indexer.compressor.w_{p}", True)),
    (re.compile(_L + r"self_attn\.compressor\.indexer\.q_b_proj\.weight"), ("param", "layers.{layer}.attn.compressor.indexer.w_q_b", True)),
    (re.compile(_L + r"self_attn\.compressor\.indexer\.position_bias"), ("param", "layers.{layer}.attn.compressor.indexer.compressor.position_bias", False)),
    (re.compile(_L + r"self_attn\.compressor\.indexer\.kv_norm\.weight"), ("param", "layers.{layer}.attn.compressor.indexer.compressor.kv_norm.weight", False)),
    (re.compile(_L + r"self_attn\.compressor\.indexer\.scorer\.weights_proj\.weight"), ("param", "layers.{layer}.attn.compressor.indexer.w_weights", True)),
    # DeepSeek sparse attention's indexer (GLM-5; `models.dsa`)
    (re.compile(_L + r"self_attn\.indexer\.(?P<p>wq_b|wk|weights_proj)\.weight"), ("param", "layers.{layer}.attn.indexer.{p}", True)),
    (re.compile(_L + r"self_attn\.indexer\.k_norm\.(?P<p>weight|bias)"), ("param", "layers.{layer}.attn.indexer.k_norm.{p}", False)),
    (re.compile(_L + r"linear_attn\.in_proj_(?P<p>qkvz|ba|qkv|z|b|a)\.weight"), ("param", "layers.{layer}.attn.w_{p}", True)),
    (re.compile(_L + r"linear_attn\.conv1d\.weight"), ("param", "layers.{layer}.attn.conv_w", False)),
    (re.compile(_L + r"linear_attn\.(?P<p>dt_bias|A_log)"), ("param", "layers.{layer}.attn.{p}", False)),
    (re.compile(_L + r"linear_attn\.norm\.weight"), ("param", "layers.{layer}.attn.norm_w", False)),
    (re.compile(_L + r"linear_attn\.out_proj\.weight"), ("param", "layers.{layer}.attn.w_out", True)),
    (re.compile(_L + r"mlp\.experts\.(?P<expert>\d+)\.(?P<p>gate|up|down)_proj\.weight"), ("expert", "{p}")),
    (re.compile(_L + r"mlp\.experts\.gate_up_proj"), ("expert", "gate_up")),
    (re.compile(_L + r"mlp\.experts\.down_proj"), ("expert", "down_fused")),
]


def _hf_name_table() -> list[tuple[re.Pattern, str]]:
    """Inverse of the "param" rows of CANONICAL: (regex over our dotted parameter path,
    HF name template), derived from the same rows so the two cannot drift apart."""
    table = []
    for pattern, target in CANONICAL:
        if target[0] != "param":
            continue
        groups = dict(re.findall(r"\(\?P<(\w+)>([^)]*)\)", pattern.pattern))
        path_re = re.escape(target[1]).replace(r"\{layer\}", r"(?P<layer>\d+)")
        if "p" in groups:
            path_re = path_re.replace(r"\{p\}", f"(?P<p>{groups['p']})")
        hf_template = re.sub(r"\(\?P<(\w+)>[^)]*\)", r"{\1}", pattern.pattern).replace("\\.", ".")
        table.append((re.compile(path_re), hf_template))
    return table


_HF_NAMES = _hf_name_table()


def hf_name(path: str) -> str:
    """The (canonical) Hugging Face tensor name of a dotted parameter path, e.g.
    layers.0.attn.wk -> model.layers.0.self_attn.k_proj.weight; the path itself if none."""
    for path_re, template in _HF_NAMES:
        m = path_re.fullmatch(path)
        if m:
            return template.format(**m.groupdict())
    return path


# Dense matrices that stay float (or bf16 bits) when the others are block-quantised
# (`dense_dtype="int8"`, a GGUF's Q8_0 tensors): the embedding (rows are gathered), routers
# and the shared-expert gate (small, and routing is sensitive to them), MLA's kv_b (split
# into per-head absorbed projections, `models.mla`) and DeepSeek-V4's o_a (cut into group
# blocks, `models.dsv4_attention`): those layers do not hand them whole to `linear`.
FLOAT_MATRICES = re.compile(r"embed|.*\.(w_router|w_shared_gate|w_kv_b|w_o_a)")
# dense_dtype names of the block formats dense matrices may be quantised to
DENSE_BLOCK_FORMATS = ("q8_0", "q4_0", "q4_k", "q6_k", "mxfp4")


def quantisable(path: str, target: tuple) -> bool:
    """Whether param `path` (classified as `target`) may be a block-quantised `QuantMatrix`:
    an HF Linear weight (a transposed target) that its layer passes whole to `linear`."""
    return target[0] == "param" and target[2] and not FLOAT_MATRICES.fullmatch(path)


def dense_block_format(dense_dtype: str | None) -> str | None:
    """The block format a folder's dense_dtype asks for ("int8" -> "q8_0"), None for
    None / "bfloat16" / "float32"; anything else is a ValueError listing the choices."""
    if dense_dtype in (None, "bfloat16", "float32"):
        return None
    fmt = QUANTISED_ALIASES.get(dense_dtype, dense_dtype)
    if fmt not in DENSE_BLOCK_FORMATS:
        raise ValueError(f"dense_dtype must be 'bfloat16', 'float32', 'int8' (q8_0), 'int4' (q4_0), 'q4_k', 'q6_k' "
                         f"or 'mxfp4', got {dense_dtype!r}")
    return fmt


def quantise_dense(w: np.ndarray, fmt: str):
    """float32 [out, in] (HF layout) -> `QuantMatrix` of block format fmt, or None when a
    row is not whole blocks (the matrix then keeps its float storage)."""
    from ftjax.models.ops import QuantMatrix

    f = FORMATS[fmt]
    if w.ndim != 2 or w.shape[1] % f.block:
        return None
    return QuantMatrix(np.ascontiguousarray(f.from_f32_numpy(np.asarray(w, np.float32))), fmt)


# Small tensors bf16 checkpoints store in float32 anyway (transformers' `_keep_in_fp32_modules`):
# they do not make the checkpoint a float32 one.
KEPT_F32 = re.compile(_L + r"mlp\.gate\.e_score_correction_bias")

# Names real checkpoints carry that hold nothing the model needs.
IGNORED = [re.compile(r".*rotary_emb\.inv_freq")]


@dataclass
class TensorRef:
    """Where one tensor's bytes live."""

    name: str  # the HF name as stored
    file: Path
    dtype: str  # safetensors dtype string
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    nbytes: int
    scale: TensorRef | None = None  # F8_E4M3: its weight_scale_inv [ceil(rows/128), ceil(cols/128)] F32

    def read(self) -> np.ndarray:
        np_dtype = _DTYPES[self.dtype][0]
        return np.memmap(self.file, dtype=np_dtype, mode="r", offset=self.offset, shape=self.shape)


@dataclass
class Checkpoint:
    config: ModelConfig
    params: dict[str, np.ndarray]  # dotted param path -> float32 [in, out], or packed (below)
    pool: HostExpertPool
    dtype: str  # stored precision of the weights: float32 | bfloat16 | float16
    path: Path
    dense_dtype: str = "float32"  # "bfloat16": matrices are uint16 bits [out, in] (packed)
    # block format(s) of the params that are QuantMatrix (quantised at load or kept as a
    # GGUF stores them; "q8_0", or "q4_k+q6_k" for several), None: none is
    dense_format: str | None = None
    experts_read: np.ndarray | None = None  # bool [E]: the routed experts in this process's pool (None: all)

    @property
    def packed(self) -> bool:
        return self.dense_dtype == "bfloat16"


# ---- files ------------------------------------------------------------------------

def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from None
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: weight_map must be a non-empty object of tensor name -> shard file")
        for name, shard in weight_map.items():
            if not isinstance(shard, str) or not shard or Path(shard).name != shard or shard in (".", ".."):
                raise CheckpointError(f"{index}: tensor {name!r} maps to {shard!r}, not a shard file name "
                                      "in the model folder")
        files = [model_dir / f for f in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise CheckpointError(f"{index}: lists shard {f.name}, which is missing")
        return files
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    shards = sorted(model_dir.glob("*.safetensors"))
    if shards:
        return shards
    raise CheckpointError(f"{model_dir}: no model.safetensors, model.safetensors.index.json or *.safetensors")


def read_header(path: Path) -> list[TensorRef]:
    """Validate a safetensors file with the library, then list its tensors and offsets."""
    try:
        with safe_open(str(path), framework="numpy"):
            pass
    except SafetensorError as e:
        raise CheckpointError(f"{path}: corrupt or truncated safetensors file ({e})") from None
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    base = 8 + header_len
    refs = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _DTYPES:
            raise CheckpointError(f"{path}: tensor {name} has dtype {info['dtype']}; ftjax reads F32, BF16, F16 and "
                                  f"F8_E4M3 (with weight_scale_inv)")
        start, end = info["data_offsets"]
        refs.append(TensorRef(name, path, info["dtype"], tuple(info["shape"]), base + start, end - start))
    return refs


def model_config(hf: dict, where: Path) -> ModelConfig:
    """The family's config reader, then `config.validate`. A value of the wrong type or
    out of range anywhere in config.json is a ConfigError naming the file, whatever the
    reader tripped on (int("abc"), a missing key, a division by a zero head count)."""
    try:
        return validate(config_from_hf(hf))
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}" if str(where) not in str(e) else str(e)) from None
    except (KeyError, TypeError, ValueError, AttributeError, ZeroDivisionError, OverflowError) as e:
        what = f"missing field {e}" if isinstance(e, KeyError) else f"{type(e).__name__}: {e}"
        raise ConfigError(f"{where}: invalid value ({what})") from None


# ---- name mapping ---------------------------------------------------------------------

def canonical_name(name: str, aliases: list[tuple[str, str]]) -> str:
    for pattern, repl in aliases:
        name = re.sub(pattern, repl, name)
    return name


def classify(name: str) -> tuple[tuple, dict[str, str]] | None:
    for pattern, target in CANONICAL:
        m = pattern.fullmatch(name)
        if m:
            return target, m.groupdict()
    return None


def expected_param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Dotted path -> shape of every device parameter (derived from the Flax model)."""
    from flax import nnx

    from ftjax.models.common import causal_lm

    _, state = nnx.split(nnx.eval_shape(lambda: causal_lm(cfg)))
    return {".".join(map(str, path)): tuple(v.shape) for path, v in nnx.to_flat_state(state)}


# ---- loading ----------------------------------------------------------------------------

class _Progress:
    """A one-line stderr progress bar for checkpoints large enough to take a while."""

    def __init__(self, total_bytes: int, min_bytes: int = 256 << 20):
        self.total, self.done, self.enabled = total_bytes, 0, total_bytes >= min_bytes and sys.stderr.isatty()
        self.t0 = time.perf_counter()

    def update(self, nbytes: int) -> None:
        self.done += nbytes
        if self.enabled:
            frac = self.done / max(self.total, 1)
            gbps = self.done / max(time.perf_counter() - self.t0, 1e-9) / 1e9
            bar = "#" * int(30 * frac)
            print(f"\rloading [{bar:<30}] {frac:6.1%} {gbps:5.2f} GB/s", end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.enabled:
            print(file=sys.stderr)


def _to_f32(ref: TensorRef) -> np.ndarray:
    a = ref.read()
    if ref.dtype == "BF16":
        return (a.astype(np.uint32) << 16).view(np.float32)
    if ref.dtype == "F8_E4M3":  # w = e4m3 * scale_inv of its 128 x 128 tile
        import ml_dtypes

        rows, cols = a.shape[-2:]
        tiles = np.asarray(ref.scale.read(), np.float32)
        scale = np.repeat(np.repeat(tiles, FP8_BLOCK, axis=-2)[..., :rows, :], FP8_BLOCK, axis=-1)[..., :cols]
        return np.asarray(a).view(ml_dtypes.float8_e4m3fn).astype(np.float32) * scale
    return np.asarray(a, dtype=np.float32)


def _expert_storage(ref: TensorRef, pool_dtype: str) -> np.ndarray:
    """Tensor in the pool's storage: uint16 bf16 bits, float32, or a block format's rows
    of blocks (quantised here, row by row: the last axis is the dot-product axis; FP8
    tensors into an fp8_e4m3 pool are relaid out as stored, not requantised)."""
    if pool_dtype == "bfloat16":
        return ref.read()  # only BF16 checkpoints get a bf16 pool
    if pool_dtype == "float32":
        return _to_f32(ref)
    if pool_dtype == "fp8_e4m3" and ref.dtype == "F8_E4M3":
        return fp8_blocks(ref.read(), ref.scale.read())
    return FORMATS[pool_dtype].from_f32_numpy(_to_f32(ref))


def _fp8_config(hf: dict, where: Path) -> tuple[dict, bool]:
    """(the config without its quantization_config, True) for an FP8 checkpoint this loader
    reads (block-wise e4m3 in 128 x 128 tiles: the weights are dequantised or kept as stored
    here, so the family's config reader, which refuses quantised checkpoints, never sees
    it); (hf, False) otherwise (another quant_method still reaches the reader and fails)."""
    q = hf.get("quantization_config")
    if not isinstance(q, dict) or q.get("quant_method") != "fp8":
        return hf, False
    if list(q.get("weight_block_size") or []) != [FP8_BLOCK, FP8_BLOCK] or q.get("fmt", "e4m3") != "e4m3":
        raise ConfigError(f"{where}: FP8 checkpoints are read with fmt e4m3 and weight_block_size [128, 128], "
                          f"got {q}")
    return {k: v for k, v in hf.items() if k != "quantization_config"}, True


def _pair_fp8_scales(refs: dict[str, TensorRef], fp8_config: bool, model_dir: Path) -> None:
    """Attach each `X.weight_scale_inv` to its F8_E4M3 `X.weight` (removing it from refs),
    checking that the config declares FP8 (`_fp8_config`) and every pair's tile shape."""
    scales = {name[:-len(FP8_SCALE)] + ".weight": refs.pop(name) for name in list(refs) if name.endswith(FP8_SCALE)}
    fp8 = [name for name, r in refs.items() if r.dtype == "F8_E4M3"]
    if not fp8 and not scales:
        return
    if not fp8_config:
        raise CheckpointError(f"{model_dir / 'config.json'}: FP8 tensors need quantization_config "
                              f"{{quant_method: fp8, fmt: e4m3, weight_block_size: [128, 128]}}")
    for name, scale in scales.items():
        if name not in refs or refs[name].dtype != "F8_E4M3":
            raise CheckpointError(f"{scale.file}: tensor {scale.name} scales no F8_E4M3 tensor {name}")
    for name in fp8:
        ref = refs[name]
        if name not in scales:
            raise CheckpointError(f"{ref.file}: F8_E4M3 tensor {name} has no {name[:-len('.weight')]}{FP8_SCALE}")
        scale = scales[name]
        want = (*ref.shape[:-2], *(-(-n // FP8_BLOCK) for n in ref.shape[-2:]))
        if len(ref.shape) < 2 or scale.dtype != "F32" or scale.shape != want:
            raise CheckpointError(f"{scale.file}: tensor {scale.name} is {scale.dtype} {list(scale.shape)}, expected "
                                  f"F32 {list(want)} (128 x 128 tiles of {name} {list(ref.shape)})")
        ref.scale = scale


def load_checkpoint(model_dir: str | Path, expert_dtype: str | None = None,
                    dense_dtype: str | None = None, experts=None) -> Checkpoint:
    """Read and check a HF MoE checkpoint folder.

    expert_dtype: storage of the host expert pool; dense_dtype: storage of the dense
    matrices (attention, router, shared experts, embedding, LM head). Each "bfloat16"
    or "float32"; default: bfloat16 for bf16 checkpoints, float32 otherwise. bfloat16
    is only kept where the stored tensors are bf16 (no silent rounding). dense_dtype may
    also be a block format ("int8" = "q8_0", "int4" = "q4_0", "q4_k", "q6_k", "mxfp4"):
    the matrices `quantisable` allows (and whose input width is whole blocks) are
    quantised to it (`models.ops.QuantMatrix`), the others keep the default storage. Experts may
    also be quantised at load: expert_dtype "int8" (= "q8_0"), "int4" (= "q4_0"), "q4_k",
    "q6_k", "mxfp4" (GGUF block formats) or "fp8_e4m3" (DeepSeek-V3's 128 x 128 tile
    scheme), the block formats of `ftjax.experts.storage` (d_model and the expert FFN width
    must be multiples of the format's block: 32; 256 for q4_k / q6_k; 128 for fp8_e4m3).
    FP8 checkpoints (see the module doc) keep FP8 experts as stored by default.
    experts: None (read every routed expert), or a function num_experts -> bool [E]: the
    experts this process reads into its pool (the others' rows are allocated, never
    written: untouched pages cost no RAM; one of several processes reads the experts its
    devices own, `Placement.local_experts`).
    """
    quantised = {**QUANTISED_ALIASES, **{name: name for name in BLOCK_FORMATS}}
    dense_fmt = dense_block_format(dense_dtype)
    if dense_fmt is not None:
        dense_dtype = None  # the matrices left float keep the default storage
    part_dtypes = expert_dtype.split("/") if isinstance(expert_dtype, str) else [expert_dtype]
    if len(part_dtypes) > 2 or any(d not in (None, "bfloat16", "float32", *quantised) for d in part_dtypes):
        raise ValueError(f"expert_dtype must be 'bfloat16', 'float32', 'int8' (q8_0), 'int4' (q4_0), "
                         f"{', '.join(repr(f) for f in BLOCK_FORMATS if f not in ('q8_0', 'q4_0'))}, "
                         f"or 'gate_up_dtype/down_dtype' of those (e.g. 'q4_k/q6_k'), got {expert_dtype!r}")
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"{model_dir}: model folder not found")
    hf, fp8_config = _fp8_config(read_config_json(model_dir), model_dir / "config.json")
    cfg = model_config(hf, model_dir / "config.json")
    fam = family(cfg.model_type)
    aliases = fam.KEY_ALIASES
    ignored = [(p, "") for p in IGNORED] + list(getattr(fam, "IGNORED_KEYS", []))
    if hasattr(fam, "ignored_keys"):  # patterns that depend on the config (e.g. MTP layers past the last layer)
        ignored += fam.ignored_keys(hf)
    skipped: dict[str, int] = {}  # reason -> tensors skipped for it

    refs: dict[str, TensorRef] = {}
    for path in safetensors_files(model_dir):
        for ref in read_header(path):
            if ref.name in refs:
                raise CheckpointError(f"{path}: tensor {ref.name} also appears in {refs[ref.name].file.name}")
            refs[ref.name] = ref
    _pair_fp8_scales(refs, fp8_config, model_dir)
    canon = {name: canonical_name(name, aliases) for name in refs}
    kept = [KEPT_F32, *getattr(fam, "KEPT_F32", [])]  # float32 tensors of bf16 checkpoints; integer tables
    stored = {r.dtype for name, r in refs.items()
              if r.dtype not in ("I64", "I32") and not any(p.fullmatch(canon[name]) for p in kept)}
    ckpt_dtype = "bfloat16" if stored == {"BF16"} else ("float16" if "F16" in stored else "float32")
    hits = {name: classify(c) for name, c in canon.items()}

    def keeps_bf16(requested: str | None, of_kind) -> bool:
        """bf16 storage when asked for (default: for bf16 checkpoints) and every tensor of
        that kind is stored bf16: converting other precisions would lose bits silently."""
        wanted = (requested or ("bfloat16" if ckpt_dtype == "bfloat16" else "float32")) == "bfloat16"
        return wanted and all(refs[name].dtype == "BF16" for name in refs if of_kind(name))

    pool_dtype = "bfloat16" if keeps_bf16(expert_dtype, lambda name: ".experts." in canon[name]) else "float32"
    expert_types = {r.dtype for name, r in refs.items() if ".experts." in canon[name]}
    if expert_dtype is None and expert_types == {"F8_E4M3"}:
        pool_dtype = "fp8_e4m3"  # FP8 experts as stored
    if len(part_dtypes) == 2:  # one format per part
        pool_dtype = pool_format(*(quantised.get(d, d) for d in part_dtypes))
    pool_dtype = quantised.get(expert_dtype, pool_dtype)
    packed = keeps_bf16(dense_dtype, lambda name: _packs(hits[name]))

    try:
        shapes = expected_param_shapes(cfg)
    except (TypeError, ValueError, OverflowError) as e:  # sizes the model cannot even describe
        raise ConfigError(f"{model_dir / 'config.json'}: the model these values describe cannot be built "
                          f"({type(e).__name__}: {e})") from None
    Lm, E, D, F = cfg.num_moe_layers, cfg.num_experts, cfg.d_model, cfg.d_ff_expert
    block = max(f.block for f in part_formats(pool_dtype).values())
    misfits = [f"{name} ({n})" for name, n in (("hidden_size", D), ("the expert FFN width", F)) if n % block]
    if misfits and Lm:
        raise ConfigError(f"expert_dtype {expert_dtype!r} stores rows as blocks of {block} weights: "
                          f"{' and '.join(misfits)} must be a multiple of {block}")
    # Pass 1: every name, layer, expert id and shape is checked, and every expected tensor
    # found, before anything is allocated or read (a config claiming huge sizes fails here).
    param_refs: dict[str, tuple[TensorRef, tuple]] = {}  # dotted path -> (ref, classification)
    expert_refs: list[tuple[TensorRef, int, int | None, str]] = []  # (ref, moe layer, expert, part)
    expert_seen: dict[tuple[int, int | None, str], str] = {}  # (moe layer, expert|None, part) -> name
    for name, ref in sorted(refs.items()):
        hit = hits[name]
        reason = next((why for p, why in ignored if p.fullmatch(canon[name])), None)
        if reason is not None:
            if reason:
                skipped[reason] = skipped.get(reason, 0) + 1
            continue
        if hit is None:
            if cfg.tie_embeddings and canon[name] == "lm_head.weight":
                continue
            raise CheckpointError(f"{ref.file}: unexpected tensor {name} (not part of a {cfg.model_type} model)")
        target, groups = hit
        layer = int(groups.get("layer", -1))
        if layer >= cfg.num_layers:
            raise CheckpointError(f"{ref.file}: tensor {name} is for layer {layer}, but the config has {cfg.num_layers} layers")
        if target[0] == "param":
            path = target[1].format(**groups)
            if path not in shapes and cfg.shared_expert_d_ff == 0 and re.search(r"\.moe\.(shared\.|w_shared_gate)", path):
                continue  # a zero-width shared expert (and its gate) contributes nothing
            if path not in shapes:
                raise CheckpointError(f"{ref.file}: unexpected tensor {name} (the config has no {path})")
            shape = ref.shape[::-1] if target[2] else ref.shape
            if tuple(shape) != shapes[path] or (target[2] and len(ref.shape) != 2):
                want = shapes[path][::-1] if target[2] else shapes[path]
                raise CheckpointError(f"{ref.file}: tensor {name} has shape {list(ref.shape)}, expected {list(want)}")
            param_refs[path] = (ref, hit)
        else:
            if not cfg.moe_layers[layer]:
                raise CheckpointError(f"{ref.file}: unexpected tensor {name}: layer {layer} is a dense layer in this config")
            m = cfg.moe_index(layer)
            part = target[1].format(**groups)
            expert = int(groups["expert"]) if "expert" in groups and groups["expert"] is not None else None
            if expert is not None and expert >= E:
                raise CheckpointError(f"{ref.file}: tensor {name} is for expert {expert}, but the config has {E} experts")
            want = {"gate": (F, D), "up": (F, D), "down": (D, F), "gate_up": (E, 2 * F, D), "down_fused": (E, D, F)}[part]
            if ref.shape != want:
                raise CheckpointError(f"{ref.file}: tensor {name} has shape {list(ref.shape)}, expected {list(want)}")
            expert_refs.append((ref, m, expert, part))
            expert_seen[(m, expert, part)] = name
    missing = [hf_name(p) for p in shapes if p not in param_refs]
    if missing:
        raise CheckpointError(f"{model_dir}: missing tensors {', '.join(missing[:8])}"
                              + (f" ... ({len(missing)} in all)" if len(missing) > 8 else ""))
    _check_experts(model_dir, cfg, expert_seen)
    for reason, count in skipped.items():
        print(f"{model_dir.name}: {count} tensors not loaded: {reason}", file=sys.stderr)

    # Pass 2: read.
    pool = HostExpertPool.allocate(Lm, E, D, F, pool_dtype)
    params: dict[str, np.ndarray] = {}
    progress = _Progress(sum(r.nbytes for r in refs.values()))
    for path, (ref, hit) in param_refs.items():
        qmatrix = None
        if dense_fmt is not None and quantisable(path, hit[0]):
            qmatrix = quantise_dense(_to_f32(ref), dense_fmt)  # HF layout [out, in]
        if qmatrix is not None:
            params[path] = qmatrix
        elif packed and _packs(hit):
            params[path] = np.array(ref.read())  # bf16 bits in the HF layout; a copy, not the file
        else:
            arr = _to_f32(ref)
            params[path] = np.ascontiguousarray(arr.T if hit[0][2] else arr)
        progress.update(ref.nbytes)
    fmts = part_formats(pool_dtype)
    mask = None if experts is None else np.asarray(experts(E), bool)
    for ref, m, expert, part in expert_refs:
        if expert is not None and mask is not None and not mask[expert]:
            progress.update(ref.nbytes)
            continue  # another process's expert
        data = _expert_storage(ref, fmts["down" if part.startswith("down") else "gate_up"].name)
        if part == "gate":
            pool.gate_up[m, expert, :F] = data
        elif part == "up":
            pool.gate_up[m, expert, F:] = data
        elif part == "down":
            pool.down[m, expert] = data
        elif part == "gate_up":
            fill_rows(pool.gate_up[m], data, mask)
        else:
            fill_rows(pool.down[m], data, mask)
        progress.update(ref.nbytes)
    progress.close()
    pool.freeze()
    return Checkpoint(cfg, params, pool, ckpt_dtype, model_dir, "bfloat16" if packed else "float32",
                      dense_formats(params), mask)


def dense_formats(params: dict) -> str | None:
    """`Checkpoint.dense_format` of a params dict: its QuantMatrix formats joined by '+'."""
    fmts = sorted({getattr(v, "fmt") for v in params.values() if hasattr(v, "fmt")})
    return "+".join(fmts) or None


def _packs(hit: tuple | None) -> bool:
    """Whether a classified tensor is a dense matrix kept as bf16 bits when packing:
    every HF Linear weight (transposed targets) and the embedding."""
    if hit is None or hit[0][0] != "param":
        return False
    return hit[0][2] or hit[0][1] == "embed"


def _check_experts(model_dir: Path, cfg: ModelConfig, seen: dict) -> None:
    """Each MoE layer must be covered exactly once: fused pair or all per-expert triplets."""
    for m, layer in enumerate(cfg.moe_layer_ids):
        fused = [(m, None, p) in seen for p in ("gate_up", "down_fused")]
        per_expert = [(m, e, p) in seen for e in range(cfg.num_experts) for p in ("gate", "up", "down")]
        if all(fused) and not any(per_expert):
            continue
        if any(fused) and any(per_expert):
            raise CheckpointError(f"{model_dir}: layer {layer} has both fused and per-expert expert tensors")
        if any(fused):
            part = "down_proj" if fused[0] else "gate_up_proj"
            raise CheckpointError(f"{model_dir}: missing tensor model.layers.{layer}.mlp.experts.{part}")
        for e in range(cfg.num_experts):
            for p in ("gate", "up", "down"):
                if (m, e, p) not in seen:
                    raise CheckpointError(f"{model_dir}: missing tensor model.layers.{layer}.mlp.experts.{e}.{p}_proj.weight")


def param_state(params: dict[str, np.ndarray]) -> dict[str, Any]:
    """Dotted paths -> nested dict (the shape `nnx.State` is built from)."""
    nested: dict[str, Any] = {}
    for path, value in params.items():
        node = nested
        *parents, leaf = path.split(".")
        for p in parents:
            node = node.setdefault(int(p) if p.isdigit() else p, {})
        node[leaf] = value
    return nested
