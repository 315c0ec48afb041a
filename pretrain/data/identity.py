"""A campaign's checkpoints belong to the data set they were trained on.

Data preparation runs at the start of every campaign run; when the sources changed underneath
(files added, removed or rewritten, another tokenizer file) it gives a data set with another
fingerprint. Resuming a stage's checkpoints on it would silently mix two corpora (and, with a
new tokenizer, feed the model other token ids), so it is refused with what changed (a diff of
the two manifests) and the two ways on.
"""

from __future__ import annotations

from pretrain.state.schema import CampaignRecord

LISTED = 5  # names listed per kind of change before "and N more"


class DataChanged(RuntimeError):
    """The campaign's checkpoints were made on another data set than preparation gives now."""


def _names(uris: list[str]) -> str:
    more = f" and {len(uris) - LISTED} more" if len(uris) > LISTED else ""
    return ", ".join(uris[:LISTED]) + more


def _value(v) -> str:
    return repr(v) if isinstance(v, str) else str(v)


def what_changed(old: dict | None, new: dict) -> list[str]:
    """The differences between two data set manifests, one line each: sources added / removed /
    changed (same URI, other identity or counts), tokenizer, settings."""
    if old is None:
        return ["the old data set's manifest cannot be read, so what changed cannot be listed"]
    lines = []
    if "sources" not in old:
        lines.append("the old data set was prepared by an earlier release, which recorded no sources to compare")
    else:
        before = {s.get("uri"): s for s in old.get("sources") or []}
        after = {s.get("uri"): s for s in new.get("sources") or []}
        for kind, uris in (
            ("added", [u for u in after if u not in before]),
            ("removed", [u for u in before if u not in after]),
            ("changed", [u for u in after if u in before and after[u] != before[u]]),
        ):
            if uris:
                lines.append(f"sources {kind}: {_names(uris)}")
    if old.get("tokenizer_sha256") != new.get("tokenizer_sha256") or old.get("vocab_size") != new.get("vocab_size"):
        lines.append(
            f"tokenizer: {old.get('vocab_size')} tokens (sha256 {str(old.get('tokenizer_sha256'))[:12]}) → "
            f"{new.get('vocab_size')} tokens (sha256 {str(new.get('tokenizer_sha256'))[:12]})"
        )
    settings_before, settings_after = old.get("settings") or {}, new.get("settings") or {}
    for key in sorted(set(settings_before) | set(settings_after)):
        if settings_before.get(key) != settings_after.get(key):
            lines.append(f"setting {key}: {_value(settings_before.get(key))} → {_value(settings_after.get(key))}")
    return lines or ["the source files' identities changed (size and modification time, or S3 ETag), not their list"]


def trained_stages(record: CampaignRecord) -> list[str]:
    """Stages that have been launched: their checkpoints belong to the recorded data set."""
    return [name for name, stage in record.stages.items() if stage.attempts > 0]


def newest_good_checkpoint(record: CampaignRecord) -> str | None:
    goods = [s.good_checkpoint.path for s in record.stages.values() if s.good_checkpoint]
    return goods[-1] if goods else None


def refuse_changed_data(record: CampaignRecord, prepared: dict, old_manifest: dict | None) -> None:
    """Raise :class:`DataChanged` if stages of the campaign were trained on a data set other than
    ``prepared`` (preparation's result: its manifest and ``location``); ``old_manifest``: the
    recorded data set's manifest (None: unreadable)."""
    old = record.data
    stages = trained_stages(record)
    if old is None or not old.fingerprint or old.fingerprint == prepared.get("fingerprint") or not stages:
        return
    lines = what_changed(old_manifest, prepared)
    changes = "\n".join(f"  - {line}" for line in lines)
    start = newest_good_checkpoint(record)
    init = f"`init_from: {start}`" if start else "`init_from:` set to one of its checkpoints"
    raise DataChanged(
        f"the data set changed since this campaign trained on it: stage(s) {', '.join(map(repr, stages))} have "
        f"checkpoints made on data set {old.fingerprint} ({old.location or 'the workdir data directory'}), but data "
        f"preparation now gives {prepared.get('fingerprint')} ({prepared.get('location')}). What changed:\n{changes}\n"
        "Resuming would continue those checkpoints on other data, so the campaign stops here (its ledger is "
        "unchanged). Either restore the old sources (so preparation gives data set "
        f"{old.fingerprint} again) and run the campaign again; or train on the new data in a new campaign (another "
        f"name or workdir) whose first stage starts from this one's weights with {init}"
        + (
            " (the tokenizer changed too: give the old one as data.tokenizer.path, or the weights meet other "
            "token ids)."
            if any(line.startswith("tokenizer:") for line in lines)
            else "."
        )
    )
