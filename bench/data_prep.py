"""Data preparation throughput and memory, side by side in one run:

1. raw ``Tokenizer.encode_batch`` on one core (RAYON_NUM_THREADS=1) over the corpus's texts, and
   ``encode_batch_fast`` (no offsets: what the pipeline's workers call);
2. the pipeline (``pretrain.data.prepare.pipeline``) with 1 worker on the same JSONL corpus;
3. the pipeline with all workers (one per core);
4. peak RSS of (3) on a corpus 4× larger.

    python bench/data_prep.py [--mib 12 --vocab 8192 --workers 0 --repeats 3]

Each measurement runs in its own child process (clean RSS); the tokenizer is trained once up
front and given to every run (``tokenizer.path``), so only reading, tokenizing and writing are
timed. Prints tokens/s (best of the interleaved repeats), tokens per CPU-second (what the
machine's other load cannot change), where the pipeline's wall time goes, the ratios the issue
asks for, and peak RSS (the preparing process and its largest worker).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's code, run alone or by python -m bench
BENCH = {
    "title": "Data preparation",
    "order": 50,
    "quick": ["--mib", "1", "--vocab", "1024", "--repeats", "1"],
    "full": ["--repeats", "3"],
    "timeout_s": 1800,
}


def make_corpus(out: Path, mib: int, copies: int = 1) -> list[Path]:
    """JSONL files of ~4 MiB each, documents = the standard library's .py files (distinct per
    copy, so deduplication keeps them all), ``mib`` MiB in all per copy."""
    sources = sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))
    out.mkdir(parents=True, exist_ok=True)
    files, f, size, k, total = [], None, 0, 0, 0
    for copy in range(copies):
        total = 0
        for src in sources:
            if total >= mib << 20:
                break
            try:
                text = f"# copy {copy}: {src.name}\n" + src.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            if f is None or size >= 4 << 20:
                if f:
                    f.close()
                files.append(out / f"part{k:04d}.jsonl")
                f, size, k = open(files[-1], "w"), 0, k + 1
            line = json.dumps({"text": text}) + "\n"
            f.write(line)
            size += len(line)
            total += len(text.encode())
    if f:
        f.close()
    return files


def encode_raw(mode: str, corpus: str, tokenizer: str) -> tuple[int, float]:
    """Tokens and seconds of the tokenizer alone on one core over the corpus's texts, in batches of ~1 MiB."""
    os.environ["RAYON_NUM_THREADS"] = "1"  # this child only: one core
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer)
    texts = [json.loads(line)["text"] for p in sorted(Path(corpus).glob("*.jsonl")) for line in open(p)]
    encode = tok.encode_batch if mode == "raw" else tok.encode_batch_fast  # _fast: no offsets (the pipeline's)
    t0 = time.perf_counter()
    tokens, batch, size = 0, [], 0
    for text in texts:
        batch.append(text)
        size += len(text)
        if size >= 1 << 20:
            tokens += sum(len(e.ids) for e in encode(batch))
            batch, size = [], 0
    tokens += sum(len(e.ids) for e in encode(batch))
    return tokens, time.perf_counter() - t0


def run_pipeline(corpus: str, tokenizer: str, workers: int) -> tuple[int, float, dict[str, float]]:
    """Tokens and seconds of the preparation pipeline, and where its wall time went."""
    from pretrain.data.prepare.pipeline import prepare
    from pretrain.spec.data import DataSpec

    data = DataSpec(
        sources=[f"{corpus}/*.jsonl"],
        tokenizer={"path": tokenizer},
        workers=workers,
        unit_bytes=1 << 20,
        shard_tokens=10_000_000,
        val_fraction=0.01,
    )
    began: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="bench-prep-") as tmp:
        t0 = time.perf_counter()
        m = prepare(
            data,
            Path(tmp) / "data",
            work=Path(tmp) / "work",
            log=lambda *_: None,
            progress=lambda p: began.setdefault(p.phase, time.perf_counter() - t0),
        )
        seconds = time.perf_counter() - t0
    tokens = sum(s["tokens"] for s in m["sources"]) - sum(s["documents"] for s in m["sources"])  # no separators
    # the pool works from the "tokenizer" report (a given tokenizer loads at once) to "assemble"
    extra = {"pool_s": began["assemble"] - began["tokenizer"], "assemble_s": seconds - began["assemble"]}
    # the workers are children of multiprocessing's fork server: stop and reap it, so their CPU
    # time and peak RSS (which it collected when it reaped them) count in RUSAGE_CHILDREN below
    # (a private CPython helper, which its own tests use; the bench's measurement only)
    from multiprocessing import forkserver

    forkserver._forkserver._stop()
    return tokens, seconds, extra


def child(mode: str, corpus: str, tokenizer: str, workers: int) -> None:
    """One measurement; prints one JSON line."""
    extra: dict[str, float] = {}
    if mode in ("raw", "raw-fast"):
        tokens, seconds = encode_raw(mode, corpus, tokenizer)
    else:
        tokens, seconds, extra = run_pipeline(corpus, tokenizer, workers)
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    print(
        json.dumps(
            {
                "tokens": tokens,
                "seconds": seconds,
                "self_mib": me.ru_maxrss / 1024,
                "worker_mib": kids.ru_maxrss / 1024,
                **extra,
                "cpu_s": me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime,
            }
        )
    )


def run_child(mode: str, corpus: Path, tokenizer: Path, workers: int = 1) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--child", mode, str(corpus), str(tokenizer), str(workers)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=12, help="corpus size (text MiB) for the throughput runs")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--workers", type=int, default=0, help="the 'all workers' run (0: one per core)")
    ap.add_argument("--repeats", type=int, default=1, help="interleaved repeats of the three throughput runs")
    ap.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    return ap.parse_args()


def train_tokenizer(corpus: Path, vocab: int, out: Path) -> Path:
    """A byte-level BPE tokenizer trained once on the corpus's first file, saved to ``out``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts = [json.loads(line)["text"] for line in open(sorted(corpus.glob("*.jsonl"))[0])]
    tok.train_from_iterator(
        texts,
        trainers.BpeTrainer(
            vocab_size=vocab,
            special_tokens=["<|endoftext|>"],
            show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    tok.save(str(out))
    return out


def measure(args: argparse.Namespace, all_workers: int) -> tuple[dict[str, dict], dict]:
    """The least disturbed of the interleaved repeats of each throughput run (raw, fast, one,
    many), and the run of all workers on the 4× corpus."""
    with tempfile.TemporaryDirectory(prefix="bench-data-") as tmp:
        small, large = Path(tmp) / "small", Path(tmp) / "large"
        make_corpus(small, args.mib)
        make_corpus(large, args.mib, copies=4)
        tokenizer = train_tokenizer(small, args.vocab, Path(tmp) / "tokenizer.json")

        runs: dict[str, list[dict]] = {"raw": [], "fast": [], "one": [], "many": []}
        for _ in range(args.repeats):  # interleaved: a busy spell of the shared machine hits every way alike
            runs["raw"].append(run_child("raw", small, tokenizer))
            runs["fast"].append(run_child("raw-fast", small, tokenizer))
            runs["one"].append(run_child("pipeline", small, tokenizer, 1))
            runs["many"].append(run_child("pipeline", small, tokenizer, all_workers))
        big = run_child("pipeline", large, tokenizer, all_workers)
    best = {k: max(v, key=lambda r: r["tokens"] / r["seconds"]) for k, v in runs.items()}  # least disturbed run
    return best, big


def print_table(args: argparse.Namespace, all_workers: int, load0: float, best: dict[str, dict], big: dict) -> None:
    raw, one, many = best["raw"], best["one"], best["many"]
    rate = {k: r["tokens"] / r["seconds"] for k, r in best.items()}
    cpu = {k: r["tokens"] / r["cpu_s"] for k, r in best.items()}
    print(
        f"corpus {args.mib} MiB of text ({raw['tokens']:,} tokens), vocab {args.vocab}, {os.cpu_count()} cores, "
        f"best of {args.repeats}, load average before/after {load0:.1f}/{os.getloadavg()[0]:.1f}"
    )
    print(
        f"raw encode_batch, 1 core        {rate['raw']:>10,.0f} tokens/s  {raw['seconds']:5.1f} s  "
        f"{cpu['raw']:>10,.0f} tokens/CPU-s"
    )
    print(
        f"raw encode_batch_fast, 1 core   {rate['fast']:>10,.0f} tokens/s  {best['fast']['seconds']:5.1f} s  "
        f"{cpu['fast']:>10,.0f} tokens/CPU-s"
    )
    print(
        f"pipeline, 1 worker              {rate['one']:>10,.0f} tokens/s  {one['seconds']:5.1f} s  "
        f"{cpu['one']:>10,.0f} tokens/CPU-s  → {rate['one'] / rate['raw']:.2f}× raw (target ≥ 0.8), "
        f"{rate['one'] / rate['fast']:.2f}× raw _fast"
    )
    print(
        f"pipeline, {all_workers} workers             {rate['many']:>10,.0f} tokens/s  {many['seconds']:5.1f} s  "
        f"{cpu['many']:>10,.0f} tokens/CPU-s  → {rate['many'] / rate['one']:.2f}× 1 worker (target ≥ 1.7)"
    )
    for name, r in (("1 worker", one), (f"{all_workers} workers", many), (f"{all_workers} workers, 4× corpus", big)):
        print(
            f"  {name}: pool {r['pool_s']:.1f} s, assembly {r['assemble_s']:.1f} s, other serial "
            f"{r['seconds'] - r['pool_s'] - r['assemble_s']:.1f} s of {r['seconds']:.1f} s"
        )
    for name, r in (("1× corpus", many), ("4× corpus", big)):
        print(f"peak RSS {name}: preparing process {r['self_mib']:.0f} MiB, largest worker {r['worker_mib']:.0f} MiB")
    print(f"peak RSS growth for a 4× corpus: {rss_growth(many, big) * 100:+.1f} % (target < 20 %)")


def rss_growth(many: dict, big: dict) -> float:
    """How much more the largest process held on the 4× corpus (0.1: 10 % more)."""
    return max(big["self_mib"], big["worker_mib"]) / max(many["self_mib"], many["worker_mib"]) - 1


def report_checks(args: argparse.Namespace, all_workers: int, load0: float, best: dict[str, dict], big: dict) -> None:
    from bench.results import Check, report

    rate = {k: r["tokens"] / r["seconds"] for k, r in best.items()}
    report(
        [
            Check(
                "pipeline 1 worker / raw encode_batch",
                round(rate["one"] / rate["raw"], 3),
                0.8,
                ">=",
                "reading, JSON parsing, hashing and writing the units cost more than offsets save",
            ),
            Check(
                f"pipeline {all_workers} workers / 1 worker",
                round(rate["many"] / rate["one"], 3),
                1.7,
                ">=",
                f"load average {load0:.1f} → {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores: the workers "
                "shared the cores with other processes (tokens/CPU-s stayed level)"
                if load0 >= 1.5
                else "the serial part of the run (scan, planning, assembly: the lines above)",
            ),
            Check(
                "peak RSS growth for a 4× corpus, %",
                round(rss_growth(best["many"], big) * 100, 1),
                20,
                "<=",
                "something the preparing process holds grows with the corpus",
            ),
        ],
        corpus_mib=args.mib,
        tokens=best["raw"]["tokens"],
    )


def main() -> None:
    args = parse_args()
    if args.child:
        mode, corpus, tokenizer, workers = args.child
        return child(mode, corpus, tokenizer, int(workers))
    all_workers = args.workers or os.cpu_count() or 1
    load0 = os.getloadavg()[0]
    best, big = measure(args, all_workers)
    print_table(args, all_workers, load0, best, big)
    report_checks(args, all_workers, load0, best, big)


if __name__ == "__main__":
    main()
