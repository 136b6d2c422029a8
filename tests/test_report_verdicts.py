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


@pytest.mark.parametrize("group", ["cache", "traces", "q_sweep", "profiles", "validation", "prefill", "simulator"])
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
    assert s["verdicts"][CANNOT] == len(LINK) + 4  # + the four claims no run here can test
    g = report.summary(results("gpu"), tmp_path)
    assert g["accelerator"] is True and g["verdicts"][REPRODUCED] == len(MEASURED) + len(LINK)
    bad = copy.deepcopy(results("cpu"))
    bad["validation"]["rows"] = [{"policy": "lru"}]
    assert report.summary(bad, tmp_path)["missing"]
