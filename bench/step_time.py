"""A decode step's time with the server's defaults, in-process, from any checkout (A/B of commits).

    .venv/bin/python bench/step_time.py --checkout /tmp/before --context 7000 --batch 1
    .venv/bin/python bench/step_time.py --context 7000 --batch 1 --sparse   # this checkout

One engine built from `--checkout`'s code (a worktree of another commit, its extensions
built; default: this one) with the server's defaults (--dtype auto, --weights auto, the
core split), `--batch` random-token prompts of `--context` tokens prefilled, `--warm` decode
steps untimed (the core split decides), then the median of `--steps` steps. `--sparse`: the
throughput bench's sparse-tiered KV flags. Prints one JSON line; run two checkouts in turns,
twice, on a quiet machine, and compare.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

if not __package__:                     # run as a script: import from the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import parser, use_checkout_cache  # noqa: E402
from bench.engine_steps import all_decoding, decoding_engine  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    ap = parser(__doc__)
    ap.add_argument("--checkout", default=str(Path(__file__).resolve().parents[1]))
    ap.add_argument("--context", type=int, default=7000)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--sparse", action="store_true")
    ap.add_argument("--warm", type=int, default=40)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--model", default=None,
                    help="an HF folder (bench/random_model.py makes one of another shape); "
                         "default: the bundled model")
    ap.add_argument("--weights", default=None, help="--weights (default: the server's, auto)")
    args = ap.parse_args(argv)
    use_checkout_cache()                # this checkout's converted model, whichever code runs
    root = str(Path(args.checkout).resolve())
    sys.path.insert(0, root)            # the engine's code from `--checkout` (bench's is loaded)
    os.chdir(root)
    kw = dict(kv_device_gb=0.5, kv_host_gb=1, kv_disk_gb=8, sparse_budget=1024) \
        if args.sparse else dict(kv_device_gb=4.0)
    kw.update({k: v for k, v in (("model", args.model), ("weights", args.weights)) if v})
    engine, ids = decoding_engine(args.context, args.batch, args.warm + args.steps, **kw)
    for _ in range(args.warm):
        engine.step()
    walls = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - t0)
    if not all_decoding(engine, ids):
        raise RuntimeError("a request finished inside the timed steps: they were not all "
                           f"{args.batch} rows")
    split = engine.core_split.decided() if getattr(engine, "core_split", None) else None
    print(json.dumps({"checkout": root, "model": args.model or "bundled",
                      "weights": args.weights or "auto",
                      "context": args.context, "batch": args.batch,
                      "sparse": args.sparse, "ms": round(1e3 * statistics.median(walls), 2),
                      "core_split": None if split is None else
                      {str(k): list(v) for k, v in split.items()}}))


if __name__ == "__main__":
    main()
