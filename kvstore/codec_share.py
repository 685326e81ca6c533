"""`--kv-tier-codec-share`: which layers' pages the disk tier stores as codec codes (LeoAM's
dynamic share of compressed transfers), decided once at start-up.

A share s in [0, 1] codes round(s x layers) of the layers, spread evenly over the depth (layer
0 is the last one coded); their pages live in one member of the disk tier, the other layers'
in another (kvstore/tiers/disk_layers.py). `auto` picks s from a cost model measured at
start-up. LeoAM sizes its share so that the transfers hide under compute, its decompression
running on the GPU. Here the codes are decoded on the disk tier's I/O threads, so a fill's two
resources that work at once are the drive (reading) and the CPU (decoding), and a fill of n
pages takes, for a share s:

    t(s) = max(n ((1 - s) r + s c), n s d)

r, c: seconds to read one page as it is, as codes (reads of RUN_PAGES neighbouring pages,
DEPTH in flight, O_DIRECT: direct_io.read_seconds_per_byte, at each stride); d: seconds to
decode one page on one core (the codec's C kernel, timed). Reading falls and decoding grows
with s; t is least where they meet, s = r / (r - c + d), or at 1 when decoding all the codes
still takes no longer than reading them (c >= d: every disk and CPU measured so far), or at 0
when codes read no faster than pages (c >= r: an IOPS-bound drive). A share predicted to save
under MIN_GAIN of the all-pages read is not taken (the codec costs accuracy). The model leaves
out what decoding takes from the compute on a CPU that has no core to spare; bench/kv_codec.py
measures the step times the shares give. The choice is kept in the disk folder (SHARE_FILE):
a restart, whose probes would time differently, keeps the layer split its cached pages were
written with.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from kvstore.config import parse_share
from kvstore.tiers.codec import PageCodec
from kvstore.tiers.direct_io import read_seconds_per_byte
from kvstore.tiers.disk_layout import SHARE_FILE

logger = logging.getLogger(__name__)

RUN_PAGES = 4         # neighbouring pages a read takes at once (a sparse step's typical run)
DEPTH = 8             # reads in flight (the disk tier's I/O threads)
PROBE_BYTES = 1 << 24  # scratch file of each read probe
DECODE_PAGES = 64     # pages decoded per timing
MIN_GAIN = 0.05


def coded_layers(share: float, num_layers: int) -> list[int]:
    """The round(share x num_layers) layers coded, spread evenly (layer l is coded when
    floor((l + 1) n / L) > floor(l n / L), so layer 0 is the last)."""
    n = int(round(share * num_layers))
    return [layer for layer in range(num_layers)
            if (layer + 1) * n // num_layers > layer * n // num_layers]


@dataclass(frozen=True)
class ShareCost:
    """Seconds per page: reading it as it is (r), as codes (c), decoding it (d)."""
    read_page_s: float
    read_code_s: float
    decode_s: float

    def seconds(self, share: float) -> float:
        """Predicted time of a fill, per page, with this share coded."""
        read = (1 - share) * self.read_page_s + share * self.read_code_s
        return max(read, share * self.decode_s)

    def share(self, min_gain: float = 0.0) -> float:
        r, c, d = self.read_page_s, self.read_code_s, self.decode_s
        if c >= r:
            return 0.0
        s = min(1.0, r / (r - c + d))
        return s if self.seconds(s) <= (1 - min_gain) * self.seconds(0.0) else 0.0


def measure_decode(codec: PageCodec, pages: int = DECODE_PAGES) -> float:
    """Seconds to decode one page (the best of 5 timings of `pages` pages)."""
    shape = codec.page_shape
    codes, meta = codec.encode_pages(torch.randn(pages, *shape.shape).to(shape.dtype))
    codec.decode_pages(codes, meta)                 # warm
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        codec.decode_pages(codes, meta)
        best = min(best, time.perf_counter() - t0)
    return best / pages


def measure_cost(codec: PageCodec, disk_root) -> ShareCost:
    """The three costs, on this machine and the disk tier's folder."""
    raw, code = codec.page_shape.nbytes_aligned, codec.stride
    per_byte = {s: read_seconds_per_byte(disk_root, RUN_PAGES * s, PROBE_BYTES, DEPTH)
                for s in (raw, code)}
    return ShareCost(raw * per_byte[raw], code * per_byte[code], measure_decode(codec))


def plan_share(mode: str, codec: PageCodec | None, num_layers: int, disk_root) -> list[int]:
    """The layers the disk tier stores as codes (all of them without a share; none without a
    codec), logged when a share is asked for. `auto` decides once per disk folder: its
    choice is kept in the folder (SHARE_FILE), so that a restart, whose probes would time
    differently, keeps the layer split its cached pages were written with (`strata cache
    clear` forgets it)."""
    if codec is None:
        return []
    share = parse_share(mode)
    if share is None:
        return _auto_layers(codec, num_layers, Path(disk_root))
    layers = coded_layers(share, num_layers)
    if share != 1.0:
        logger.info("KV tier codec share %g: %d of %d layers coded on disk", share,
                    len(layers), num_layers)
    return layers


def _auto_layers(codec: PageCodec, num_layers: int, root: Path) -> list[int]:
    path = root / SHARE_FILE
    try:
        kept = json.loads(path.read_text())
        if kept["codec"] == codec.name and kept["layers"] == num_layers:
            logger.info("KV tier codec share auto: %d of %d layers coded, as measured when "
                        "%s was written", kept["coded"], num_layers, path)
            return coded_layers(kept["coded"] / num_layers, num_layers)
    except (OSError, ValueError, KeyError, TypeError):
        pass                        # none yet (or unreadable): measure
    cost = measure_cost(codec, root)
    share = cost.share(MIN_GAIN)
    layers = coded_layers(share, num_layers)
    logger.info("KV tier codec share auto: a page reads in %.1f us as it is and %.1f us as %s "
                "codes, decodes in %.1f us: %d of %d layers coded (share %.2f, predicted %.0f%% "
                "of the uncoded read time)", cost.read_page_s * 1e6, cost.read_code_s * 1e6,
                codec.name, cost.decode_s * 1e6, len(layers), num_layers, share,
                100 * cost.seconds(len(layers) / num_layers) / cost.seconds(0.0))
    try:
        path.write_text(json.dumps({"codec": codec.name, "layers": num_layers,
                                    "coded": len(layers), "cost": dataclasses.asdict(cost)}))
    except OSError as exc:
        logger.warning("KV tier codec share auto: could not keep the choice in %s (%s): a "
                       "restart measures again", path, exc)
    return layers
