"""ServerSettings: the HTTP layer's settings (flags of `strata serve`, engine/settings.py).

`python -m server.settings --write-readme` regenerates README.md's flag table from these and
engine/args.py's EngineArgs; `--check` exits 1 when the README differs (tests run it too).
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from engine.settings import FLAGS_BEGIN, FLAGS_END, check_choices, markdown_rows, setting
from server.limits import DEFAULT_MAX_REQUEST_BYTES
from server.reasoning import PARSERS
from server.tool_formats import PARSERS as TOOL_PARSERS
from scheduler.sampling_params import POOLINGS
from server.response_store import DEFAULT_RESPONSES_STORE_MB

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
README = Path(__file__).resolve().parent.parent / "README.md"


@dataclass(frozen=True)
class ServerSettings:
    host: str = setting("127.0.0.1", "address to listen on", group="server")
    port: int = setting(8000, "port to listen on", group="server")
    api_key: str | None = setting(None, "require 'Authorization: Bearer KEY' on /v1 (or env "
                                  "STRATA_API_KEY)", group="server")
    max_request_bytes: int = setting(DEFAULT_MAX_REQUEST_BYTES, "request bodies above this "
                                     "size get HTTP 413 before they are parsed (0: no limit)",
                                     group="server")
    responses_store_mb: float = setting(DEFAULT_RESPONSES_STORE_MB, "memory for the responses "
                                        "created with store: true (/v1/responses, which "
                                        "previous_response_id continues); the least recently "
                                        "used go first (0: store none)", group="server")
    reasoning_parser: str = setting("auto", "split a reasoning model's <think> text out of the "
                                    "answer into reasoning_content (chat) or a reasoning item "
                                    "(responses): qwen3 (thinking when the answer opens "
                                    "<think>), deepseek_r1 (the prompt opened it); auto: qwen3 "
                                    "when the chat template writes <think>", PARSERS,
                                    group="server")
    tool_call_parser: str = setting("auto", "how the model writes tool calls, read back into "
                                    "tool_calls and forced by tool_choice required: hermes "
                                    "(<tool_call> blocks), mistral ([TOOL_CALLS] and a JSON "
                                    "array), llama3_json (the answer is {name, parameters}), "
                                    "phi4_mini_json (functools and a JSON array); "
                                    "auto: by the chat template, hermes for templates that do "
                                    "not render tools", TOOL_PARSERS, group="server")
    embedding_pooling: str = setting("last", "/v1/embeddings: an input's final hidden state "
                                     "of its last token (vLLM's default for decoder models) or "
                                     "the mean over its tokens, L2-normalized", POOLINGS,
                                     group="server")
    allow_runtime_lora: bool = setting(False, "serve POST /v1/load_lora_adapter and "
                                       "/v1/unload_lora_adapter (vLLM's), which load LoRA "
                                       "folders from this server's disk while it serves",
                                       group="server")
    chat_template: str = setting("", "a Jinja chat template instead of the model's: a file, or "
                                 "the template itself (vLLM's --chat-template)",
                                 group="server")
    trust_request_chat_template: bool = setting(False, "let a chat request's own "
                                                "`chat_template` (vLLM's field) render it: a "
                                                "template is code this server runs (in "
                                                "Jinja's sandbox)", group="server")
    allowed_origins: str = setting("*", "origins whose web pages may call this server (CORS): "
                                   "comma-separated or a JSON list (vLLM's form); *: any, as "
                                   "vLLM and llama.cpp allow; '': none", group="server")
    allowed_methods: str = setting("*", "HTTP methods those pages may use (CORS; as "
                                   "--allowed-origins)", group="server")
    allowed_headers: str = setting("*", "request headers those pages may send (CORS; as "
                                   "--allowed-origins)", group="server")
    allow_credentials: bool = setting(False, "let those pages send cookies (CORS); needs "
                                      "origins named in --allowed-origins, not *",
                                      group="server")
    ssl_keyfile: str | None = setting(None, "serve HTTPS with this private key (PEM), with "
                                      "--ssl-certfile", group="server")
    ssl_certfile: str | None = setting(None, "the certificate (PEM) of --ssl-keyfile",
                                       group="server")
    root_path: str = setting("", "the path prefix a reverse proxy serves this server under "
                             "and strips before forwarding (ASGI root_path, as vLLM's "
                             "--root-path: the API docs' URLs carry it)", group="server")
    uds: str | None = setting(None, "listen on this Unix domain socket instead of "
                              "--host/--port", group="server")
    log_level: str = setting("info", "log level", LOG_LEVELS, group="server")
    disable_log_stats: bool = setting(False, "no stats line in the log every 10 s while "
                                      "requests run (throughput, requests, KV pages, prefix "
                                      "hits: vLLM's)", group="server")
    enable_log_requests: bool = setting(False, "a log line per finished request: its tokens "
                                        "(cached, output), time to first token, decode speed",
                                        group="server")
    drain_seconds: float = setting(0.0, "on SIGTERM or Ctrl-C, keep serving this long with "
                                   "/health answering 503, so that a router or load balancer "
                                   "moves new requests away first (a second signal stops at "
                                   "once)", group="server")

    def __post_init__(self):
        check_choices(self)
        if not 0 < self.port < 65536:
            raise ValueError(f"--port must be in 1..65535, got {self.port}")
        if self.drain_seconds < 0:
            raise ValueError("--drain-seconds must be >= 0")
        if self.responses_store_mb < 0:
            raise ValueError("--responses-store-mb must be >= 0 (0: store no responses)")
        if self.max_request_bytes < 0:
            raise ValueError("--max-request-bytes must be >= 0 (0: no limit)")
        self.cors()
        self.chat_template_source()
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValueError("--ssl-keyfile and --ssl-certfile go together")
        for flag, path in (("--ssl-keyfile", self.ssl_keyfile),
                           ("--ssl-certfile", self.ssl_certfile)):
            if path is not None and not Path(path).expanduser().is_file():
                raise ValueError(f"{flag}: no such file: {path}")

    def listen(self) -> dict:
        """uvicorn.Config's keywords of where and how this server listens."""
        where = {"uds": self.uds} if self.uds else {"host": self.host, "port": self.port}
        tls = {"ssl_keyfile": str(Path(self.ssl_keyfile).expanduser()),
               "ssl_certfile": str(Path(self.ssl_certfile).expanduser())} \
            if self.ssl_keyfile else {}
        return {**where, **tls, "root_path": self.root_path}

    def chat_template_source(self) -> str | None:
        """--chat-template's text (a file's, or the flag's own), None: the model's (ValueError:
        neither a file nor a template, or not valid Jinja)."""
        from server.tokenizer import TemplateError, compile_template
        if not self.chat_template:
            return None
        path = Path(self.chat_template).expanduser()
        if "{{" in self.chat_template or "{%" in self.chat_template:
            source = self.chat_template          # (a long one is no file name: check first)
        elif path.is_file():
            source = path.read_text()
        else:
            raise ValueError(f"--chat-template: {self.chat_template} is no file and no Jinja "
                             "template")
        try:
            compile_template(source)
        except TemplateError as exc:
            raise ValueError(f"--chat-template: {exc}") from None
        return source

    def cors(self) -> dict:
        """Starlette's CORSMiddleware keywords (ValueError: a flag is no list, or credentials
        with any origin, which would let every site send this server's cookies)."""
        origins = flag_list(self.allowed_origins, "--allowed-origins")
        if self.allow_credentials and "*" in origins:
            raise ValueError("--allow-credentials needs the origins named in --allowed-origins "
                             "(not *)")
        return dict(allow_origins=origins, allow_credentials=self.allow_credentials,
                    allow_methods=flag_list(self.allowed_methods, "--allowed-methods"),
                    allow_headers=flag_list(self.allowed_headers, "--allowed-headers"))


def flag_list(value: str, flag: str) -> list[str]:
    """A list flag's items: a JSON list of strings (vLLM's form) or comma-separated."""
    if value.lstrip().startswith("["):
        try:
            items = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{flag}: not a JSON list: {exc}") from None
        if not all(isinstance(i, str) for i in items):
            raise ValueError(f"{flag}: a JSON list of strings, got {value}")
        return items
    return [item.strip() for item in value.split(",") if item.strip()]


def flag_table() -> str:
    """The README's flag table, generated from the settings dataclasses."""
    from engine.args import EngineArgs          # plain module: no torch
    rows = markdown_rows(ServerSettings) + markdown_rows(EngineArgs)
    return "\n".join(["| flag | default | meaning |", "|---|---|---|", *rows])


def readme_with_flags(text: str) -> str:
    """`text` (README.md) with the block between the flag markers regenerated."""
    start, end = text.index(FLAGS_BEGIN) + len(FLAGS_BEGIN), text.index(FLAGS_END)
    return text[:start] + "\n" + flag_table() + "\n" + text[end:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write-readme", action="store_true")
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args(argv)
    text = README.read_text()
    fresh = readme_with_flags(text)
    if args.write_readme and fresh != text:
        README.write_text(fresh)
    elif args.check and fresh != text:
        print("README.md's flag table is stale: run python -m server.settings --write-readme",
              file=sys.stderr)
        return 1
    elif not (args.write_readme or args.check):
        print(flag_table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
