"""The job contract (``trainer.job.config``): a value keeps the spec's name from the spec to the
worker, the job file round-trips, and a job file of the release before still loads."""

import dataclasses
import json
import tarfile
from pathlib import Path

import pytest

from pretrain.run.jobs import job_config, write_job
from pretrain.spec.campaign import parse_spec
from trainer.job.config import JobConfig

DATA = Path(__file__).parent.parent / "data"

# job fields the orchestrator works out rather than copies (their spec section has no such field)
RESOLVED = {
    "model": {"vocab_size"},
    "stage": {"index", "global_batch", "skip_samples"},
    "data": {"fingerprint", "cache_dir"},
    "checkpoint": {"location", "s3_max_attempts"},
    "fault_tolerance": set(),
    "cluster": set(),
    "tracking": set(),
}


def spec(tmp_path, **sections):
    return parse_spec(
        {
            "name": "c",
            "workdir": str(tmp_path / "w"),
            "stages": [{"name": "main", "steps": 12, "carry_optimizer": False, "lr": 1e-3}],
            **sections,
        }
    )


@pytest.mark.parametrize("section", sorted(RESOLVED))
def test_every_job_section_uses_the_names_of_its_spec_section(tmp_path, section):
    s = spec(tmp_path)
    spec_section = s.stages[0] if section == "stage" else getattr(s, section)
    job_fields = {f.name for f in dataclasses.fields(getattr(job_config(s, 0, 0, None, 64), section))}
    renamed = job_fields - RESOLVED[section] - set(type(spec_section).model_fields)
    assert not renamed, f"job.{section} names {sorted(renamed)}, which its spec section does not have"


def test_a_value_arrives_at_the_worker_under_its_spec_name(tmp_path):
    s = spec(
        tmp_path,
        checkpoint={
            "interval": 7,
            "memory_interval": 7,
            "keep": 4,
            "uri": "s3://bucket/ckpt",
            "s3_region": "eu-west-1",
        },
        fault_tolerance={"storage_outage_s": 123.0, "step_timeout_s": 45.0, "spike_zscore": 3.5},
        cluster={"spares_per_node": 0, "parallelism": "fsdp"},
        skip_samples=[{"stage": "main", "start": 8, "end": 16}],
    )
    written = json.loads(write_job(job_config(s, 0, 2, None, 64)).read_text())
    assert written["checkpoint"]["interval"] == 7 and written["checkpoint"]["keep"] == 4
    assert written["fault_tolerance"]["storage_outage_s"] == 123.0
    assert written["stage"]["carry_optimizer"] is False and written["stage"]["name"] == "main"

    job = JobConfig.load(s.layout.job_dir("main", 2) / "job.json")
    assert (job.checkpoint.interval, job.checkpoint.options) == (7, {"region": "eu-west-1"})
    assert job.checkpoint.location == "s3://bucket/ckpt/main"
    assert job.fault_tolerance.phase_timeouts["step"] == 45.0 and job.fault_tolerance.spike_zscore == 3.5
    assert (job.cluster.spares_per_node, job.cluster.parallelism) == (0, "fsdp")
    assert job.stage.skip_samples == [(8, 16)] and job.attempt == 2
    assert job.lease is None
    assert job == job_config(s, 0, 2, None, 64)


def test_a_job_file_of_the_release_before_loads_with_its_values(tmp_path):
    with tarfile.open(DATA / "campaign_release_before.tar.gz") as tar:
        flat = json.load(tar.extractfile("w/jobs/warmup/attempt_000/job.json"))
    job = JobConfig.from_dict(flat)
    assert (job.stage.name, job.stage.index, job.stage.steps, job.stage.seq_len) == ("warmup", 0, 6, 32)
    assert job.stage.carry_optimizer is flat["init_optimizer"]
    assert (job.checkpoint.location, job.checkpoint.interval, job.checkpoint.keep) == (
        flat["ckpt_dir"],
        flat["ckpt_interval"],
        flat["ckpt_keep"],
    )
    assert job.fault_tolerance.phase_timeouts == flat["hang_timeouts"]
    assert job.fault_tolerance.spike_zscore == flat["spike"]["zscore"]
    assert job.data.uri == flat["data_dir"] and job.model.vocab_size == flat["model"]["vocab_size"]
    assert JobConfig.from_dict(json.loads(job.to_json())) == job  # and written again in today's form
