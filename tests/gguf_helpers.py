"""Writing a GGUF from a tiny transformers checkpoint as llama.cpp's converter does (the
bundled model's vocabulary), and checking that the file serves the checkpoint's logits."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np
import torch

from bench.gguf_random import copy_tokenizer
from engine.gguf_convert import bundled_gguf_path
from engine.model_loader import load_model
from tests.kv_cache import make_kv_cache
from tests.model_helpers import PagedSequence, page_pool, step

# the float16 fields of each block type (byte offset, typical size): a scale d, a min m (Q4_1 /
# Q5_1: signed) or dmin (the K types)
_HALVES = {"Q4_0": ((0, 2.5e-3),), "Q4_1": ((0, 2.5e-3), (2, -2e-2)), "Q5_0": ((0, 1.2e-3),),
           "Q5_1": ((0, 1.2e-3), (2, -2e-2)), "Q8_0": ((0, 3e-4),),
           "Q4_K": ((0, 8e-5), (2, 8e-5)), "Q5_K": ((0, 4e-5), (2, 4e-5)), "Q6_K": ((208, 2e-5),)}


def random_blocks(kind: str, n: int, k: int, seed: int = 0, size: float = 1.0) -> np.ndarray:
    """Random valid GGUF blocks of a [n, k] tensor of `kind`, as the file stores them: random
    codes and sub-block scales, float16 fields sized for weights of ~0.02 x `size`."""
    from engine.gguf_blocks import BLOCK_BYTES
    rng = np.random.default_rng(seed)
    per = 256 if kind.endswith("_K") else 32
    raw = rng.integers(0, 256, (n, k // per, BLOCK_BYTES[kind]), dtype=np.uint8)
    if kind == "Q6_K":      # sub-block scales as llama.cpp's quantizer sets them: the
        # largest -128 (d = its scale / -128), the others of similar size, either sign
        mag = rng.integers(64, 129, (n, k // per, 16))
        sign = rng.choice([-1, 1], (n, k // per, 16))
        raw[..., 192:208] = np.clip(mag * sign, -128, 127).astype(np.int8).view(np.uint8)
    for at, typical in _HALVES[kind]:
        half = (size * typical * (0.5 + rng.random((n, k // per, 1)))).astype(np.float16)
        raw[..., at:at + 2] = half.view(np.uint8)
    return raw.reshape(n, -1)


TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
       "lm_head.weight": "output.weight"}


def write_gguf(hf, path: Path, arch: str, names: dict[str, str],
               metadata: Callable[[object, object], None],
               value: Callable[[str, np.ndarray], np.ndarray | dict | None] = lambda n, v: v
               ) -> None:
    """hf's shape and tensors into a GGUF of `arch` at `path`: layer tensors by `names` (the
    HF module -> llama.cpp's name), `metadata(writer, hf config)` adding the architecture's
    own keys, `value(hf name, array)` the array stored (None: not stored; a dict: tensors
    stored in its place, {GGUF name: (array, GGML type or None)})."""
    import gguf
    cfg = hf.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    metadata(w, cfg)
    copy_tokenizer(w, bundled_gguf_path())                  # the bundled model's vocabulary
    for name, p in hf.state_dict().items():
        array = value(name, p.float().numpy())
        if isinstance(array, dict):
            for out, (data, raw) in array.items():
                w.add_tensor(out, data, raw_dtype=raw)
            continue
        if name.startswith("model.layers."):
            layer, module = name[len("model.layers."):].split(".", 1)
            module, kind = module.rsplit(".", 1)
            out = f"blk.{layer}.{names[module]}.{kind}"
        else:
            out = TOP[name]
        if array is not None:
            w.add_tensor(out, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def assert_serves_its_logits(hf, folder: Path, cfg, path: Path) -> None:
    """The model loaded from the GGUF (its converted folder's config) gives hf's logits of a
    40-token prompt."""
    ours = load_model(folder, cfg, dtype=torch.float32, gguf=path)
    tokens = torch.randint(3, cfg.vocab_size, (40,),
                           generator=torch.Generator().manual_seed(0)).tolist()
    (got,) = step(ours, make_kv_cache(ours, 16, 4), [(PagedSequence(tokens, page_pool(16)),
                                                       len(tokens))])
    with torch.no_grad():
        want = hf(torch.tensor([tokens])).logits[0].float()
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
