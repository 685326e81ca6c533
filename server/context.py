"""ServerContext: what every route needs (engine, tokenizer, served names, API key, metrics)."""
from __future__ import annotations

import hmac
import logging
from typing import Callable

from engine.generation_defaults import OTHER_PENALTY, drop_other_penalty
from engine.protocol import EngineClient
from server.errors import invalid_api_key, model_not_found, not_ready
from server.metrics import ServerMetrics
from scheduler.sampling_params import ReasoningMarks
from server.reasoning import CLOSE, OPEN, grammar_marks, resolve_parser
from server.tokenizer import Tokenizer
from server.tool_formats import resolve_format

logger = logging.getLogger(__name__)

# The tokenizer may exist only once the engine has loaded the model: accept a loader.
TokenizerSource = Tokenizer | Callable[[], Tokenizer | None]


class ServerContext:
    def __init__(self, engine: EngineClient, tokenizer: TokenizerSource, *,
                 served_model_name: str, model_aliases: tuple[str, ...] = (),
                 api_key: str | None = None, reasoning_parser: str = "auto",
                 tool_call_parser: str = "auto", lora_modules: dict[str, str] | None = None):
        self.engine = engine
        self.served_model_name = served_model_name
        self.model_names = frozenset((served_model_name, *model_aliases))
        # LoRA adapters a request may name in `model` (--lora-modules): name -> folder
        self.lora_modules = dict(lora_modules or {})
        clash = self.model_names & self.lora_modules.keys()
        if clash:
            raise ValueError(f"--lora-modules: {', '.join(sorted(clash))} is the served "
                             "model's name")
        self.metrics = ServerMetrics(engine)
        self._api_key = api_key or None
        self._reasoning_parser = reasoning_parser
        self._tool_call_parser = tool_call_parser
        self.draining = False          # stopping: /health says 503, requests are still served
        # a request's own chat_template may render it (--trust-request-chat-template)
        self.trust_request_chat_template = False
        self._tokenizer_source = tokenizer
        self._tokenizer: Tokenizer | None = tokenizer if isinstance(tokenizer, Tokenizer) else None

    @property
    def tokenizer(self) -> Tokenizer | None:
        if self._tokenizer is None:
            try:
                self._tokenizer = self._tokenizer_source()
            except Exception:
                logger.exception("loading the tokenizer failed")
        return self._tokenizer

    @property
    def reasoning_style(self) -> str | None:
        """How answers split into reasoning and content (server/reasoning.py), for this
        model's chat template; None: they do not."""
        tokenizer = self.tokenizer
        return resolve_parser(self._reasoning_parser,
                              tokenizer.chat_template if tokenizer is not None else None)

    @property
    def tool_format(self) -> str:
        """How this model writes tool calls (server/tool_formats.py)."""
        tokenizer = self.tokenizer
        return resolve_format(self._tool_call_parser,
                              tokenizer.chat_template if tokenizer is not None else None)

    @property
    def reasoning_marks(self) -> ReasoningMarks | None:
        """The thinking span a chat answer's grammar leaves free (server/reasoning.py
        `grammar_marks`), or None."""
        tokenizer = self.tokenizer
        if tokenizer is None:
            return None
        return grammar_marks(self.reasoning_style, tokenizer.token_id(OPEN),
                             tokenizer.token_id(CLOSE))

    @property
    def is_ready(self) -> bool:
        return bool(self.engine.is_ready) and self.tokenizer is not None

    @property
    def max_model_len(self) -> int:
        return int(self.engine.max_model_len)

    @property
    def max_waiting(self) -> int:
        return int(self.engine.max_waiting)

    @property
    def sampling_defaults(self) -> dict:
        """The model's defaults of request fields (--generation-config), {} while loading."""
        return getattr(self.engine, "sampling_defaults", None) or {}

    def with_sampling_defaults(self, request):
        """`request` (a chat or completion request) with each sampling field it leaves unset or
        null set to the model's default (--generation-config), as vLLM does. One repetition
        penalty's default gives way to the other given by the request (both would be a 400).
        The default max_tokens is not set here: it only caps what the context leaves
        (`OpenAIServing.generation`), as vLLM caps it."""
        defaults = dict(self.sampling_defaults)
        defaults.pop("max_tokens", None)
        if not defaults:
            return request
        drop_other_penalty(defaults, [k for k in OTHER_PENALTY
                                      if getattr(request, k, None) is not None])
        fields = type(request).model_fields
        update = {k: v for k, v in defaults.items()
                  if k in fields and getattr(request, k) is None}
        return request.model_copy(update=update) if update else request

    def require_ready(self) -> Tokenizer:
        """The tokenizer, or 503 while the model is loading (or the engine is gone)."""
        if not self.is_ready:
            self.metrics.record_rejection("not_ready")
            raise not_ready()
        return self._tokenizer

    def check_api_key(self, authorization: str | None, x_api_key: str | None = None) -> None:
        """401 unless ``Authorization: Bearer <key>`` (or Anthropic's ``x-api-key: <key>``)
        matches (no key configured: open)."""
        if self._api_key is None:
            return
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer":
            token = x_api_key or ""
        if not hmac.compare_digest(token.strip().encode(), self._api_key.encode()):
            raise invalid_api_key()

    def check_model(self, model: str | None) -> None:
        """404 unless the request names the served model (or an alias) or a LoRA adapter;
        omitted means served."""
        if model is not None and model not in self.model_names \
                and model not in self.lora_modules:
            raise model_not_found(model)

    def lora_of(self, model: str | None) -> str | None:
        """The LoRA adapter a request's `model` names, or None (the base model); 404 when it
        names neither (an adapter unloaded since `check_model`: never the base model silently)."""
        if model in self.lora_modules:
            return model
        self.check_model(model)
        return None

    def model_name(self, model: str | None) -> str:
        """The model a response names: the adapter the request asked for, else the served
        name."""
        return model if model in self.lora_modules else self.served_model_name
