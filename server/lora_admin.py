"""Loading and unloading LoRA adapters while serving (vLLM's `POST /v1/load_lora_adapter` and
`/v1/unload_lora_adapter`), with `--allow-runtime-lora` only: these routes read folders on
the server's disk, so they are off unless asked for (and behind `--api-key` when one is set).

A loaded adapter is served from the engine's next step on and listed at /v1/models; an
unloaded one answers 404 to new requests. Unloading an adapter that waiting or running
requests use is refused (400): they finish first.
"""
from __future__ import annotations

from pathlib import Path
from typing import Annotated

from fastapi import APIRouter
from pydantic import Field, StrictInt
from starlette.responses import PlainTextResponse

from server.errors import APIError, invalid_request
from server.protocol import Text
from server.protocol_tools import _Request

Name = Annotated[Text, Field(min_length=1, max_length=256)]


class LoadLoraRequest(_Request):
    lora_name: Name
    lora_path: Annotated[Text, Field(min_length=1)]


class UnloadLoraRequest(_Request):
    lora_name: Name
    lora_int_id: StrictInt | None = None        # vLLM's; names are what Strata keys by


def lora_not_found(name: str) -> APIError:
    return APIError(404, f"The LoRA adapter '{name}' cannot be found.",
                    type="invalid_request_error", param="lora_name", code="model_not_found")


def add_routes(v1: APIRouter, ctx, errors: dict) -> None:
    """The two routes on the /v1 router (its API key and readiness checks apply)."""

    @v1.post("/load_lora_adapter", response_class=PlainTextResponse, responses=errors)
    async def load_lora_adapter(request: LoadLoraRequest) -> PlainTextResponse:
        from engine.args import LORA_CONFIG_FILE as CONFIG_FILE   # (kvstore's config: lazily)
        name, folder = request.lora_name, Path(request.lora_path).expanduser()
        if name in ctx.model_names or name in ctx.lora_modules:
            raise invalid_request(f"The LoRA adapter '{name}' has already been loaded (or is "
                                  "the served model's name).", param="lora_name")
        if not (folder / CONFIG_FILE).is_file():
            raise invalid_request(f"{folder} holds no {CONFIG_FILE}.", param="lora_path")
        try:
            await ctx.engine.load_lora(name, str(folder))
        except ValueError as exc:
            raise invalid_request(str(exc), param="lora_path") from None
        ctx.lora_modules[name] = str(folder)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @v1.post("/unload_lora_adapter", response_class=PlainTextResponse, responses=errors)
    async def unload_lora_adapter(request: UnloadLoraRequest) -> PlainTextResponse:
        name = request.lora_name
        folder = ctx.lora_modules.pop(name, None)     # new requests naming it: 404
        if folder is None:
            raise lora_not_found(name)
        try:
            await ctx.engine.unload_lora(name)
        except KeyError:
            raise lora_not_found(name) from None
        except ValueError as exc:
            ctx.lora_modules[name] = folder
            raise invalid_request(f"{exc}; unload it once they end.",
                                  param="lora_name") from None
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
