"""`strata serve`: start the HTTP server at once, load the engine in the background.

/health answers 503 (and /v1 routes 503) until the engine has loaded; then 200. The engine is
imported here, lazily, inside the loader thread: no other module of `server/` imports torch.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import inspect
import logging
import os
import sys
import threading
from pathlib import Path

import uvicorn

from server.api import build_app
from server.engine_slot import EngineSlot
from server.limits import DEFAULT_MAX_REQUEST_BYTES
from server.tokenizer import Tokenizer

logger = logging.getLogger("strata.cli")



def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="strata", description="Strata inference server")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    _add_model_flags(serve)
    serve.add_argument("--served-model-name", default=None,
                       help="model id in the API (default: SmolLM2-135M-Instruct for the bundled "
                            "model, else the folder or file name)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    from engine.args import DTYPES, WEIGHTS            # plain module: no torch
    serve.add_argument("--dtype", choices=DTYPES, default="auto",
                       help="activations and the weights of prefill steps; auto: whichever "
                            "this CPU multiplies faster, timed at start-up (the KV cache is "
                            "bf16 unless fp32 is given)")
    serve.add_argument("--weights", choices=WEIGHTS, default="auto",
                       help="weight format of decode steps: native (a GGUF file's Q4_0/Q4_1 "
                            "and Q8_0 blocks as stored, through our kernel or torch's packed "
                            "ones; a float checkpoint's dtype), a dense dtype, or int8/int4 (a "
                            "float checkpoint quantized at load); auto: the fastest on this CPU "
                            "of native and the dense dtypes, timed at start-up")
    serve.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    serve.add_argument("--max-model-len", type=int, default=None,
                       help="prompt + completion tokens (default: the model's positions)")
    serve.add_argument("--max-num-seqs", type=int, default=16, help="running requests at most")
    serve.add_argument("--max-num-batched-tokens", type=int, default=2048,
                       help="tokens per engine step at most")
    serve.add_argument("--max-waiting", type=int, default=256,
                       help="waiting requests at most; more get HTTP 429 (a request whose "
                            "n x prompts exceeds it, 400)")
    serve.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                       help="request bodies above this size get HTTP 413 before they are "
                            "parsed (0: no limit)")
    serve.add_argument("--kv-device-gb", type=float, default=1.0,
                       help="device KV tier (GPU memory; a preallocated RAM pool on CPU)")
    serve.add_argument("--kv-host-gb", type=float, default=0.0, help="host DRAM KV tier (0: none)")
    serve.add_argument("--kv-disk-gb", type=float, default=0.0,
                       help="disk KV tier, the backing store when set (0: none)")
    serve.add_argument("--kv-disk-path", default=None,
                       help="folder for the disk tier's files (default: beside the model cache)")
    serve.add_argument("--sparse-budget", type=int, default=0,
                       help="KV tokens attended per request, layer and KV head in decode "
                            "(0: dense attention)")
    serve.add_argument("--sparse-sink-tokens", type=int, default=16,
                       help="first tokens always attended in sparse decode")
    serve.add_argument("--sparse-local-tokens", type=int, default=64,
                       help="most recent tokens always attended in sparse decode")
    serve.add_argument("--dense-layers", type=int, default=2,
                       help="the first layers always attend densely")
    serve.add_argument("--selector", choices=("quest", "mean"), default="quest",
                       help="page scoring: Quest's min/max bound or the mean key")
    serve.add_argument("--sparse-head-pages", choices=("per-head", "union"), default="per-head",
                       help="each KV head attends to its own selected pages, or to the union "
                            "of all heads' pages (fetched anyway)")
    serve.add_argument("--sparse-obs-window", type=int, default=32,
                       help="the last N prompt tokens' attention, computed once at the end of "
                            "prefill, ranks each page (SnapKV's observation window; 0: off)")
    serve.add_argument("--sparse-obs-reduce", choices=("sum", "max"), default="max",
                       help="how a page's attention from the observation window's queries and "
                            "a GQA group's heads combine: summed (SnapKV) or the largest")
    serve.add_argument("--sparse-prior-share", type=float, default=0.25,
                       help="share of the selected pages (after sink and local pages) kept for "
                            "the pages the observation window attended most; the rest are "
                            "picked per step by --selector")
    serve.add_argument("--pipeline", choices=("sequential", "sfc", "layer-ahead"),
                       default="sequential",
                       help="how sparse decode schedules page selection, fetch and compute per "
                            "layer: one after another; SFC micro-batches (select | resolve | "
                            "fetch overlapped); or layer-ahead prefetch of the next layer's "
                            "predicted pages during this layer's compute")
    serve.add_argument("--micro-batch", type=int, default=0,
                       help="sequences per SFC micro-batch (0: calibrate on the first decode "
                            "steps)")
    serve.add_argument("--residency", choices=("cycle", "lru"), default="cycle",
                       help="which pages the device and host tiers evict when full: cycle "
                            "(a step reads the layers in turn, so keep a fixed share of them: "
                            "first pages unused for a whole step, then the most recently used) "
                            "or lru (least recently used)")
    serve.add_argument("--kv-force-tier", choices=("none", "host", "disk"), default="none",
                       help="diagnostics: evict pages down to this tier after every step")
    serve.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer KEY' on /v1 (env STRATA_API_KEY)")
    serve.add_argument("--log-level", default="info",
                       choices=("critical", "error", "warning", "info", "debug"))
    serve.add_argument("--threads", type=int, default=None,
                       help="torch CPU threads for the model (default: all cores)")
    serve.add_argument("--decode-threads", type=int, default=None,
                       help="torch CPU threads for steps that only decode (default: --threads; "
                            "one fewer with --pipeline sfc or layer-ahead, whose stage threads "
                            "use that core)")
    prepare = commands.add_parser("prepare-model",
                                  help="convert a .gguf model once into the cached HF folder")
    _add_model_flags(prepare)
    return parser


def _add_model_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="HF model folder or .gguf file (default: the bundled "
                             "SmolLM2-135M-Instruct GGUF, also named 'bundled')")
    parser.add_argument("--cache-dir", default=None,
                        help="where converted models are cached (default: $STRATA_CACHE_DIR or "
                             "~/.cache/strata/models)")


def served_name(model: str | None, explicit: str | None) -> str:
    from engine.args import default_served_name     # plain module: no torch
    return explicit or default_served_name(model)


def engine_args(args: argparse.Namespace, served_model_name: str):
    """EngineArgs from the CLI flags (only fields EngineArgs declares; None keeps its default).
    Raises ValueError for invalid values, before anything is loaded."""
    from engine.args import EngineArgs                 # plain dataclass: no torch
    values = {"model": args.model, "served_model_name": served_model_name, "dtype": args.dtype,
              "weights": args.weights,
              "page_size": args.page_size, "max_model_len": args.max_model_len,
              "max_num_seqs": args.max_num_seqs,
              "max_num_batched_tokens": args.max_num_batched_tokens,
              "max_waiting": args.max_waiting, "kv_device_gb": args.kv_device_gb,
              "kv_host_gb": args.kv_host_gb, "kv_disk_gb": args.kv_disk_gb,
              "kv_disk_path": args.kv_disk_path, "sparse_budget": args.sparse_budget,
              "sparse_sink_tokens": args.sparse_sink_tokens,
              "sparse_local_tokens": args.sparse_local_tokens,
              "dense_layers": args.dense_layers, "selector": args.selector,
              "kv_force_tier": args.kv_force_tier,
              "sparse_head_pages": args.sparse_head_pages,
              "sparse_obs_window": args.sparse_obs_window,
              "sparse_prior_share": args.sparse_prior_share,
              "sparse_obs_reduce": args.sparse_obs_reduce,
              "pipeline": args.pipeline, "micro_batch": args.micro_batch,
              "residency": args.residency,
              "threads": args.threads, "decode_threads": args.decode_threads,
              "cache_dir": args.cache_dir}
    known = {f.name for f in dataclasses.fields(EngineArgs)}
    return EngineArgs(**{k: v for k, v in values.items() if k in known and v is not None})


class EngineLoader:
    """Loads the engine off the event loop, then attaches it to the slot."""

    def __init__(self, engine_args, slot: EngineSlot, server: uvicorn.Server):
        self._engine_args, self._slot, self._server = engine_args, slot, server
        self._loop: asyncio.AbstractEventLoop | None = None
        self.failed = False

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        threading.Thread(target=self._run, name="strata-engine-loader", daemon=True).start()

    def _call(self, fn, *args):
        result = fn(*args)
        if inspect.isawaitable(result):          # an async factory / start runs on the loop
            result = asyncio.run_coroutine_threadsafe(result, self._loop).result()
        return result

    def _run(self) -> None:
        try:
            from engine.async_engine import AsyncEngine
            logger.info("loading %s", self._engine_args.model or "the bundled model")
            create = getattr(AsyncEngine, "create", None)
            engine = self._call(create if callable(create) else AsyncEngine, self._engine_args)
            if not engine.is_ready and hasattr(engine, "start"):
                self._call(engine.start)
            tokenizer = Tokenizer.from_folder(engine.tokenizer_path)
            self._slot.attach(engine, tokenizer)
            logger.info("ready: %s (max_model_len %d)", engine.model_name, engine.max_model_len)
        except Exception as exc:
            logger.exception("loading the engine failed")
            self._slot.fail(str(exc))
            self.failed = True
            self._server.should_exit = True


async def _serve(server: uvicorn.Server, loader: EngineLoader) -> None:
    serving = asyncio.create_task(server.serve())
    while not server.started and not serving.done():
        await asyncio.sleep(0.02)
    if server.started:                         # listening: /health answers 503 from now on
        loader.start(asyncio.get_running_loop())
    await serving


def serve(args: argparse.Namespace) -> int:
    name = served_name(args.model, args.served_model_name)
    try:
        load_args = engine_args(args, name)
    except ValueError as exc:
        print(f"strata serve: {exc}", file=sys.stderr)
        return 2
    slot = EngineSlot(name)
    aliases = tuple(a for a in {args.model} if a and a != name)
    app = build_app(slot, slot.tokenizer, served_model_name=name,
                    api_key=args.api_key or os.environ.get("STRATA_API_KEY") or None,
                    model_aliases=aliases, max_request_bytes=args.max_request_bytes)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    loader = EngineLoader(load_args, slot, server)
    with asyncio.Runner(loop_factory=config.get_loop_factory()) as runner:
        runner.run(_serve(server, loader))
    engine = slot.engine
    shutdown = getattr(engine, "shutdown", None) if engine is not None else None
    if callable(shutdown):
        shutdown()
    return 1 if loader.failed or not server.started else 0


def prepare_model(args: argparse.Namespace) -> int:
    """Convert the model once (a .gguf into the HF-folder cache), so `serve` starts fast."""
    from engine.gguf_convert import ensure_hf_folder    # imports torch when converting
    folder = ensure_hf_folder(args.model, Path(args.cache_dir) if args.cache_dir else None)
    print(folder)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=getattr(args, "log_level", "info").upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "prepare-model":
        return prepare_model(args)
    return serve(args)


if __name__ == "__main__":
    sys.exit(main())
