"""The campaign workdir lock: a second holder is refused at once with who holds it; the lock
goes away with its holder, however that process ends."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from pretrain.state.lock import CampaignBusy, LockUnavailable, campaign_lock, lock_failure, lock_fd, read_holder
from support.campaigns import small_spec


def try_lock(workdir, flow_run: str) -> dict:
    """Take the lock as another flow run of this process would: from another thread (its own context)."""

    def take():
        with campaign_lock(workdir, "c1", flow_run=flow_run) as holder:
            return holder

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(take).result()


def test_second_holder_is_refused_with_the_holder_named(tmp_path):
    with campaign_lock(tmp_path, "c1", flow_run="run-1") as holder:
        assert read_holder(tmp_path) == holder and holder["pid"] == os.getpid()
        started = time.monotonic()
        with pytest.raises(
            CampaignBusy,
            match=rf"campaign 'c1' in {tmp_path} is already running \(pid {os.getpid()} on "
            r".*, flow run run-1, since .*\)\. .*cancel it",
        ):
            try_lock(tmp_path, "run-2")
        assert time.monotonic() - started < 1  # refused, not queued
    with campaign_lock(tmp_path, "c1", flow_run="run-3"):  # released on exit
        assert read_holder(tmp_path)["flow_run"] == "run-3"


HOLD = (
    "import sys, threading; from pretrain.state.lock import campaign_lock\n"
    "with campaign_lock(sys.argv[1], 'c1'):\n    print('held', flush=True); threading.Event().wait()\n"
)


def test_lock_of_a_killed_process_is_free_at_once(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(CampaignBusy, match=f"pid {holder.pid}"):
            with campaign_lock(tmp_path, "c1"):
                pass
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
    with campaign_lock(tmp_path, "c1") as mine:
        assert mine["pid"] == os.getpid()


def test_the_lock_is_reentrant_within_one_flow_run_and_held_until_the_outermost_exit(tmp_path):
    with campaign_lock(tmp_path, "c1", flow_run="run-1") as outer:
        with campaign_lock(tmp_path, "c1", flow_run="sub-run") as inner:  # a subflow of the campaign
            assert inner == outer and read_holder(tmp_path)["flow_run"] == "run-1"
        with pytest.raises(CampaignBusy):  # the subflow's exit did not release the campaign's lock
            try_lock(tmp_path, "run-2")
    assert try_lock(tmp_path, "run-3")["flow_run"] == "run-3"


def test_prepare_data_is_refused_while_another_process_runs_the_campaign(prefect_harness, tmp_path):
    from flows.prepare_data import prepare_data

    spec = small_spec(tmp_path / "wd")
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(spec.workdir_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(
            CampaignBusy, match=f"campaign 't' in {spec.workdir_path} is already running \\(pid {holder.pid}"
        ):
            prepare_data(spec=spec)
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
    layout = spec.layout
    assert not layout.data_dir.exists() and not (spec.workdir_path / "ledger.json").exists()  # nothing written


def test_a_flow_holding_the_campaign_lock_prepares_data_as_its_subflow(prefect_harness, prepared_data, tmp_path):
    from prefect import flow

    from flows.prepare_data import prepare_data
    from support.campaigns import seed_data

    spec = small_spec(tmp_path / "wd")
    seed_data(spec, prepared_data)

    @flow
    def campaign_like():  # what the campaign flow does: lock, then call prepare-data
        with campaign_lock(spec.workdir_path, spec.name, "the-campaign"):
            summary = prepare_data(spec)
            with pytest.raises(CampaignBusy, match="flow run the-campaign"):
                try_lock(spec.workdir_path, "another-run")  # still the campaign's
            return summary

    assert campaign_like()["vocab_size"] == 512
    assert json.loads((spec.workdir_path / "ledger.json").read_text())["data"]["vocab_size"] == 512


@pytest.mark.parametrize(
    "err, says",
    [
        (
            OSError(errno.EOPNOTSUPP, "Operation not supported"),
            f"does not support file locks: Operation not supported (errno {errno.errorcode[errno.EOPNOTSUPP]})",
        ),
        (OSError(errno.ENOLCK, "No locks available"), "does not support file locks: No locks available (errno ENOLCK)"),
        (
            OSError(errno.EROFS, "Read-only file system"),
            "Read-only file system (errno EROFS). Check that the campaign's workdir is writable",
        ),
    ],
)
def test_a_filesystem_that_cannot_lock_gets_a_clear_error(tmp_path, err, says):
    message = str(lock_failure(tmp_path / "campaign.lock", err))
    assert message.startswith(f"cannot lock {tmp_path / 'campaign.lock'}: ") and says in message
    assert "--workdir" in message


def test_a_descriptor_that_flock_refuses_gives_the_clear_error_not_an_oserror(tmp_path):
    """No filesystem here refuses flock (ext4, tmpfs, proc, sysfs all lock; no NFS or FUSE mount): a
    descriptor that cannot be locked for real (O_PATH: EBADF) takes the same path as EOPNOTSUPP."""
    path = tmp_path / "campaign.lock"
    path.touch()
    fd = os.open(path, os.O_PATH)
    try:
        with pytest.raises(LockUnavailable, match=rf"cannot lock {path}: .*\(errno EBADF\)"):
            lock_fd(fd, path)
    finally:
        os.close(fd)


def test_a_workdir_that_cannot_hold_the_lock_file_is_a_clear_error(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(LockUnavailable, match=rf"cannot lock {tmp_path / 'file' / 'wd' / 'campaign.lock'}: .*ENOTDIR"):
        with campaign_lock(tmp_path / "file" / "wd", "c1"):
            pass
