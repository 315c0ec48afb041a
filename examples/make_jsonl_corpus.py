"""Write a JSONL corpus to try ``pretrain`` on your own data without downloading anything: the
Python standard library's source files, one JSON record per file, split into a few shards.

    python examples/make_jsonl_corpus.py corpus/            # ≈ 8 MB in corpus/stdlib-0000N.jsonl
    pretrain data prepare examples/jsonl-corpus.yaml        # tokenize it (all cores), print its stats
    pretrain run examples/jsonl-corpus.yaml                 # train on it

Each record is ``{"id": ..., "path": ..., "content": ...}``: the text is in ``content``, which
is why the spec says ``text_field: content``. Your own corpus only needs one JSON object per
line with the text in one field (``.jsonl.gz`` / ``.jsonl.zst`` are read as they are).
"""

from __future__ import annotations

import argparse
import json
import sysconfig
from pathlib import Path


def stdlib_files(max_bytes: int) -> list[Path]:
    """The standard library's .py files in a stable order, up to ``max_bytes`` of them."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chosen, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts or not path.is_file():
            continue
        if total >= max_bytes:
            break
        chosen.append(path)
        total += path.stat().st_size
    return chosen


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="directory to write the shards into (created)")
    p.add_argument("--shards", type=int, default=4, help="number of .jsonl files")
    p.add_argument("--max-mb", type=float, default=8.0, help="megabytes of source text to take")
    args = p.parse_args(argv)
    files = stdlib_files(int(args.max_mb * 1_000_000))
    root = Path(sysconfig.get_paths()["stdlib"])
    args.out.mkdir(parents=True, exist_ok=True)
    outs = [open(args.out / f"stdlib-{i:05d}.jsonl", "w", encoding="utf-8") for i in range(args.shards)]
    try:
        for i, path in enumerate(files):
            text = path.read_text(encoding="utf-8", errors="replace")
            record = {"id": i, "path": str(path.relative_to(root)), "content": text}
            outs[i % args.shards].write(json.dumps(record, ensure_ascii=False) + "\n")
    finally:
        for f in outs:
            f.close()
    size = sum(f.stat().st_size for f in args.out.glob("stdlib-*.jsonl"))
    print(f"wrote {len(files)} documents ({size / 1e6:.1f} MB) into {args.shards} JSONL files in {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
