"""Shared test setup: numpy beside XLA must not spawn its own threads (tail spikes)."""

import os
import sys
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).parent))  # tests/hf_models.py

# The suite is bound by XLA compilation (hundreds of tiny models and step shapes, each run
# a few times): LLVM's optimisation level 0 compiles 20-30% faster and changes no result
# (XLA picks fusions and reduction order before LLVM; no fast-math either way). Set before
# the first backend use, so the CLI and server processes the tests start inherit it.
# Benchmarks never run under it. FTJAX_TEST_XLA_OPT=2 gives back XLA's default.
_XLA_OPT = f"--xla_backend_optimization_level={os.environ.get('FTJAX_TEST_XLA_OPT', '0')}"
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_XLA_OPT}".strip()

import pytest  # noqa: E402

# Cross-product variants, and the heaviest single cases whose ground a default test
# covers, run under `-m slow` only. The default suite keeps one representative per axis
# (every family once, every policy once, every geometry kind once), so it stays under 15
# minutes on 2 cores; `pytest -m slow` runs these. Names are
# node ids (file::test[params]) relative to the repository root.
SLOW_VARIANTS = {
    "tests/test_sessions.py": [f"{test}[{family}-{policy}]"
                               for test in ("test_session_api", "test_generate_many_equals_each_generate")
                               for family in ("qwen2_moe", "mixtral", "olmoe") for policy in ("device", "host", "lru")]
                              + ["test_batched_decode_past_the_unrolled_size"],  # 8 and 16 rows at top-4 / top-8
    "tests/test_parity.py": [
        *(f"test_other_geometries[{p}]" for p in ("mixtral-overrides1", "qwen2_moe-overrides2", "olmoe-overrides3",
                                                  "qwen2_moe-overrides4", "qwen3_moe-overrides5",
                                                  "qwen3_next-overrides6", "qwen3_5_moe_text-overrides7")),
        *(f"test_packed_bf16_dense_weights[{p}]" for p in ("glm4_moe-overrides1", "glm_moe_dsa-overrides2",
                                                           "mixtral-overrides3", "olmoe-overrides4",
                                                           "qwen2_moe-overrides5", "qwen3_5_moe_text-overrides6",
                                                           "qwen3_next-overrides8", "qwen3_moe-overrides9")),
        "test_fused_expert_layout[mixtral]", "test_fused_expert_layout[qwen3_next]"],
    "tests/test_serve_robustness.py": [f"test_concurrent_distinct_and_shared_prefix_requests_all_answered[{mode}]"
                                       for mode in ("off", "prefix")],  # semantic runs by default
    "tests/test_glm_dsa.py": ["test_tied_selections_match_transformers_and_every_chunking[h2-d32-q20]",
                              "test_tied_selections_match_transformers_and_every_chunking[h4]"],
    "tests/test_engine_faults.py": ["test_shared_prefix_requests_all_end_with_cold_tokens[off]"],
    # the elastic cache bucket by bucket over the whole context (test_yielding_... covers the bytes given back)
    "tests/test_memory.py": ["test_growing_session_shrinks_the_expert_cache_with_unchanged_tokens"],
    # process 0 dying end to end (test_exit_on_abort... covers the abort's message and status)
    "tests/test_distributed.py": ["test_when_process_0_dies_the_others_say_so_and_exit"],
    "tests/test_deltanet.py": ["test_policies_match_transformers[device]", "test_policies_match_transformers[host]"],
    "tests/test_deepseek.py": ["test_policies_match_transformers[host]", "test_other_geometries[overrides1]"],
    "tests/test_executor.py": ["test_policies_compute_the_device_function[qwen2_moe-lru-transfer-only]",
                               "test_lru_matches_offline_replay[qwen2_moe-0.3-bandwidth5]"],
}


# The files that take longest in the default suite (about 1-3 minutes each on 2 cores),
# longest first. xdist (`--dist loadfile --no-loadscope-reorder`, pyproject.toml) hands
# files to its workers in collection order, so these go first and the short files fill
# in at the end: the run ends with both workers busy until its last minute, not one of
# them alone in a long file.
LONGEST_FILES = ["test_serve_processes.py", "test_deltanet.py", "test_config_space.py", "test_parity.py",
                 "test_bench_paper.py", "test_quant.py", "test_mesh.py", "test_numerics.py", "test_serve.py",
                 "test_serve_robustness.py", "test_state_cache.py", "test_memory.py", "test_distributed.py",
                 "test_placement.py", "test_executor.py", "test_glm_dsa.py", "test_sessions.py"]
assert all((Path(__file__).parent / name).is_file() for name in LONGEST_FILES), "a renamed file in LONGEST_FILES"


@pytest.hookimpl(tryfirst=True)  # before `-m 'not slow'` deselects
def pytest_collection_modifyitems(config, items):
    slow = {f"{path}::{name}" for path, names in SLOW_VARIANTS.items() for name in names}
    for item in items:
        if item.nodeid in slow:
            item.add_marker(pytest.mark.slow)
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: files stay whole, tests in order


RUN_FOLDER_ENV = "FTJAX_TEST_RUN_FOLDER"  # the run's folder, set by the process that made it


def pytest_configure(config):
    """One folder for the run's machine-local state (every xdist worker, the controller
    and the CLI and server processes tests start share it; the process that made it —
    the xdist controller, or pytest alone — deletes it at the end):

    - `profiles/`: the bandwidth profiles (B_P / B_H) loads measure, instead of the
      user's ~/.cache/ftjax: a run neither reads what an earlier one stored nor leaves
      anything behind, so it measures, and takes, the same on every machine.
    - `xla/`: one XLA compilation cache: a program compiled once — the same model built
      again by another test, the same step shapes — is loaded, not compiled again. The
      key is the whole program, so a hit is the same program (host-kernel programs too:
      they name the expert pool by its registry id, not an address); tests use it as the
      CLI and servers they start do (`ftjax.compilation.use_folder`).
      FTJAX_TEST_XLA_CACHE=0 turns it off."""
    import tempfile

    run = os.environ.get(RUN_FOLDER_ENV)
    if run is None:  # the run's first process: pytest alone, or xdist's controller before its workers start
        run = tempfile.mkdtemp(prefix="ftjax-test-run-")
        os.environ[RUN_FOLDER_ENV] = run  # the workers inherit it
        config._ftjax_run_folder = run
    os.environ.setdefault("FTJAX_PROFILE_DIR", os.path.join(run, "profiles"))
    if os.environ.get("FTJAX_TEST_XLA_CACHE", "1") == "0":
        os.environ["FTJAX_COMPILE_CACHE"] = "0"  # nor in the CLI processes tests start
        return
    from ftjax.compilation import use_folder

    xla = os.path.join(run, "xla")
    os.environ["FTJAX_COMPILE_CACHE"] = xla  # the CLI and servers the tests start use it too
    use_folder(xla)


def pytest_unconfigure(config):
    import shutil

    run = getattr(config, "_ftjax_run_folder", None)
    if run is not None:
        shutil.rmtree(run, ignore_errors=True)


@pytest.fixture(autouse=True, scope="module")
def _collect_fully_after_each_module():
    """A whole collection once per test file: what the file's fixtures held is freed (and
    nothing stays frozen at exit, where the interpreter's last collection skips frozen
    objects)."""
    yield
    import gc

    gc.unfreeze()
    gc.collect()


@pytest.fixture(autouse=True)
def _free_models_after_each_test(_collect_fully_after_each_module):
    """Collect the models a test dropped (they sit in reference cycles): a freed host pool
    gives its registry id back, so the next model of the same shape lowers to the same
    program and the compilation cache serves it. What survives the collection is then
    frozen (`gc.freeze`): the next collection walks only the objects made since, not
    every object of the run so far (a full walk took 0.4-0.8 s a test late in a worker,
    a third of the suite's CPU time). Frozen cycles a file's fixtures drop are collected
    at the end of that file."""
    yield
    import gc

    gc.collect()
    gc.freeze()
