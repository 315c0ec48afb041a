"""``prepare``: sources → tokenizer → tokenized units (on all cores, recorded as they finish) →
shards + manifest in ``<root>/<fingerprint>/``, a versioned data set that is reused, never
rewritten. ``root`` is a local directory or an ``s3://`` URL (staged in ``work``, manifest
uploaded last)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from pretrain.data.corpus.files import expand_sources
from pretrain.data.corpus.readers import reader_settings
from pretrain.data.corpus.units import plan_units
from pretrain.data.prepare.assemble import AssembledUnit, assemble
from pretrain.data.prepare.errors import DataPrepError, removed_if_disk_full
from pretrain.data.prepare.fingerprint import fingerprint, output_settings, source_entry, tokenizer_identity
from pretrain.data.prepare.pool import UnitJob, run_units
from pretrain.data.prepare.progress import PrepProgress, ProgressCallback
from pretrain.data.prepare.sample import trained_tokenizer
from pretrain.data.prepare.tokenizer import LoadedTokenizer, load_tokenizer
from pretrain.data.prepare.unitcache import UnitResult, clear_stale_temporaries, prune, read_unit_result, unit_dir_name
from pretrain.data.prepare.upload import Uploader
from pretrain.spec.data import DataSpec
from trainer.common.atomic import atomic_write_bytes, move_aside
from trainer.common.diskfull import describe, is_disk_full
from trainer.data.manifest import (
    MANIFEST,
    SKIP_REASONS,
    TOKENIZER_FILE,
    DamagedManifest,
    encode_manifest,
    parse_manifest,
)
from trainer.storage import NotAFile, NotFound, StorageError, open_storage


def _is_s3(url: str) -> bool:
    return str(url).startswith("s3://")


def _existing(target, location: str, log) -> dict | None:
    """The complete data set at ``location``, if any; a damaged manifest means none."""
    try:
        raw = target.get_bytes(MANIFEST)
    except NotFound:
        return None
    except NotAFile as err:  # moved aside when the new manifest is written
        log(f"{location}/{MANIFEST} is damaged ({err}); preparing it again")
        return None
    except StorageError as err:
        raise DataPrepError(f"cannot read data sets under {location}: {err}") from None
    try:
        manifest = parse_manifest(raw)
    except DamagedManifest as err:
        log(f"{location}/{MANIFEST} is damaged ({err}); preparing it again")
        return None
    if problem := _missing_file(target, manifest):
        log(f"data set {location} is damaged ({problem}); preparing it again")
        return None
    return manifest


def _missing_file(target, manifest: dict) -> str | None:
    """A file the manifest names that is absent, or (on a local disk, where a stat is cheap) of
    the wrong size: what is wrong, or None. Contents are checked by their sha256 where they are
    fetched (the node cache), not on every run."""
    itemsize = 2 if manifest["dtype"] == "uint16" else 4
    shards = [(s["file"], s["tokens"] * itemsize) for split in manifest["splits"].values() for s in split]
    if target.local_path(MANIFEST) is None:  # S3: one listing, not a request per shard
        present = set(target.list())
        gone = [f for f in [manifest.get("tokenizer", TOKENIZER_FILE)] + [f for f, _ in shards] if f not in present]
        return f"{gone[0]} is missing" if gone else None
    for name, size in [(manifest.get("tokenizer", TOKENIZER_FILE), None)] + shards:
        path = target.local_path(name)
        if not path.is_file():
            return f"{name} is missing"
        if size is not None and path.stat().st_size != size:
            return f"{name} has {path.stat().st_size} bytes, not {size}"
    return None


def _guarded(progress: ProgressCallback | None, log) -> ProgressCallback:
    """``progress``, but a display that fails (a console, a Prefect server going away) is logged
    once and then left out: it never stops data preparation."""
    state = {"failed": progress is None}

    def report(p: PrepProgress) -> None:
        if state["failed"]:
            return
        try:
            progress(p)
        except Exception as err:  # whatever the display raises
            state["failed"] = True
            log(f"progress reporting failed ({type(err).__name__}: {err}); data preparation goes on without it")

    return report


def _cores() -> int:
    """Cores this process may run on (a container's CPU set, not the host's count)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1


def _unit_bytes(unit, n_units: int) -> int:
    """Source bytes one unit stands for (progress): its byte range, or a Parquet file's share."""
    return unit.source.size // n_units if unit.source.format == "parquet" else unit.stop - unit.start


def prepare(
    data: DataSpec,
    root: str | Path,
    *,
    work: Path,
    s3_options: dict | None = None,
    log=print,
    progress: ProgressCallback | None = None,
) -> dict:
    """Build (or reuse) the data set for ``data`` under ``root``; returns its manifest plus
    ``reused`` and ``location`` (the data set's directory or s3 URL)."""
    report = _guarded(progress, log)
    report(PrepProgress("scan"))
    s3 = s3_options or {}
    sources = expand_sources(data, s3_options)
    flat = [s for group in sources.values() for s in group]
    given = load_tokenizer(data.tokenizer, s3_options) if data.tokenizer.path else None
    settings = output_settings(data)
    tok_identity = tokenizer_identity(data, given.sha256 if given else None)
    fp = fingerprint(sources, settings, tok_identity)
    location = f"{str(root).rstrip('/')}/{fp}" if _is_s3(str(root)) else str(Path(root).expanduser().absolute() / fp)
    target = open_storage(location, **(s3 if _is_s3(location) else {}))
    existing = _existing(target, location, log)
    if existing is not None and existing.get("fingerprint") == fp:
        log(f"data set {location} is up to date (fingerprint {fp}); reusing it")
        report(PrepProgress("done"))
        return {**existing, "reused": True, "location": location}

    plans = [plan_units(s, data.unit_bytes, s3_options) for s in flat]
    units = [(i, u, _unit_bytes(u, len(p))) for i, p in enumerate(plans) for u in p]
    work = Path(work)
    report(PrepProgress("tokenizer", units_total=len(units), bytes_total=sum(b for *_, b in units)))
    tok = given or trained_tokenizer(
        data, [u for _, u, _ in units], work / "tokenizers" / f"{fp}.json", s3_options, log
    )
    results = _tokenize(data, units, tok, work, s3_options, log, report)
    if not any(r.documents for _, r in results):
        skipped = {r: sum(res.skipped.get(r, 0) for _, res in results) for r in SKIP_REASONS}
        what = ", ".join(f"{n} {r}" for r, n in skipped.items() if n) or "every file is empty"
        raise DataPrepError(
            f"data.sources gave no documents ({len(flat)} file(s); skipped: {what}): point "
            "data.sources at text, JSONL or Parquet files with text in them"
        )
    report(PrepProgress("assemble", len(units), len(units), *_totals(units, results)))
    out = Path(location) if not _is_s3(location) else work / "staging" / fp
    uploader = Uploader(target, location) if _is_s3(location) else None
    try:
        manifest = _write_data_set(data, sources, flat, units, results, tok, fp, settings, out, uploader)
        if uploader:
            report(PrepProgress("upload", len(units), len(units), *_totals(units, results)))
            uploader.finish(out / MANIFEST)
    finally:
        if uploader:
            uploader.close()
    _log_summary(log, manifest, location, flat, [e for _, r in results for e in r.skip_examples][:3])
    _prune(work, {p.name for p, _ in results}, f"{fp}.json")
    report(PrepProgress("done", len(units), len(units), *_totals(units, results)))
    return {**manifest, "reused": False, "location": location}


def _totals(units, results) -> tuple[int, int, int, int]:
    return (
        sum(b for *_, b in units),
        sum(b for *_, b in units),
        sum(r.tokens for _, r in results),
        sum(r.documents for _, r in results),
    )


def _tokenize(
    data: DataSpec, units: list, tok: LoadedTokenizer, work: Path, s3_options, log, report
) -> list[tuple[Path, UnitResult]]:
    """Every unit's result, in unit order: finished ones reused, the rest tokenized on the pool."""
    cache = work / "units"
    clear_stale_temporaries(cache)
    read_settings = reader_settings(data)
    itemsize = 2 if tok.dtype == "uint16" else 4
    paths = [cache / unit_dir_name(u.key, tok.sha256, read_settings) for _, u, _ in units]
    results: list[UnitResult | None] = [read_unit_result(p, itemsize) for p in paths]
    todo = [i for i, r in enumerate(results) if r is None]
    for i in todo:  # a damaged result in the way of the unit's new one (a rename never replaces a directory)
        if paths[i].is_dir():
            shutil.rmtree(paths[i])
        else:
            paths[i].unlink(missing_ok=True)
    workers = data.workers or _cores()
    done = {"units": 0, "bytes": 0, "tokens": 0, "docs": 0}
    total_bytes = sum(b for *_, b in units)

    def finished(i: int, r: UnitResult) -> None:
        results[i] = r
        done["units"] += 1
        done["bytes"] += units[i][2]
        done["tokens"] += r.tokens
        done["docs"] += r.documents
        report(
            PrepProgress(
                "tokenize", done["units"], len(units), done["bytes"], total_bytes, done["tokens"], done["docs"]
            )
        )

    for i, r in enumerate(results):
        if r is not None:
            finished(i, r)
    if todo:
        reused = f"; {len(units) - len(todo)} finished earlier are reused" if len(todo) < len(units) else ""
        log(f"tokenizing {len(todo)} of {len(units)} work unit(s) on {min(workers, len(todo))} process(es){reused}")
        wanted = {p.name for p in paths}
        if (
            not data.tokenizer.path
            and cache.is_dir()
            and any(not p.name.startswith(".") and p.name not in wanted for p in cache.iterdir())
        ):
            log(
                "the tokenizer is trained on a sample of the corpus, so a changed corpus changes it and every "
                "unit is tokenized again; set data.tokenizer.path to a fixed tokenizer.json to re-tokenize only "
                "the changed files"
            )
        try:
            run_units(
                [UnitJob(units[i][1], paths[i]) for i in todo],
                workers=workers,
                tokenizer_json=tok.json,
                dtype=tok.dtype,
                data=data,
                s3_options=s3_options,
                done=lambda k, r: finished(todo[k], r),
            )
        except OSError as err:
            if not is_disk_full(err):
                raise
            raise DataPrepError(
                describe(cache, 0, "tokenized work units", "Free space there and run again; finished units are kept.")
            ) from None
    else:
        log(f"all {len(units)} work unit(s) were tokenized earlier; assembling the data set")
    return [(p, r) for p, r in zip(paths, results)]


def _write_data_set(
    data,
    sources,
    flat,
    units,
    results,
    tok: LoadedTokenizer,
    fp: str,
    settings: dict,
    out: Path,
    uploader: Uploader | None,
) -> dict:
    """Tokenizer, shards and (last) the manifest into ``out`` (each but the manifest handed to
    ``uploader`` once written, for an S3 data set); returns the manifest."""
    out.mkdir(parents=True, exist_ok=True)
    if (out / MANIFEST).is_dir():  # a damaged one: uncommit before touching shards
        move_aside(out / MANIFEST)
    (out / MANIFEST).unlink(missing_ok=True)
    itemsize = 2 if tok.dtype == "uint16" else 4
    need = sum((r.tokens + r.documents) * itemsize for _, r in results) + len(tok.json)
    assembled = [AssembledUnit(i, flat[i].group, flat[i].weight, p, r) for (i, _, _), (p, r) in zip(units, results)]
    with removed_if_disk_full(out, need) as written:
        written.append(out / TOKENIZER_FILE)
        atomic_write_bytes(out / TOKENIZER_FILE, tok.json.encode())
        if uploader:
            uploader(out / TOKENIZER_FILE)
        splits, documents, stats = assemble(
            assembled,
            list(sources),
            out=out,
            dtype=tok.dtype,
            eot_id=tok.eot_id,
            val_fraction=data.val_fraction,
            shard_tokens=data.shard_tokens,
            n_sources=len(flat),
            written=written,
            on_shard=uploader,
        )
        if not (documents["train"] and documents["val"]):
            raise DataPrepError(
                f"data.sources gave {sum(documents.values())} distinct document(s); need at least 2 "
                "(one for training, one for validation): add data"
            )
        src = [
            {
                **source_entry(s),
                "units": st.units,
                "documents": st.documents,
                "tokens": st.tokens,
                "skipped": {r: st.skipped.get(r, 0) for r in SKIP_REASONS},
            }
            for s, st in zip(flat, stats)
        ]
        raw = encode_manifest(
            fingerprint=fp,
            dtype=tok.dtype,
            vocab_size=tok.vocab_size,
            eot_id=tok.eot_id,
            tokenizer_sha256=tok.sha256,
            splits=splits,
            documents=documents,
            groups=list(sources),
            sources=src,
            settings={**settings, "tokenizer": _tok_settings(data, tok)},
        )
        written.append(out / MANIFEST)
        atomic_write_bytes(out / MANIFEST, raw)  # last: the data set counts from here
    return parse_manifest(raw)


def _tok_settings(data: DataSpec, tok: LoadedTokenizer) -> dict:
    t = data.tokenizer
    return (
        {"path": t.path, "sha256": tok.sha256, "eos_token": t.eos_token}
        if t.path
        else {
            "vocab_size": t.vocab_size,
            "min_frequency": t.min_frequency,
            "sample_bytes": t.sample_bytes,
            "eos_token": t.eos_token,
        }
    )


def _prune(work: Path, units: set[str], tokenizer: str) -> None:
    """Keep only what the next incremental run can use: this data set's unit results and tokenizer."""
    prune(work / "units", units)
    shutil.rmtree(work / "staging", ignore_errors=True)  # an S3 data set's copy left by a failed upload
    for p in (work / "tokenizers").glob("*.json"):
        if p.name != tokenizer:
            p.unlink(missing_ok=True)


def _log_summary(log, manifest: dict, location: str, flat, examples: list[str]) -> None:
    skipped = ", ".join(f"{n} {r}" for r, n in manifest["skipped"].items() if n)
    log(
        f"prepared {manifest['tokens']['train']} train / {manifest['tokens']['val']} val tokens "
        f"({manifest['documents']['train']} / {manifest['documents']['val']} documents, vocab "
        f"{manifest['vocab_size']}, {manifest['dtype']}) from {len(flat)} file(s) in {location}"
        + (f"; skipped: {skipped}" if skipped else "")
        + (f" (e.g. {'; '.join(examples)})" if examples else "")
    )
