"""The model's own sampling defaults (`--generation-config`, `--override-generation-config`):
what a request that leaves a sampling field unset (or null) gets, as vLLM and llama.cpp do.

- An HF folder's generation_config.json: temperature, top_p, top_k, min_p,
  repetition_penalty, and max_new_tokens as the default max_tokens (vLLM's
  `--generation-config auto`; transformers' own defaults are not applied: only what the file
  says).
- A GGUF file's `general.sampling.*` keys (llama.cpp reads them as its defaults): temp,
  top_k, top_p, min_p, penalty_repeat and penalty_last_n (llama.cpp's repeat_penalty and
  repeat_last_n), xtc_probability and xtc_threshold, mirostat, mirostat_tau, mirostat_eta.
  Where a GGUF file was converted, its keys win over the converted folder's file.
- `--generation-config vllm`: none of these (the API's defaults: temperature 1, no
  truncation); a folder: its generation_config.json instead of the model's.
- `--override-generation-config '{"temperature": 0.5}'`: on top, by request field name.

Values are checked at start-up against the request fields' ranges (ValueError naming the
field and where it came from). Plain Python: the server reads the result.
"""
from __future__ import annotations

import json
import logging
import math
from pathlib import Path

logger = logging.getLogger(__name__)

GENERATION_CONFIG_FILE = "generation_config.json"
# generation_config.json key -> request field (vLLM's list)
HF_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
           "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
# GGUF metadata key -> request field (llama.cpp's names for its own samplers)
GGUF_KEYS = {f"general.sampling.{k}": v for k, v in {
    "temp": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
    "penalty_repeat": "repeat_penalty", "penalty_last_n": "repeat_last_n",
    "xtc_probability": "xtc_probability", "xtc_threshold": "xtc_threshold",
    "mirostat": "mirostat", "mirostat_tau": "mirostat_tau",
    "mirostat_eta": "mirostat_eta"}.items()}
# request field -> (integer?, lowest, highest, lowest excluded?): the API's own ranges
FIELDS = {"temperature": (False, 0.0, 2.0, False), "top_p": (False, 0.0, 1.0, True),
          "top_k": (True, -1, None, False), "min_p": (False, 0.0, 1.0, False),
          "repetition_penalty": (False, 0.0, 10.0, True),
          "repeat_penalty": (False, 0.0, 10.0, True), "repeat_last_n": (True, -1, None, False),
          "xtc_probability": (False, 0.0, 1.0, False), "xtc_threshold": (False, 0.0, 1.0, False),
          "mirostat": (True, 0, 2, False), "mirostat_tau": (False, 0.0, 100.0, True),
          "mirostat_eta": (False, 0.0, 10.0, True), "max_tokens": (True, 1, None, False)}
MODES = ("auto", "vllm")


def sampling_defaults(mode: str, folder: Path, gguf: Path | None, override: str) -> dict:
    """Request field -> default, from `mode` (auto: the model's; vllm: none; else a folder
    holding a generation_config.json), the GGUF file's keys (auto) and `override` (JSON). A
    value out of range in the model's own files is left out with a warning; in a file or
    JSON given by flag it is a ValueError."""
    found: dict = {}
    if mode == "auto":
        _merge(found, _lenient(_from_hf(folder / GENERATION_CONFIG_FILE)))
        if gguf is not None:
            _merge(found, _lenient(_from_gguf(gguf)))
    elif mode != "vllm":
        path = Path(mode).expanduser() / GENERATION_CONFIG_FILE
        if not path.is_file():
            raise ValueError(f"--generation-config: no {path}")
        _merge(found, {k: _checked(k, v, src) for k, (v, src) in _from_hf(path).items()})
    _merge(found, check_override(override))
    return found


# each repetition penalty kind -> the other kind's fields: a request with both is a 400, so
# a default of one kind gives way to the other kind given later (a source, the request)
OTHER_PENALTY = {"repetition_penalty": ("repeat_penalty", "repeat_last_n"),
                 "repeat_penalty": ("repetition_penalty",)}


def drop_other_penalty(defaults: dict, given) -> None:
    """Drop from `defaults` the other kind's fields of each repetition penalty in `given`
    (names)."""
    for name in given:
        for other in OTHER_PENALTY.get(name, ()):
            defaults.pop(other, None)


def _merge(found: dict, new: dict) -> None:
    """`found` updated by `new`; a repetition penalty of one kind in `new` (vLLM's, or
    llama.cpp's with its window) drops the other kind's from `found` (`OTHER_PENALTY`)."""
    drop_other_penalty(found, new)
    found.update(new)


def check_override(override: str) -> dict:
    """--override-generation-config's defaults (ValueError naming what is wrong)."""
    if not override:
        return {}
    try:
        extra = json.loads(override)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--override-generation-config is not JSON: {exc}") from None
    if not isinstance(extra, dict) or set(extra) - set(FIELDS):
        raise ValueError("--override-generation-config takes an object of "
                         f"{', '.join(FIELDS)}; got {override}")
    if "repetition_penalty" in extra and "repeat_penalty" in extra:
        raise ValueError("--override-generation-config: give repetition_penalty (vLLM's) or "
                         "repeat_penalty (llama.cpp's), not both")
    return {k: _checked(k, v, "--override-generation-config") for k, v in extra.items()}


def _lenient(found: dict) -> dict:
    kept = {}
    for field, (value, source) in found.items():
        try:
            kept[field] = _checked(field, value, source)
        except ValueError as exc:
            logger.warning("sampling default left out: %s", exc)
    return kept


def _from_hf(path: Path) -> dict:
    """field -> (value, where it came from) of a generation_config.json ({} if none)."""
    if not path.is_file():
        return {}
    try:
        conf = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} could not be read: {exc}") from None
    return {field: (conf[key], str(path)) for key, field in HF_KEYS.items()
            if conf.get(key) is not None}


def _from_gguf(path: Path) -> dict:
    """field -> (value, where it came from) of a GGUF file's general.sampling.* keys."""
    from gguf import GGUFReader
    reader, found = GGUFReader(str(path)), {}
    for key, field in GGUF_KEYS.items():
        f = reader.fields.get(key)
        if f is not None and f.data:
            value = f.parts[f.data[0]].tolist()[0]
            if isinstance(value, float):        # a float32 as written: 0.7, not 0.699999988
                value = float(f"{value:.7g}")
            found[field] = (value, f"{path.name}: {key}")
    return found


def _checked(field: str, value, source: str):
    integer, low, high, open_low = FIELDS[field]
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok and integer:
        ok = float(value).is_integer()
        value = int(value) if ok else value
    ok = ok and (value > low if open_low else value >= low) and (high is None or value <= high)
    if not ok:
        span = f"{'(' if open_low else '['}{low}, {high if high is not None else 'inf'}]"
        kind = "an integer " if integer else ""
        raise ValueError(f"{field} {value!r} from {source} is not {kind}in {span}")
    return float(value) if not integer else value
