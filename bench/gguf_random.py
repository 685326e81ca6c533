"""A GGUF of a real model's shape with random weights, written as llama.cpp's converter and
quantizer write one, for benchmarks that run the same file in Strata and llama-server (no
download: the bundled model's tokenizer, so the vocabulary is its 49,152 tokens).

    .venv/bin/python bench/gguf_random.py --shape qwen3-30b-a3b --layers 6 --out /tmp/moe.gguf
    .venv/bin/python bench/gguf_random.py --shape llama-3.2-1b --quant Q4_K_M --out /tmp/l.gguf

Every matrix in `--quant` blocks but the router (`ffn_gate_inp`, F32, as llama.cpp's
quantizer leaves it); norms F32. Q4_0 and Q8_0: normal(0, 0.02) weights quantized by the
`gguf` package. Q4_K_M (the usual download): llama.cpp's recipe of types (Q6_K for the output
head, or the tied embedding, and for attn_v / ffn_down in its "more bits" layers; Q4_K for
the rest), random blocks (random codes and sub-block scales, weights of ~0.02): the `gguf`
package has no K-quant quantizer. The text means nothing, only the time a step takes does.
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
    "llama-3.2-1b": ("llama", dict(
        hidden=2048, heads=32, kv_heads=8, head_dim=64, layers=16, ffn=8192,
        rope_theta=5e5, eps=1e-5, context=131072, tied=True)),
    "llama-3.1-8b": ("llama", dict(
        hidden=4096, heads=32, kv_heads=8, head_dim=128, layers=32, ffn=14336,
        rope_theta=5e5, eps=1e-5, context=131072)),
}
QUANTS = ("Q4_0", "Q8_0", "Q4_K_M")
# the float16 fields of each block type (byte offset, typical size for weights of ~0.02): a
# scale d, a min m (Q4_1 / Q5_1: signed) or dmin (the K types)
_HALVES = {"Q4_0": ((0, 2.5e-3),), "Q4_1": ((0, 2.5e-3), (2, -2e-2)), "Q5_0": ((0, 1.2e-3),),
           "Q5_1": ((0, 1.2e-3), (2, -2e-2)), "Q8_0": ((0, 3e-4),),
           "Q4_K": ((0, 8e-5), (2, 8e-5)), "Q5_K": ((0, 4e-5), (2, 4e-5)), "Q6_K": ((208, 2e-5),),
           "Q3_K": ((108, 2e-4),), "IQ4_NL": ((0, 3e-4),), "IQ4_XS": ((0, 2e-5),)}


def random_blocks(kind: str, n: int, k: int, seed: int = 0, size: float = 1.0) -> np.ndarray:
    """Random valid GGUF blocks of a [n, k] tensor of `kind`, as the file stores them: random
    codes and sub-block scales (Q6_K's as llama.cpp's quantizer sets them: of similar size,
    either sign), float16 fields sized for weights of ~0.02 x `size`."""
    from engine.gguf_blocks import BLOCK_BYTES, BLOCK_WEIGHTS
    rng = np.random.default_rng(seed)
    per = BLOCK_WEIGHTS[kind]
    raw = rng.integers(0, 256, (n, k // per, BLOCK_BYTES[kind]), dtype=np.uint8)
    if kind == "Q6_K":
        mag = rng.integers(64, 129, (n, k // per, 16))
        sign = rng.choice([-1, 1], (n, k // per, 16))
        raw[..., 192:208] = np.clip(mag * sign, -128, 127).astype(np.int8).view(np.uint8)
    for at, typical in _HALVES[kind]:
        half = (size * typical * (0.5 + rng.random((n, k // per, 1)))).astype(np.float16)
        raw[..., at:at + 2] = half.view(np.uint8)
    return raw.reshape(n, -1)


def k_mix_type(name: str, layers: int, tied: bool) -> str:
    """The block type llama.cpp's Q4_K_M recipe gives tensor `name` (llama-quant.cpp: Q6_K
    for the output head, for attn_v and ffn_down where `use_more_bits`: the first and last
    eighth of the layers and every third between; Q4_K otherwise)."""
    if name == "output.weight" or tied and name == "token_embd.weight":
        return "Q6_K"
    part = name.split(".")
    if part[0] == "blk" and (part[2] == "attn_v" or part[2].startswith("ffn_down")):
        i = int(part[1])
        more = i < layers // 8 or i >= 7 * layers // 8 or (i - layers // 8) % 3 == 2
        return "Q6_K" if more else "Q4_K"
    return "Q4_K"


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
    if "experts" in s:
        w.add_expert_count(s["experts"])
        w.add_expert_used_count(s["used"])
        w.add_expert_feed_forward_length(s["expert_size"])


def _tensors(s: dict, layers: int):
    """(GGUF name, shape in numpy order, quantized?) of every tensor."""
    h, d = s["hidden"], s["head_dim"]
    yield "token_embd.weight", (VOCAB, h), True
    yield "output_norm.weight", (h,), False
    if not s.get("tied"):
        yield "output.weight", (VOCAB, h), True
    for b in range(layers):
        yield f"blk.{b}.attn_norm.weight", (h,), False
        yield f"blk.{b}.attn_q.weight", (s["heads"] * d, h), True
        yield f"blk.{b}.attn_k.weight", (s["kv_heads"] * d, h), True
        yield f"blk.{b}.attn_v.weight", (s["kv_heads"] * d, h), True
        yield f"blk.{b}.attn_output.weight", (h, s["heads"] * d), True
        yield f"blk.{b}.ffn_norm.weight", (h,), False
        if "experts" not in s:
            yield f"blk.{b}.ffn_gate.weight", (s["ffn"], h), True
            yield f"blk.{b}.ffn_up.weight", (s["ffn"], h), True
            yield f"blk.{b}.ffn_down.weight", (h, s["ffn"]), True
            continue
        e, i = s["experts"], s["expert_size"]
        yield f"blk.{b}.attn_q_norm.weight", (d,), False
        yield f"blk.{b}.attn_k_norm.weight", (d,), False
        yield f"blk.{b}.ffn_gate_inp.weight", (e, h), False
        yield f"blk.{b}.ffn_gate_exps.weight", (e, i, h), True
        yield f"blk.{b}.ffn_up_exps.weight", (e, i, h), True
        yield f"blk.{b}.ffn_down_exps.weight", (e, h, i), True


def _blocks(name: str, dims: tuple, quant: str, s: dict, layers: int, rng):
    """A matrix's (or 3-D experts') blocks of `quant` and their GGML type."""
    import gguf
    if quant == "Q4_K_M":
        kind = k_mix_type(name, layers, bool(s.get("tied")))
        raw = random_blocks(kind, int(np.prod(dims[:-1])), dims[-1], int(rng.integers(1 << 30)))
        return raw.reshape(*dims[:-1], -1), gguf.GGMLQuantizationType[kind]
    qtype = gguf.GGMLQuantizationType[quant]
    # (a 3-D tensor an expert at a time: ~1 GB of float32 at once at most)
    value = np.stack([gguf.quants.quantize(
        (0.02 * rng.standard_normal(dims[1:] if len(dims) == 3 else dims, dtype=np.float32)),
        qtype) for _ in range(dims[0] if len(dims) == 3 else 1)])
    return (value if len(dims) == 3 else value[0]), qtype


def write(shape: str, layers: int, quant: str, out: Path, progress=None) -> Path:
    import gguf
    from engine.gguf_convert import bundled_gguf_path
    arch, s = SHAPES[shape]
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
        raw, qtype = _blocks(name, dims, quant, s, layers, rng)
        w.add_tensor(name, raw, raw_dtype=qtype)
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
    ap.add_argument("--layers", type=int, default=None,
                    help="the first LAYERS layers (default: all of the shape's)")
    ap.add_argument("--quant", choices=QUANTS, default="Q4_0")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    layers = args.layers or SHAPES[args.shape][1]["layers"]
    print(write(args.shape, layers, args.quant, args.out))


if __name__ == "__main__":
    main()
