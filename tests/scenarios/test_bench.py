"""`python -m bench`: finds the benchmark scripts, runs them, and writes docs/benchmarks.md
section by section (a run of one benchmark keeps the others' sections)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # bench/ is not an installed package

from bench import document, registry  # noqa: E402
from bench.results import Check  # noqa: E402


def run_bench(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    env.pop("BENCH_RESULT", None)
    return subprocess.run(
        [sys.executable, "-m", "bench", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_every_bench_script_is_found_with_its_quick_arguments_without_importing_it(tmp_path):
    found, broken = registry.discover()
    names = {b.name for b in found}
    assert {"flash_checkpoint", "s3_persist", "data_prep", "recovery", "trainer_overhead", "gpu"} <= names
    assert broken == []
    by_name = {b.name: b for b in found}
    assert by_name["trainer_overhead"].args(quick=True) != by_name["trainer_overhead"].args(quick=False)
    # a benchmark written later without a BENCH literal (as chaos_goodput may be) still runs, shortened
    (tmp_path / "later.py").write_text(
        '"""A later benchmark: faults every minute."""\nimport nonexistent_module\n'
        'p.add_argument("--minutes", type=float, default=10)\n'
        'p.add_argument("--fault-every", type=float, default=120)\n'
    )
    (tmp_path / "broken.py").write_text("def (:\n")
    later, broken = registry.discover(tmp_path)
    assert [(b.name, b.title, b.args(True), b.args(False)) for b in later] == [
        ("later", "A later benchmark: faults every minute", ["--minutes", "1", "--fault-every", "20"], [])
    ]
    assert broken == ["broken.py"]


@pytest.mark.parametrize(
    "check, verdict",
    [
        (Check("ratio", 0.98, 0.97, ">="), "met"),
        (Check("ratio", 0.90, 0.97, ">=", "slow kernels"), "missed: slow kernels"),
        (Check("wall ratio", 1.05, 1.10, "<="), "met"),
        (Check("wall ratio", 2.0, 1.10, "<="), "missed: no reason recorded"),
    ],
)
def test_a_check_says_met_or_missed_with_why(check, verdict):
    assert check.line().endswith(verdict)


def test_a_kept_section_survives_and_a_damaged_document_is_written_anew(tmp_path):
    s = document.Section(
        name="a",
        title="A",
        command="python bench/a.py",
        machine="m",
        mode="quick",
        wall_s=1,
        output="x 1\n",
        checks=[Check("r", 1.0, 0.9)],
    )
    out = tmp_path / "b.md"
    document.write(out, [s], command="python -m bench", machine="m")
    kept = document.parse(out.read_text())
    assert list(kept) == ["a"] and kept["a"].checks == s.checks and kept["a"].render() == s.render()
    assert document.parse("# Benchmarks\n<!-- bench:a {not json} -->\nx\n<!-- /bench:a -->\n") == {}


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU benchmark would run for real")
def test_python_m_bench_quick_writes_a_well_formed_section_and_keeps_the_others(tmp_path):
    out = tmp_path / "benchmarks.md"
    out.write_text(
        document.Section(
            name="data_prep",
            title="Data preparation (earlier run)",
            command="c",
            machine="m",
            mode="full",
            wall_s=9,
            output="kept table\n",
        ).render()
        + "\n## The test suite's CPU\n\nwritten by hand\n"
    )
    done = run_bench("--quick", "--only", "gpu", "--out", str(out))
    assert done.returncode == 0, done.stderr
    text = out.read_text()
    sections = document.parse(text)
    assert set(sections) == {"data_prep", "gpu"}  # the other benchmarks were not run and had no section
    assert "kept table" in sections["data_prep"].text
    assert text.endswith(
        "<!-- /bench:gpu -->\n\n## The test suite's CPU\n\nwritten by hand\n"
    )  # prose after the sections stays
    gpu = sections["gpu"]
    assert gpu.status == "skipped: no CUDA device" and gpu.mode == "quick"
    assert "## GPU" in gpu.text and "`python bench/gpu.py --steps 6" in gpu.text
    assert "**Quick mode**" in text and "| GPU" in text and "cores" in text and "torch" in text


def test_an_unknown_benchmark_name_is_refused_with_the_known_ones(tmp_path):
    done = run_bench("--only", "nope", "--out", str(tmp_path / "b.md"))
    assert done.returncode == 2 and "no benchmark named nope" in done.stderr and "trainer_overhead" in done.stderr
    assert not (tmp_path / "b.md").exists()


def test_the_campaign_breakdown_adds_up_to_its_wall_time_and_names_where_it_went():
    from bench.orchestration import breakdown

    p = "12:00:00.000 | INFO    | "
    lines = [
        (20.0, p + "Flow run 'a' - Beginning flow run 'a' for flow 'pretrain-campaign'"),
        (21.0, p + "Flow run 'a' - campaign demo"),
        (30.0, p + "Task run 'open-campaign-run-a09' - Finished in state Completed()"),
        (31.0, p + "Flow run 'b' - Beginning subflow run 'b' for flow 'prepare-data'"),
        (34.0, p + "Flow run 'b' - Finished in state Completed()"),
        (35.0, p + "Flow run 'c' - Beginning subflow run 'c' for flow 'train-stage'"),
        (36.0, p + "Flow run 'c' - stage main: launching attempt 0 from scratch"),
        (36.5, p + "Task run 'run-training-job-8c9' - stage main attempt 0: 1 node(s) × 2 workers"),
        (45.0, p + "Task run 'judge-checkpoints-1a2' - stage main: checkpoint 2 is good"),  # beside training:
        (45.5, p + "Task run 'judge-checkpoints-1a2' - Finished in state Completed()"),  # no time of its own
        (60.0, p + "Task run 'run-training-job-8c9' - Finished in state Completed()"),
        (64.0, p + "Task run 'judge-checkpoints-3f0' - stage main: checkpoint 5 is good"),
        (65.0, p + "Task run 'judge-checkpoints-3f0' - Finished in state Completed()"),
        (66.0, p + "Flow run 'c' - Finished in state Completed()"),
        (66.5, p + "Task run 'finish-run-7f8' - Finished in state Completed()"),
        (80.0, "Loading weights: 100%"),  # a library's line: not where a task started
        (85.0, p + "Task run 'register-final-model-51d' - Finished in state Completed()"),
        (86.0, p + "Flow run 'a' - Finished in state Completed()"),
        (86.5, "campaign demo — completed"),
    ]
    parts = dict(breakdown(lines, wall=87.0))
    assert parts == {
        "start: CLI, Prefect API server, flow run created": 20.0,
        "train-stage: training jobs (node agents, workers)": 24.0,  # from the launch line before its first
        "train-stage: validation gate": 5.0,  # from the job's end to the gate's
        "train-stage: the rest (MLflow stage runs, resume point, …)": 2.0,
        "campaign task register-final-model": 18.5,  # from Prefect's line before it, not the library's
        "campaign task open-campaign-run": 9.0,
        "subflow prepare-data": 3.0,
        "after the flow: status table, API server stop": 1.0,
        "the rest: Prefect between tasks and subflows, short tasks": 4.5,
    }
    assert sum(parts.values()) == pytest.approx(87.0)


@pytest.mark.parametrize(
    "body, timeout_s, status",
    [
        (
            "import sys\nprint('half a table')\nsys.exit('disk full while writing')\n",
            60,
            "failed: exit status 1 (disk full while writing)",
        ),
        ("import signal\nprint('half a table', flush=True)\nsignal.pause()\n", 1, "failed: did not finish within 1 s"),
    ],
)
def test_a_failing_or_hanging_benchmark_is_recorded_as_failed_with_its_output(tmp_path, body, timeout_s, status):
    from bench.__main__ import run_one

    script = tmp_path / "broken_bench.py"
    script.write_text(body)
    b = registry.Benchmark(name="broken_bench", title="Broken", path=script, timeout_s=timeout_s)
    section = run_one(b, quick=True, facts_line="m", log=lambda _: None)
    assert section.status == status and section.checks == []
    assert "half a table" in section.output and f"**{status}**" in section.render()


def test_the_summary_is_one_table_row_per_check_even_when_a_reason_holds_a_pipe():
    failed = document.Section(
        name="f",
        title="F",
        command="c",
        machine="m",
        mode="quick",
        wall_s=1,
        output="",
        status="failed: exit status 1 (a | b)",
    )
    ok = document.Section(
        name="o",
        title="O",
        command="c",
        machine="m",
        mode="quick",
        wall_s=1,
        output="",
        checks=[Check("x", 2.0, 1.1, "<=", "start | stop")],
    )
    rows = document.summary([failed, ok])[2:]
    assert len(rows) == 2 and all(r.replace("\\|", "").count("|") == 6 for r in rows)
