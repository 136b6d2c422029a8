"""Shared test setup: numpy beside XLA must not spawn its own threads (tail spikes)."""

import os
import sys
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).parent))  # tests/hf_models.py

import pytest  # noqa: E402

# Cross-product variants that run under `-m slow` only. The default suite keeps one
# representative per axis (every family once, every policy once, every geometry kind
# once), so it stays near 15 minutes on 2 cores; `pytest -m slow` runs these. Names are
# node ids (file::test[params]) relative to the repository root.
SLOW_VARIANTS = {
    "tests/test_sessions.py": [f"{test}[{family}-{policy}]"
                               for test in ("test_session_api", "test_generate_many_equals_each_generate")
                               for family in ("qwen2_moe", "mixtral", "olmoe") for policy in ("host", "lru")],
    "tests/test_parity.py": [
        *(f"test_other_geometries[{p}]" for p in ("mixtral-overrides1", "qwen2_moe-overrides2", "olmoe-overrides3",
                                                  "qwen2_moe-overrides4", "qwen3_moe-overrides5",
                                                  "qwen3_5_moe_text-overrides7")),
        *(f"test_packed_bf16_dense_weights[{p}]" for p in ("glm4_moe-overrides1", "glm_moe_dsa-overrides2",
                                                           "mixtral-overrides3", "olmoe-overrides4",
                                                           "qwen2_moe-overrides5", "qwen3_5_moe_text-overrides6",
                                                           "qwen3_moe-overrides9")),
        "test_fused_expert_layout[mixtral]", "test_fused_expert_layout[qwen3_next]"],
    "tests/test_deltanet.py": ["test_policies_match_transformers[device]", "test_policies_match_transformers[host]"],
    "tests/test_deepseek.py": ["test_policies_match_transformers[host]"],
}


@pytest.hookimpl(tryfirst=True)  # before `-m 'not slow'` deselects
def pytest_collection_modifyitems(config, items):
    slow = {f"{path}::{name}" for path, names in SLOW_VARIANTS.items() for name in names}
    for item in items:
        if item.nodeid in slow:
            item.add_marker(pytest.mark.slow)
