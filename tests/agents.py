"""Start one real node agent (``python -m trainer.launch``) for a stage of a small spec."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import seed_data, small_spec
from pretrain.cluster import free_port
from pretrain.jobs import build_job, write_job
from trainer.config import JobConfig


def agent_job(workdir: Path, prepared_data: Path, attempt: int = 0, steps: int = 4, **checkpoint) -> JobConfig:
    """A one-stage, one-node, one-worker job of ``steps`` steps (checkpoint settings overridable)."""
    spec = small_spec(workdir, cluster={"workers_per_node": 1, "max_restarts": 0},
                      stages=[{"name": "s", "steps": steps, "seq_len": 32, "micro_batch": 2}],
                      checkpoint={"interval": 2, "memory_interval": 1, "keep": 2, **checkpoint})
    seed_data(spec, prepared_data)
    return build_job(spec, 0, attempt, None)


def start_agent(job: JobConfig, **popen) -> subprocess.Popen:
    job_path = write_job(job)
    log = open(Path(job.job_dir) / "node0.log", "ab")
    cmd = [sys.executable, "-m", "trainer.launch", str(job_path), "--nproc", "1", "--rdzv-endpoint",
           f"127.0.0.1:{free_port()}", "--run-id", Path(job.job_dir).name, "--rdzv-host"]
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, **popen)


def node_log(job: JobConfig) -> str:
    return (Path(job.job_dir) / "node0.log").read_text(errors="replace")
