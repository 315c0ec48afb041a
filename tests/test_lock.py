"""The campaign workdir lock: a second holder is refused at once with who holds it; the lock
goes away with its holder, however that process ends."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from pretrain.lock import CampaignBusy, campaign_lock, read_holder


def test_second_holder_is_refused_with_the_holder_named(tmp_path):
    with campaign_lock(tmp_path, "c1", flow_run="run-1") as holder:
        assert read_holder(tmp_path) == holder and holder["pid"] == os.getpid()
        started = time.monotonic()
        with pytest.raises(CampaignBusy, match=rf"campaign 'c1' in {tmp_path} is already running \(pid {os.getpid()} on "
                                               r".*, flow run run-1, since .*\)\. .*cancel it"):
            with campaign_lock(tmp_path, "c1", flow_run="run-2"):
                pass
        assert time.monotonic() - started < 1  # refused, not queued
    with campaign_lock(tmp_path, "c1", flow_run="run-3"):  # released on exit
        assert read_holder(tmp_path)["flow_run"] == "run-3"


def test_lock_of_a_killed_process_is_free_at_once(tmp_path):
    code = ("import sys, threading; from pretrain.lock import campaign_lock\n"
            "with campaign_lock(sys.argv[1], 'c1'):\n    print('held', flush=True); threading.Event().wait()\n")
    holder = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
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
