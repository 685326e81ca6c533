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
