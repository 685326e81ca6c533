"""The README Results sections of the API benches: embeddings against llama.cpp. Called by
bench/report.py."""
from __future__ import annotations

from bench.common import cpu_line


def embeddings_section(rep: dict, png: str) -> list[str]:
    out = ["### Embeddings", "",
           f"`.venv/bin/python bench/embeddings.py`: one /v1/embeddings request of "
           f"{rep['inputs']['short']} short texts (24 tokens) and one of {rep['inputs']['long']} "
           f"long ones ({rep['long_tokens']} tokens), against llama.cpp's `llama-server "
           f"--embeddings --pooling last` on the same GGUF (`--parallel "
           f"{rep['peer_slots']}`, 2 threads), in turns, median of {rep['rounds']} rounds; "
           "Strata with `--prefix-cache off` (each round resends the same texts, which its "
           f"cache would answer from the cached pages). {cpu_line(rep['machine'])}.", "",
           f"![embeddings]({png})", "",
           "| texts | server | request s | inputs/s | tokens/s |", "|---|---|---|---|---|"]
    strata = rep["servers"].get("strata", {})
    for name, ws in rep["servers"].items():
        for w, r in ws.items():
            ratio = ""
            if name != "strata" and w in strata:
                ratio = f" (Strata {r['request_s'] / strata[w]['request_s']:.2f}x faster)"
            out.append(f"| {rep['inputs'][w]} x {w} | {name} | {r['request_s']:.2f}{ratio} | "
                       f"{r['inputs_per_s']:.1f} | {r['tokens_per_s']:.0f} |")
    agree = rep.get("agreement") or {}
    if agree:
        out += ["", "The two servers' vectors agree: cosine similarity " + "; ".join(
            f"{w} mean {a['cosine_mean']:.4f}, min {a['cosine_min']:.4f}"
            for w, a in agree.items()) + "."]
    return out + [""]
