"""`strata serve`: start the HTTP server at once, load the engine in the background.

/health answers 503 (and /v1 routes 503) until the engine has loaded; then 200. The engine is
imported here, lazily, inside the loader thread: no other module of `server/` imports torch
(the one exception: `--device cuda[:N]` is checked with torch before listening, so a GPU that
cannot be used is a clear error rather than a server that fails to load).
"""
from __future__ import annotations

import argparse
import asyncio
import inspect
import logging
import os
import sys
import threading
from pathlib import Path

import uvicorn

from server.api import build_app
from server.engine_slot import EngineSlot
from engine.settings import add_flags, from_namespace
from server.settings import ServerSettings
from server.tokenizer import Tokenizer

logger = logging.getLogger("strata.cli")



def build_parser() -> argparse.ArgumentParser:
    """`strata serve` / `strata prepare-model`; every flag comes from a settings dataclass
    (server/settings.py, engine/args.py), and an unknown flag is an error."""
    from engine.args import EngineArgs                 # plain dataclass: no torch
    parser = argparse.ArgumentParser(prog="strata", description="Strata inference server")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    add_flags(serve.add_argument_group("server"), ServerSettings)
    add_flags(serve.add_argument_group("engine"), EngineArgs)
    prepare = commands.add_parser("prepare-model",
                                  help="convert a .gguf model once into the cached HF folder")
    add_flags(prepare, EngineArgs, only=("model", "cache_dir"))
    calib = commands.add_parser("calibrate", help="fit the keys' low-rank projection of "
                                "--selector lowrank on text (once per model; serve does it "
                                "on first use otherwise)")
    add_flags(calib, EngineArgs, only=("model", "cache_dir", "lowrank_rank", "hf_overrides",
                                       "max_model_len"))
    calib.add_argument("--text", action="append", default=None, metavar="FILE",
                       help="calibration text file (repeatable; default: the bundled essays)")
    calib.add_argument("--tokens", type=int, default=32768,
                       help="calibration tokens, in sequences of 2048 (default 32768)")
    prof = commands.add_parser("profile", help="measure per layer and KV head how the "
                               "selector's recall grows with the budget, and write a budget "
                               "plan for --sparse-budget-plan (KVDrive's 2D window scaling)")
    add_flags(prof, EngineArgs, only=("model", "cache_dir", "sparse_budget", "page_size",
                                      "sparse_sink_tokens", "sparse_local_tokens",
                                      "dense_layers", "selector"))
    prof.add_argument("--out", default=None, metavar="JSON",
                      help="the plan file (default: budget-plan-<budget>.json here)")
    prof.add_argument("--text", action="append", default=None, metavar="FILE",
                      help="calibration text file (repeatable; default: the bundled essays)")
    prof.add_argument("--tokens", type=int, default=16384,
                      help="calibration tokens (default 16384)")
    prof.add_argument("--length", type=int, default=8192,
                      help="tokens per calibration sequence, at most the model's positions "
                      "(default 8192)")
    prof.add_argument("--window", type=int, default=32,
                      help="last positions of each sequence taken as decode queries")
    prof.add_argument("--options", default=None, metavar="N,N,...",
                      help="budgets (tokens) a head may get (default 128,256,...,4096)")
    cache = commands.add_parser("cache", help="list or empty the prefix cache kept on the "
                                "disk tier (--kv-disk-path)")
    cache.add_argument("action", choices=("ls", "clear"))
    add_flags(cache, EngineArgs, only=("kv_disk_path", "cache_dir"))
    return parser


def served_name(model: str | None, explicit: str | None) -> str:
    from engine.args import default_served_name     # plain module: no torch
    return explicit or default_served_name(model)


def engine_args(args: argparse.Namespace, served_model_name: str):
    """EngineArgs from the CLI flags (an unset flag keeps the field's default).
    Raises ValueError for invalid values, before anything is loaded."""
    from engine.args import EngineArgs                 # plain dataclass: no torch
    args.served_model_name = served_model_name
    return from_namespace(EngineArgs, args)


class EngineLoader:
    """Loads the engine off the event loop, then attaches it to the slot."""

    def __init__(self, engine_args, slot: EngineSlot, server: uvicorn.Server,
                 chat_template: str | None = None):
        self._engine_args, self._slot, self._server = engine_args, slot, server
        self._chat_template = chat_template         # --chat-template's, over the model's
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
            tokenizer = Tokenizer.from_folder(engine.tokenizer_path, self._chat_template)
            self._slot.attach(engine, tokenizer)
            logger.info("ready: %s (max_model_len %d)", engine.model_name, engine.max_model_len)
        except Exception as exc:
            logger.exception("loading the engine failed")
            self._slot.fail(str(exc))
            self.failed = True
            self._server.should_exit = True


class DrainingServer(uvicorn.Server):
    """uvicorn's server, whose first SIGTERM / SIGINT starts a drain of `drain_s` seconds:
    /health answers 503 (`on_drain`) while requests are still served, then it stops as
    uvicorn does. A second signal, or a drain of 0, stops at once."""

    def __init__(self, config: uvicorn.Config, drain_s: float, on_drain):
        super().__init__(config)
        self._drain_s = drain_s
        self._on_drain = on_drain
        self._draining = False

    def handle_exit(self, sig, frame) -> None:
        if self._drain_s <= 0 or self._draining or not self.started:
            super().handle_exit(sig, frame)
            return
        self._draining = True
        self._on_drain()
        logger.info("draining for %.1f s before stopping (signal again to stop now)",
                    self._drain_s)
        timer = threading.Timer(self._drain_s, super().handle_exit, (sig, frame))
        timer.daemon = True
        timer.start()


async def _serve(server: uvicorn.Server, loader: EngineLoader) -> None:
    serving = asyncio.create_task(server.serve())
    while not server.started and not serving.done():
        await asyncio.sleep(0.02)
    if server.started:                         # listening: /health answers 503 from now on
        loader.start(asyncio.get_running_loop())
    await serving


def _app(slot: EngineSlot, name: str, aliases: tuple[str, ...], settings, load_args):
    """The app over `slot` (ValueError: flags that contradict each other, an adapter folder
    that is not one)."""
    from engine.args import LORA_CONFIG_FILE          # plain module: no torch
    loras = load_args.lora_adapters()
    for lora, folder in loras.items():
        if not (folder / LORA_CONFIG_FILE).is_file():
            raise ValueError(f"--lora-modules: {lora}={folder} holds no {LORA_CONFIG_FILE}")
    return build_app(slot, slot.tokenizer, served_model_name=name,
                     api_key=settings.api_key or os.environ.get("STRATA_API_KEY") or None,
                     model_aliases=aliases, max_request_bytes=settings.max_request_bytes,
                     responses_store_mb=settings.responses_store_mb,
                     reasoning_parser=settings.reasoning_parser,
                     tool_call_parser=settings.tool_call_parser,
                     embedding_pooling=settings.embedding_pooling,
                     lora_modules={k: str(v) for k, v in loras.items()},
                     allow_runtime_lora=settings.allow_runtime_lora, cors=settings.cors(),
                     trust_request_chat_template=settings.trust_request_chat_template,
                     log_stats=not settings.disable_log_stats,
                     log_requests=settings.enable_log_requests)


def serve(args: argparse.Namespace) -> int:
    name = served_name(args.model, args.served_model_name)
    try:
        load_args = engine_args(args, name)
        settings = from_namespace(ServerSettings, args)
        if load_args.device.startswith("cuda"):     # a GPU that cannot be used: no server
            from engine.devices import resolve_device   # NOTE: loads torch, as asked for a GPU
            resolve_device(load_args.device)
    except ValueError as exc:
        print(f"strata serve: {exc}", file=sys.stderr)
        return 2
    if "*" in settings.cors()["allow_origins"] and not (
            settings.api_key or os.environ.get("STRATA_API_KEY")) and (
            settings.allow_runtime_lora or settings.trust_request_chat_template):
        logger.warning("any web page may call this server (--allowed-origins *) without an "
                       "--api-key, and it loads adapters or runs request templates: set a "
                       "key or name the origins")
    slot = EngineSlot(name)
    aliases = tuple(a for a in {args.model} if a and a != name)
    try:
        app = _app(slot, name, aliases, settings, load_args)
    except ValueError as exc:
        print(f"strata serve: {exc}", file=sys.stderr)
        return 2
    config = uvicorn.Config(app, **settings.listen(), log_level=settings.log_level,
                            timeout_graceful_shutdown=5)
    server = DrainingServer(config, settings.drain_seconds,
                            on_drain=lambda: setattr(app.state.ctx, "draining", True))
    loader = EngineLoader(load_args, slot, server, settings.chat_template_source())
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


def calibrate_command(args: argparse.Namespace) -> int:
    """`strata calibrate`: the keys' low-rank basis of --selector lowrank, written where
    serve looks for it (engine/calibration.py)."""
    from engine.args import EngineArgs
    from engine.calibration import calibrate_model
    eargs = EngineArgs(model=args.model, cache_dir=args.cache_dir,
                       lowrank_rank=args.lowrank_rank, hf_overrides=args.hf_overrides,
                       max_model_len=args.max_model_len)
    path, proj = calibrate_model(eargs, args.tokens, args.text)
    print(f"{path}: rank {proj.rank} keeps {100 * min(proj.energy):.1f}-"
          f"{100 * max(proj.energy):.1f}% of the keys' energy per layer "
          f"({proj.tokens} tokens)")
    return 0


def profile_command(args: argparse.Namespace) -> int:
    """`strata profile`: a budget plan for --sparse-budget-plan (engine/profile.py)."""
    from engine.args import EngineArgs
    from engine.profile import profile_model, write_plan
    if not args.sparse_budget or args.sparse_budget <= 0:
        print("error: strata profile needs --sparse-budget N (the uniform budget whose total "
              "the plan spends)", file=sys.stderr)
        return 2
    given = {name: getattr(args, name) for name in (
        "model", "cache_dir", "sparse_budget", "page_size", "sparse_sink_tokens",
        "sparse_local_tokens", "dense_layers", "selector") if getattr(args, name) is not None}
    eargs = EngineArgs(**given)                 # flags not given keep their defaults
    options = [int(o) for o in args.options.split(",")] if args.options else None
    plan = profile_model(eargs, args.tokens, args.length, args.window, options, args.text)
    print(write_plan(plan, args.out or f"budget-plan-{args.sparse_budget}.json"))
    return 0


def cache_command(args: argparse.Namespace) -> int:
    """`strata cache ls | clear`: the segment files and index logs under --kv-disk-path."""
    from engine.args import EngineArgs, disk_folders
    from kvstore.cache_files import clear_cache, format_listing, list_cache
    from kvstore.tiers.disk_layout import DiskPathInUse
    roots = disk_folders(args.kv_disk_path) if args.kv_disk_path else \
        [EngineArgs(cache_dir=args.cache_dir).resolved_cache_dir.parent / "kv"]
    status = 0
    for root in roots:          # several folders (one per drive): each in turn
        if not root.is_dir():
            print(f"no KV disk folder at {root}")
        elif args.action == "ls":
            print(f"{root}:")
            print(format_listing(list_cache(root)))
        else:
            try:
                print(f"removed {clear_cache(root)} files from {root}")
            except DiskPathInUse as exc:
                print(f"error: {exc}", file=sys.stderr)
                status = 1
    return status


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    level = getattr(args, "log_level", None) or ServerSettings.log_level
    logging.basicConfig(level=level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "prepare-model":
        return prepare_model(args)
    if args.command == "cache":
        return cache_command(args)
    if args.command == "calibrate":
        return calibrate_command(args)
    if args.command == "profile":
        return profile_command(args)
    return serve(args)


if __name__ == "__main__":
    sys.exit(main())
