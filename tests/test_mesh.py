"""Expert parallelism over a mesh of forced host devices (`ftjax.placement`,
`ftjax.experts.parallel`): logits within rel 1e-5 of one device and identical greedy
tokens on 2 and 4 devices, each device's cache holding only the experts it owns, at
most its own slots; per-device telemetry that adds up. The cases run in a process of
their own (`mesh_check.py`: XLA_FLAGS must be set before JAX starts)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import ftjax

HERE = Path(__file__).parent
ENV = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "OPENBLAS_NUM_THREADS": "1"}
ALL_POLICIES = "device,host,lru,lru-transfer-only,lru-host-only,static-frequency,static-layer"


def run_cases(tmp_path, *args) -> list[dict]:
    out = tmp_path / "mesh.jsonl"
    proc = subprocess.run([sys.executable, str(HERE / "mesh_check.py"), str(out), *args], env=ENV, cwd=HERE,
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(line) for line in out.read_text().splitlines()]


def check(lines: list[dict], expected: int) -> None:
    assert len(lines) == expected
    for line in lines:
        case = f"{line['family']} / {line['policy']} / {line['devices']} devices"
        assert line["rel"] <= 1e-5, case
        assert line["tokens_equal"] and line["ownership"], case
        per_device = line["per_device"]
        assert len(per_device) == line["devices"] and len({d["device"] for d in per_device}) == line["devices"], case
        assert sum(d["experts_owned"] for d in per_device) > 0, case


def test_mesh_matches_one_device(tmp_path):
    """One family under `lru` on 4 devices, 2 experts a device (every family, hybrids
    included, every policy, 2 and 4 devices: -m slow)."""
    check(run_cases(tmp_path, "--families", "qwen3_moe", "--policies", "lru", "--devices", "4"), 1)


@pytest.mark.slow
def test_mesh_matches_one_device_every_family_and_policy(tmp_path):
    lines = run_cases(tmp_path, "--policies", ALL_POLICIES)
    check(lines, 10 * 7 * 2)


def test_devices_is_checked_before_anything_loads():
    for bad in (0, 99, "two", [1, 2]):
        with pytest.raises(ValueError, match="devices must"):
            ftjax.load(devices=bad)


def test_options_not_yet_combined_with_a_mesh_are_refused():
    code = ("import ftjax\n"
            "for kw in ({'device_memory_bytes': 1 << 30}, {'overlap_host': True}):\n"
            "    try:\n"
            "        ftjax.load(policy='lru', cache_slots=8, bandwidth=(1.0, 1.0), devices=2, **kw)\n"
            "    except ValueError as e:\n"
            "        print('refused:', e)\n")
    proc = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    refused = proc.stdout.splitlines()
    assert len(refused) == 2 and all("not available with devices=2" in r for r in refused), proc.stdout


def test_server_on_two_devices_shows_each_devices_share(tmp_path):
    """`ftjax serve --devices 2`: requests run on the mesh; /v1/stats and /metrics give
    each device's hits, fetches and bytes, which add up to the totals."""
    import urllib.request

    openai = pytest.importorskip("openai")
    import serving

    with serving.server("--policy", "lru", "--cache-slots", "8", "--bandwidth", "1", "1", "--devices", "2",
                        "--state-cache", "off", env=ENV, timeout_s=300) as port:
        oai = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        r = oai.chat.completions.create(model="ftjax-default", messages=[{"role": "user", "content": "Hello"}],
                                        max_tokens=8, temperature=0)
        assert r.usage.completion_tokens == 8
        experts = serving.get_json(port, "/v1/stats")["experts"]
        per_device = experts["devices"]
        assert [d["device"] for d in per_device] == ["cpu:0", "cpu:1"]
        for key in ("hits", "fetched", "host_computed"):
            assert sum(d[key] for d in per_device) == experts[key]
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
        assert 'ftjax_device_expert_fetched_total{device="cpu:1"}' in text
