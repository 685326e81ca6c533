"""Several replicas behind vllm-router: a correctness-and-overhead run (on a 2-core box the
replicas share the cores, so this is no throughput scaling figure).

1. Router overhead: the same short request (1 token out) sent straight to a replica and through
   the router, alternated, `--overhead-requests` times each: latency p50 / p99 of both.
2. The shared-document workload (bench/prefix.py's): `--docs` documents of ~`--context` tokens,
   `--questions` each, `--clients` at a time, through the router in front of 1 and of 2
   replicas: wall time, TTFT p50, which replica served each document, and the prefix-cache hit
   ratio (hit tokens / prompt tokens) summed over the replicas.

    .venv/bin/python bench/scaleout.py [--quick]
"""
from __future__ import annotations

import asyncio
import shlex
import subprocess
import sys
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

if not __package__:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (LOGS, ROOT, add_out_arg, add_replot_arg, cpu_line, parser, pct, pyplot,
                          read_json, result_header, result_path, save_figure, tokenizer,
                          use_checkout_cache, write_json)
from bench.servers import free_port, start_server, stop

FLAGS = ROOT / "deploy" / "router" / "flags"
REPLICA_FLAGS = ["--drain-seconds", "6"]


def router_flags() -> list[str]:
    return [a for ln in FLAGS.read_text().splitlines() if ln.strip() and not ln.startswith("#")
            for a in shlex.split(ln)]


@contextmanager
def router(workers: list[str]):
    import httpx
    port = free_port()
    LOGS.mkdir(parents=True, exist_ok=True)
    log = (LOGS / f"router-{len(workers)}.log").open("w")
    proc = subprocess.Popen([str(Path(sys.executable).parent / "vllm-router"), "--host",
                             "127.0.0.1", "--port", str(port), "--prometheus-host", "127.0.0.1",
                             "--prometheus-port", str(free_port()), "--worker-urls", *workers,
                             *router_flags()], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"router exited; see {log.name}")
            try:
                if httpx.get(url + "/readiness", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        yield url
    finally:
        stop(proc)


def metrics(url: str) -> dict[str, float]:
    import httpx
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(("strata_prefix_cache_", "strata_prompt_tokens_total",
                            "strata_request_success_total")):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def overhead(direct: str, routed: str, n: int) -> dict:
    import httpx
    body = {"model": "SmolLM2-135M-Instruct", "max_tokens": 1, "temperature": 0,
            "messages": [{"role": "user", "content": "Say yes."}]}
    times = {"direct": [], "router": []}
    with httpx.Client(timeout=120) as c:
        for i in range(n + 2):
            for name, url in (("direct", direct), ("router", routed)):
                t = time.perf_counter()
                assert c.post(url + "/v1/chat/completions", json=body).status_code == 200
                if i >= 2:                                   # two warm-up rounds
                    times[name].append(time.perf_counter() - t)
    res = {k: {"p50_ms": 1e3 * pct(v, 50), "p99_ms": 1e3 * pct(v, 99)} for k, v in times.items()}
    res["overhead_p50_ms"] = res["router"]["p50_ms"] - res["direct"]["p50_ms"]
    res["overhead_p99_ms"] = res["router"]["p99_ms"] - res["direct"]["p99_ms"]
    return res


async def shared_docs(url: str, docs: list[str], questions: int, clients: int) -> dict:
    from bench.servers import async_openai
    client = async_openai(url + "/v1", timeout=1800)
    sem = asyncio.Semaphore(clients)
    ttfts = []

    async def ask(d: int, q: int) -> None:
        async with sem:
            t = time.perf_counter()
            stream = await client.chat.completions.create(
                model="SmolLM2-135M-Instruct", max_tokens=8, temperature=0, stream=True,
                messages=[{"role": "user", "content": f"{docs[d]}\n\nQuestion {q}: what is "
                                                      f"point {q} of the text?"}])
            first = None
            async for _ in stream:
                first = first or time.perf_counter()
            ttfts.append(first - t)

    t = time.perf_counter()
    # each document's questions arrive together, the documents one after another overlapping
    await asyncio.gather(*[ask(d, q) for q in range(questions) for d in range(len(docs))])
    return {"wall_s": time.perf_counter() - t, "ttft_p50_s": pct(ttfts, 50),
            "ttft_p99_s": pct(ttfts, 99)}


def workload(replicas: list[str], docs: list[str], args) -> dict:
    before = [metrics(u) for u in replicas]
    with router(replicas) as url:
        res = asyncio.run(shared_docs(url, docs, args.questions, args.clients))
    after = [metrics(u) for u in replicas]
    per = []
    for b, a in zip(before, after):
        per.append({k: a.get(k, 0.0) - b.get(k, 0.0) for k in a})
    hits = sum(p.get("strata_prefix_cache_hits_total", 0) for p in per)
    queried = sum(p.get("strata_prefix_cache_queries_total", 0) for p in per)
    served = [sum(v for k, v in p.items() if k.startswith("strata_request_success_total"))
              for p in per]
    return {**res, "hit_ratio": hits / queried if queried else 0.0, "requests_per_replica": served,
            "ideal_hit_ratio": 1 - 1 / args.questions}


def run(args) -> dict:
    tok = tokenizer()
    from bench.common import essay_texts
    docs = essay_texts(tok, args.docs, args.context)
    rep = {**result_header("scaleout"), "settings": {k: getattr(args, k) for k in (
        "docs", "context", "questions", "clients", "overhead_requests")},
        "router_flags": router_flags()}
    with ExitStack() as stack:
        urls = []
        for i in range(2):
            LOGS.mkdir(parents=True, exist_ok=True)
            proc, url = start_server(REPLICA_FLAGS, log=LOGS / f"replica-{i}.log")
            stack.callback(stop, proc)
            urls.append(url)
        with router(urls) as routed:
            rep["overhead"] = overhead(urls[0], routed, args.overhead_requests)
        print(f"router overhead p50 {rep['overhead']['overhead_p50_ms']:.1f} ms", flush=True)
        rep["one_replica"] = workload(urls[:1], docs[: len(docs) // 2], args)
        print("1 replica:", rep["one_replica"], flush=True)
        rep["two_replicas"] = workload(urls, docs[len(docs) // 2:], args)
        print("2 replicas:", rep["two_replicas"], flush=True)
    return rep


def plot(rep: dict, path: Path) -> None:
    plt = pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.4))
    o = rep["overhead"]
    a.bar(["direct p50", "router p50", "direct p99", "router p99"],
          [o["direct"]["p50_ms"], o["router"]["p50_ms"], o["direct"]["p99_ms"],
           o["router"]["p99_ms"]], color=["#888", "#36c", "#888", "#36c"])
    a.set_ylabel("ms per 1-token request")
    a.set_title("router overhead")
    names = ["1 replica", "2 replicas"]
    runs = [rep["one_replica"], rep["two_replicas"]]
    b.bar(names, [r["hit_ratio"] for r in runs], color="#36c", label="measured")
    b.plot(names, [r["ideal_hit_ratio"] for r in runs], "k_", markersize=30,
           label="every repeat hits")
    b.set_ylim(0, 1)
    b.set_ylabel("prefix-cache hit ratio")
    b.set_title("shared documents through the router")
    b.legend(loc="lower right", fontsize=8)
    fig.suptitle(cpu_line(rep["machine"]), fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> None:
    ap = parser(__doc__)
    ap.add_argument("--docs", type=int, default=8, help="documents (half per configuration)")
    ap.add_argument("--context", type=int, default=2000, help="tokens per document")
    ap.add_argument("--questions", type=int, default=4, help="questions per document")
    ap.add_argument("--clients", type=int, default=4, help="requests in flight")
    ap.add_argument("--overhead-requests", type=int, default=30)
    ap.add_argument("--quick", action="store_true", help="4 documents of ~1K tokens")
    add_out_arg(ap, "scaleout", quick=True)
    add_replot_arg(ap)
    args = ap.parse_args(argv)
    if args.replot:
        plot(read_json(args.replot), Path(args.replot).with_suffix(".png"))
        return
    if args.quick:
        args.docs, args.context, args.overhead_requests = 4, 1000, 10
    use_checkout_cache()
    rep = run(args)
    out = write_json(result_path(args.out, "scaleout", args.quick), rep)
    plot(rep, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
