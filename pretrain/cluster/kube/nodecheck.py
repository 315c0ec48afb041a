"""The node check on Kubernetes: ``python -m trainer.nodecheck`` in pods of the training pods'
shape (image, resources, volumes, scheduling, service account: the stage launch's manifests with
another command), one Indexed Job per check, a headless Service so every pod finds pod 0 (the
allreduce's TCPStore) by DNS as training does.

Each worker slot writes its JSON row to ``<workdir>/node-checks/<id>/node<n>-<slot>.json`` on the
shared workdir; the orchestrator reads them, adds the Kubernetes node each pod ran on, and tears
the check down. ``<workdir>/node-checks/hosts.json`` remembers which Kubernetes node each node
index was checked on, so a launch keeps its pods off the nodes of excluded indices
(``KubernetesCluster.start``). The judgement is the local cluster's (``judge_nodes``).
"""

from __future__ import annotations

import json
import shlex
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from pretrain.cluster.kube.manifests import LABEL, Launch, object_name, stage_launch
from pretrain.cluster.kube.pods import PodVerdict
from trainer.common.atomic import atomic_write_json

CHECK_DIR = "node-checks"
HOSTS = "hosts.json"


def checks_dir(workdir: Path) -> Path:
    return Path(workdir) / CHECK_DIR


@dataclass(frozen=True)
class NodeCheckLaunch(Launch):
    """The manifests of one node check: the stage launch's pods running the health check."""

    check_id: str = ""
    picked: tuple[int, ...] = ()  # campaign node index of each check pod (completion index → node)
    workers_per_node: int = 1
    delays: tuple[tuple[int, float], ...] = ()  # (global rank, extra seconds per matmul): chaos drills
    out_dir: str = ""

    @property
    def name(self) -> str:
        return object_name(self.spec.name, f"node-check-{self.check_id}", 0)

    @property
    def port(self) -> int:
        return self.kube.rdzv_port + 1  # not training's: a re-check may run beside a training job

    def selector(self) -> dict[str, str]:
        return {
            "app.kubernetes.io/name": "pretrain",
            "app.kubernetes.io/managed-by": "prefect-pretrain",
            f"{LABEL}/campaign": super().selector()[f"{LABEL}/campaign"],
            f"{LABEL}/node-check": self.check_id,
        }

    def annotations(self) -> dict[str, str]:
        return {
            **self.kube.annotations,
            f"{LABEL}/campaign": self.spec.name,
            f"{LABEL}/node-check": self.check_id,
            f"{LABEL}/nodes": ",".join(map(str, self.picked)),
        }

    def out(self, node: int, slot: int) -> str:
        return f"{self.out_dir}/node{node}-{slot}.json"

    def command(self) -> list[str]:
        """Per completion index: its node's worker slots, all at once, each writing its row."""
        wpn, world, delays = self.workers_per_node, len(self.picked) * self.workers_per_node, dict(self.delays)
        cases = []
        for k, node in enumerate(self.picked):
            slots = []
            for slot in range(wpn):
                argv = [
                    "python",
                    "-m",
                    "trainer.nodecheck",
                    "--workdir",
                    str(self.spec.workdir_path),
                    "--rank",
                    str(k * wpn + slot),
                    "--world",
                    str(world),
                    "--master-addr",
                    self.host0(),
                    "--master-port",
                    str(self.port),
                    "--extra-delay",
                    str(delays.get(node * wpn + slot, 0.0)),
                    "--out",
                    self.out(node, slot),
                ]
                slots.append(f"{shlex.join(argv)} & p{slot}=$!")
            waits = " ".join(f"wait $p{slot} || rc=1;" for slot in range(wpn))
            cases.append(f"{k}) {'; '.join(slots)}; {waits} exit $rc;;")
        return [
            "sh",
            "-c",
            'rc=0; case "$JOB_COMPLETION_INDEX" in '
            + " ".join(cases)
            + ' *) echo "no node check for index $JOB_COMPLETION_INDEX" >&2; exit 78;; esac',
        ]


def check_launch(
    spec, nodes: list[int], delays: dict[int, float] | None, check_id: str | None = None
) -> NodeCheckLaunch:
    """The node check of ``nodes`` (campaign node indices), shaped like the first stage's launch."""
    base = stage_launch(spec, spec.stages[0].name)
    check_id = check_id or uuid.uuid4().hex[:8]
    return NodeCheckLaunch(
        spec,
        base.job,
        base.job_location,
        len(nodes),
        check_id=check_id,
        picked=tuple(nodes),
        workers_per_node=spec.cluster.workers_per_node,
        delays=tuple(sorted((delays or {}).items())),
        out_dir=str(checks_dir(spec.workdir_path) / check_id),
    )


@dataclass
class HostMemory:
    """Which Kubernetes node each campaign node index was last checked on (``hosts.json``)."""

    path: Path
    problems: list[str] = field(default_factory=list)  # why the file could not be used (named, with what to do)

    def read(self) -> dict[int, str]:
        if not self.path.exists():
            return {}
        try:
            hosts = json.loads(self.path.read_text())["hosts"]
            return {int(n): str(h) for n, h in hosts.items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            self.problems.append(
                f"{self.path} is unreadable ({type(e).__name__}): nodes that failed the node check "
                "are not kept off their Kubernetes nodes this time; delete the file (the next node "
                "check writes it anew)"
            )
            return {}

    def update(self, hosts: dict[int, str]) -> None:
        atomic_write_json(self.path, {"hosts": {str(n): h for n, h in sorted({**self.read(), **hosts}.items())}})

    def avoid(self, exclude: set[int]) -> tuple[tuple[str, ...], list[str]]:
        """The Kubernetes nodes of the ``exclude``d indices; and notices for the flow's logs."""
        known = self.read()
        unknown = sorted(n for n in exclude if n not in known)
        notices = list(self.problems)
        if unknown and not self.problems:
            notices.append(
                f"node(s) {unknown} failed the node check but its Kubernetes node is not recorded in "
                f"{self.path}: their pods may land on it again"
            )
        hosts = tuple(sorted({known[n] for n in exclude if n in known}))
        if hosts:
            notices.append(
                f"pods kept off Kubernetes node(s) {list(hosts)}, where node(s) {sorted(exclude)} failed the node check"
            )
        return hosts, notices


def result_rows(
    launch: NodeCheckLaunch, verdicts: dict[int, PodVerdict], logs: dict[int, str], waited_s: float
) -> list[dict]:
    """One row per worker slot: the slot's measurements, or ``ok`` False with why (the pod's
    failure, its log tail, or no result in time)."""
    rows = []
    for k, node in enumerate(launch.picked):
        v = verdicts.get(k)
        for slot in range(launch.workers_per_node):
            row = {"node": node, "local_rank": slot, "ok": False, "host": v.host if v else None}
            path = Path(launch.out(node, slot))
            try:
                row.update(json.loads(path.read_text()), ok=True)
            except FileNotFoundError:
                row["error"] = _why_missing(v, logs.get(k), waited_s, path)
            except (OSError, ValueError, TypeError) as e:
                row["error"] = f"its result {path} is unreadable ({type(e).__name__}): the check wrote a damaged file"
            rows.append(row)
    return rows


def _why_missing(v: PodVerdict | None, log: str | None, waited_s: float, path: Path) -> str:
    if v is None:
        return f"its pod was never created in {waited_s:.0f}s (a quota or admission policy refuses it?)"
    if v.state == "failed":
        tail = (log or "").strip()[-1500:]
        return v.message + (f"; log: {tail}" if tail and not v.fatal else "")
    if v.state == "succeeded":
        return (
            f"pod {v.name} ended well but its result {path} is not here: the campaign workdir must be the "
            "same volume in the pods and here (cluster.kubernetes.workdir_claim, mounted at the workdir's path)"
        )
    return f"no result in {waited_s:.0f}s (pod {v.name} is {v.state})"


def wait_settled(handle, n: int, timeout_s: float, poll_s: float = 0.2) -> tuple[dict[int, PodVerdict], float]:
    """Wait until every check pod has ended, one cannot ever run (a configuration error), or the
    timeout; returns the verdicts and the seconds waited."""
    began = time.monotonic()
    while True:
        verdicts = handle.verdicts()
        ended = len(verdicts) >= n and all(v.state in ("succeeded", "failed") for v in verdicts.values())
        if ended or any(v.fatal for v in verdicts.values()) or time.monotonic() - began > timeout_s:
            return verdicts, time.monotonic() - began
        threading.Event().wait(poll_s)  # the handle's watcher updates the pods meanwhile
