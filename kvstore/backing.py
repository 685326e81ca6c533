"""How the backing tier is laid out, decided once at start-up: which layers the disk tier
stores as codes (kvstore/codec_share.py), whether fills recompute (kvstore/recompute.py), and
so how many pages of every layer the backing tier's budget holds."""
from __future__ import annotations

import torch

from kvstore.codec_share import plan_share
from kvstore.config import KVStoreConfig
from kvstore.recompute import KVFromInputs, plan_recompute
from kvstore.tiers.base import PageShape
from kvstore.tiers.codec import PageCodec


def backing_geometry(cfg: KVStoreConfig, shape: PageShape, num_layers: int, budgets: dict,
                     codec: PageCodec | None, device: torch.device, hidden_size: int,
                     kv_from_inputs: KVFromInputs | None):
    """(the layers the disk tier codes, the KV recompute plan, how many pages of every layer
    the backing tier holds), decided at start-up."""
    # the layers the disk tier stores as codes (kvstore/codec_share.py)
    coded = plan_share(cfg.tier_codec_share, codec if budgets["disk"] else None, num_layers,
                       cfg.disk_path)
    # NOTE: with the codec a disk or host page takes its codes' bytes: more pages fit
    layer_bytes = shape.nbytes * num_layers
    if codec is not None and cfg.backing == "disk":
        layer_bytes = len(coded) * codec.stride + (num_layers - len(coded)) * shape.nbytes_aligned
    elif codec is not None and cfg.backing == "host" and budgets["host"]:
        layer_bytes = (codec.code_bytes + codec.meta_bytes) * num_layers
    if cfg.recompute != "off" and 0 < len(coded) < num_layers:
        raise ValueError(f"--kv-tier-codec-share codes {len(coded)} of {num_layers} layers: "
                         "a share of the layers does not combine with --kv-recompute (its "
                         "planner reads K/V pages of one size)")
    plan = plan_recompute(cfg.recompute, shape,
                          codec.stride if codec is not None else shape.nbytes_aligned,
                          hidden_size, kv_from_inputs,
                          cfg.disk_path if cfg.disk_bytes else None, device.type == "cpu")
    if plan is not None:         # each page's inputs share the disk budget
        layer_bytes += plan.input_stride * num_layers
    backing_bytes = next(budgets[t] for t in ("disk", "host", "device") if budgets[t])
    max_pages = backing_bytes // layer_bytes
    if max_pages < 1:
        raise ValueError(f"the {cfg.backing} tier ({backing_bytes / 2**30:.3f} GB) holds no "
                         f"page of {cfg.page_size} tokens over {num_layers} layers "
                         f"({layer_bytes} bytes); raise --kv-{cfg.backing}-gb")
    return coded, plan, max_pages
