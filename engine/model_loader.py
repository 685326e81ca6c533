"""Build our LlamaForCausalLM from a Hugging Face folder (config.json + *.safetensors)."""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open

from engine.llama import LlamaForCausalLM
from engine.model_config import ModelConfig

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"


def safetensors_files(folder: Path) -> list[Path]:
    """The checkpoint shards of `folder`: those named by the sharded index, else every
    *.safetensors file."""
    folder = Path(folder)
    index = folder / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [folder / f for f in sorted(set(weight_map.values()))]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {folder} (a .gguf file? pass it as the "
                                "model and it is converted once)")
    return files


def iter_safetensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of every shard, read lazily one at a time."""
    for path in safetensors_files(folder):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_model(path: str | Path, config: ModelConfig | None = None,
               dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu",
               max_model_len: int | None = None, gguf: Path | None = None,
               decode_format: str | None = None, prefill_rows: int = 0,
               keep_dense: bool = True) -> LlamaForCausalLM:
    """Our model with the weights of the HF folder `path` (or, given `gguf`, of that GGUF
    file, its quantized tensors kept as they are), in `dtype` on `device`, in eval mode.

    config: ModelConfig.from_hf(path) when not given.
    max_model_len: longest sequence to serve (default: the config's max_position_embeddings);
    it sizes the RoPE tables.
    decode_format: a kernels.packed_linear format for steps of fewer than `prefill_rows`
    rows (None: the dense `dtype` weights for every step).
    keep_dense: False: a GGUF file's quantized matmuls keep their packed form alone, for
    steps of any rows (engine/weight_plan.py `dense_copy_fits`).
    """
    t0 = time.monotonic()
    folder = Path(path)
    config = config or ModelConfig.from_hf(folder)
    model = LlamaForCausalLM(config, dtype=dtype, device=device, max_model_len=max_model_len)
    if gguf is not None:
        from engine.gguf_weights import iter_gguf_weights
        model.load_weights(iter_gguf_weights(gguf, config), decode_format, keep_dense)
    else:
        model.load_weights(iter_safetensors(folder))
    model.pack(decode_format, prefill_rows)
    model.eval()
    logger.info("loaded %s (%s, %d layers, %s%s) in %.2f s", (gguf or folder).name,
                config.architecture, config.num_hidden_layers, dtype,
                f", {decode_format} for decode" if decode_format else "", time.monotonic() - t0)
    return model
