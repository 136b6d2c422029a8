"""The results page and the README's headline rows are generated from committed raw lines
(scripts/results.py), and every number in them resolves to a clean raw line on the machine
its row names. Also the generator's rules on synthetic folders, and the runners' one
clean-tree check (ftjax/runinfo.py). Standard library only: no jax, no ftjax import (both
modules are loaded by path)."""

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\[([^\]]*)\]\(([^)#]+)#L(\d+)\)")


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


results = _load("ftjax_results_script", REPO / "scripts" / "results.py")
runinfo = _load("ftjax_runinfo_script", REPO / "ftjax" / "runinfo.py")


# ---------------------------------------------------------------------------- the committed page


def test_page_and_readme_are_what_the_raw_lines_give():
    assert results.main(["--check"]) == 0, "run: python scripts/results.py"


def _tables(text: str):
    """(caption, header cells, rows of cells) of every markdown table in text."""
    lines, out, i = text.splitlines(), [], 0
    while i < len(lines):
        if lines[i].startswith("|") and i + 1 < len(lines) and lines[i + 1].startswith("|---"):
            caption = next((lines[j] for j in range(i - 1, max(-1, i - 4), -1) if lines[j].startswith("*")), "")
            header = [c.strip() for c in lines[i].strip("|").split("|")]
            rows, i = [], i + 2
            while i < len(lines) and lines[i].startswith("|"):
                rows.append([c.strip() for c in lines[i].strip("|").split(" | ")])
                i += 1
            out.append((caption, header, rows))
        else:
            i += 1
    return out


def _resolve(base: Path, target: str, n: int) -> dict:
    path = (base / target).resolve()
    assert path.is_relative_to(REPO / "docs" / "results"), target
    text = path.read_text().splitlines()
    assert 1 <= n <= len(text), f"{target}#L{n}: no such line"
    return json.loads(text[n - 1])


def _numbers(x):
    if isinstance(x, bool):
        return
    if isinstance(x, (int, float)):
        yield x
    elif isinstance(x, dict):
        for v in x.values():
            yield from _numbers(v)
    elif isinstance(x, list):
        for v in x:
            yield from _numbers(v)


def _check_tables(text: str, base: Path, machine_in_label: bool) -> int:
    """Every number of every table resolves; returns how many were checked."""
    checked = 0
    for caption, header, rows in _tables(text):
        for row in rows:
            assert len(row) == len(header), row
            cpus = set()
            for col, cell in zip(header[1:], row[1:]):
                if "(ratio)" in col:  # derived from the linked cells of the row (regeneration checks the sums)
                    assert re.fullmatch(r"(\d+\.\d\dx|—)", cell), cell
                    continue
                for shown, target, n in LINK.findall(cell):
                    line = _resolve(base, target, int(n))
                    assert line.get("dirty") is False and re.fullmatch(r"[0-9a-f]{7,40}", line.get("commit", "")), \
                        f"{target}#L{n} is not from a clean tree"
                    assert any(results.fmt(v) == shown for v in _numbers(line)), \
                        f"{shown} is no value of {target}#L{n}"
                    machine = line.get("machine") if isinstance(line.get("machine"), dict) else line
                    cpus.add(machine["cpu"])
                    checked += 1
                rest = LINK.sub("", cell)
                assert not re.search(r"\d", rest), f"a number without its raw line: {cell!r}"
            where = row[0] if machine_in_label else caption
            for cpu in cpus:
                assert cpu in where, f"row {row[0]!r} links lines of {cpu}, which {where!r} does not name"
    return checked


def test_every_number_on_the_results_page_resolves_to_a_clean_raw_line():
    page = (REPO / "docs" / "results.md").read_text()
    assert _check_tables(page, REPO / "docs", machine_in_label=False) > 0


def test_every_readme_headline_resolves_to_a_clean_raw_line_on_the_machine_it_names():
    text = (REPO / "README.md").read_text()
    region = text.split(results.BEGIN)[1].split(results.END)[0]
    rows = [r for r in region.splitlines() if r.startswith("|") and not r.startswith("|---")]
    assert 1 < len(rows) <= results.MAX_HEADLINES + 1  # header + at most ~10 rows
    assert _check_tables(region, REPO, machine_in_label=True) > 0


def test_readme_quotes_no_performance_figure_outside_the_generated_rows():
    text = (REPO / "README.md").read_text()
    head, rest = text.split(results.BEGIN)
    outside = head + rest.split(results.END)[1]
    figure = re.compile(r"\d[\d.,]*\s*(?:-\s*\d[\d.,]*\s*)?(?:tok/s|GB/s|ms/token|µs|ms\b|x faster|x slower)")
    assert not figure.findall(outside), figure.findall(outside)


def test_raw_lines_are_committed_clean_and_each_used_by_a_table():
    runs = results.load_runs()  # raises on a dirty line or a stray file
    page, _, tables = results.build(runs)  # raises on a line no table uses
    files = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "docs" / "results").rglob("*.jsonl"))
    assert files and tables
    tracked = subprocess.run(["git", "ls-files", "docs/results"], cwd=REPO, capture_output=True, text=True)
    assert tracked.returncode == 0, f"the results are checked in a git checkout: {tracked.stderr}"
    assert sorted(tracked.stdout.split()) == files, "raw lines must be committed (git add docs/results)"


# ---------------------------------------------------------------------------- the generator's rules


def _line(**kw) -> str:
    base = {"bench": "batched_decode", "model": "m", "policy": "host", "cache_slots": 0, "threads": 2,
            "total_tok_per_s": 10.0, "batch": 1, "commit": "abcdef1", "dirty": False,
            "machine": {"cpu": "CPU A", "cores": 2}}
    return json.dumps({**base, **kw})


def _tree(tmp_path, lines: list[str]) -> Path:
    run = tmp_path / "docs" / "results" / "batch" / "2026-01-01-x"
    run.mkdir(parents=True)
    (run / "batch.jsonl").write_text("\n".join(lines) + "\n")
    return tmp_path / "docs" / "results"


def test_synthetic_run_builds_one_linked_table(tmp_path):
    root = _tree(tmp_path, [_line(batch=1), _line(batch=4, total_tok_per_s=25.0)])
    page, heads, tables = results.build(results.load_runs(root))
    assert "[10.0](results/batch/2026-01-01-x/batch.jsonl#L1)" in page
    assert "[25.0](results/batch/2026-01-01-x/batch.jsonl#L2)" in page and "2.50x" in page
    assert "CPU A, 2 cores" in page and "`abcdef1`" in page
    assert "docs/results/batch/2026-01-01-x/batch.jsonl#L2" in heads
    assert "## Not measured on a clean tree yet" in page and "**Decode against llama.cpp**" in page


@pytest.mark.parametrize("bad", [{"dirty": True}, {"dirty": None}, {"commit": "unknown"}])
def test_a_line_from_a_dirty_tree_stops_the_generator(tmp_path, bad):
    root = _tree(tmp_path, [_line(), _line(batch=2, **bad)])
    with pytest.raises(results.ResultsError, match=r"batch.jsonl#L2: not from a clean tree"):
        results.load_runs(root)


def test_a_line_without_the_dirty_field_stops_the_generator(tmp_path):
    line = json.loads(_line())
    del line["dirty"]
    root = _tree(tmp_path, [json.dumps(line)])
    with pytest.raises(results.ResultsError, match="not from a clean tree"):
        results.load_runs(root)


def test_a_line_no_table_uses_stops_the_generator(tmp_path):
    root = _tree(tmp_path, [_line(), json.dumps({**json.loads(_line()), "bench": "something_else"})])
    with pytest.raises(results.ResultsError, match=r"#L2: used by no table"):
        results.build(results.load_runs(root))


def test_two_machines_in_one_table_stop_the_generator(tmp_path):
    root = _tree(tmp_path, [_line(), _line(batch=2, machine={"cpu": "CPU B", "cores": 2})])
    with pytest.raises(results.ResultsError, match="one machine per table"):
        results.build(results.load_runs(root))


def test_median_is_a_measured_line_not_an_average(tmp_path):
    lines = [results.Line(Path("f.jsonl"), i + 1, {"v": v}) for i, v in enumerate([3.0, 1.0, 4.0, 2.0])]
    assert results.median_line(lines, lambda x: x.data["v"]).data["v"] == 2.0  # lower middle of 1 2 3 4


# ---------------------------------------------------------------------------- the runners' clean-tree check


def _git(cwd, *args):
    subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture
def repo(tmp_path, monkeypatch):
    _git(tmp_path, "init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    _git(tmp_path, "add", "a.py")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "a")
    monkeypatch.setattr(runinfo, "REPO", tmp_path)
    return tmp_path


def test_require_clean_passes_a_clean_tree(repo):
    (repo / "untracked.txt").write_text("not part of the build\n")  # untracked files do not count
    info = runinfo.require_clean(False)
    assert info["dirty"] is False and re.fullmatch(r"[0-9a-f]{7,40}", info["commit"])


def test_require_clean_refuses_a_dirty_tree_naming_the_files(repo):
    (repo / "a.py").write_text("x = 2\n")
    with pytest.raises(runinfo.DirtyTreeError, match=r"a\.py.*--allow-dirty"):
        runinfo.require_clean(False)
    assert runinfo.require_clean(True)["dirty"] is True  # allowed: the line says so


def test_outside_a_checkout_counts_as_dirty(tmp_path, monkeypatch):
    monkeypatch.setattr(runinfo, "REPO", tmp_path)
    assert runinfo.commit_info() == {"commit": "unknown", "dirty": True}
    with pytest.raises(runinfo.DirtyTreeError, match="not a git checkout"):
        runinfo.require_clean(False)


def test_check_clean_or_exit_exits_2_with_the_reason(repo, capsys):
    (repo / "a.py").write_text("x = 3\n")
    with pytest.raises(SystemExit) as e:
        runinfo.check_clean_or_exit(False, prog="bench_x.py")
    assert e.value.code == 2 and "bench_x.py: error: refusing to record" in capsys.readouterr().err


def test_machine_info_names_cpu_flags_and_run_fields_the_command():
    m = runinfo.machine_info()
    assert isinstance(m["cpu_flags"], list) and set(m["cpu_flags"]) <= set(runinfo.ISA_FLAGS)
    f = runinfo.run_fields()
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d", f["time"]) and f["command"]


def test_soak_lines_make_a_memory_table(tmp_path):
    run = tmp_path / "docs" / "results" / "memory" / "2026-01-02-soak"
    run.mkdir(parents=True)
    line = {"bench": "serve_agent_soak", "requests": 1160, "state_cache": "semantic", "state_cache_budget_mib": 256,
            "rss_mib_baseline": 1400.0, "rss_mib_end": 1428.0, "commit": "abcdef1", "dirty": False,
            "machine": {"cpu": "CPU A", "cores": 2}}
    (run / "soak.jsonl").write_text(json.dumps(line) + "\n")
    page, _, tables = results.build(results.load_runs(tmp_path / "docs" / "results"))
    assert "## Memory" in page and "[1428](results/memory/2026-01-02-soak/soak.jsonl#L1)" in page and "1.02x" in page
    assert "- **Memory**" not in page  # no longer in the "not measured" list


def test_context_lines_set_each_slowdown_beside_its_bytes_bound(tmp_path):
    run = tmp_path / "docs" / "results" / "context" / "2026-01-03-x"
    run.mkdir(parents=True)
    common = {"commit": "abcdef1", "dirty": False, "machine": {"cpu": "CPU A", "cores": 2}, "threads": 2}
    ours = [{"bench": "decode_context", "model": "m", "policy": "host", "kv_dtype": "bfloat16", "context": c,
             "ms_per_token": ms, "step_bytes_read": nbytes, **common}
            for c, ms, nbytes in [(8, 2.0, 100), (3000, 3.3, 150)]]
    peer = [{"bench": "context_llamacpp", "gguf": "/tmp/m.gguf", "type_k": "f16", "context": c, "ms_per_token": ms,
             **common} for c, ms in [(8, 1.5), (3000, 6.0)]]
    (run / "ftjax.jsonl").write_text("\n".join(map(json.dumps, ours)) + "\n")
    (run / "llamacpp.jsonl").write_text("\n".join(map(json.dumps, peer)) + "\n")
    page, _, _ = results.build(results.load_runs(tmp_path / "docs" / "results"))
    ftjax_row = next(r for r in page.splitlines() if r.startswith("| ftjax: `m`"))
    peer_row = next(r for r in page.splitlines() if r.startswith("| llama.cpp: `m.gguf`"))
    assert ftjax_row.endswith("| 1.65x | 1.10x |")  # 3.3 / 2.0 slower where the bytes grow 1.5x
    assert peer_row.endswith("| 4.00x | — |")  # llama.cpp's lines carry no bytes
    assert "- **Cost growth with context**" not in page  # llama.cpp's rows answer the gap
