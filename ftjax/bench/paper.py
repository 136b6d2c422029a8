"""`ftjax bench paper`: the paper's experiments, regenerated into one folder.

    profile (B_P, B_H) --> traces (device policy: text decode + agent chat) --> cache lab
        --> q sweep (predicted + measured) --> runtime runs (LRU check, validation, prefill)
        --> simulator (paper machines, this machine) --> state cache, device memory budget
        --> report.md + one JSON line

Files in the output folder:
    traces/*.npz, traces/index.json, traces/chat-agent.txt   routing traces (lab.Trace) + stats
    cache_policies.json, miss_rate.png       miss-rate curves (+ warm start, LRU-vs-runtime check)
    engine_checks.json                       the state cache's reuse and the device memory budget, measured
    q_sweep.json, q_sweep.png                layer time vs q: predicted and measured
    simulator.json, decode_tok_s.png         simulated tok/s per machine / policy + validation
    prefill_overlap.json, prefill_overlap.png
    report.md, results.json, summary.json    the report, every number, the one-line summary

Each stage records its wall time; a stage that fails is recorded in the report and the
summary (exit status 1) and the later stages still run. All sizes come from
`PaperSettings` (`quick()` / `full()`; tests shrink them further).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ftjax.config import read_config_json
from ftjax.data import corpus
from ftjax.experts.profile import DEFAULT_SHAPE, machine_info, measure
from ftjax.runinfo import commit_info
from ftjax.runinfo import machine_info as cpu_info
from ftjax.lab.geometry import ModelGeometry, qwen3_30b_a3b
from ftjax.lab.machines import PAPER_MACHINES, HardwareProfile, from_profile
from ftjax.lab.report import plot_miss_rates
from ftjax.model import DEFAULT_MODEL_DIR, bucket

from ftjax.bench import cachelab, decode, engine_checks, prefill, qsweep, report, traces
from ftjax.bench.plots import decode_figure, prefill_figure


@dataclasses.dataclass(frozen=True)
class PaperSettings:
    """Sizes of every experiment (defaults = --quick)."""

    texts: tuple[str, ...] = corpus.names()
    prompt_tokens: int = 64  # held-out window per text prompt (also the validation prompt)
    prompts_per_text: int = 2
    decode_tokens: int = 48  # greedy tokens per text prompt
    trace_cache_len: int = 1024  # one KV length for every trace generation (one decode compile)
    chat_turns: int = 3
    chat_turn_tokens: int = 32
    fractions: tuple[float, ...] = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75)
    check_fraction: float = 0.25  # cache size of the LRU-vs-runtime check
    check_prompts: int = 2  # generations in the check (cache kept between them)
    check_policies: tuple[str, ...] = ("lru-transfer-only", "lru")  # lru: with the RTX 4090's B_P / B_H
    run_tokens: int = 48  # tokens per check / validation generation
    validate_runs: tuple[tuple[str, float], ...] = (
        ("lru-transfer-only", 0.25), ("lru", 0.25), ("static-frequency", 0.25), ("host", 0.0))
    validate_rounds: int = 3  # interleaved timing rounds per validation run
    q_repeats: int = 9
    q_miss_multiples: tuple[int, ...] = (1, 2)  # m = multiple * K
    reference_shape: bool = True  # also sweep q with Qwen3-30B-A3B experts
    sim_fraction: float = 0.25  # cache fraction when VRAM does not decide it
    sim_tokens: int = 64  # synthetic Qwen3-30B-A3B tokens timed (as many again for warm-up)
    warm_tokens: int = 256  # cache lab warm start: decode tokens of history replayed first
    profile_seconds: float = 0.5
    profile_working_set_mib: float | None = None  # None: 4x the last-level cache, >= 1 GiB (honest DRAM numbers)
    prefill_tokens: int = 512  # 0: skip the prefill-overlap stage
    prefill_repeats: int = 3
    state_cache_tokens: int = 384  # cached prefix of an agent turn; 0: skip the state-cache stage
    state_cache_turn_tokens: int = 64  # tokens the turn adds to it
    state_cache_repeats: int = 3
    memory_tokens: int = 1024  # a session grown to this many tokens under a device budget; 0: skip
    threads: int | None = None

    @classmethod
    def quick(cls, **kw) -> "PaperSettings":
        return cls(**kw)

    @classmethod
    def full(cls, **kw) -> "PaperSettings":
        base = dict(prompts_per_text=6, decode_tokens=160, trace_cache_len=2048, chat_turns=6,
                    chat_turn_tokens=96, check_prompts=3, run_tokens=128, q_repeats=25, sim_tokens=256,
                    validate_rounds=5,
                    profile_seconds=1.0, prefill_tokens=1536, prefill_repeats=5, state_cache_tokens=1536,
                    state_cache_turn_tokens=256, state_cache_repeats=5, memory_tokens=2047,
                    validate_runs=(("lru-transfer-only", 0.25), ("lru", 0.25), ("static-frequency", 0.25),
                                   ("static-layer", 0.5), ("lru-transfer-only", 0.5), ("lru", 0.1),
                                   ("host", 0.0), ("device", 1.0)))
        return cls(**{**base, **kw})


class Bench:
    """State shared by the stages of one run (settings, paths, measured numbers, results)."""

    def __init__(self, out: Path, model_path: str | None, settings: PaperSettings, quick: bool,
                 log: Callable[[str], None]):
        self.out, self.settings, self.quick, self.log = out, settings, quick, log
        self.model_dir = Path(model_path) if model_path else DEFAULT_MODEL_DIR
        self.results: dict[str, Any] = {"errors": {}, "stage_s": {}}
        self.models: dict = {}

    # ---- stages ------------------------------------------------------------------------------
    def stage(self, name: str, fn: Callable[[], Any]) -> Any:
        self.log(f"== {name}")
        start = time.perf_counter()
        try:
            return fn()
        except Exception as e:  # recorded and reported; the other stages still run
            self.results["errors"][name] = f"{type(e).__name__}: {e}"
            self.log(f"!! {name} failed: {type(e).__name__}: {e}\n{traceback.format_exc()}")
            return None
        finally:
            self.results["stage_s"][name] = round(time.perf_counter() - start, 2)

    def setup(self) -> None:
        if not (self.model_dir / "config.json").is_file():
            raise FileNotFoundError(f"no model at {self.model_dir} (config.json missing); pass --model DIR")
        hf = read_config_json(self.model_dir)
        import ftjax

        probe = ftjax.load(self.model_dir)  # device policy: the trace recorder
        if probe.tokenizer is None:
            raise ValueError(f"{self.model_dir} has no tokenizer.json: the bench needs text in and out")
        self.models["device"] = probe
        cfg, pool = probe.config, probe.checkpoint.pool
        geo = ModelGeometry.from_hf_config(hf, bytes_per_weight=2.0 if pool.dtype == "bfloat16" else 4.0)
        geo = dataclasses.replace(geo, num_moe_layers=cfg.num_moe_layers, num_experts=cfg.num_experts,
                                  top_k=cfg.top_k, d_model=cfg.d_model, d_ff=cfg.d_ff_expert)
        self.cfg, self.geometry, self.dtype = cfg, geo, pool.dtype
        self.results["model"] = {
            "path": str(self.model_dir), "embedded": self.model_dir.resolve() == DEFAULT_MODEL_DIR.resolve(),
            "model_type": hf.get("model_type"), "num_layers": cfg.num_layers, "num_moe_layers": cfg.num_moe_layers,
            "num_experts": cfg.num_experts, "top_k": cfg.top_k, "d_model": cfg.d_model, "d_ff": cfg.d_ff_expert,
            "dtype": pool.dtype, "expert_bytes": pool.expert_bytes, "max_seq_len": probe.max_seq_len,
            "expert_pool_bytes": pool.expert_bytes * cfg.num_moe_layers * cfg.num_experts}

    def profile(self) -> None:
        s = self.settings
        shapes = {"model": (self.cfg.d_model, self.cfg.d_ff_expert, self.cfg.top_k)}
        if s.reference_shape:
            shapes["qwen3-30b-a3b"] = (*DEFAULT_SHAPE, 8)
        self.profiles, self.hw = {}, {}
        for name, (d, f, k) in shapes.items():
            ws = int(s.profile_working_set_mib * 2**20) if s.profile_working_set_mib else None
            p = measure((d, f), self.dtype, s.threads, top_k=k, seconds=s.profile_seconds, pool_bytes=ws)
            self.profiles[name] = p
            self.hw[name] = this_machine(p)
            self.log(f"profile {name} [{d}, {f}] x{k}: B_P {p['b_p_gbps']:.2f} GB/s, B_H {p['b_h_gbps']:.2f} GB/s "
                     f"(concurrent {p['b_p_concurrent_gbps']:.2f} / {p['b_h_concurrent_gbps']:.2f}), "
                     f"read {p['host_read_gbps']:.1f} GB/s")
        self.results["profiles"] = self.profiles

    def record_traces(self) -> None:
        s, model = self.settings, self.models["device"]
        tdir = self.out / "traces"
        tdir.mkdir(parents=True, exist_ok=True)
        self.traces = {}
        for name in s.texts:
            t = traces.record_text_trace(model, name, num_prompts=s.prompts_per_text, prompt_tokens=s.prompt_tokens,
                                         decode_tokens=s.decode_tokens, cache_len=s.trace_cache_len)
            self.traces[f"decode-{name}"] = t
            self.log(f"trace decode-{name}: {t.meta['new_tokens']} new tokens, {len(t)} records")
        if s.chat_turns > 0:
            t = traces.record_chat_trace(model, texts=s.texts, turns=s.chat_turns, turn_tokens=s.chat_turn_tokens,
                                         cache_len=s.trace_cache_len, log=self.log)
            self.traces["chat-agent"] = t
            (tdir / "chat-agent.txt").write_text(t.meta["transcript"])
            self.log(f"trace chat-agent: {t.meta['turns']} turns, {t.meta['new_tokens']} new tokens, {len(t)} records")
        index = {}
        for name, t in self.traces.items():
            t.save(tdir / f"{name}.npz")
            meta = {k: v for k, v in t.meta.items() if k != "transcript"}
            coverage = traces.prefill_coverage(t)
            lengths = meta.get("prompt_tokens")
            lengths = lengths if isinstance(lengths, list) else [lengths] * len(coverage)
            index[name] = {"file": f"traces/{name}.npz", "records": len(t), "meta": meta,
                           "locality": traces.locality(t), "zipf_s": traces.zipf_exponent(t),
                           "prefill_coverage": [{**c, "prompt_tokens": n} for c, n in zip(coverage, lengths)]}
        (tdir / "index.json").write_text(json.dumps(index, indent=1) + "\n")
        self.results["traces"] = index

    def cache_lab(self) -> None:
        s = self.settings
        curves = cachelab.policy_curves(self.traces, s.fractions, warm_tokens=s.warm_tokens, log=self.log)
        curves["belady_violations"] = cachelab.belady_violations(curves["results"])
        curves["semantics"] = cachelab.__doc__.split("\n\n")[1].replace("\n", " ")
        self.results["cache"] = curves
        self._write_cache_json()
        plot_miss_rates(curves["results"], self.out / "miss_rate.png",
                        f"decode miss rate, {len(self.traces)} traces pooled ({self.results['model']['model_type']})")

    def _write_cache_json(self) -> None:
        doc = {k: v for k, v in self.results["cache"].items()}
        doc["runtime_check"] = self.results.get("lru_check")
        (self.out / "cache_policies.json").write_text(json.dumps(doc, indent=1, default=_json) + "\n")

    def q_sweep(self) -> None:
        s, K = self.settings, self.cfg.top_k
        shapes = [qsweep.measure_shape("model", self.cfg.d_model, self.cfg.d_ff_expert, self.dtype,
                                       [m * K for m in s.q_miss_multiples], self.hw["model"], PAPER_MACHINES,
                                       s.threads, s.q_repeats, self.log)]
        if s.reference_shape:
            d, f = DEFAULT_SHAPE
            shapes.append(qsweep.measure_shape("qwen3-30b-a3b", d, f, "bfloat16", [m * 8 for m in s.q_miss_multiples],
                                               self.hw["qwen3-30b-a3b"], PAPER_MACHINES, s.threads, s.q_repeats,
                                               self.log))
        self.results["q_sweep"] = {"machine": machine_info(), "repeats": s.q_repeats, "shapes": shapes}
        (self.out / "q_sweep.json").write_text(json.dumps(self.results["q_sweep"], indent=1, default=_json) + "\n")
        qsweep.plot(shapes, self.out / "q_sweep.png")

    def _prompt(self, text_index: int, skip: int) -> list[int]:
        s = self.settings
        name = s.texts[text_index % len(s.texts)]
        return traces.text_prompts(self.models["device"].tokenizer, name, 1, s.prompt_tokens, skip=skip)[0]

    @property
    def run_cache_len(self) -> int:
        return bucket(self.settings.prompt_tokens + self.settings.run_tokens, 128)

    def lru_check(self) -> None:
        s, total = self.settings, self.geometry.num_expert_slots_total
        slots = max(1, int(round(s.check_fraction * total)))
        prompts = [self._prompt(i, s.prompts_per_text + 1) for i in range(s.check_prompts)]
        injected = PAPER_MACHINES["rtx4090"].bandwidth
        checks = []
        for policy in s.check_policies:
            bw = injected if policy == "lru" else None
            model = decode.load_model(self.model_dir, policy, slots, threads=s.threads, bandwidth=bw)
            self.models[(policy, slots, bw)] = model
            c = cachelab.lru_check(model, prompts, s.run_tokens, self.run_cache_len, policy, bw)
            c["bandwidth_source"] = "injected: rtx4090 (paper)" if bw else None
            checks.append(c)
            self.log(f"LRU check {policy} ({slots} slots{', B_P/B_H ' + str(bw) if bw else ''}): "
                     f"{'PASS' if c['passed'] else 'FAIL'} over {c['records']} records; first mismatch: "
                     f"{c['first_mismatch']}")
        self.results["lru_check"] = checks
        if "cache" in self.results:
            self._write_cache_json()

    def validation(self) -> None:
        s, geo = self.settings, self.geometry
        total = geo.num_expert_slots_total
        hw = self.hw["model"]
        prompt = self._prompt(0, s.prompts_per_text)
        # static-frequency pins: profiled on every trace except the prompt's own text
        own = f"decode-{s.texts[0]}"
        profile_names = [n for n in self.traces if n != own] or list(self.traces)
        profile = traces.concat([self.traces[n].decode_only() for n in profile_names])
        freq = np.bincount(profile.flat_ids(), minlength=total).reshape(geo.num_moe_layers, geo.num_experts)
        models, warm = [], set()
        for policy, fraction in s.validate_runs:
            run = decode.Run(policy, fraction)
            slots = run.slots(total)
            bw = hw.bandwidth if policy == "lru" else None
            key = (policy, slots, bw)
            if key in self.models:  # the LRU check's model: compiled for this prompt bucket already
                warm.add(len(models))
            elif policy == "device":
                key = "device"  # the trace recorder (compiled for another KV length: warmed below)
            else:
                self.models[key] = decode.load_model(self.model_dir, policy, slots, threads=s.threads,
                                                     bandwidth=bw, frequency=freq)
            models.append((run, self.models[key]))
        self.log(f"validation: {len(models)} models loaded, timing {s.validate_rounds} interleaved rounds")
        measured = list(zip([r for r, _ in models],
                            decode.measure_runs(models, prompt, s.run_tokens, self.run_cache_len,
                                                s.validate_rounds, warm)))
        for run, m in measured:
            self.log(f"measured {run.policy} ({run.slots(total)} slots): {m['measured_tok_per_s']:.1f} tok/s "
                     f"(rounds {', '.join(f'{1 / t:.0f}' for t in m['round_step_s'])}), "
                     f"decode miss rate {m['decode_miss_rate']:.3f}")
        rows, hw_cal = decode.validate(measured, hw, geo, len(prompt), profile)
        for r in rows:
            self.log(f"validate {r['policy']:>18} {r['slots']:>4} slots: measured {r['measured_tok_per_s']:8.1f} "
                     f"predicted {r['predicted_tok_per_s']:8.1f} tok/s  err {r['rel_err']:+.1%}"
                     f"{'  (calibration run)' if r['calibration'] else ''}")
        for key in [k for k in self.models if isinstance(k, tuple) and k[0] not in ("lru-transfer-only",)]:
            del self.models[key]  # each model holds its own copy of the expert pool
        self.results["validation"] = {
            "rows": rows, "calibrated_on": rows[0]["policy"] + f" @ {rows[0]['slots']} slots",
            "per_token_overhead_s": hw_cal.per_token_overhead_s, "prompt_tokens": len(prompt),
            "static_frequency_profiled_on": profile_names, "hardware": dataclasses.asdict(hw_cal)}

    def prefill(self) -> None:
        s = self.settings
        if s.prefill_tokens <= 0:
            self.results["prefill"] = {"available": False, "reason": "skipped (prefill_tokens = 0)"}
            return
        model = next((m for k, m in self.models.items() if isinstance(k, tuple) and k[0] == "lru-transfer-only"),
                     None)
        if model is None:
            slots = max(1, int(round(s.check_fraction * self.geometry.num_expert_slots_total)))
            model = decode.load_model(self.model_dir, "lru-transfer-only", slots, threads=s.threads)
        valid = corpus.split(s.texts[-1])[1]
        ids = model.tokenizer.encode(valid)[: min(s.prefill_tokens, model.max_seq_len - 2)]
        r = prefill.prefill_overlap(model, ids, s.prefill_repeats)
        self.results["prefill"] = r
        (self.out / "prefill_overlap.json").write_text(json.dumps(r, indent=1, default=_json) + "\n")
        if r.get("available"):
            prefill_figure(r, self.out / "prefill_overlap.png")
            self.log(f"prefill {r['tokens']} tokens: T_prefill {r['t_prefill_s'] * 1e3:.1f} ms, T_transfer "
                     f"{r['t_transfer_s'] * 1e3:.1f} ms, T_compute {r['t_compute_s'] * 1e3:.1f} ms, "
                     f"ratio {r['overlap_ratio']:.2f}")
        else:
            self.log(f"prefill overlap: {r['reason']}")

    def simulator(self) -> None:
        s = self.settings
        machines = dict(PAPER_MACHINES)
        rows = []
        # The loaded model on its own traces: the first text's trace is replayed first without
        # timing (warm-up; static-frequency pins are profiled on it), the others are scored.
        # This machine: the profile plus the per-token overhead calibrated in validation.
        first = f"decode-{s.texts[0]}"
        profile = self.traces[first].decode_only()
        scored = traces.concat([profile] + [t.decode_only() for n, t in self.traces.items() if n != first])
        warm = len(set(profile.step.tolist()))
        cal = self.results.get("validation", {}).get("hardware")
        own = {**machines, "this-machine": HardwareProfile(**cal) if cal else self.hw["model"]}
        slots = max(1, int(round(s.sim_fraction * self.geometry.num_expert_slots_total)))
        rows += decode.simulate_grid("model", scored, self.geometry, own, dict.fromkeys(own, slots),
                                     profile=profile, warmup_tokens=warm)
        # Qwen3-30B-A3B on synthetic traces fitted to the recorded locality and skew: the first
        # half is warm-up and static-frequency profile; the timed half shares its popularity
        # ("stationary") or is a fresh draw ("drift", a new topic)
        qwen = qwen3_30b_a3b()
        loc = traces.locality(traces.concat([t.decode_only() for t in self.traces.values()]))
        zipf = float(np.median([v["zipf_s"] for v in self.results["traces"].values()]))
        synth = decode.matched_synthetic(qwen, loc["reuse"], loc["chance"], zipf, 2 * s.sim_tokens, seed=0)
        synth.meta["warmup_tokens"] = s.sim_tokens
        q_profile = synth.subset(synth.step < s.sim_tokens)
        fresh = decode.matched_synthetic(qwen, loc["reuse"], loc["chance"], zipf, s.sim_tokens, seed=1)
        drift = traces.concat([q_profile, fresh])
        hw_q = {**machines, "this-machine": self.hw.get("qwen3-30b-a3b", self.hw["model"])}
        q_slots = {n: (qwen.slots_that_fit(hw.device_mem_gib, 2.0) if hw.device_mem_gib
                       else int(round(s.sim_fraction * qwen.num_expert_slots_total))) for n, hw in hw_q.items()}
        for name, trace in (("qwen3-30b-a3b stationary", synth), ("qwen3-30b-a3b drift", drift)):
            rows += decode.simulate_grid(name, trace, qwen, hw_q, q_slots, profile=q_profile,
                                         warmup_tokens=s.sim_tokens, policies=decode.QWEN_POLICIES)
            self.log(f"simulated {name}")
        self.results["simulator"] = {
            "rows": rows, "speedups": decode.speedups(rows),
            "geometries": {"model": dataclasses.asdict(self.geometry), "qwen3-30b-a3b": dataclasses.asdict(qwen)},
            "machines": {n: dataclasses.asdict(hw) for n, hw in {**own, **{"this-machine (qwen shape)":
                                                                            hw_q["this-machine"]}}.items()},
            "synthetic": synth.meta, "model_trace": {"scored": [n for n in self.traces if n != first],
                                                     "warmup_and_profile": first, "cache_slots": slots,
                                                     "this_machine_calibrated": bool(cal)}}
        self.log("simulated: " + ", ".join(f"{r['geometry']}/{r['machine']} {r['speedup']:.2f}x"
                                           for r in self.results["simulator"]["speedups"]))

    def state_cache(self) -> None:
        s, model = self.settings, self.models["device"]
        valid = corpus.split(s.texts[-1])[1]
        ids = model.tokenizer.encode(valid)
        r = engine_checks.state_cache_reuse(model, ids, s.state_cache_tokens, s.state_cache_turn_tokens,
                                            s.state_cache_repeats, self.log)
        self.results["state_cache"] = r
        self._write_engine_json()
        if not r["available"]:
            self.log(f"state cache: {r['reason']}")

    def device_memory(self) -> None:
        s = self.settings
        slots = max(1, int(round(s.check_fraction * self.geometry.num_expert_slots_total)))
        r = engine_checks.memory_budget(self.model_dir, slots, s.threads, s.memory_tokens, self.log)
        self.results["device_memory"] = r
        self._write_engine_json()
        if not r["available"]:
            self.log(f"device memory: {r['reason']}")

    def _write_engine_json(self) -> None:
        doc = {k: self.results.get(k) for k in ("state_cache", "device_memory")}
        (self.out / "engine_checks.json").write_text(json.dumps(doc, indent=1, default=_json) + "\n")

    def write_outputs(self) -> None:
        sim = self.results.get("simulator", {})
        val = self.results.get("validation", {})
        doc = {**sim, "validation": val}
        (self.out / "simulator.json").write_text(json.dumps(doc, indent=1, default=_json) + "\n")
        if sim.get("rows") or val.get("rows"):
            decode_figure(sim.get("rows", []), val.get("rows", []), self.out / "decode_tok_s.png")


def this_machine(profile: dict) -> HardwareProfile:
    """This machine as the simulator sees it: its "device" is the CPU, so device memory
    bandwidth is the measured host read bandwidth."""
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return from_profile(profile, name="this-machine", device_mem_gbps=profile["host_read_gbps"],
                        host_mem_gib=round(mem_gib, 1))


def _json(x):
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, (np.integer, np.floating)):
        return x.item()
    if dataclasses.is_dataclass(x):
        return dataclasses.asdict(x)
    return str(x)


def run_paper(out: str | Path, model: str | None = None, settings: PaperSettings | None = None, *,
              quick: bool = True, log: Callable[[str], None] | None = None) -> dict:
    """Run every stage into `out`; returns the summary (also written to summary.json)."""
    t0 = time.perf_counter()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    settings = settings or (PaperSettings.quick() if quick else PaperSettings.full())
    log = log or (lambda m: print(f"[{time.perf_counter() - t0:7.1f}s] {m}", file=sys.stderr, flush=True))
    b = Bench(out, model, settings, quick, log)
    b.results.update(**commit_info(), machine={**cpu_info(), **machine_info()},
                     settings=dataclasses.asdict(settings),
                     quick=quick, started=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                     loadavg_start=os.getloadavg())
    b.stage("setup", b.setup)
    if "setup" not in b.results["errors"]:
        b.stage("profile", b.profile)
        b.stage("traces", b.record_traces)
        if hasattr(b, "traces"):
            b.stage("cache lab", b.cache_lab)
        if hasattr(b, "hw"):
            b.stage("q sweep", b.q_sweep)
        b.stage("LRU check", b.lru_check)
        if hasattr(b, "traces") and hasattr(b, "hw"):
            b.stage("validation", b.validation)
            b.stage("simulator", b.simulator)
        b.stage("prefill overlap", b.prefill)
        b.stage("state cache", b.state_cache)
        b.stage("device memory", b.device_memory)
        b.stage("outputs", b.write_outputs)
    b.results["elapsed_s"] = round(time.perf_counter() - t0, 1)
    b.results["loadavg_end"] = os.getloadavg()
    (out / "results.json").write_text(json.dumps(b.results, indent=1, default=_json) + "\n")
    b.stage("report", lambda: report.write(out / "report.md", b.results))
    summary = report.summary(b.results, out)
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=_json) + "\n")
    return summary
