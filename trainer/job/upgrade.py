"""``job.json`` of the release before, in today's form: one flat object whose fields had names
of their own (``ckpt_interval``, ``saver_outage_s``, ``init_optimizer`` …) becomes the sections
that mirror the spec (``trainer.job.config.JobConfig``). Reading an older job file (a live job
taken back after an upgrade, a workdir of that release) goes through here; nothing writes it."""

from __future__ import annotations

# fields that came in later releases of the flat form, as the jobs without them behaved
_LATER = {
    "data_fingerprint": "",
    "data_cache_dir": "",
    "hang_adaptive": {"factor": 0.0, "floor_s": 0.0, "warmup": 0},
    "rollback_in_process": False,
}


def upgraded(flat: dict) -> dict:
    """The sectioned job of a flat one; a KeyError names a field that neither form has."""
    flat = {**_LATER, **flat}
    hang, adaptive, spike = flat["hang_timeouts"], flat["hang_adaptive"], flat["spike"] or {}
    data_options, storage_options = flat.get("data_options") or {}, flat.get("storage_options") or {}
    return {
        "seed": flat["seed"],
        "attempt": flat["attempt"],
        "job_dir": flat["job_dir"],
        "model": flat["model"],
        "stage": {
            "name": flat["stage"],
            "index": flat["stage_index"],
            **flat["optim"],
            "mixture": flat["mixture"],
            "carry_optimizer": flat["init_optimizer"],
            "init_from": flat["init_from"],
            "skip_samples": flat["skip"],
        },
        "data": {
            "uri": flat["data_dir"],
            "fingerprint": flat["data_fingerprint"],
            "cache_dir": flat["data_cache_dir"],
            "s3_endpoint_url": data_options.get("endpoint_url"),
            "s3_region": data_options.get("region"),
        },
        "checkpoint": {
            "location": flat["ckpt_dir"],
            "interval": flat["ckpt_interval"],
            "memory_interval": flat["memory_interval"],
            "keep": flat["ckpt_keep"],
            "shm_dir": flat["shm_dir"],
            "shm_fallback": flat["shm_fallback"],
            "s3_endpoint_url": storage_options.get("endpoint_url"),
            "s3_region": storage_options.get("region"),
        },
        "fault_tolerance": {
            "startup_timeout_s": hang["startup"],
            "step_timeout_s": hang["step"],
            "checkpoint_timeout_s": hang["checkpoint"],
            "hang_timeout_factor": adaptive["factor"],
            "hang_timeout_floor_s": adaptive["floor_s"],
            "hang_warmup_steps": adaptive["warmup"],
            "spike_zscore": spike.get("zscore", 0.0),
            "spike_window": spike.get("window", 50),
            "spike_min_steps": spike.get("min_steps", 1),
            "max_rollbacks": flat["max_rollbacks"],
            "rollback_in_process": flat["rollback_in_process"],
            "node_check_threshold": flat["node_check_threshold"],
            "saver_max_failures": flat["saver_max_failures"],
            "saver_backoff_s": flat["saver_backoff_s"],
            "storage_outage_s": flat.get("saver_outage_s", 600.0),
            "fast_recovery_timeout_s": flat.get("fast_recovery_timeout_s", 30.0),
        },
        "cluster": {
            "nodes_min": flat["nodes_min"],
            "spares_per_node": flat.get("spares_per_node", 1),
            "backend": flat["backend"],
            "parallelism": flat["parallelism"],
            "threads_per_worker": flat["threads_per_worker"],
        },
        "tracking": {"log_every": flat["log_every"]},
        "lease": flat.get("lease") or None,
        "chaos": flat["chaos"],
    }
