"""Regenerate the results page and the README's headline rows from the committed raw lines.

    python scripts/results.py           # rewrite docs/results.md and README.md's headline table
    python scripts/results.py --check   # exit 1 if either file differs from what the lines give

Raw lines live in docs/results/QUESTION/RUN/FILE.jsonl: one JSON object a line, exactly as a
benchmark runner printed it (commit, dirty, machine, time, command, measurements). QUESTION
is one of the folders in QUESTIONS below, RUN one run on one machine (its
name starts with the date), FILE says what ran (`ftjax.jsonl`, `llamacpp.jsonl`, ...).

Rules the generator enforces (and tests/test_results_page.py with it):
- every line is from a clean tree (`"dirty": false` and a commit hash): a line recorded
  with --allow-dirty, or without the field, stops the generator;
- every line is used by a table: superseded runs are deleted with their tables, not kept
  beside them;
- one machine per table: every line of a table names the same CPU model, core count and
  (where recorded) ISA flags, and the caption says which;
- every measured number in a table is a link to the raw line it comes from; ratios are
  computed from the linked cells of their row.

Pure standard library: no jax, no ftjax import.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
RESULTS = DOCS / "results"
PAGE = DOCS / "results.md"
README = REPO / "README.md"
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
MAX_HEADLINES = 10
HEX = re.compile(r"^[0-9a-f]{7,40}$")


class ResultsError(ValueError):
    """The raw lines break a rule of the results folder (the message names the line)."""


# ---------------------------------------------------------------------------- raw lines


@dataclass(frozen=True, eq=False)
class Line:
    path: Path  # relative to docs/
    n: int  # 1-based line number
    data: dict

    def __eq__(self, other) -> bool:
        return isinstance(other, Line) and (self.path, self.n) == (other.path, other.n)

    def __hash__(self) -> int:
        return hash((self.path, self.n))

    @property
    def ref(self) -> str:
        return f"{self.path.as_posix()}#L{self.n}"

    def get(self, key, default=None):
        return self.data.get(key, default)

    @property
    def machine(self) -> dict:
        """CPU fields, nested under "machine" or at the top level (both forms exist)."""
        m = self.data.get("machine")
        return m if isinstance(m, dict) else self.data

    @property
    def cpu(self) -> str:
        return str(self.machine.get("cpu", "unknown CPU"))

    @property
    def cores(self):
        return self.machine.get("cores")

    @property
    def flags(self) -> tuple[str, ...] | None:
        f = self.machine.get("cpu_flags")
        return tuple(f) if isinstance(f, list) else None

    @property
    def load(self) -> float | None:
        return self.machine.get("loadavg_1m")


@dataclass
class Run:
    question: str
    name: str  # folder name, starts with YYYY-MM-DD
    lines: list[Line]

    def bench(self, *names: str) -> list[Line]:
        return [x for x in self.lines if x.get("bench") in names]


def read_lines(path: Path, docs: Path = DOCS) -> list[Line]:
    """The lines of one raw file, each checked to come from a clean tree; paths relative
    to `docs` (the folder the results page lives in)."""
    out = []
    rel = path.relative_to(docs)
    for n, text in enumerate(path.read_text().splitlines(), 1):
        if not text.strip():
            continue
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ResultsError(f"{rel}#L{n}: not JSON ({e})") from None
        if data.get("dirty") is not False or not HEX.match(str(data.get("commit", ""))):
            raise ResultsError(f"{rel}#L{n}: not from a clean tree (dirty={data.get('dirty')!r}, commit="
                               f"{data.get('commit')!r}); lines recorded with --allow-dirty or without the field "
                               f"are pruned, not used")
        out.append(Line(rel, n, data))
    return out


def load_runs(root: Path = RESULTS) -> dict[str, list[Run]]:
    """{question folder: its runs, newest first} from a results folder (default docs/results)."""
    runs: dict[str, list[Run]] = {}
    docs = root.parent
    known = {q.folder for q in QUESTIONS}
    for qdir in sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []:
        if qdir.name not in known:
            raise ResultsError(f"docs/results/{qdir.name}: not a question of scripts/results.py ({sorted(known)})")
        for rdir in sorted((p for p in qdir.iterdir() if p.is_dir()), reverse=True):  # newest first
            if not re.match(r"^\d{4}-\d{2}-\d{2}", rdir.name):
                raise ResultsError(f"{rdir.relative_to(docs)}: a run folder's name starts with its date")
            lines = [x for f in sorted(rdir.glob("*.jsonl")) for x in read_lines(f, docs)]
            if lines:
                runs.setdefault(qdir.name, []).append(Run(qdir.name, rdir.name, lines))
    stray = [p.relative_to(docs) for p in root.rglob("*") if p.is_file() and p.suffix != ".jsonl"] \
        if root.is_dir() else []
    if stray:
        raise ResultsError(f"docs/results holds raw JSON lines only (*.jsonl), not {stray[0]}")
    return runs


# ---------------------------------------------------------------------------- cells and tables


def fmt(x: float) -> str:
    """Three significant digits, at least one decimal below 100 (the lines carry more)."""
    ax = abs(x)
    if ax >= 100:
        return f"{x:.0f}"
    if ax >= 10:
        return f"{x:.1f}"
    return f"{x:.2f}"


@dataclass(frozen=True)
class Value:
    x: float
    line: Line
    unit: str = ""

    def md(self, base: str) -> str:
        return f"[{fmt(self.x)}]({base}{self.line.ref})" + (f" {self.unit}" if self.unit else "")


@dataclass(frozen=True)
class Ratio:
    """a / b of two linked cells of the same row, or of two such ratios (derived: not a
    raw number)."""
    a: Value | Ratio
    b: Value | Ratio

    @property
    def x(self) -> float:
        return self.a.x / self.b.x

    def md(self, base: str) -> str:
        return f"{self.x:.2f}x"


@dataclass(frozen=True)
class Joined:
    """Several linked values in one cell (e.g. the two ends of a range of contexts)."""
    parts: tuple[Value, ...]
    sep: str = " / "
    unit: str = ""

    def md(self, base: str) -> str:
        return self.sep.join(p.md(base) for p in self.parts) + (f" {self.unit}" if self.unit else "")


@dataclass(frozen=True)
class Text:
    s: str

    def md(self, base: str) -> str:
        return self.s


Cell = Value | Ratio | Joined | Text
NONE = Text("—")


def cell_lines(c: Cell) -> list[Line]:
    if isinstance(c, Value):
        return [c.line]
    if isinstance(c, Ratio):
        return cell_lines(c.a) + cell_lines(c.b)
    if isinstance(c, Joined):
        return [p.line for p in c.parts]
    return []


@dataclass
class Table:
    title: str
    header: list[str]
    rows: list[list[Cell]]  # first cell of a row: its label (Text)
    run: Run
    note: str = ""

    def lines(self) -> list[Line]:
        return [x for row in self.rows for c in row for x in cell_lines(c)]


@dataclass
class Headline:
    label: str  # names the machine
    ftjax: Cell
    peer: Cell
    anchor: str  # section of docs/results.md


def median_line(lines: list[Line], key: Callable[[Line], float]) -> Line:
    """The line holding the median (the lower of the middle two for an even count): a
    value some run measured, never an average of two."""
    ordered = sorted(lines, key=key)
    return ordered[(len(ordered) - 1) // 2]


def series(lines: list[Line], key: Callable[[Line], float], unit: str = "") -> tuple[Value, Cell]:
    """(median, every round in the order measured, or — for one line) of a series of lines."""
    med = median_line(lines, key)
    if len(lines) == 1:
        return Value(key(med), med, unit), NONE
    ordered = sorted(lines, key=lambda x: (x.path.as_posix(), x.n))
    return Value(key(med), med, unit), Joined(tuple(Value(key(x), x) for x in ordered), sep=", ")


# ---------------------------------------------------------------------------- machines and captions


def one_machine(lines: list[Line], where: str) -> Line:
    first = lines[0]
    for x in lines[1:]:
        if (x.cpu, x.cores) != (first.cpu, first.cores) or (x.flags and first.flags and x.flags != first.flags):
            raise ResultsError(f"{where}: one machine per table, but {first.ref} is {first.cpu} x{first.cores} and "
                               f"{x.ref} is {x.cpu} x{x.cores}")
    return first


def machine_name(lines: list[Line]) -> str:
    m = one_machine(lines, "table")
    return f"{m.cpu}, {m.cores} cores"


def llama_build_flags(lines: list[Line]) -> list[str]:
    info = next((x.get("system_info") for x in lines if x.get("system_info")), "")
    return [k.strip() for k, v in (p.split("=") for p in info.split("|") if "=" in p) if v.strip() == "1"
            and k.strip().startswith(("AVX", "AMX", "F16C", "FMA", "SVE", "NEON"))]


def caption(table: Table) -> str:
    lines = table.lines()
    m = one_machine(lines, table.title)
    flags = sorted({f for x in lines for f in (x.flags or ())})
    if flags:
        isa = "ISA flags " + " ".join(flags)
    else:
        built = llama_build_flags(lines)
        isa = "ISA flags not recorded by these lines" + (
            f" (llama.cpp's build, made for this CPU or a subset of it, reports {' '.join(built)})" if built else "")
    times = sorted(str(x.get("time"))[:10] for x in lines if x.get("time"))
    if times:
        date = times[0] if times[0] == times[-1] else f"{times[0]} to {times[-1]}"
    else:
        date = f"{table.run.name[:10]} (the run folder's date; the lines carry no time)"
    commits = sorted({str(x.get("commit")) for x in lines})
    loads = [x.load for x in lines if isinstance(x.load, (int, float))]
    load = f"; load average {min(loads):.1f}-{max(loads):.1f} while measuring" if loads else ""
    commands = sorted({x.get("command") for x in lines if x.get("command")})
    cmd = ("; commands: " + ", ".join(f"`{c}`" for c in commands)) if commands else ""
    return (f"*{m.cpu}, {m.cores} cores, {isa}. {date}, commit{'s' if len(commits) > 1 else ''} "
            f"{', '.join(f'`{c}`' for c in commits)}, {len(set(lines))} raw lines in "
            f"`{Path('docs', *lines[0].path.parts[:3]).as_posix()}/`{load}{cmd}.*")


def render_table(t: Table, base: str) -> str:
    out = ["| " + " | ".join(t.header) + " |", "|" + "---|" * len(t.header)]
    out += ["| " + " | ".join(c.md(base) for c in row) + " |" for row in t.rows]
    return "\n".join(out)


# ---------------------------------------------------------------------------- questions


def weights_of(stem: str) -> str:
    s = stem.lower()
    for tag, name in (("q4_k_m", "Q4_K_M"), ("q8_0", "Q8_0"), ("q4_0", "Q4_0"), ("bf16", "bf16")):
        if s.endswith(tag):
            return name
    return "bf16"  # an HF folder: ftjax loads the bf16 checkpoint the peer's bf16 GGUF was converted from


def _ftjax_model(x: Line) -> str:
    """The model a line ran, named as its llama.cpp counterpart's: a bf16 GGUF ("x-bf16.gguf")
    and the HF folder it was converted from ("x") are the same weights."""
    stem = Path(str(x.get("model"))).stem
    return stem[:-5] if stem.endswith("-bf16") else stem


def _llama_model(x: Line) -> str:
    stem = Path(str(x.get("gguf"))).stem
    return stem[:-5] if stem.endswith("-bf16") else stem


def _prompt(x: Line):
    """Prompt tokens of a line; `hybrid_decode` lines before the field was recorded ran
    scripts/bench_hybrid.py's fixed 64-token prompt."""
    if x.get("bench") == "hybrid_decode" and x.get("prompt_tokens") is None:
        return 64
    return x.get("prompt_tokens")


def _pairs(run: Run, ftjax_value: str, llama_value: str, ftjax_benches=("quant_model", "hybrid_decode")):
    """(label, weights, threads, ftjax lines, llama.cpp lines) for each model x thread count
    both engines ran in this run with the given fields."""
    out = []
    ft = [x for x in run.bench(*ftjax_benches) if isinstance(x.get(ftjax_value), (int, float))]
    ll = [x for x in run.bench("decode_llamacpp") if isinstance(x.get(llama_value), (int, float))]
    keys = sorted({(_ftjax_model(x), x.get("threads"), _prompt(x)) for x in ft},
                  key=lambda k: (k[0], k[1] or 0, k[2] or 0))
    for model, threads, prompt in keys:
        a = [x for x in ft if (_ftjax_model(x), x.get("threads"), _prompt(x)) == (model, threads, prompt)]
        b = [x for x in ll if (_llama_model(x), x.get("threads")) == (model, threads)
             and x.get("prompt_tokens") == prompt]
        if not b:
            continue
        pinned = all(x.get("pinned_cores") == 1 for x in a) and threads == 1
        gguf = Path(str(b[0].get("gguf"))).name
        label = (f"`{gguf}` ({weights_of(Path(gguf).stem)}), {threads} thread{'s' if threads != 1 else ''}"
                 f"{' (both pinned to one core)' if pinned else ''}, {prompt}-token prompt, "
                 f"{len(a)} / {len(b)} rounds")
        out.append((label, weights_of(Path(gguf).stem), threads, a, b))
    return out


def _versus(run: Run, ftjax_value: str, llama_value: str, unit: str, what: str, anchor: str):
    rows, heads = [], []
    for label, weights, threads, a, b in _pairs(run, ftjax_value, llama_value):
        fa, fs = series(a, lambda x: float(x.get(ftjax_value)))
        la, ls = series(b, lambda x: float(x.get(llama_value)))
        rows.append([Text(label), fa, fs, la, ls, Ratio(fa, la)])
        rounds = "one round" if len(a) == len(b) == 1 else "medians of the rounds"
        heads.append(Headline(f"{what}: {label.rsplit(', ', 1)[0]}, {rounds}; {machine_name(a + b)}, "
                              f"{run.name[:10]}",
                              Value(fa.x, fa.line, unit), Value(la.x, la.line, unit), anchor))
    if not rows:
        return [], []
    header = ["weights, threads, rounds (ftjax / llama.cpp)", f"ftjax {unit} (median)", "ftjax, every round",
              f"llama.cpp {unit} (median)", "llama.cpp, every round", "ftjax / llama.cpp (ratio)"]
    return [Table(f"{run.name}", header, rows, run)], heads


def decode_tables(run: Run):
    return _versus(run, "decode_tok_per_s", "tok_per_s", "tok/s", "Decode", "decode-against-llamacpp")


def prefill_tables(run: Run):
    return _versus(run, "prefill_tok_per_s", "prompt_tok_per_s", "tok/s", "Prefill", "prefill-against-llamacpp")


def ceiling_tables(run: Run):
    lines = [x for x in run.bench("quant_model") if isinstance(x.get("read_ceiling_gbps"), (int, float))
             and isinstance(x.get("decode_read_gbps"), (int, float))]
    rows, heads, seen = [], [], {}
    order = sorted(lines, key=lambda x: (_ftjax_model(x), x.get("threads") or 0, x.path.as_posix(), x.n))
    for x in order:
        threads = x.get("threads")
        k = seen[(_ftjax_model(x), threads)] = seen.get((_ftjax_model(x), threads), 0) + 1
        pinned = " (pinned to one core)" if x.get("pinned_cores") == 1 and threads == 1 else ""
        read, ceil = Value(x.get("decode_read_gbps"), x), Value(x.get("read_ceiling_gbps"), x)
        rows.append([Text(f"`{Path(str(x.get('model'))).name}` ({weights_of(_ftjax_model(x))}), {threads} "
                          f"thread{'s' if threads != 1 else ''}{pinned}, round {k}"),
                     Value(x.get("decode_tok_per_s"), x), read, ceil, Ratio(read, ceil)])
    if not rows:
        return [], []
    header = ["weights, threads, round", "decode tok/s", "read GB/s", "read ceiling GB/s (probe)",
              "read / ceiling (ratio)"]
    return [Table(run.name, header, rows, run,
                  "Read GB/s = the bytes a decode step reads (dense + top-k experts) x tok/s; the ceiling is the "
                  "read probe run right after at the same thread count.")], heads


def context_tables(run: Run):
    """ftjax's rows (bench_context) and llama.cpp's (bench_llamacpp --contexts): ms/token per
    context and the slowdown from the first context to the last; for ftjax also the bytes
    bound of that slowdown (step bytes at the last context / at the first) and how far
    the measured slowdown is above it."""
    ours, peers = run.bench("decode_context"), run.bench("context_llamacpp")
    groups: dict[tuple, list[Line]] = {}
    for x in ours:
        groups.setdefault(("ftjax", x.get("model"), x.get("policy"), x.get("threads"), x.get("kv_dtype")), []).append(x)
    for x in peers:
        groups.setdefault(("llama.cpp", Path(x.get("gguf")).name, "llama-bench", x.get("threads"), x.get("type_k")),
                          []).append(x)
    contexts = sorted({x.get("context") for x in ours + peers})
    rows, heads = [], []
    for (who, model, policy, threads, kv), g in sorted(groups.items(), key=lambda kv: str(kv[0])):
        by = {x.get("context"): x for x in g}
        cells: list[Cell] = [Text(f"{who}: `{model}`, `{policy}`, {threads} threads, {kv} K/V")]
        cells += [Value(by[c].get("ms_per_token"), by[c]) if c in by else NONE for c in contexts]
        lo, hi = by.get(contexts[0]), by.get(contexts[-1])
        if not (lo and hi):
            rows.append(cells + [NONE] * len(contexts))
            continue
        first, last = Value(lo.get("ms_per_token"), lo), Value(hi.get("ms_per_token"), hi)
        cells.append(Ratio(last, first))
        for c in contexts[1:]:  # the measured slowdown over its bytes bound, where the lines give the bytes
            x = by.get(c)
            bytes_given = x and x.get("step_bytes_read") and lo.get("step_bytes_read")
            cells.append(Ratio(Ratio(Value(x.get("ms_per_token"), x), first),
                               Ratio(Value(x.get("step_bytes_read"), x), Value(lo.get("step_bytes_read"), lo)))
                         if bytes_given else NONE)
        rows.append(cells)
        if kv == "bfloat16" and who == "ftjax":
            heads.append(Headline(f"Decode step with {contexts[0]} / {contexts[-1]} tokens of context, `{model}`, "
                                  f"{kv} K/V, {threads} threads; {machine_name(g)}, {run.name[:10]}",
                                  Joined((first, last), unit="ms"), NONE, "cost-growth-with-context"))
    if not rows:
        return [], []
    header = ["engine: model, policy, threads, K/V"] + [f"{c} tokens: ms/token" for c in contexts] + \
             [f"{contexts[-1]} / {contexts[0]} (ratio)"] + \
             [f"{c} / {contexts[0]}: slowdown / bytes bound (ratio)" for c in contexts[1:]]
    return [Table(run.name, header, rows, run,
                  "The bytes bound of a slowdown: what one decode step reads at least (dense matrices, top-k "
                  "experts and the context's K/V) at that context over the first; a step bound by memory reads "
                  "slows by that much, so 1.00x is the floor and the distance above it is time lost to "
                  "something else.")], heads


def batch_tables(run: Run):
    lines = run.bench("batched_decode")
    groups: dict[tuple, list[Line]] = {}
    for x in lines:
        groups.setdefault((x.get("model"), x.get("policy"), x.get("cache_slots"), x.get("threads")), []).append(x)
    sizes = sorted({x.get("batch") for x in lines})
    rows, heads = [], []
    for (model, policy, slots, threads), g in sorted(groups.items(), key=lambda kv: str(kv[0])):
        by = {x.get("batch"): x for x in g}
        th = f"{threads} threads" if threads else "threads: all cores"
        label = f"`{model}`, `{policy}`{f' ({slots} slots)' if slots else ''}, {th}"
        cells: list[Cell] = [Text(label)]
        cells += [Value(by[b].get("total_tok_per_s"), by[b]) if b in by else NONE for b in sizes]
        lo, hi = by.get(sizes[0]), by.get(sizes[-1])
        cells.append(Ratio(Value(hi.get("total_tok_per_s"), hi), Value(lo.get("total_tok_per_s"), lo))
                     if lo and hi else NONE)
        rows.append(cells)
        if policy == "host" and lo and hi:
            heads.append(Headline(f"Batched decode, total tok/s with B = {sizes[0]} / {sizes[-1]} sessions, "
                                  f"`{model}`, `{policy}`; {machine_name(g)}, {run.name[:10]}",
                                  Joined((Value(lo.get("total_tok_per_s"), lo), Value(hi.get("total_tok_per_s"), hi)),
                                         unit="tok/s"), NONE, "batched-decode"))
    if not rows:
        return [], []
    header = ["model, policy, threads"] + [f"B = {b}: total tok/s" for b in sizes] + \
             [f"B = {sizes[-1]} / B = {sizes[0]} (ratio)"]
    return [Table(run.name, header, rows, run)], heads


def compile_tables(run: Run):
    lines = run.bench("compile")
    rows, heads = [], []
    restarts = any(x.get("restart_ttft_s") is not None for x in lines)
    for x in sorted(lines, key=lambda x: (str(x.get("model")), x.get("layers") or 0, x.get("prompt_tokens") or 0, x.n)):
        depth = f", {x.get('layers')} layers" if x.get("layers") else ""
        row = [Text(f"`{x.get('model')}`{depth}, `{x.get('policy')}`, {x.get('prompt_tokens')}-token prompt"),
               Value(x.get("prefill_compile_s"), x), Value(x.get("decode_compile_s"), x),
               Value(x.get("first_ttft_s"), x)]
        if restarts:
            row += [Value(x.get("restart_ttft_s"), x), Value(x.get("restart_read_s"), x)]
        rows.append(row)
        if x.get("model") == "default" and x.get("policy") == "lru" and x.get("layers") in (None, 6):
            heads.append(Headline(f"A fresh model's first prompt, embedded model, `lru`: XLA compile of the prompt / "
                                  f"first TTFT; {machine_name([x])}, {run.name[:10]}",
                                  Joined((Value(x.get("prefill_compile_s"), x), Value(x.get("first_ttft_s"), x)),
                                         unit="s"), NONE, "compile-time-of-a-fresh-model"))
    if not rows:
        return [], []
    header = ["model, policy, prompt", "prompt compile s", "first decode step compile s", "first TTFT s"]
    if restarts:
        header += ["first TTFT s, restarted process", "cache reads s, restarted process"]
    return [Table(run.name, header, rows, run)], heads


def agent_tables(run: Run):
    """`ftjax bench agent` summary lines (its last stdout line): TTFT p50 / p95 / max per
    workload and state-cache mode."""
    rows = []
    for x in run.bench("agent"):
        for key, t in sorted((x.get("ttft_ms") or {}).items()):
            tool = f", tool time {x.get('tool_time_s'):g} s" if x.get("tool_time_s") else ""
            scale = f", scale {x.get('scale'):g}" if x.get("scale") not in (None, 1.0) else ""
            load = ""
            if (x.get("agents") or 1) > 1:  # the load case: idle work done while every session was sending
                idle = ((x.get("idle_work_all_sessions") or {}).get(key.split("/")[1]) or {}).get(key.split("/")[0])
                load = (f", {x.get('agents')} sessions on {x.get('max_batch')} rows"
                        + (f" (idle prefills while all sent: {idle['admitted']}, {idle['tokens']:,} tokens)"
                           if idle else ""))
            rows.append([Text(f"`{x.get('model')}`, {key.replace('/', ', ')}, history {x.get('history')}{tool}{scale}"
                              f"{load}"),
                         Value(t["p50"], x), Value(t["p95"], x), Value(t["max"], x)])
    if not rows:
        return [], []
    return [Table(run.name, ["model, workload, state cache", "TTFT p50 ms", "TTFT p95 ms", "TTFT max ms"], rows,
                  run)], []


def cache_tables(run: Run):
    """`ftjax bench paper` summary lines: steady-state miss rate per policy at the paper's
    cache fraction, Belady's optimum beside them."""
    rows = []
    for x in run.bench("paper"):
        mr = (x.get("miss_rate") or {}).get("steady") or {}
        frac = (x.get("miss_rate") or {}).get("cache_fraction")
        for policy, v in mr.items():
            if isinstance(v, (int, float)):
                rows.append([Text(f"`{x.get('model')}`, cache = {frac} of the experts, `{policy}`"), Value(v, x)])
    if not rows:
        return [], []
    return [Table(run.name, ["model, cache size, policy", "decode miss rate"], rows, run)], []


def memory_tables(run: Run):
    """`scripts/bench_soak.py` / `scripts/bench_serve.py` lines: the serving process's
    resident memory at the start of the measured phase and at its end."""
    rows = []
    for x in run.bench("serve_agent_soak"):
        hist = x.get("agent_history_tokens") or {}
        long = f", agent histories p50 {hist['p50']:,} tokens (context {x.get('context'):,})" if hist.get("p50") else ""
        chunk = f", prefill chunk {x.get('prefill_chunk')}" if x.get("prefill_chunk") else ""
        rows.append([Text(f"`bench_soak.py`, {x.get('requests')} requests, state cache {x.get('state_cache')} "
                          f"({x.get('state_cache_budget_mib')} MiB){long}{chunk}"),
                     Value(x.get("rss_mib_baseline"), x), Value(x.get("rss_mib_end"), x),
                     Ratio(Value(x.get("rss_mib_end"), x), Value(x.get("rss_mib_baseline"), x))])
    for x in run.bench("serve_soak"):
        rows.append([Text(f"`bench_serve.py`, {x.get('requests')} requests, {x.get('concurrency')} clients"),
                     Value(x.get("server_rss_start_mib"), x), Value(x.get("server_rss_end_mib"), x),
                     Ratio(Value(x.get("server_rss_end_mib"), x), Value(x.get("server_rss_start_mib"), x))])
    if not rows:
        return [], []
    return [Table(run.name, ["run", "server RSS at start MiB", "server RSS at end MiB", "end / start (ratio)"], rows,
                  run)], []


def prompt_tables(run: Run):
    """`scripts/bench_prompt_cost.py` lines: prefill seconds per prompt length with the
    padding-bounded pieces against one power-of-two-padded call, first call (compile
    included) in a fresh process and in a restarted one (persistent compilation cache)."""
    rows, llama = [], False
    for x in run.bench("prompt_cost"):
        for r in x.get("rows") or []:
            warm, pow2 = Value(r["warm_s"], x), Value(r["pow2_warm_s"], x)
            first, restart = Value(r["first_s"], x), Value(r["restart_first_s"], x)
            row = [Text(f"{r['tokens']:,} tokens: pieces {'+'.join(map(str, r['pieces']))}, "
                        f"padded {r['padded']:,} (power-of-two rule {r['pow2_padded']:,})"),
                   warm, pow2, Ratio(pow2, warm), first, restart]
            if "llamacpp_s" in r:
                llama = True
                lc = Value(r["llamacpp_s"], x)
                row += [lc, Ratio(lc, warm), Ratio(lc, first), Ratio(lc, restart)]
            rows.append(row)
    if not rows:
        return [], []
    header = ["prompt", "warm s", "warm s, power-of-two padding", "padding / pieces (ratio)", "first call s (compiles)",
              "first call s, restarted process"]
    if llama:
        header += ["llama.cpp s (llama-bench, median)", "llama.cpp / warm (ratio)", "llama.cpp / first call (ratio)",
                   "llama.cpp / restarted first call (ratio)"]
        rows = [row + [Text("—")] * (len(header) - len(row)) for row in rows]
    return [Table(run.name, header, rows, run)], []


def prompt_attention_tables(run: Run):
    """`scripts/bench_prompt_attention.py` lines: one layer's attention for a prompt chunk,
    the bf16 tiles (AMX or their vector form) and the exact kernel per thread count against
    XLA's blocked form."""
    lines = run.bench("prompt_attention")
    threads = sorted({n for x in lines for n in (x.get("exact_ms") or {})}, key=int)
    rows = []
    for x in lines:
        tiles = x.get("tiles_ms") if isinstance(x.get("tiles_ms"), dict) else {}
        xla = Value(x.get("xla_ms"), x)
        row = [Text(f"{x.get('geometry')} ({x.get('heads')} heads, {x.get('kv_heads')} KV heads of "
                    f"{x.get('head_dim')}), {x.get('tokens'):,} tokens, "
                    + ("the first chunk" if x.get("chunk") == "first" else f"after {x.get('keys') - x.get('tokens'):,} keys")
                    + (f", tiles `{x.get('tiles_isa')}`" if x.get("tiles_isa") else ""))]
        row += [Value(tiles[n], x) if n in tiles else Text("—") for n in threads]
        exact = x.get("exact_ms") or {}
        row += [Value(exact[n], x) if n in exact else Text("—") for n in threads]
        row += [xla, Ratio(xla, Value(tiles[threads[-1]], x)) if threads and threads[-1] in tiles else Text("—")]
        rows.append(row)
    if not rows:
        return [], []
    header = (["geometry, chunk"] + [f"tiles ms, {n} thread{'s' if n != '1' else ''}" for n in threads]
              + [f"exact kernel ms, {n} thread{'s' if n != '1' else ''}" for n in threads]
              + ["XLA blocked ms, all cores", f"XLA / tiles at {threads[-1] if threads else '?'} threads (ratio)"])
    return [Table(run.name, header, rows, run)], []


def expert_prefill_tables(run: Run):
    """`scripts/bench_expert_prefill.py` lines: one MoE layer's expert prefill per kernel
    path, expert format and thread count, oneMKL's GEMMs on the same products beside them."""
    lines = [x for x in run.bench("expert_prefill") if "ms" in x.data]

    def key(x):
        return x.get("threads"), x.get("dtype", "bfloat16")
    exact = {key(x): Value(x.get("ms"), x) for x in lines
             if x.get("system") == "ftjax" and x.get("path") == (x.get("machine") or {}).get("isa", {}).get("auto")}
    rows = []
    for x in lines:
        ms = Value(x.get("ms"), x)
        rows.append([Text(f"{x.get('system')} `{x.get('path')}`, {x.get('dtype', 'bfloat16')} experts, {x.get('threads')} "
                          f"thread{'s' if x.get('threads') != 1 else ''}"
                          + ("" if x.get("system") == "ftjax" else f" ({x.get('scope')})")),
                     ms, Value(x.get("tokens_per_s"), x), Value(x.get("tflops"), x),
                     Ratio(exact[key(x)], ms) if key(x) in exact else Text("—")])
    if not rows:
        return [], []
    header = ["system, path, experts, threads", "ms a layer", "tokens / s", "TFLOP/s", "speed vs the exact path (ratio)"]
    return [Table(run.name, header, rows, run)], []


def numerics_tables(run: Run):
    """`scripts/bench_decode.py --model DIR --numerics exact fast` lines: a whole model's
    prefill and decode per numerics (fast: the AMX tiles for expert prefill where the CPU
    has them)."""
    lines = [x for x in run.bench("decode_geometry") if x.get("numerics")]
    rows = []
    for x in lines:
        rows.append([Text(f"`{Path(str(x.get('model_dir'))).name}`, `{x.get('policy')}`, {x.get('threads')} threads, "
                          f"numerics {x.get('numerics')} (host experts `{x.get('host_isa')}`)"),
                     Value(x.get("prompt_tokens"), x), Value(x.get("prefill_tok_per_s"), x), Value(x.get("tok_per_s"), x),
                     Value(x.get("first_run_s_incl_compile"), x)])
    if not rows:
        return [], []
    header = ["model, policy, threads, numerics", "prompt tokens", "prefill tok/s", "decode tok/s",
              "first run s (compiles)"]
    return [Table(run.name, header, rows, run)], []


def overlap_tables(run: Run):
    """`scripts/bench_host_overlap.py` lines: a synthetic layer's host and device halves
    alone, one after the other, with no order between them, and as the start / finish pair."""
    rows = []
    for x in run.bench("host_overlap"):
        longest = Value(max(x.get("host_ms"), x.get("device_ms")), x)
        pair, serial = Value(x.get("pair_ms"), x), Value(x.get("serial_ms"), x)
        rows.append([Text(f"{x.get('tokens')} tokens x {x.get('experts')} experts ({x.get('d_model')} x {x.get('d_ff')}, "
                          f"{x.get('host_threads')} host thread); {x.get('device_matmuls')} matmuls"
                          + ("; XLA and host threads pinned to their own cores" if x.get("pinned") else "")),
                     Value(x.get("host_ms"), x), Value(x.get("device_ms"), x), serial, Value(x.get("blocking_ms"), x), pair,
                     Ratio(pair, longest), Ratio(serial, longest)]
                    + ([Value(x.get("corun_ms"), x), Ratio(pair, Value(x.get("corun_ms"), x))] if "corun_ms" in x.data
                       else [Text("—")] * 2))
    if not rows:
        return [], []
    header = ["layer: host half; device half", "host ms", "device ms", "serial ms", "no order ms", "pair ms",
              "pair / max (ratio)", "serial / max (ratio)", "both at once, no step, ms", "pair / both at once (ratio)"]
    return [Table(run.name, header, rows, run)], []


def mesh_tables(run: Run):
    """`scripts/bench_mesh.py` lines: the default model's decode on 1, 2 and 4 devices."""
    rows = []
    for x in run.bench("mesh"):
        runs = x.get("runs")
        one = Value(runs[0]["decode_step_ms"], x)
        for r in runs:
            rates = Joined(tuple(Value(d["hit_rate"], x) for d in r["per_device"]), sep=", ")
            step = Value(r["decode_step_ms"], x)
            rows.append([Text(f"{r['devices']} ({'forced host devices' if x.get('forced_host_devices') else 'real'})"),
                         Value(x.get("cache_slots_per_device"), x), step, Value(r["prefill_s"], x), rates,
                         Ratio(step, one), Text("yes" if x.get("same_tokens") else "NO")])
    if not rows:
        return [], []
    header = ["devices", "cache slots per device", "decode step ms", "prefill s", "hit rate per device",
              "step / first row (ratio)", "same tokens"]
    return [Table(run.name, header, rows, run)], []


def processes_tables(run: Run):
    """`scripts/bench_processes.py` lines: one process against several, per process."""
    rows = []
    for x in run.bench("processes"):
        runs = x.get("runs")
        one = Value(runs["1"]["processes"][0]["peak_rss_bytes"], x)
        for n, r in runs.items():
            for p in r["processes"]:
                rss = Value(p["peak_rss_bytes"], x)
                read = Value(p["pool_bytes_read"], x)
                rows.append([Text(f"{n} (process {p['process']})"), read, Ratio(read, Value(p["pool_bytes"], x)),
                             rss, Ratio(rss, one), Value(p["load_s"], x),
                             Value(p["prefill_s"], x), Value(p["decode_tok_s"], x),
                             Text("yes" if r["tokens_equal"] else "NO")])
    if not rows:
        return [], []
    header = ["processes", "pool bytes read", "read / pool (ratio)", "peak RSS bytes", "RSS / one process (ratio)",
              "load s",
              "prefill s", "decode tok/s", "same tokens"]
    return [Table(run.name, header, rows, run)], []


def mixed_tables(run: Run):
    """`scripts/bench_mixed_prefill.py` lines: a long prompt's TTFT beside decoding rows per
    prefill chunk, against the same prompt alone, and the decoding rows' inter-token gaps."""
    rows = []
    for x in run.bench("mixed_prefill"):
        for r in x.get("rows") or []:
            ttft, solo = Value(r["ttft_s"], x), Value(r["alone_ttft_s"], x)
            gap = r["gap_ms"]
            rows.append([Text(f"chunk {r['chunk']:,}: {x.get('prompt_tokens'):,}-token prompt beside "
                              f"{x.get('decoding_rows')} decoding rows (context {x.get('context'):,})"),
                         ttft, Joined(tuple(Value(v, x) for v in r["ttft_rounds_s"]), sep=", "), solo,
                         Ratio(ttft, solo), Value(gap["p50"], x), Value(gap["p95"], x), Value(gap["max"], x)])
    if not rows:
        return [], []
    header = ["prefill chunk, prompt", "TTFT s (median)", "TTFT s, every round", "the prompt alone: TTFT s",
              "beside rows / alone (ratio)", "decoders' gap ms p50", "gap ms p95", "gap ms max"]
    return [Table(run.name, header, rows, run)], []


def decode_gaps(runs: list[Run]) -> list[str]:
    have = set()
    for run in runs:
        for _, weights, threads, _, _ in _pairs(run, "decode_tok_per_s", "tok_per_s"):
            have.add((weights, threads))
    missing = [f"{w} at {t} thread{'s' if t != 1 else ''}" for w in ("bf16", "Q8_0", "Q4_K_M") for t in (1, 2)
               if (w, t) not in have]
    return [f"{', '.join(missing)}: no clean pair of runs (both engines, one machine)"] if missing else []


LEGEND = (
    ("olmoe-*.gguf", "OLMoE-1B-7B geometry, 4 layers (`make_geometry_checkpoint.py --family olmoe --layers 4`), "
                     "converted and quantised by llama.cpp's own tools"),
    ("geom-q36", "Qwen3.6-35B-A3B geometry (Gated DeltaNet hybrid), 4 layers (`--family qwen3_5_moe`); "
                 "`geom-q36-bf16.gguf` its bf16 conversion"),
    ("ftjax-geom", "Qwen3-30B-A3B geometry, 4 layers (`--family qwen3_moe`)"),
    ("/tmp/geom-olmoe", "the OLMoE geometry folder"),
    ("default_model` / `default", "the embedded model"),
)


@dataclass
class Question:
    folder: str
    title: str
    intro: str
    builders: list[Callable[[Run], tuple[list[Table], list[Headline]]]]
    produce: str  # the commands that record lines for it
    titles: list[tuple[str, str]] = field(default_factory=list)  # (heading, intro) per builder after the first
    gaps: Callable[[list[Run]], list[str]] = lambda runs: []  # what this question still lacks


QUESTIONS = [
    Question("decode", "Decode against llama.cpp",
             "The same weights in both engines: GGUF files made by llama.cpp's own converter and quantizer from a "
             "geometry checkpoint (`scripts/make_geometry_checkpoint.py`: a model family's real layer shapes, fewer "
             "layers, random weights), greedy decode after a prompt; the peers take turns within a run. The median "
             "over the rounds is the raw line holding it (the lower middle one for an even count), every round "
             "beside it.",
             [decode_tables, prefill_tables, ceiling_tables],
             "`scripts/bench_quant.py --skip-ppl --skip-kernel --model /tmp/olmoe-FORMAT.gguf --threads 1 2` and "
             "`scripts/bench_llamacpp.py --gguf /tmp/olmoe-FORMAT.gguf --threads T --prompt 512 --new 32` for FORMAT "
             "in bf16, q8_0, q4_k_m, taking turns ([benchmarks.md](benchmarks.md#decode-and-prefill-against-llamacpp))",
             [("Prefill against llama.cpp", "The same runs: the prompt before the decode, in tokens per second."),
              ("Decode against the read ceiling", "ftjax alone: how close a decode step comes to the bytes per "
                                                  "second the machine can read. The probe (`host_kernels/"
                                                  "bandwidth.cc`) reads 1, 2, 4 and 8 streams per thread and keeps "
                                                  "the fastest from the run 2026-12-07-zen4-streams-probe on; the "
                                                  "runs before it read one stream per thread, which a kernel "
                                                  "reading several streams beats (the bf16 expert GEMV read 1.34x "
                                                  "of it on one Zen 4 core), so their ratios run high.")],
             decode_gaps),
    Question("context", "Cost growth with context",
             "ms per decoded token with a given number of tokens already held (`scripts/bench_context.py`: decode "
             "steps on a state of that capacity; llama.cpp: llama-bench's tg at that depth, on the same weights).",
             [context_tables],
             "`scripts/bench_context.py --model DIR --threads 2 --contexts 8 1024 3000 8192 32768 --steps 16 "
             "--rounds 3 [--kv-dtype float32]` and `scripts/bench_llamacpp.py --llama-bench BIN --gguf FILE "
             "--contexts 8 1024 3000 8192 32768 --new 16 --rounds 3 --threads 2`, DIR the OLMoE attention geometry "
             "(`scripts/make_geometry_checkpoint.py --family olmoe_attention --layers 2`) and FILE its GGUF",
             gaps=lambda runs: [] if any(r.bench("context_llamacpp") for r in runs) else
             ["llama.cpp at the same contexts on the same machine"]),
    Question("agent", "Agent TTFT with and without state reuse",
             "`ftjax bench agent`: synthetic agent transcripts with history rewrites replayed against `ftjax serve`, "
             "one server per `--state-cache` mode; client-side TTFT.",
             [agent_tables],
             "`ftjax bench agent --out DIR | tail -1 >> docs/results/agent/DATE/agent.jsonl`"),
    Question("cache", "Cache-policy miss rates against Belady",
             "`ftjax bench paper`: decode miss rates of the expert-cache policies on routing traces of the loaded "
             "model, at the cache size the paper's RTX 5090 would hold, with Belady's optimum as the floor.",
             [cache_tables],
             "`ftjax bench paper --out DIR | tail -1 >> docs/results/cache/DATE/paper.jsonl`"),
    Question("memory", "Memory",
             "Resident memory of a serving process over a long run (`scripts/bench_soak.py`: the start is after its "
             "first phase, every program compiled and the state cache at its budget).",
             [memory_tables],
             "`python scripts/bench_soak.py | tail -1 >> docs/results/memory/DATE-soak/soak.jsonl`"),
    Question("batch", "Batched decode",
             "B sessions decoded together in one step (`scripts/bench_batch.py`): total tokens per second.",
             [batch_tables],
             "`scripts/bench_batch.py --policies host lru --batches 1 2 4 8`"),
    Question("prompt", "Prompt cost against length",
             "Prefill seconds of one prompt into a new session on the embedded model's weights at a declared context "
             "of 16,384 tokens (`ftjax.bench.models.default_model_with_context`): the pieces of "
             "`ftjax/engine/shapes.py` (padding within 12.5%) against one call per chunk padded to a power of two, "
             "and the first call of each length in a fresh process (compiling) and in a restarted one that reads "
             "the persistent compilation cache; where the run has them, llama.cpp's llama-bench on the same weights "
             "(a GGUF of the default model at that context), the same lengths from an empty context, as many "
             "threads.",
             [prompt_tables],
             "`scripts/bench_prompt_cost.py [--llama-bench BIN --gguf FILE] | tail -1 >> "
             "docs/results/prompt/DATE/prompt.jsonl`"),
    Question("attention", "Prompt attention per path",
             "One layer's attention for a prompt chunk, bf16 K/V cache (`scripts/bench_prompt_attention.py`): the bf16 "
             "tiles (`host_kernels/attention_tiles.cc`, what numerics=\"fast\" runs: AMX tiles on an AMX CPU, their "
             "AVX512-BF16 vector form on one without; q, k, v and the softmax weights rounded to bf16) and the exact "
             "f32 kernel at each thread count, against XLA's blocked "
             "f32 form (what a prompt runs without either or under numerics=\"exact\") on all cores; a first chunk "
             "from position 0 and a chunk appended after a long history.",
             [prompt_attention_tables],
             "`scripts/bench_prompt_attention.py >> docs/results/attention/DATE/attention.jsonl`"),
    Question("prefill", "Expert prefill per kernel path",
             "One MoE layer of OLMoE-1B-7B's experts (64 x [2048, 1024], top-8, bf16, Q8_0 or llama.cpp's Q4_K_M "
             "pair q4_k/q6_k) and 512 routed tokens "
             "(`scripts/bench_expert_prefill.py`): ftjax's host expert kernel under each ISA path (the exact AVX-512 "
             "/ AVX2 kernels; for bf16 experts AVX512_BF16 and the AMX tiles round activations to bf16; for Q8_0 "
             "`amx_bf16` is the AMX-INT8 tiles, the exact path's integer sums; for Q4_K / Q6_K the bf16 tiles on rows "
             "widened to bf16 pass by pass; `avx512_bf16_tiles` is the bf16 tiles' AVX512-BF16 vector form, for CPUs "
             "without AMX, Q8_0 widened to bf16 too), the whole layer; oneMKL doing only "
             "each expert's two products, activations already gathered: `cblas_gemm_bf16bf16f32` for bf16 and the K "
             "formats, `cblas_gemm_s8u8s32` for Q8_0 (one scale per matrix: the int8 work without Q8_0's scale per 32).",
             [expert_prefill_tables, numerics_tables],
             "`scripts/bench_expert_prefill.py --mkl-lib DIR [--dtype q8_0 | q4_k/q6_k] >> docs/results/prefill/DATE/prefill.jsonl`; "
             "`scripts/bench_decode.py --model DIR --policies host --numerics exact fast --prompt 512 --new 16 "
             "--threads 2 --no-breakdown >> docs/results/prefill/DATE/numerics.jsonl`",
             [("Whole model, exact and fast numerics", "The OLMoE-1B-7B geometry with 4 of its 16 layers "
               "(`make_geometry_checkpoint.py --family olmoe --layers 4`), host policy: a 512-token prompt's prefill "
               "and the decode after it, `numerics` exact (f32 activations) and fast (bf16 K/V, the AMX tiles for "
               "expert prefill).")]),
    Question("overlap", "Host and device halves of a layer",
             "A synthetic MoE layer (`scripts/bench_host_overlap.py`): the host expert kernel and an XLA matmul "
             "chain of about the same time, alone, one after the other (serial), with no order between them (XLA's "
             "CPU runtime may overlap them itself) and as the start / finish pair the executor uses; XLA kept to "
             "one core, the host kernel on the other.",
             [overlap_tables],
             "`scripts/bench_host_overlap.py | tail -1 >> docs/results/overlap/DATE/overlap.jsonl` (3 runs)"),
    Question("mesh", "Experts split over several devices",
             "The embedded model decoding on 1, 2 and 4 devices of a mesh (`scripts/bench_mesh.py`: each device owns "
             "the experts e % P == d and caches its own; attention replicated; one all-reduce per MoE layer), the "
             "same cache slots per device, pinned bandwidths. Forced host devices share this machine's cores and "
             "RAM: the step times show what the collective and the replicated attention cost, not a speed-up.",
             [mesh_tables],
             "`scripts/bench_mesh.py | tail -1 >> docs/results/mesh/DATE/mesh.jsonl`"),
    Question("processes", "Experts split over several processes",
             "One process, then two on localhost (`scripts/bench_processes.py`: `jax.distributed`, gloo, one CPU "
             "device each, each process reading only the experts its device owns), on the OLMoE geometry with 4 "
             "layers (`make_geometry_checkpoint.py --family olmoe --layers 4`), lru with 16 slots per device, pinned "
             "bandwidths, a 128-token prompt and 16 greedy tokens. The processes share this machine's two cores: "
             "the rates show the all-reduce between processes per MoE layer, not a speed-up.",
             [processes_tables],
             "`scripts/bench_processes.py --model DIR | tail -1 >> docs/results/processes/DATE/processes.jsonl`"),
    Question("mixed", "Prefill beside decoding rows",
             "The scheduler prefills a prompt one chunk per iteration, each followed by a decode step of the rows "
             "already decoding (`scripts/bench_mixed_prefill.py`, the embedded model at a declared context, warm): "
             "per `--prefill-chunk`, the new prompt's time to first token with rows decoding and alone (no row "
             "decodes: the solo chunk), and the decoding rows' gaps between tokens while it prefills.",
             [mixed_tables],
             "`scripts/bench_mixed_prefill.py | tail -1 >> docs/results/mixed/DATE/mixed.jsonl`"),
    Question("compile", "Compile time of a fresh model",
             "XLA backend compile seconds of a fresh model's first prompt and first decode step, and the wall time of "
             "that first prompt, in an empty compilation-cache folder (`scripts/bench_compile.py`); where the run has "
             "them, the first prompt of a restarted process reading those programs back from the cache and the "
             "seconds of those reads. `N layers`: the embedded model made N layers deep "
             "(`ftjax.bench.models.default_model_with_layers`), for compile time against depth.",
             [compile_tables],
             "`scripts/bench_compile.py`"),
]


def anchor(title: str) -> str:
    return re.sub(r"[^a-z0-9 -]", "", title.lower()).replace(" ", "-")


# ---------------------------------------------------------------------------- the page and the README rows


def build(runs: dict[str, list[Run]] | None = None):
    """-> (page markdown, README headline markdown, every table) from the raw lines."""
    runs = load_runs() if runs is None else runs
    sections, headlines, tables, missing, gaps = [], [], [], [], []
    for q in QUESTIONS:
        titles = [(q.title, "")] + q.titles
        parts = []
        for (title, intro), builder in zip(titles, q.builders):
            made = [(t, h) for run in runs.get(q.folder, []) for t, h in [builder(run)]]
            ts = [t for tt, _ in made for t in tt]
            headlines += [h for _, hh in made for h in hh]
            tables += ts
            if ts:
                body = [intro, ""] if intro else []
                for t in ts:
                    body += [f"### {t.title}\n", caption(t), "", render_table(t, ""), ""]
                    if t.note:
                        body += [t.note, ""]
                parts.append((title, body))
        gaps += [(q, g) for g in q.gaps(runs.get(q.folder, []))]
        if not parts:
            missing.append(q)
            continue
        first = parts[0][0]
        sections.append(f"## {first}\n\n{q.intro}\n\nReproduce: {q.produce}.\n\n" + "\n".join(parts[0][1]))
        sections += [f"## {title}\n\n" + "\n".join(body) for title, body in parts[1:]]
    anchors = {anchor(line[3:]) for sec in sections for line in sec.splitlines() if line.startswith("## ")}
    for h in headlines:
        if h.anchor not in anchors:
            raise ResultsError(f"headline {h.label!r} links to #{h.anchor}, which is no section of the page")
    used = {x for t in tables for x in t.lines()}
    every = {x for rs in runs.values() for r in rs for x in r.lines}
    unused = sorted(every - used, key=lambda x: x.ref)
    if unused:
        raise ResultsError(f"{unused[0].ref}: used by no table (and {len(unused) - 1} more); superseded or unused "
                           f"lines are pruned, or a table is added for them")
    page = _page(sections, missing, gaps)
    return page, _headlines(headlines), tables


def _page(sections: list[str], missing: list[Question], gaps: list[tuple[Question, str]]) -> str:
    out = ["# Results", "",
           "<!-- Generated by scripts/results.py from docs/results/**/*.jsonl; edit those, not this file. -->", "",
           "One table per question, one machine per table. Every measured number links to the raw JSON line it "
           "comes from (committed under `docs/results/`, recorded from a clean tree: `\"dirty\": false` at the "
           "commit in the caption); ratios are computed from the linked cells of their row. Runs that a newer "
           "run of the same question replaced, and every line measured on an uncommitted tree, are not kept. "
           "How each benchmark works and what was learned from it: [benchmarks.md](benchmarks.md).", "",
           "Regenerate with `python scripts/results.py` after adding lines (`--check` tells whether this page and "
           "the README's headline rows are current).", "",
           "Model names in the tables are the files and folders the benchmark commands make "
           "([benchmarks.md](benchmarks.md) has the commands): " + "; ".join(f"`{k}`: {v}" for k, v in LEGEND) + ".",
           ""]
    out += [s.rstrip() + "\n" for s in sections]
    if missing or gaps:
        out += ["## Not measured on a clean tree yet", ""]
        out += [f"- **{q.title}**: no clean raw line. Produce them with {q.produce}." for q in missing]
        out += [f"- **{q.title}**: {g}. Produce them with {q.produce}." for q, g in gaps]
        out.append("")
    return "\n".join(out)




def _headlines(heads: list[Headline]) -> str:
    heads = heads[:MAX_HEADLINES]
    base = "docs/"
    rows = ["| figure; machine, run date | ftjax | llama.cpp | table |", "|---|---|---|---|"]
    for h in heads:
        md = [h.ftjax.md(base), h.peer.md(base)]
        rows.append(f"| {h.label} | {md[0]} | {md[1]} | [results](docs/results.md#{h.anchor}) |")
    return "\n".join(rows)


def replace_region(text: str, body: str) -> str:
    if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
        raise ResultsError(f"README.md needs one {BEGIN} ... {END} region")
    head, rest = text.split(BEGIN)
    _, tail = rest.split(END)
    return f"{head}{BEGIN}\n{body}\n{END}{tail}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if docs/results.md or README.md is not current")
    args = ap.parse_args(argv)
    try:
        page, heads, _ = build()
        readme = replace_region(README.read_text(), heads)
    except ResultsError as e:
        print(f"results.py: error: {e}", file=sys.stderr)
        return 2
    stale = [p for p, new in ((PAGE, page), (README, readme)) if not p.is_file() or p.read_text() != new]
    if args.check:
        for p in stale:
            print(f"results.py: {p.relative_to(REPO)} is not what docs/results/ gives: run python scripts/results.py",
                  file=sys.stderr)
        return 1 if stale else 0
    PAGE.write_text(page)
    README.write_text(readme)
    for p in stale:
        print(f"wrote {p.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
