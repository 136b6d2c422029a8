"""`ftjax bench paper` end to end, in a tiny configuration, on a small random qwen3_moe
checkpoint with the default model's tokenizer files (so the corpus prompts and the chat
template work): every artifact is written and the checks it reports hold."""

import json
import shutil

import pytest

import hf_models
from ftjax.bench import main_bench
from ftjax.bench.cachelab import POLICY_ORDER, belady_violations
from ftjax.bench.paper import PaperSettings, run_paper
from ftjax.lab.report import check_cache_policies_json
from ftjax.lab.trace import Trace
from ftjax.model import DEFAULT_MODEL_DIR

TINY = PaperSettings.quick(
    texts=("austen", "kjv"), prompt_tokens=24, prompts_per_text=1, decode_tokens=16, trace_cache_len=1024,
    chat_turns=2, chat_turn_tokens=8, fractions=(0.1, 0.25, 0.5, 0.75), check_prompts=2, run_tokens=12,
    validate_runs=(("lru-transfer-only", 0.25), ("host", 0.0)), q_repeats=2, q_miss_multiples=(1,),
    reference_shape=False, sim_tokens=16, profile_seconds=0.02, profile_working_set_mib=16, prefill_tokens=0, threads=2,
    state_cache_tokens=96, state_cache_turn_tokens=16, state_cache_repeats=2, memory_tokens=300)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    hf = hf_models.build("qwen3_moe", seed=3, vocab_size=4096, num_experts=8, num_experts_per_tok=2,
                         mlp_only_layers=[], max_position_embeddings=1024)
    path = hf_models.save(hf, tmp_path_factory.mktemp("tiny_moe"))
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(DEFAULT_MODEL_DIR / f, path / f)
    return path


@pytest.fixture(scope="module")
def run(model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("paper")
    summary = run_paper(out, str(model_dir), TINY, quick=True, log=lambda m: None)
    return out, summary


def test_runs_clean_and_writes_every_artifact(run):
    out, summary = run
    assert summary["errors"] is None, summary["errors"]
    for name in ("cache_policies.json", "q_sweep.json", "simulator.json", "summary.json", "report.md",
                 "traces/index.json", "traces/chat-agent.txt", "engine_checks.json"):
        assert (out / name).is_file(), name
    for png in ("miss_rate.png", "q_sweep.png", "decode_tok_s.png"):
        assert (out / png).stat().st_size > 1000, png
    assert summary["out"] == str(out) and summary["machine"]["platform"] == "cpu"


def test_traces_hold_generated_decode_records(run):
    out, _ = run
    names = {p.stem for p in (out / "traces").glob("*.npz")}
    assert names == {"decode-austen", "decode-kjv", "chat-agent"}
    for name in names:
        t = Trace.load(out / "traces" / f"{name}.npz")
        decode = t.decode_only()
        assert len(decode) > 0 and len(decode) % t.num_layers == 0  # one record per (token, MoE layer)
        assert set(t.phase.tolist()) == {0, 1}  # prefill records first, then generated tokens
    transcript = (out / "traces" / "chat-agent.txt").read_text()
    assert "<tool_call>" in transcript and "<tool_output>" in transcript and "<think>" in transcript


def test_cache_policies_schema_and_belady_bound(run):
    out, _ = run
    doc = json.loads((out / "cache_policies.json").read_text())
    assert check_cache_policies_json(doc) == []
    rows = doc["results"]
    assert {r["policy"] for r in rows} == set(POLICY_ORDER)
    assert all(set(r) == {"policy", "cache_fraction", "miss_rate"} for r in rows)
    assert {r["cache_fraction"] for r in rows} == set(TINY.fractions)
    assert belady_violations(rows) == []
    for name, per in doc["per_trace"].items():  # the bound holds trace by trace too
        assert belady_violations(per) == [], name
    assert set(doc["static_frequency_profiled_on"]["decode-austen"]) == {"decode-kjv", "chat-agent"}


def test_lru_matches_the_runtime(run):
    out, summary = run
    checks = json.loads((out / "cache_policies.json").read_text())["runtime_check"]
    assert [c["policy"] for c in checks] == ["lru-transfer-only", "lru"]
    for c in checks:
        assert c["passed"] and c["first_mismatch"] is None and c["counters_equal"], c
        assert c["decode_records"] > 0
    assert summary["lru_check_passed"] is True


def test_q_sweep_and_simulator_outputs(run):
    out, _ = run
    qs = json.loads((out / "q_sweep.json").read_text())
    sweep = qs["shapes"][0]["sweeps"][0]
    assert sweep["m"] == 2 and len(sweep["measured_s"]) == 3 and 0 <= sweep["measured_best_q"] <= 2
    assert set(sweep["predicted"]) == {"this-machine", "rtx5090-server", "rtx4090", "rtx5090-desktop",
                                       "rtx4060-laptop", "rtx-pro-6000"}
    sim = json.loads((out / "simulator.json").read_text())
    assert {r["geometry"] for r in sim["rows"]} == {"model", "qwen3-30b-a3b stationary", "qwen3-30b-a3b drift"}
    val = sim["validation"]["rows"]
    assert [v["calibration"] for v in val] == [True, False]
    assert abs(val[0]["rel_err"]) < 1e-6  # the calibration run is fitted exactly
    for v in val:  # the simulator replays the run's own log: same misses as the runtime counted
        assert v["predicted_miss_rate"] == pytest.approx(v["runtime_miss_rate"])


def test_report_has_paper_tables_and_verdicts(run):
    out, _ = run
    md = (out / "report.md").read_text()
    for heading in ("## 6. The paper's claims: reproduced, refuted, or cannot test here", "### Reproduced",
                    "### Refuted", "### Cannot test on this machine", "### Beside the paper",
                    "### Lab LRU vs runtime"):
        assert heading in md, heading
    assert "16.0%" in md and "41.0%" in md and "62.0%" in md  # the paper's Qwen miss rates
    assert "52.70" in md and "178.00" in md  # the paper's B_P / B_H beside ours
    assert "skipped (prefill_tokens = 0)" in md


def test_state_cache_and_memory_budget_are_measured_not_assumed(run):
    out, summary = run
    doc = json.loads((out / "engine_checks.json").read_text())
    sc = doc["state_cache"]
    assert sc["available"] and sc["cuttable"] is True  # qwen3_moe: attention only
    assert sc["reused_tokens"] == [TINY.state_cache_tokens] * TINY.state_cache_repeats and sc["same_next_token"]
    mem = doc["device_memory"]
    assert mem["available"] and mem["releases_bytes"] is True and mem["steps"]
    buffers = [s["cache_buffer_bytes"] for s in mem["steps"]]
    assert min(buffers) < mem["start"]["cache_buffer_bytes"]  # the buffer is re-allocated smaller
    md = (out / "report.md").read_text()
    assert "not implemented in this build" not in md
    assert "State caching saves re-prefill" in md and "no separate device memory" in md
    assert summary["state_cache"]["available"] and summary["device_memory"]["releases_bytes"] is True


def test_cli_rejects_a_missing_model(tmp_path, capsys):
    rc = main_bench(["paper", "--quick", "--allow-dirty", "--out", str(tmp_path / "o"), "--model",
                     str(tmp_path / "nope")])
    assert rc == 1
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert "setup" in summary["errors"]
    assert "FAILED" in (tmp_path / "o" / "report.md").read_text()
