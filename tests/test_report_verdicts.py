"""The paper report's verdict logic on synthetic result dicts: every verdict is reachable,
every decided verdict prints its rule, claims about the host->device link cannot be
tested on the CPU backend, and missing or malformed results give MISSING (report and
summary still render) instead of an exception."""

import copy

import pytest

from ftjax.bench import report
from ftjax.bench.report import CANNOT, MISSING, REFUTED, REPRODUCED

F = 0.25  # the only cache fraction: paper_fraction picks it


def rows(rates: dict) -> list[dict]:
    return [{"policy": p, "cache_fraction": F, "miss_rate": m} for p, m in rates.items()]


def results(platform="cpu", good=True) -> dict:
    """A complete result dict; good=True: every measured claim holds, else every one fails."""
    lru, sf, sl, pl, ours = (0.1, 0.3, 0.5, 0.2, 0.08) if good else (0.6, 0.3, 0.5, 0.2, 0.7)
    return {
        "machine": {"platform": platform, "cpu": "test", "hostname": "h"},
        "cache": {"results": rows({"lru": lru, "belady": 0.05, "static-frequency": sf, "static-layer": sl}),
                  "static_preloaded": [], "belady_violations": [], "static_frequency_profiled_on": {},
                  "warm_start": rows({"lru": lru, "static-frequency": sf, "static-layer": sl, "lru-per-layer": pl,
                                      "reuse-rate": ours})},
        "traces": {"t": {"locality": {"selections": 100, "reuse": 0.5 if good else 0.2, "chance": 0.2,
                                      "decode_tokens": 10},
                         "prefill_coverage": [{"prompt_tokens": 64, "coverage": 0.95 if good else 0.5}],
                         "meta": {"kind": "text"}, "zipf_s": 1.0}},
        "q_sweep": {"repeats": 3, "shapes": [{"name": "model", "expert_shape": [8, 4], "sweeps": [
            {"m": 8, "q_star": 3, "measured_best_q": 3 if good else 7, "q_star_slowdown": 1.0 if good else 1.5,
             "measured_q_star_s": 1.0 if good else 4.0, "host_only_s": 2.0, "transfer_only_s": 3.0,
             "calibrated": {"q": 3 if good else 7, "b_p_gbps": 5.0, "b_h_gbps": 12.0,
                            "slowdown": 1.02 if good else 1.5}}]}]},
        "profiles": {"model": {"b_p_gbps": 5.0, "b_h_gbps": 20.0, "b_p_concurrent_gbps": 5.0,
                               "b_h_concurrent_gbps": 15.0 if good else 5.0, "expert_shape": [8, 4]}},
        "validation": {"calibrated_on": "lru", "rows": [
            {"policy": "lru", "slots": 4, "calibration": True, "rel_err": 0.0, "measured_tok_per_s": 10.0},
            {"policy": "host", "slots": 0, "calibration": False, "rel_err": 0.05 if good else 0.4,
             "measured_tok_per_s": 8.0}]},
        "prefill": {"available": True, "overlap_ratio": 1.1 if good else 1.8, "serial_ratio": 0.6, "tokens": 128,
                    "t_prefill_s": 0.1, "t_transfer_s": 0.09, "t_compute_s": 0.05, "repeats": 3},
    }


def verdicts(r) -> dict[str, tuple[str, str]]:
    return {claim: (v, e) for claim, v, e in report.claims(r)}


def find(vs, fragment) -> tuple[str, str]:
    hits = [v for c, v in vs.items() if fragment in c]
    assert len(hits) == 1, (fragment, list(vs))
    return hits[0]


LINK = ("best split of a layer's misses", "Splitting misses", "B_H - B_P", "Streamed prefill overlaps",
        "Online calibration settles")
MEASURED = ("Global LRU misses less", "per-layer partition", "`reuse-rate`", "Consecutive decode tokens",
            "Prefill touches almost every expert", "within 15%")
RULES = {"Global LRU misses less": "LRU < static-frequency < static-layer",
         "per-layer partition": "global <= per-layer", "`reuse-rate`": "reuse-rate <= LRU",
         "Consecutive decode tokens": "reuse > 1.2x chance", "Prefill touches almost every expert": ">= 90%",
         "within 15%": "|error| <= 15%", "best split of a layer's misses": "max(1, m/8)",
         "Splitting misses": "t(q*) < min(t(0), t(m))", "B_H - B_P": "within 0.2 B_H",
         "Streamed prefill overlaps": "<= 1.2", "Online calibration settles": "<= 1.10 t(best)"}


@pytest.mark.parametrize("good,expected", [(True, REPRODUCED), (False, REFUTED)])
def test_measured_claims_follow_their_rules(good, expected):
    vs = verdicts(results("cpu", good))
    for fragment in MEASURED:
        verdict, evidence = find(vs, fragment)
        assert verdict == expected, (fragment, evidence)
        assert "Rule: " in evidence and RULES[fragment] in evidence, (fragment, evidence)


@pytest.mark.parametrize("good", [True, False])
def test_link_claims_cannot_be_tested_on_the_cpu_backend(good):
    vs = verdicts(results("cpu", good))
    for fragment in LINK:
        verdict, evidence = find(vs, fragment)
        assert verdict == CANNOT, (fragment, evidence)
        assert "no accelerator" in evidence and "CPU memcpy" in evidence
        would = REPRODUCED if good else REFUTED
        assert f"the rule would say {would}" in evidence and RULES[fragment] in evidence  # measured, shown
    assert not any(v == REPRODUCED for c, (v, _) in vs.items() if any(f in c for f in LINK))


@pytest.mark.parametrize("good,expected", [(True, REPRODUCED), (False, REFUTED)])
def test_link_claims_are_decided_with_an_accelerator(good, expected):
    vs = verdicts(results("gpu", good))
    for fragment in LINK:
        verdict, evidence = find(vs, fragment)
        assert verdict == expected, (fragment, evidence)
        assert "Rule: " in evidence and RULES[fragment] in evidence


def test_unknown_platform_counts_as_no_accelerator():
    r = results("gpu")
    del r["machine"]
    assert find(verdicts(r), "B_H - B_P")[0] == CANNOT


def test_missing_rows_give_missing_not_a_crash():
    r = results("cpu")
    r["cache"]["warm_start"] = [x for x in r["cache"]["warm_start"] if x["policy"] not in ("static-layer",
                                                                                           "lru-per-layer")]
    vs = verdicts(r)
    verdict, evidence = find(vs, "Global LRU misses less")
    assert verdict == MISSING and "static-layer at 0.25" in evidence
    assert find(vs, "per-layer partition") == (MISSING, "no result for lru-per-layer at 0.25 in the cache-policy "
                                                        "results")
    assert find(vs, "`reuse-rate`")[0] == REPRODUCED  # the rows it needs are there


@pytest.mark.parametrize("group", ["cache", "traces", "q_sweep", "profiles", "validation", "prefill", "simulator",
                                   "state_cache", "device_memory"])
def test_malformed_groups_give_missing_and_everything_still_renders(group, tmp_path):
    r = results("gpu")
    r[group] = {"unexpected": 1}  # a stage that wrote something else
    out = report.claims(r)
    assert all(v in report.VERDICTS for _, v, _ in out)
    if group != "simulator":
        assert any(v == MISSING and group in c + e for c, v, e in out), out
    md = report.render(r)
    assert "## 6. The paper's claims" in md
    s = report.summary(r, tmp_path)
    assert set(s["verdicts"]) == set(report.VERDICTS)
    report.write(tmp_path / "report.md", r)


def test_empty_and_partial_results_render(tmp_path):
    for r in ({}, {"errors": {"setup": "boom"}}, {"machine": {"platform": "cpu"}, "profiles": {"model": {}}}):
        md = report.render(r)
        assert "## 6. The paper's claims" in md
        s = report.summary(r, tmp_path)
        assert s["verdicts"][REPRODUCED] == 0 and s["verdicts"][CANNOT] >= 4


def test_report_sections_list_missing_claims():
    r = results("cpu")
    r["q_sweep"] = {"shapes": [{"name": "model", "sweeps": []}]}
    md = report.render(r)
    assert "### Missing" in md and "the q sweep holds no sweeps" in md
    assert "### Cannot test on this machine" in md and "no accelerator" in md


def test_summary_reports_accelerator_and_verdict_counts(tmp_path):
    s = report.summary(results("cpu"), tmp_path)
    assert s["accelerator"] is False and s["missing"] is None
    assert s["verdicts"][REPRODUCED] == len(MEASURED) and s["verdicts"][REFUTED] == 0
    assert s["verdicts"][CANNOT] == len(LINK) + 5  # absolute speeds, 64k-token TTFT, and the state-cache pair
    # and elastic VRAM, which these results did not measure
    g = report.summary(results("gpu"), tmp_path)
    assert g["accelerator"] is True and g["verdicts"][REPRODUCED] == len(MEASURED) + len(LINK)
    bad = copy.deepcopy(results("cpu"))
    bad["validation"]["rows"] = [{"policy": "lru"}]
    assert report.summary(bad, tmp_path)["missing"]


# ---- the state cache and the device memory budget: decided by what the stages measured

STATE = "State caching saves re-prefill"
BOUNDS = "Snapshots at </think>"
ELASTIC = "Elastic VRAM"


def state_cache(**kw) -> dict:
    base = {"available": True, "mode": "semantic", "cuttable": True, "prefix_tokens": 384, "turn_tokens": 448,
            "repeats": 3, "reused_tokens": [384, 384, 384], "t_off_s": [0.1] * 3, "t_reuse_s": [0.02] * 3,
            "t_off_median_s": 0.1, "t_reuse_median_s": 0.02, "same_next_token": True}
    return {**base, **kw}


def device_memory(releases=False, shrink_buffer=False, refused=None) -> dict:
    mib = 2 ** 20
    steps = [{"tokens": t, "capacity": t, "states_bytes": t * 6144, "active_slots": a,
              "cache_buffer_bytes": (a if shrink_buffer else 96) * 192 * 1024} for t, a in ((128, 95), (1023, 60))]
    return {"available": True, "releases_bytes": releases, "budget_bytes": 64 * mib, "weights_bytes": 40 * mib,
            "scratch_bytes": 6 * mib, "slot_bytes": 192 * 1024, "max_slots": 96,
            "start": {"active_slots": 96, "cache_buffer_bytes": 96 * 192 * 1024}, "steps": steps, "refused": refused,
            "active_slots_after_close": 96, "counters": {"shrinks": 2, "grows": 1, "refused": 0}}


def test_state_cache_reuse_is_decided_by_its_measurement():
    r = results("cpu")
    r["state_cache"] = state_cache()
    verdict, evidence = find(verdicts(r), STATE)
    assert verdict == REPRODUCED and "Rule: " in evidence and "384, 384, 384" in evidence and "5.00x" in evidence
    for bad in (dict(reused_tokens=[384, 200, 384]), dict(t_reuse_median_s=0.2), dict(same_next_token=False)):
        r["state_cache"] = state_cache(**bad)
        assert find(verdicts(r), STATE)[0] == REFUTED, bad


@pytest.mark.parametrize("cuttable,why", [(True, "cuttable"), (False, "recurrent state")])
def test_boundary_snapshots_say_why_this_run_cannot_test_them(cuttable, why):
    r = results("gpu")
    r["state_cache"] = state_cache(cuttable=cuttable)
    verdict, evidence = find(verdicts(r), BOUNDS)
    assert verdict == CANNOT and why in evidence and "ftjax bench agent" in evidence


def test_state_cache_that_could_not_run_gives_the_reason_and_a_failed_stage_missing():
    r = results("cpu")
    r["state_cache"] = {"available": False, "reason": "ftjax.engine.state_cache does not import (boom)"}
    vs = verdicts(r)
    assert find(vs, STATE) == (CANNOT, "ftjax.engine.state_cache does not import (boom)")
    assert find(vs, BOUNDS)[0] == CANNOT
    del r["state_cache"]
    r["errors"] = {"state cache": "RuntimeError: boom"}
    assert find(verdicts(r), STATE) == (MISSING, "the `state cache` stage failed: RuntimeError: boom")


@pytest.mark.parametrize("platform", ["cpu", "gpu"])
def test_elastic_vram_cannot_be_reproduced_by_a_build_that_keeps_the_bytes(platform):
    r = results(platform)
    r["device_memory"] = device_memory()
    verdict, evidence = find(verdicts(r), ELASTIC)
    assert verdict == CANNOT
    assert "RELEASES_DEVICE_BYTES is False" in evidence and "kept its size" in evidence
    assert "left 60 of 96 slots active" in evidence and "18.0 MiB before" in evidence  # what it measured
    assert ("no accelerator" in evidence) == (platform == "cpu")


def test_elastic_vram_is_decided_on_an_accelerator_when_the_build_frees_bytes():
    r = results("gpu")
    r["device_memory"] = device_memory(releases=True, shrink_buffer=True)
    verdict, evidence = find(verdicts(r), ELASTIC)
    assert verdict == REPRODUCED and "Rule: " in evidence
    r["device_memory"] = device_memory(releases=True, shrink_buffer=True, refused={"tokens": 2047, "error": "x"})
    assert find(verdicts(r), ELASTIC)[0] == REFUTED
    r = results("cpu")
    r["device_memory"] = device_memory(releases=True, shrink_buffer=True)
    assert find(verdicts(r), ELASTIC)[0] == CANNOT  # no separate device memory to run out of


def test_scale_claims_name_what_this_run_lacks():
    r = results("cpu")
    r["model"] = {"model_type": "qwen3_moe", "expert_pool_bytes": 3 * 2 ** 20, "max_seq_len": 2048}
    vs = verdicts(r)
    speeds, ttft = find(vs, "Absolute decode speeds"), find(vs, "Worst-case TTFT")
    assert speeds[0] == CANNOT and "no accelerator" in speeds[1] and "qwen3_moe" in speeds[1]
    assert ttft[0] == CANNOT and "2048 tokens" in ttft[1]
    r["machine"] = {"platform": "gpu", "device_kind": "NVIDIA GeForce RTX 5090"}
    r["model"]["max_seq_len"] = 65536
    ttft = find(verdicts(r), "Worst-case TTFT")
    assert ttft[0] == CANNOT and "does not replay" in ttft[1] and "no accelerator" not in ttft[1]


def test_no_verdict_is_fixed_text():
    for r in (results("cpu"), results("gpu")):
        r["state_cache"], r["device_memory"] = state_cache(), device_memory()
        assert not any("not implemented" in e for _, _, e in report.claims(r))
