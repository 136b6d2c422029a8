"""Accelerator checks (`-m gpu`, run by scripts/gpu_check.sh): placement by memory kind,
and every policy giving the `device` reference's tokens on the accelerator. They skip on
the CPU backend unless FTJAX_GPU_DRY_RUN=1 (the script's --dry-run), which runs the same
assertions on the CPU backend's memory kinds."""

import os

import jax
import pytest

import ftjax

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(jax.default_backend() == "cpu" and os.environ.get("FTJAX_GPU_DRY_RUN") != "1",
                       reason="needs an accelerator (or FTJAX_GPU_DRY_RUN=1)"),
]
PROMPT = [464, 1110, 328, 262, 995]


def test_placement_on_the_accelerator():
    model = ftjax.load(policy="lru", cache_slots=24)
    assert model.placement() == {"expert_pool": "pinned_host", "expert_cache": "device",
                                 "state": "device", "dense": "device"}


@pytest.mark.parametrize("policy", ["host", "lru", "lru-transfer-only", "lru-host-only"])
def test_policies_give_the_device_tokens(policy):
    reference = ftjax.load(policy="device").generate(PROMPT, 16)
    kw = {} if policy == "host" else dict(cache_slots=24)
    assert ftjax.load(policy=policy, **kw).generate(PROMPT, 16) == reference


def test_the_start_finish_pair_gives_the_blocking_calls_tokens():
    """The host experts as a start / finish pair (CUDA handlers on a GPU, stream-ordered)
    against the single blocking call: the same tokens."""
    kw = dict(policy="lru", cache_slots=24, bandwidth=(1.0, 4.0), calibrate=False)
    assert ftjax.load(**kw, overlap_host=True).generate(PROMPT, 16) == \
        ftjax.load(**kw, overlap_host=False).generate(PROMPT, 16)
