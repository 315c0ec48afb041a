"""Tokenizing work units on ``data.workers`` processes, each unit's result recorded in the unit
cache (``unitcache``) as it finishes, so a killed run resumes at the unfinished units.

Workers are forked from multiprocessing's fork server (single-threaded, its imports done once;
the caller may be a threaded Prefect process, which is never forked); each one is one core: the tokenizers
library's own thread pool is limited to one thread there.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pretrain.data.prepare.errors import DataPrepError
from pretrain.data.prepare.unitcache import DOC_DTYPE, UnitResult, doc_hash, write_unit
from pretrain.spec.data import DataSpec

BATCH_CHARS = 1 << 20  # text handed to one encode_batch call: bounds a worker's memory beyond its unit
MAX_EXAMPLES = 3


@dataclass(frozen=True)
class UnitJob:
    """One unit to tokenize and where its result goes."""

    unit: object  # pretrain.data.corpus.units.WorkUnit
    out: Path


@dataclass
class _WorkerState:
    """What a worker process holds for all its units (set once by the pool initializer)."""

    tokenizer: object
    dtype: str
    data: DataSpec
    s3_options: dict | None


_state: _WorkerState | None = None  # one per worker process, set by _init_worker (not used in the parent)


def _init_worker(started, tokenizer_json: str, dtype: str, data_json: str, s3_options: dict | None) -> None:
    global _state
    # Ctrl-C reaches the whole process group: the parent stops the pool (the units in flight
    # finish and stay recorded); a worker interrupted mid-unit would only print a traceback
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ["RAYON_NUM_THREADS"] = "1"  # this worker process only: one worker = one core
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from tokenizers import Tokenizer

    _state = _WorkerState(
        Tokenizer.from_str(tokenizer_json), dtype, DataSpec.model_validate_json(data_json), s3_options
    )
    started.set()


def tokenize_unit(job: UnitJob, state: _WorkerState | None = None) -> UnitResult:
    """Read one unit, tokenize its documents in bounded batches and record the result."""
    from pretrain.data.corpus.readers import Doc, read_unit

    st = state or _state
    assert st is not None, "tokenize_unit runs in a pool worker (or is given its state)"

    def fill(tokens_f, docs_f) -> UnitResult:
        r = UnitResult()
        batch: list[str] = []
        size = 0

        def flush() -> None:
            nonlocal size
            if not batch:
                return
            docs = np.zeros(len(batch), dtype=DOC_DTYPE)
            for i, (text, enc) in enumerate(zip(batch, st.tokenizer.encode_batch_fast(batch))):
                ids = np.asarray(enc.ids, dtype=st.dtype)
                ids.tofile(tokens_f)
                r.tokens += len(ids)
                h = doc_hash(text)
                docs[i] = (r.tokens, h)
                r.min_hash = h if r.min_hash is None else min(r.min_hash, h)
                r.max_hash = h if r.max_hash is None else max(r.max_hash, h)
            docs.tofile(docs_f)
            r.documents += len(batch)
            batch.clear()
            size = 0

        for item in read_unit(job.unit, st.data, st.s3_options):
            if isinstance(item, Doc):
                if not item.text:
                    r.skipped["empty"] = r.skipped.get("empty", 0) + 1
                    continue
                batch.append(item.text)
                size += len(item.text)
                if size >= BATCH_CHARS:
                    flush()
            else:
                r.skipped[item.reason] = r.skipped.get(item.reason, 0) + 1
                if len(r.skip_examples) < MAX_EXAMPLES:
                    r.skip_examples.append(f"{item.reason}: {item.where}")
        flush()
        return r

    return write_unit(job.out, fill)


def run_units(
    jobs: list[UnitJob],
    *,
    workers: int,
    tokenizer_json: str,
    dtype: str,
    data: DataSpec,
    s3_options: dict | None,
    done: Callable[[int, UnitResult], None],
) -> None:
    """Tokenize ``jobs`` on ``workers`` processes; ``done(index, result)`` as each finishes (in
    completion order). The first failure stops the rest (finished units stay recorded)."""
    if not jobs:
        return
    ctx = multiprocessing.get_context("forkserver")
    # the fork server imports the worker's modules once; each worker is forked from it (single-
    # threaded, never from this possibly threaded process), so no worker imports them again
    ctx.set_forkserver_preload(["pretrain.data.prepare.pool"])
    n = max(1, min(workers, len(jobs)))
    started = ctx.Event()  # set by the first worker that is ready: one that dies later is not a failed start
    pool = ProcessPoolExecutor(
        n,
        mp_context=ctx,
        initializer=_init_worker,
        initargs=(started, tokenizer_json, dtype, data.model_dump_json(), s3_options),
    )
    try:
        queue = iter(enumerate(jobs))
        pending: dict = {}
        while True:  # at most two units in flight per worker: a killed run loses little
            while len(pending) < 2 * n and (nxt := next(queue, None)) is not None:
                pending[pool.submit(tokenize_unit, nxt[1])] = nxt[0]
            if not pending:
                break
            finished, _ = wait(pending, return_when=FIRST_COMPLETED)
            for fut in finished:
                i = pending.pop(fut)
                done(i, fut.result())
    except BrokenProcessPool:
        raise _pool_broke(started.is_set()) from None
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _pool_broke(started: bool) -> DataPrepError:
    """What to tell the user when a worker process died: while working (memory, most likely), or
    before any was ready."""
    if started:
        return DataPrepError(
            "a data preparation worker process died (out of memory?): lower data.workers or "
            "data.unit_bytes and run again; finished work units are kept"
        )
    script = _unguarded_script()
    if script:
        return DataPrepError(
            f"the data preparation worker processes ended before they could start: each one runs "
            f"{script} again first (Python's multiprocessing does), which calls this again; put "
            'that script\'s own work under `if __name__ == "__main__":` and run it again'
        )
    return DataPrepError(
        "the data preparation worker processes ended before they could start; the error they printed above says why"
    )


def _unguarded_script() -> str | None:
    """The script this process runs (``python script.py``, not ``-m``) when its text has no
    ``__main__`` check, or None."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if path is None or getattr(main, "__spec__", None) is not None:
        return None
    try:
        return None if "__main__" in Path(path).read_text(errors="replace") else path
    except OSError:
        return None
