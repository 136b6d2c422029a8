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


PLAIN_JAX = """
import jax, jax.numpy as jnp
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.jit(lambda x: x * 2 + 1)(jnp.ones(3)).block_until_ready()
"""


def test_a_second_process_compiles_nothing_new(tmp_path):
    """... also in a folder that a plain JAX process (no size cap) wrote to first."""
    folder = tmp_path / "xla"
    subprocess.run([sys.executable, "-c", PLAIN_JAX], env={**os.environ, "JAX_COMPILATION_CACHE_DIR": str(folder)},
                   check=True, timeout=120)
    assert os.listdir(folder), "the plain JAX process wrote nothing"
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


def test_prune_deletes_the_least_recently_used_entries_down_to_a_share_of_the_cap(tmp_path):
    from ftjax.compilation import PRUNE_TO, prune

    def entry(name: str, size: int, last_use: float, atime_file: bool = False):
        (tmp_path / name).write_bytes(b"x" * size)
        os.utime(tmp_path / name, (last_use, last_use))
        if atime_file:  # JAX's own timestamp beside an entry it wrote under its cap
            (tmp_path / f"{name}-atime").write_bytes(b"12345678")
            os.utime(tmp_path / f"{name}-atime", (last_use, last_use))

    for i in range(10):  # 10 entries of 100 bytes, entry i last used at time 1000 + i
        entry(f"jit_step-{i}-cache", 100, 1000.0 + i, atime_file=i % 2 == 0)
    (tmp_path / ".lockfile").write_bytes(b"")
    os.utime(tmp_path / "jit_step-0-cache", (5000.0, 900.0))  # read recently, written first: kept

    assert prune(tmp_path, max_bytes=2000) == 0  # under the cap: nothing goes
    assert len(os.listdir(tmp_path)) == 16
    deleted = prune(tmp_path, max_bytes=800)
    left = sorted(os.listdir(tmp_path))
    assert deleted >= 1040 - PRUNE_TO * 800 and sum((tmp_path / n).stat().st_size for n in left) <= PRUNE_TO * 800
    assert left == [".lockfile", "jit_step-0-cache", "jit_step-0-cache-atime", "jit_step-6-cache",
                    "jit_step-6-cache-atime", "jit_step-7-cache", "jit_step-8-cache", "jit_step-8-cache-atime",
                    "jit_step-9-cache"]
    assert prune(tmp_path / "absent") == 0
