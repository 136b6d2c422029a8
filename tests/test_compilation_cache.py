"""The persistent compilation cache: a restarted process reads its programs back.

Each case runs a fresh Python process (the cache is per process state in JAX) that
loads the default model and generates; the folder comes from FTJAX_COMPILE_CACHE.
ftjax writes every program however fast it compiled (no wall-clock threshold, which a
busy machine would cross in one process and not in the next), so "the second process
compiled nothing new" does not depend on timing."""

import json
import os
import subprocess
import sys

CHILD = """
import json, jax, ftjax
m = ftjax.load()
tokens = m.generate(m.tokenizer.encode("To be, or not to be"), 4)
print(json.dumps({"folder": jax.config.jax_compilation_cache_dir, "tokens": tokens}))
"""


def run(env: dict) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD], env={**os.environ, **env}, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_second_process_compiles_nothing_new(tmp_path):
    folder = tmp_path / "xla"
    env = {"FTJAX_COMPILE_CACHE": str(folder)}
    first = run(env)
    entries = set(os.listdir(folder))
    assert first["folder"] == str(folder) and entries, "the first process wrote no compiled program"
    assert any(e.startswith("jit_fresh_state") for e in entries), "a small program (a session's state) was not written"
    second = run(env)
    assert second["tokens"] == first["tokens"]
    assert set(os.listdir(folder)) == entries, "the second process compiled programs the first had written"


def test_off_and_the_users_own_folder(tmp_path):
    assert run({"FTJAX_COMPILE_CACHE": "0"})["folder"] is None
    own = tmp_path / "mine"
    got = run({"FTJAX_COMPILE_CACHE": str(tmp_path / "ours"), "JAX_COMPILATION_CACHE_DIR": str(own)})
    assert got["folder"] == str(own) and not (tmp_path / "ours").exists()


def test_compile_benchmark_compiles_cold_whatever_the_users_cache_holds(tmp_path):
    """scripts/bench_compile.py times cold compiles in a folder of its own (a user's folder
    holding the programs would turn them into reads), then the reads of a restart."""
    users = tmp_path / "users-cache"
    users.mkdir()
    out = subprocess.run([sys.executable, "scripts/bench_compile.py", "--allow-dirty", "--policies", "device"],
                         env={**os.environ, "FTJAX_COMPILE_CACHE": str(users)}, capture_output=True, text=True,
                         timeout=600, cwd=os.path.join(os.path.dirname(__file__), ".."))
    assert out.returncode == 0, out.stderr[-3000:]
    line = json.loads(out.stdout.strip().splitlines()[-1])
    assert line["cold_read_s"] == 0 and line["prefill_compile_s"] > 0, line
    assert line["restart_read_s"] > 0, line  # the restart read its programs back
    assert not os.listdir(users), "the benchmark wrote into the user's cache folder"


def test_default_model_made_deeper_repeats_its_layers(tmp_path):
    import numpy as np

    import ftjax
    from ftjax.bench.models import default_model_with_layers

    base = ftjax.load()
    same = ftjax.load(default_model_with_layers(base.config.num_layers, tmp_path / "same"))
    ids = base.tokenizer.encode("It is a truth universally acknowledged")
    np.testing.assert_array_equal(same.logits(ids), base.logits(ids))
    deep = ftjax.load(default_model_with_layers(base.config.num_layers + 2, tmp_path / "deep"))
    assert deep.config.num_layers == base.config.num_layers + 2
    layers = deep._params["layers"]
    np.testing.assert_array_equal(np.asarray(layers[base.config.num_layers + 1]["attn"]["wq"][...]),
                                  np.asarray(layers[1]["attn"]["wq"][...]))
