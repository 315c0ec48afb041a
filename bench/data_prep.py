"""Data preparation throughput and memory, side by side in one run:

1. raw ``Tokenizer.encode_batch`` on one core (RAYON_NUM_THREADS=1) over the corpus's texts;
2. the pipeline (``pretrain.dataset.prepare``) with 1 worker on the same JSONL corpus;
3. the pipeline with all workers (one per core);
4. peak RSS of (3) on a corpus 4× larger.

    python bench/data_prep.py [--mib 24 --vocab 8192 --workers 0]

Each measurement runs in its own child process (clean RSS); the tokenizer is trained once up
front and given to every run (``tokenizer.path``), so only reading, tokenizing and writing are
timed. Prints tokens/s, the ratios the issue asks for, and peak RSS (the preparing process and
its largest worker).
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


def child(mode: str, corpus: str, tokenizer: str, workers: int) -> None:
    """One measurement; prints one JSON line."""
    if mode == "raw":
        os.environ["RAYON_NUM_THREADS"] = "1"  # this child only: one core
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(tokenizer)
        texts = [json.loads(line)["text"] for p in sorted(Path(corpus).glob("*.jsonl")) for line in open(p)]
        t0 = time.perf_counter()
        tokens, batch, size = 0, [], 0
        for text in texts:
            batch.append(text)
            size += len(text)
            if size >= 1 << 20:
                tokens += sum(len(e.ids) for e in tok.encode_batch(batch))
                batch, size = [], 0
        tokens += sum(len(e.ids) for e in tok.encode_batch(batch))
        seconds = time.perf_counter() - t0
    else:
        from pretrain.dataset.prepare import prepare
        from pretrain.spec_data import DataSpec

        data = DataSpec(sources=[f"{corpus}/*.jsonl"], tokenizer={"path": tokenizer}, workers=workers,
                        unit_bytes=1 << 20, shard_tokens=10_000_000, val_fraction=0.01)
        with tempfile.TemporaryDirectory(prefix="bench-prep-") as tmp:
            t0 = time.perf_counter()
            m = prepare(data, Path(tmp) / "data", work=Path(tmp) / "work", log=lambda *_: None)
            seconds = time.perf_counter() - t0
        tokens = sum(s["tokens"] for s in m["sources"]) - sum(s["documents"] for s in m["sources"])  # no separators
    rss = {"self_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
           "worker_mib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}
    print(json.dumps({"tokens": tokens, "seconds": seconds, **rss}))


def run_child(mode: str, corpus: Path, tokenizer: Path, workers: int = 1) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", mode, str(corpus), str(tokenizer), str(workers)],
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=24, help="corpus size (text MiB) for the throughput runs")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--workers", type=int, default=0, help="the 'all workers' run (0: one per core)")
    ap.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        mode, corpus, tokenizer, workers = args.child
        return child(mode, corpus, tokenizer, int(workers))
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    all_workers = args.workers or os.cpu_count() or 1
    with tempfile.TemporaryDirectory(prefix="bench-data-") as tmp:
        small, large = Path(tmp) / "small", Path(tmp) / "large"
        make_corpus(small, args.mib)
        make_corpus(large, args.mib, copies=4)
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        texts = [json.loads(line)["text"] for line in open(sorted(small.glob("*.jsonl"))[0])]
        tok.train_from_iterator(texts, trainers.BpeTrainer(
            vocab_size=args.vocab, special_tokens=["<|endoftext|>"], show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
        tokenizer = Path(tmp) / "tokenizer.json"
        tok.save(str(tokenizer))

        raw = run_child("raw", small, tokenizer)
        one = run_child("pipeline", small, tokenizer, 1)
        many = run_child("pipeline", small, tokenizer, all_workers)
        big = run_child("pipeline", large, tokenizer, all_workers)
    rate = {k: r["tokens"] / r["seconds"] for k, r in (("raw", raw), ("one", one), ("many", many), ("big", big))}
    print(f"corpus {args.mib} MiB of text ({raw['tokens']:,} tokens), vocab {args.vocab}, {os.cpu_count()} cores")
    print(f"raw encode_batch, 1 core        {rate['raw']:>12,.0f} tokens/s  ({raw['seconds']:.1f} s)")
    print(f"pipeline, 1 worker              {rate['one']:>12,.0f} tokens/s  ({one['seconds']:.1f} s)  "
          f"→ {rate['one'] / rate['raw']:.2f}× raw (target ≥ 0.8)")
    print(f"pipeline, {all_workers} workers             {rate['many']:>12,.0f} tokens/s  ({many['seconds']:.1f} s)  "
          f"→ {rate['many'] / rate['one']:.2f}× 1 worker (target ≥ 1.7)")
    print(f"pipeline, {all_workers} workers, 4× corpus  {rate['big']:>12,.0f} tokens/s  ({big['seconds']:.1f} s)")
    for name, r in (("1× corpus", many), ("4× corpus", big)):
        print(f"peak RSS {name}: preparing process {r['self_mib']:.0f} MiB, largest worker {r['worker_mib']:.0f} MiB")
    grow = max(big["self_mib"], big["worker_mib"]) / max(many["self_mib"], many["worker_mib"]) - 1
    print(f"peak RSS growth for a 4× corpus: {grow * 100:+.1f} % (target < 20 %)")


if __name__ == "__main__":
    main()
