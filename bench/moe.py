"""A mixture-of-experts model served by Strata and by llama.cpp's llama-server, from one GGUF
file: bench/gguf_peer.py on Qwen3-30B-A3B's layer shape (hidden 2048, 32 query and 4 KV heads
of 128, 128 experts of 768, 8 a token), 6 of its 48 layers, every matrix in Q4_0 blocks (the
router F32), random weights.

    .venv/bin/python bench/moe.py            # bench/results/moe.json and .png (~10 min)
    .venv/bin/python bench/moe.py --replot bench/results/moe.json

Other flags are bench/gguf_peer.py's (--prompt-tokens, --decode, --rounds, ...).
"""
from __future__ import annotations

import sys
from pathlib import Path

if not __package__:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.gguf_peer import main as peer_main  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    peer_main(["--shape", "qwen3-30b-a3b", "--layers", "6", "--quant", "Q4_0", "--name", "moe",
               *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    main()
