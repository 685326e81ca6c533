"""Tokenizer: a HF tokenizer folder read with `tokenizers` and `jinja2` (no transformers, no torch).

NOTE: `from transformers import AutoTokenizer` imports torch, which the HTTP edge must not do;
so this reads `tokenizer.json` with `tokenizers.Tokenizer` and renders the chat template (from
`chat_template.jinja`, or `tokenizer_config.json["chat_template"]`) the way transformers does:
a sandboxed jinja2 environment with trim_blocks, lstrip_blocks, loop controls, `tojson`,
`raise_exception` and `strftime_now`.
"""
from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path

import jinja2
import jinja2.meta
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer


class TemplateError(ValueError):
    """The chat template rejected the conversation (HTTP 400)."""


def _raise_exception(message: str):
    raise TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def compile_template(source: str) -> jinja2.Template:
    """A chat template compiled (TemplateError: it is not valid Jinja)."""
    try:
        return _compile_template(source)
    except jinja2.TemplateSyntaxError as exc:
        raise TemplateError(f"The chat template is not valid Jinja (line {exc.lineno}): "
                            f"{exc.message}") from None


@lru_cache(maxsize=8)
def _compile_template(source: str) -> jinja2.Template:
    return _environment().from_string(source)


@lru_cache(maxsize=32)
def reads_variable(source: str, name: str) -> bool:
    """Whether a template reads the variable `name` (Qwen's reads `tools`; Phi-4-mini's
    mentions 'tools' only as a key of its messages); a template that does not parse, by
    its text."""
    try:
        return name in jinja2.meta.find_undeclared_variables(_environment().parse(source))
    except jinja2.TemplateSyntaxError:
        return name in source


def _environment() -> jinja2.Environment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2 byte-level BPE: the printable character that stands for each byte, inverted."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def _token_content(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


class Tokenizer:
    """Encode, decode and chat-template one model's tokenizer (immutable after load)."""

    def __init__(self, backend: HFTokenizer, *, chat_template: str | None = None,
                 bos_token: str | None = None, eos_token: str | None = None):
        self._backend = backend
        self.chat_template = chat_template
        self._token_texts: dict[int, str] = {}      # token_text's, filled as asked
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self._added_ids = frozenset(backend.get_added_tokens_decoder())
        decoder = json.loads(backend.to_str()).get("decoder") or {}
        parts = [decoder, *decoder.get("decoders", [])]
        self._byte_level = any(d.get("type") == "ByteLevel" for d in parts)
        # SentencePiece's pieces (Llama 2, Mistral, Gemma): "▁" for a space, <0xNN> for
        # a byte the vocabulary lacks
        self._metaspace = any(d.get("type") == "Metaspace" or (
            d.get("type") == "Replace" and (d.get("pattern") or {}).get("String") == "▁")
            for d in parts)
        # the longest token in bytes (a byte-level piece has one character a byte; added tokens
        # and other vocabularies count their UTF-8, an overestimate at worst): `min_tokens`
        # is a lower bound
        self.max_token_bytes = max((len(p) if self._byte_level and i not in self._added_ids
                                    else len(p.encode("utf-8"))
                                    for p, i in backend.get_vocab(True).items()), default=1)

    @classmethod
    def from_folder(cls, folder: str | Path, chat_template: str | None = None) -> "Tokenizer":
        """The folder's tokenizer; `chat_template`: one over the folder's (--chat-template)."""
        folder = Path(folder)
        backend = HFTokenizer.from_file(str(folder / "tokenizer.json"))
        config_path = folder / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.exists() else {}
        template = config.get("chat_template")
        if (folder / "chat_template.jinja").exists():
            template = (folder / "chat_template.jinja").read_text()
        elif (folder / "chat_template.json").exists():
            template = json.loads((folder / "chat_template.json").read_text()).get("chat_template")
        if isinstance(template, list):      # named templates: take "default"
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        return cls(backend, chat_template=chat_template or template,
                   bos_token=_token_content(config.get("bos_token")),
                   eos_token=_token_content(config.get("eos_token")))

    # ------------------------------------------------------------------ text <-> ids
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def min_tokens(self, text: str) -> int:
        """A lower bound on the tokens of `text`, without tokenizing it (a prompt far over the
        context is refused at once: tokenizing 10 MB takes seconds and holds the GIL)."""
        return -(-len(text.encode("utf-8")) // self.max_token_bytes)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token as text (partial UTF-8 sequences show as U+FFFD), special tokens kept,
        a SentencePiece piece's leading space too (decoding it alone drops it); cached
        (logprobs responses ask for the same tokens again and again)."""
        text = self._token_texts.get(token_id)
        if text is None:
            raw = self._piece_bytes(token_id)
            text = raw.decode("utf-8", "replace") if raw is not None else \
                self._backend.decode([token_id], skip_special_tokens=False)
            self._token_texts[token_id] = text
        return text

    def token_id(self, text: str) -> int | None:
        """The id of the token whose text is exactly `text` (Qwen3's <think>), or None."""
        return self._backend.token_to_id(text)

    def token_bytes(self, token_id: int) -> list[int]:
        """The exact UTF-8 bytes of one token (OpenAI logprobs `bytes`)."""
        raw = self._piece_bytes(token_id)
        if raw is None and self._byte_level and token_id not in self._added_ids:
            piece = self._backend.id_to_token(token_id)
            table = _byte_decoder()
            if piece is not None and all(ch in table for ch in piece):
                return [table[ch] for ch in piece]
        return list(raw if raw is not None else self.token_text(token_id).encode("utf-8"))

    def _piece_bytes(self, token_id: int) -> bytes | None:
        """A SentencePiece vocabulary's token as its bytes (None for other vocabularies and
        added tokens): <0xNN> is that byte, "▁" a space."""
        if not self._metaspace or token_id in self._added_ids:
            return None
        piece = self._backend.id_to_token(token_id)
        if piece is None:
            return None
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        return piece.replace("▁", " ").encode("utf-8")

    # ------------------------------------------------------------------ chat
    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None, *,
                            add_generation_prompt: bool = True,
                            continue_final_message: bool = False,
                            template_kwargs: dict | None = None,
                            chat_template: str | None = None) -> str:
        """Render a conversation ending with the assistant's generation prompt (unless
        add_generation_prompt is false); `tools`: the OpenAI tool definitions, for a template
        that renders them (server/tools.py). continue_final_message: the text ends where the
        last (assistant) message's content does, so the answer continues it (what follows
        it, the end of the turn, is cut, as transformers and vLLM do). template_kwargs: more
        variables for the template (vLLM's chat_template_kwargs). chat_template: a request's
        template instead of the model's."""
        source = chat_template or self.chat_template
        if not source:
            raise TemplateError("This model has no chat template; use /v1/completions.")
        try:
            text = compile_template(source).render(
                **(template_kwargs or {}), messages=messages, tools=tools,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        except TemplateError:
            raise
        # NOTE: what the request's values make the template do wrong (a chat_template_kwargs
        # value where it calls a function, ...) is the request's error, not the server's
        except (jinja2.TemplateError, TypeError, ValueError, LookupError,
                AttributeError) as exc:
            raise TemplateError(f"The chat template failed: {exc}") from exc
        return _end_at_final_message(text, messages) if continue_final_message else text

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None,
                    **options) -> list[int]:
        """apply_chat_template's text (options: its keywords) as token ids."""
        # NOTE: the template writes the special tokens itself; add none on top.
        return self.encode(self.apply_chat_template(messages, tools, **options),
                           add_special_tokens=False)


def _end_at_final_message(text: str, messages: list[dict]) -> str:
    """The rendered text cut just after the last message's content (a template may strip it:
    then just after its stripped form)."""
    final = messages[-1].get("content") or ""
    if not final.strip():
        raise TemplateError("continue_final_message: the last message has no text to continue")
    for content in (final, final.strip()):
        if content and (at := text.rfind(content)) >= 0:
            return text[:at + len(content)]
    raise TemplateError("continue_final_message: the chat template did not render the last "
                        "message's content")
