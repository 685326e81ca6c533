"""A GGUF of a real model's shape with random weights, written as llama.cpp's converter and
quantizer write one, for benchmarks that run the same file in Strata and llama-server (no
download: the bundled model's tokenizer, so the vocabulary is its 49,152 tokens).

    .venv/bin/python bench/gguf_random.py --shape qwen3-30b-a3b --layers 6 --out /tmp/moe.gguf

Every matrix in `--quant` blocks (Q4_0 or Q8_0) but the router (`ffn_gate_inp`, F32, as
llama.cpp's quantizer leaves it); norms F32. Weights are normal(0, 0.02): the text means
nothing, only the time a step takes does.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

if not __package__:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import parser  # noqa: E402

VOCAB = 49152                   # the bundled tokenizer's
# (general.architecture, the shape's metadata) of the public checkpoints
SHAPES = {
    "qwen3-30b-a3b": ("qwen3moe", dict(
        hidden=2048, heads=32, kv_heads=4, head_dim=128, layers=48, experts=128, used=8,
        expert_size=768, ffn=6144, rope_theta=1e6, eps=1e-6, context=40960)),
}


def copy_tokenizer(writer, source: Path) -> None:
    """The tokenizer.* fields of the GGUF at `source` into `writer`."""
    import gguf
    reader = gguf.GGUFReader(str(source))
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            kind = field.types[0]
            sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(key, field.contents(), kind, sub)


def _metadata(w, s: dict, layers: int) -> None:
    w.add_context_length(s["context"])
    w.add_embedding_length(s["hidden"])
    w.add_feed_forward_length(s["ffn"])
    w.add_block_count(layers)
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv_heads"])
    w.add_layer_norm_rms_eps(s["eps"])
    w.add_key_length(s["head_dim"])
    w.add_value_length(s["head_dim"])
    w.add_rope_freq_base(s["rope_theta"])
    w.add_expert_count(s["experts"])
    w.add_expert_used_count(s["used"])
    w.add_expert_feed_forward_length(s["expert_size"])


def _tensors(s: dict, layers: int):
    """(GGUF name, shape in numpy order, quantized?) of every tensor."""
    h, d, e, i = s["hidden"], s["head_dim"], s["experts"], s["expert_size"]
    yield "token_embd.weight", (VOCAB, h), True
    yield "output_norm.weight", (h,), False
    yield "output.weight", (VOCAB, h), True
    for b in range(layers):
        yield f"blk.{b}.attn_norm.weight", (h,), False
        yield f"blk.{b}.attn_q.weight", (s["heads"] * d, h), True
        yield f"blk.{b}.attn_k.weight", (s["kv_heads"] * d, h), True
        yield f"blk.{b}.attn_v.weight", (s["kv_heads"] * d, h), True
        yield f"blk.{b}.attn_output.weight", (h, s["heads"] * d), True
        yield f"blk.{b}.attn_q_norm.weight", (d,), False
        yield f"blk.{b}.attn_k_norm.weight", (d,), False
        yield f"blk.{b}.ffn_norm.weight", (h,), False
        yield f"blk.{b}.ffn_gate_inp.weight", (e, h), False
        yield f"blk.{b}.ffn_gate_exps.weight", (e, i, h), True
        yield f"blk.{b}.ffn_up_exps.weight", (e, i, h), True
        yield f"blk.{b}.ffn_down_exps.weight", (e, h, i), True


def write(shape: str, layers: int, quant: str, out: Path, progress=None) -> Path:
    import gguf
    from engine.gguf_convert import bundled_gguf_path
    arch, s = SHAPES[shape]
    qtype = gguf.GGMLQuantizationType[quant]
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(out), arch)
    _metadata(w, s, layers)
    copy_tokenizer(w, bundled_gguf_path())
    for name, dims, quantized in _tensors(s, layers):
        if not quantized:       # norms near 1, the router's scores spread
            value = (1 + 0.1 * rng.standard_normal(dims) if "norm" in name
                     else rng.standard_normal(dims)).astype(np.float32)
            w.add_tensor(name, value)
            continue
        # (a 3-D tensor an expert at a time: ~1 GB of float32 at once at most)
        value = np.stack([gguf.quants.quantize(
            (0.02 * rng.standard_normal(dims[1:] if len(dims) == 3 else dims,
                                        dtype=np.float32)), qtype)
            for _ in range(dims[0] if len(dims) == 3 else 1)])
        w.add_tensor(name, value if len(dims) == 3 else value[0], raw_dtype=qtype)
        if progress is not None:
            progress(name)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def main(argv: list[str] | None = None) -> None:
    ap = parser(__doc__)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--quant", choices=("Q4_0", "Q8_0"), default="Q4_0")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    print(write(args.shape, args.layers, args.quant, args.out))


if __name__ == "__main__":
    main()
