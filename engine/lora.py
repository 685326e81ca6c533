"""LoRA adapters served beside the base model (`--lora-modules name=path,...`, vLLM's
multi-LoRA): each request names its adapter in `model`, and one step may mix requests of
several adapters and of the base model.

An adapter is a PEFT folder (adapter_config.json, adapter_model.safetensors) of low-rank
deltas on the decoder layers' projections: W' = W + s B A, A [r, in], B [out, r],
s = lora_alpha / r (lora_alpha / sqrt(r) with use_rslora). The base weights are never
changed: a step adds s (x A^T) B^T to the rows of the requests that use the adapter
(`LoraBatch.apply`), after each of the layer's fused matmuls (q/k/v into `qkv`, gate/up into
`gate_up`, as engine/llama.py fuses them, so an adapter's parts are fused the same way: A
stacked, B block-diagonal, s folded into B). A partial rotary's q and k rows are reordered as
the base weights are. The C decode layers add the same deltas in their own calls
(kernels/decode_layer.py's LoraWords) where the model runs float32 on the CPU.

An adapter's KV differs from the base model's, so its prompt pages are cached under a salt of
its own (`fingerprint`: the adapter's bytes, so a changed adapter never reads stale pages).
"""
from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch

from engine.args import LORA_CONFIG_FILE
from engine.model_config import ModelConfig, matmul_rows, projection_rows
from kernels.decode_layer import LoraWords, lora_table

CONFIG_FILE = LORA_CONFIG_FILE
WEIGHTS_FILE = "adapter_model.safetensors"
# PEFT's tensor names: ...layers.<i>.<self_attn|mlp>.<module>.lora_<A|B>.weight
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


@dataclass
class LoraAdapter:
    name: str
    path: Path
    fingerprint: str                 # digest of the adapter's files: its prefix-cache salt
    rank: int
    # (layer, fused matmul) -> (A^T [in, R], B^T [R, out] with the scale folded in),
    # contiguous: what both the op-by-op layers and the C decode layers read
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    layers: int                      # the model's decoder layers

    @cached_property
    def native_table(self) -> torch.Tensor | None:
        """This adapter's table for the C decode layers (kernels/decode_layer.lora_table),
        made on first use; None where they do not serve it."""
        return lora_table(self.weights, self.layers)

    @classmethod
    def load(cls, name: str, path: str | Path, cfg: ModelConfig, dtype: torch.dtype,
             device, qkv_rows: torch.Tensor | None = None) -> "LoraAdapter":
        """_read, with every failure (a damaged file, an unreadable folder) a ValueError."""
        try:
            return cls._read(name, path, cfg, dtype, device, qkv_rows)
        except ValueError:
            raise
        except Exception as exc:  # noqa: BLE001 - safetensors, OS and shape errors alike
            raise ValueError(f"LoRA {name}: {path} could not be read: {exc}") from exc

    @classmethod
    def _read(cls, name: str, path: str | Path, cfg: ModelConfig, dtype: torch.dtype,
              device, qkv_rows: torch.Tensor | None = None) -> "LoraAdapter":
        """Read a PEFT adapter folder for a model of `cfg`; `qkv_rows`: the base model's
        reorder of its fused q/k/v rows (a partial rotary), applied to B alike. ValueError
        naming what does not fit (another model's shapes, modules it does not adapt, DoRA)."""
        from safetensors.torch import load_file
        path = Path(path).expanduser()
        conf_file, weights_file = path / CONFIG_FILE, path / WEIGHTS_FILE
        if not conf_file.is_file() or not weights_file.is_file():
            raise ValueError(f"LoRA {name}: {path} holds no {CONFIG_FILE} and {WEIGHTS_FILE}")
        conf = json.loads(conf_file.read_text())
        _check_config(name, conf)
        digest = hashlib.blake2b(conf_file.read_bytes() + weights_file.read_bytes(),
                                 digest_size=16).hexdigest()
        pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        for key, tensor in load_file(str(weights_file)).items():
            m = _KEY.search(key)
            if m is None:
                raise ValueError(f"LoRA {name}: tensor {key} adapts no decoder projection "
                                 "(only q/k/v/o and gate/up/down are served)")
            pairs.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = tensor
        alpha, rs = float(conf.get("lora_alpha", 8)), bool(conf.get("use_rslora"))
        parts, out_rows = projection_rows(cfg), matmul_rows(cfg)
        stacked: dict[tuple[int, str], list] = {}
        for (layer, module), ab in sorted(pairs.items()):
            if module not in parts or layer >= cfg.num_hidden_layers or set(ab) != {"A", "B"}:
                raise ValueError(f"LoRA {name}: layer {layer} {module} is not a projection of "
                                 "this model with both lora_A and lora_B")
            a, b = ab["A"].float(), ab["B"].float()
            fused, start, size = parts[module]
            if fused in ("gate_up", "down") and cfg.moe is not None and cfg.moe.routed(layer):
                raise ValueError(f"LoRA {name}: layer {layer} {module}: that layer's MLP is "
                                 "routed to experts here (adapters on experts are not served)")
            size = out_rows[fused] if size is None else size
            if a.shape[0] != b.shape[1] or b.shape[0] != size:
                raise ValueError(f"LoRA {name}: layer {layer} {module} has shapes A "
                                 f"{tuple(a.shape)}, B {tuple(b.shape)}: another model's")
            r = a.shape[0]
            scale = alpha / (math.sqrt(r) if rs else r)
            stacked.setdefault((layer, fused), []).append((start, a, b * scale))
        weights = {}
        for (layer, fused), blocks in stacked.items():
            a = torch.cat([blk[1] for blk in blocks])
            b = torch.zeros(out_rows[fused], a.shape[0])
            col = 0
            for start, _, bb in blocks:
                b[start:start + bb.shape[0], col:col + bb.shape[1]] = bb
                col += bb.shape[1]
            if fused == "qkv" and qkv_rows is not None:
                b = b[qkv_rows]
            expect = cfg.intermediate_size if fused == "down" else (
                cfg.num_attention_heads * cfg.head_dim if fused == "o" else cfg.hidden_size)
            if a.shape[1] != expect:
                raise ValueError(f"LoRA {name}: layer {layer} {fused} takes {a.shape[1]} "
                                 f"inputs, this model's {expect}")
            weights[(layer, fused)] = (a.t().contiguous().to(dtype).to(device),
                                       b.t().contiguous().to(dtype).to(device))
        if not weights:
            raise ValueError(f"LoRA {name}: {weights_file} holds no LoRA weights")
        rank = max(at.shape[1] for at, _ in weights.values())
        return cls(name, path, digest, rank, weights, cfg.num_hidden_layers)


def _check_config(name: str, conf: dict) -> None:
    """ValueError for what Strata does not serve: other PEFT methods, DoRA, trained biases,
    whole modules saved beside the adapter, per-module alphas."""
    if conf.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"LoRA {name}: peft_type {conf.get('peft_type')} is not LoRA")
    for key, off in (("use_dora", False), ("bias", "none"), ("modules_to_save", None),
                     ("alpha_pattern", None)):
        value = conf.get(key)
        if value and value != off:          # (None, false, [] and {} are off too)
            raise ValueError(f"LoRA {name}: {key} {value!r} is not served")


class LoraBatch:
    """A step's adapter rows: for each adapter used, the rows of its requests' tokens."""

    def __init__(self, groups: list[tuple[LoraAdapter, torch.Tensor | None]],
                 row_adapter: list[int]):
        self.groups = groups            # rows None: every row of the step
        self.row_adapter = row_adapter  # each row's group (-1: the base model)

    @classmethod
    def build(cls, spans: list[tuple[LoraAdapter | None, int, int]], total: int,
              device) -> "LoraBatch | None":
        """spans: (adapter or None, first row, rows) per request, in row order; None when no
        request uses an adapter (the base model's step, the C layers allowed)."""
        rows: dict[str, tuple[int, LoraAdapter, list[int]]] = {}    # name -> (group, ...)
        row_adapter = [-1] * total
        for adapter, start, n in spans:
            if adapter is not None:
                group, _, ids = rows.setdefault(adapter.name, (len(rows), adapter, []))
                ids.extend(range(start, start + n))
                row_adapter[start:start + n] = [group] * n
        if not rows:
            return None
        return cls([(a, None if len(r) == total else torch.tensor(r, device=device))
                    for _, a, r in rows.values()], row_adapter)

    def native(self) -> LoraWords | None:
        """These rows for the C decode layers, or None where an adapter is not served there."""
        tables = [adapter.native_table for adapter, _ in self.groups]
        if any(t is None for t in tables):
            return None
        return LoraWords(self.row_adapter, tables)

    def apply(self, layer: int, fused: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y [T, out] (the fused matmul of x [T, in]) with each adapter's delta added to its
        rows (in place where rows are a subset; y is the matmul's own fresh tensor)."""
        for adapter, rows in self.groups:
            ab = adapter.weights.get((layer, fused))
            if ab is None:
                continue
            at, bt = ab
            xs = x if rows is None else x.index_select(0, rows)
            delta = ((xs.to(at.dtype) @ at) @ bt).to(y.dtype)
            if rows is None:
                y = y + delta
            else:
                y.index_add_(0, rows, delta)
        return y

