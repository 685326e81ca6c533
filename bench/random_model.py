"""A checkpoint of a real model's shape with random weights, for step-time benchmarks of shapes
the bundled model does not have (no download: the bundled model's tokenizer, its ids within
the vocabulary).

    .venv/bin/python bench/random_model.py --shape gemma3-1b --out /tmp/gemma3-1b
    .venv/bin/python bench/step_time.py --model /tmp/gemma3-1b --context 4000

Weights are transformers' initialization (bf16 safetensors); the text they produce means
nothing, only the time a step takes does.
"""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

if not __package__:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import parser  # noqa: E402

# config.json fields of the public checkpoints (their shapes; vocabularies as they are)
SHAPES = {
    "gemma3-1b": ("gemma3", dict(
        vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
        num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512,
        max_position_embeddings=32768, query_pre_attn_scalar=256, rms_norm_eps=1e-6,
        rope_theta=1e6, rope_local_base_freq=10000.0, bos_token_id=2, eos_token_id=1,
        pad_token_id=0)),
    "gemma2-2b": ("gemma2", dict(
        vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
        num_attention_heads=8, num_key_value_heads=4, head_dim=256, sliding_window=4096,
        max_position_embeddings=8192, query_pre_attn_scalar=256, rms_norm_eps=1e-6,
        attn_logit_softcapping=50.0, final_logit_softcapping=30.0, rope_theta=10000.0,
        bos_token_id=2, eos_token_id=1, pad_token_id=0)),
    "llama-1b": ("llama", dict(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
        rope_theta=500000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)),
}


def write(shape: str, out: Path) -> Path:
    """The checkpoint and the bundled model's tokenizer files in `out`."""
    import torch
    from transformers import (Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM,
                              Gemma3TextConfig, LlamaConfig, LlamaForCausalLM)
    from engine.gguf_convert import default_cache_dir, ensure_hf_folder

    family, fields = SHAPES[shape]
    cfg_cls, model_cls = {"gemma2": (Gemma2Config, Gemma2ForCausalLM),
                          "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM),
                          "llama": (LlamaConfig, LlamaForCausalLM)}[family]
    torch.manual_seed(0)
    model = model_cls(cfg_cls(**fields)).to(torch.bfloat16).eval()
    model.save_pretrained(out)
    bundled = ensure_hf_folder(None, default_cache_dir())
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (bundled / name).is_file():
            shutil.copy(bundled / name, out / name)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = parser(__doc__)
    ap.add_argument("--shape", choices=sorted(SHAPES), required=True)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    print(write(args.shape, args.out))


if __name__ == "__main__":
    main()
