"""Campaign helpers the tests share: small specs, seeded data, waiting, a campaign's processes, events and
checkpoints."""

from __future__ import annotations

import contextvars
import fcntl
import os
import shutil
import time
from pathlib import Path

import psutil
import pytest

from pretrain.data.campaign import data_record  # noqa: E402
from pretrain.spec.campaign import CampaignSpec, parse_spec  # noqa: E402

HARNESS_DATABASE = "prefect-test.db"  # the name Prefect's test harness gives its server's database


TRACKING_STORE = "mlflow.db"  # a campaign's store in its workdir (seed_data) or a test's (own_tracking_store)


DATA = {"sources": ["{stdlib}/json/*.py"], "max_bytes": 200_000, "tokenizer": {"vocab_size": 512}, "val_fraction": 0.2}


def made_once(tmp_path_factory, name: str, make) -> Path:
    """``root/name``, made by ``make(path)`` in one process of the session: the suite's worker
    processes share the parent of their temporary directories; the first one makes it (under a
    file lock, atomically), the others wait and reuse it. Treat it as read-only."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    path = root / name
    with open(root / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not path.exists():
            part = root / f".{name}.part"
            make(part)
            os.replace(part, path)
    return path


def _migrate_prefect_database(path: Path) -> None:
    """Prefect's own ``prefect server database upgrade``, in a process of its own: the server
    keeps sqlite in WAL mode, and only the last connection's close writes the WAL back into the
    file (migrated in this process, the file alone lacked the last ten tables)."""
    import subprocess
    import sys

    env = {
        **os.environ,
        "PREFECT_HOME": str(path.parent / ".prefect-home"),
        "PREFECT_SERVER_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{path}",
    }
    done = subprocess.run(
        [sys.executable, "-m", "prefect", "server", "database", "upgrade", "-y"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0 and not Path(f"{path}-wal").exists(), done.stdout + done.stderr


def _tracking_template(prepared: Path) -> Path:
    return prepared.parents[1] / TRACKING_STORE


def small_spec(workdir: Path, **overrides) -> CampaignSpec:
    """A campaign that trains in seconds on 2 CPU workers; overrides replace top-level sections."""
    body = {
        "name": "t",
        "workdir": str(workdir),
        "data": DATA,
        "model": {"n_layer": 2, "n_head": 2, "d_model": 32, "max_seq_len": 64},
        "cluster": {"workers_per_node": 2, "max_restarts": 1},
        "stages": [
            {"name": "warmup", "steps": 6, "seq_len": 32, "micro_batch": 4, "warmup_steps": 2},
            {"name": "main", "steps": 10, "seq_len": 64, "micro_batch": 4, "grad_accum": 2},
        ],
        "checkpoint": {"interval": 4, "memory_interval": 2, "keep": 2},
        "resume": {"max_attempts": 2},
        # registration (export + MLflow model, ≈ 5 s) is tested where it is asked for
        "tracking": {"register_model": False},
    }
    body.update(overrides)
    return parse_spec(body)


def seed_data(spec: CampaignSpec, prepared: Path, own_store: bool = True) -> None:
    """The campaign's data set as its data preparation leaves it: in ``<workdir>/data/<fingerprint>``,
    recorded in the ledger (preparation then finds it up to date); and (``own_store``) the
    session's empty tracking store where the campaign keeps its own."""
    from pretrain.state.ledger import Ledger
    from trainer.data.sampler import read_manifest

    store = spec.workdir_path / TRACKING_STORE
    if own_store and spec.tracking.uri is None and not store.exists():
        store.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(_tracking_template(prepared), store)
    copy = spec.layout.data_dir / prepared.name
    shutil.copytree(prepared, copy, dirs_exist_ok=True)
    Ledger.open(spec).set_data(data_record({**read_manifest(copy), "location": str(copy)}))


def run_to_completion(spec: CampaignSpec, prepared: Path, attempts: int | None = None) -> dict:
    """Seed the campaign's data, run it in this process and return its first stage's status,
    failing the test unless the campaign completed with every step of that stage done (in
    ``attempts`` attempts, where given)."""
    from flows.campaign import pretrain_campaign

    seed_data(spec, prepared)
    status = pretrain_campaign(spec=spec)
    stage = status["stages"][0]
    assert status["status"] == "completed" and stage["steps_done"] == spec.stages[0].steps, status
    assert attempts is None or stage["attempts"] == attempts, stage
    return stage


def kept_trajectory(rows: list[dict], steps: int, global_batch: int | None = None) -> dict[int, dict]:
    """The last metrics row of each step (a step redone after a restart replaces its first row),
    failing the test unless steps 1..``steps`` are all there and (``global_batch``) step s trained
    on the sample positions [global_batch·(s−1), global_batch·s): the global batch kept through
    every recovery, no sample twice, none skipped."""
    final = {m["step"]: m for m in rows}
    assert sorted(final) == list(range(1, steps + 1)), sorted(final)
    if global_batch is not None:
        wrong = {s: m["consumed"] for s, m in final.items() if m["consumed"] != global_batch * s}
        assert not wrong, f"steps whose consumed count is not {global_batch} × step: {wrong}"
    return final


def campaign_data_dir(spec: CampaignSpec) -> Path:
    """The local directory of the data set the campaign's ledger records."""
    from pretrain.data.campaign import campaign_data

    return Path(campaign_data(spec).location)


def wait_for(condition, timeout: float, what: str, interval: float = 0.05):
    """Poll ``condition`` until it returns a truthy value; fail the test after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval)  # polling a condition with a deadline, not waiting out a race
    pytest.fail(f"timed out after {timeout}s waiting for {what}")


def campaign_processes(workdir: Path, module: str) -> list[psutil.Process]:
    """Live ``python -m <module>`` processes whose command line names the campaign's workdir."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if module in cmd and any(str(workdir) in c for c in cmd):
            try:
                if p.status() != psutil.STATUS_ZOMBIE:
                    found.append(p)
            except psutil.NoSuchProcess:
                pass
    return found


def worker_processes(workdir: Path) -> list[psutil.Process]:
    """The campaign's training workers (not the node agents' warm spares, which hold no rank)."""
    return [p for p in campaign_processes(workdir, "trainer.worker") if "--spare" not in p.info["cmdline"]]


def run_campaign_while(spec, act):
    """Run the campaign in a thread, call ``act()`` meanwhile (e.g. to kill a process);
    returns (the campaign's status, what ``act`` returned)."""
    from concurrent.futures import ThreadPoolExecutor

    from flows.campaign import pretrain_campaign

    with ThreadPoolExecutor(1) as pool:
        run = pool.submit(contextvars.copy_context().run, pretrain_campaign, spec=spec)  # the session's zygote
        acted = act()
        return run.result(timeout=300), acted


def save_checkpoint(spec: CampaignSpec, stage_index: int = 0, steps: int = 2):
    """Train ``steps`` optimizer steps in this process and commit a checkpoint exactly as a
    worker does (``trainer.checkpoint.state.save``, manifest with the job's record); returns its ref."""
    import torch

    from pretrain.run.jobs import build_job
    from trainer.checkpoint import state
    from trainer.data.sampler import GlobalSampler, TokenWindows, make_batch
    from trainer.dist import DistInfo
    from trainer.loop import build_model
    from trainer.model import lm_loss

    job = build_job(spec, stage_index, 1, None)
    torch.manual_seed(spec.seed)
    model, opt = build_model(job, torch.device("cpu"))
    windows = TokenWindows(job.data.uri, "train", job.stage.seq_len)
    sampler, b = GlobalSampler(len(windows), spec.seed), job.stage.micro_batch
    for i in range(steps):
        x, y = make_batch(windows, sampler, range(i * b, (i + 1) * b))
        opt.zero_grad()
        lm_loss(model(x), y).backward()
        opt.step()
    info = DistInfo(rank=0, local_rank=0, world_size=1, restart_count=0, device=torch.device("cpu"), backend="gloo")
    return state.save(job, info, step=steps, consumed=steps * b, model=model, optimizer=opt)


def session_api_env(**extra: str) -> dict[str, str]:
    """The environment of a child process (a CLI) that talks to the session's Prefect API (the
    harness's), as with a user's configured ``PREFECT_API_URL``, with ``extra`` set."""
    from prefect.settings import PREFECT_API_URL

    return {**os.environ, **extra, "PREFECT_API_URL": PREFECT_API_URL.value()}


def pretrain_cli(*args: str, timeout: float = 180):
    """Run the ``pretrain`` command line in a fresh process."""
    import subprocess
    import sys

    return subprocess.run(
        [sys.executable, "-m", "pretrain.cli.app", *args], capture_output=True, text=True, timeout=timeout
    )


def copy_checkpoint(ref, dest: Path, edit=None) -> str:
    """Copy a local checkpoint's stage directory into ``dest``; ``edit(step_dir)`` changes the
    copy (e.g. flips a byte); returns the copy's location."""
    stage = dest / Path(ref.location).parent.name
    shutil.copytree(Path(ref.location).parent, stage)
    step_dir = stage / Path(ref.location).name
    if edit is not None:
        edit(step_dir)
    return str(step_dir)


def flip_byte(path: Path, at: int = -10) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def campaign_events(api_url: str, campaign: str) -> list[dict]:
    """The ``pretrain.*`` events a Prefect server stored for ``campaign``, newest first."""
    import httpx
    from prefect.events.filters import EventFilter, EventNameFilter, EventResourceFilter

    flt = EventFilter(
        event=EventNameFilter(prefix=["pretrain."]), resource=EventResourceFilter(id=[f"pretrain.campaign.{campaign}"])
    )
    r = httpx.post(f"{api_url}/events/filter", json={"filter": flt.model_dump(mode="json"), "limit": 50}, timeout=10)
    r.raise_for_status()
    return r.json()["events"]


def assert_no_duplicate_metric_steps(tracking_uri: str) -> None:
    """No run of any experiment at ``tracking_uri`` holds two values of one metric at one step."""
    from collections import Counter

    from mlflow.entities import ViewType
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    exps = [e.experiment_id for e in client.search_experiments(view_type=ViewType.ALL)]
    twice = {}
    for run in client.search_runs(exps, run_view_type=ViewType.ALL, max_results=1000):
        for key in run.data.metrics:
            steps = Counter(m.step for m in client.get_metric_history(run.info.run_id, key))
            if dup := sorted(s for s, n in steps.items() if n > 1):
                twice[f"{run.info.run_name} ({run.info.run_id}) {key}"] = dup
    assert not twice, f"metrics logged twice at one step: {twice}"


def final_model(spec: CampaignSpec, stage: str = "main") -> dict:
    """The model tensors of the stage's newest committed checkpoint."""
    from pretrain.run.jobs import checkpoint_store

    store = checkpoint_store(spec, stage)
    return store.load_shard(store.read_pointer(), "model.pt")["model"]
