"""A/B of the NHD-era kernels (loaded from another checkout) against this tree's HND kernels,
in one process on the same data, alternating, so machine noise hits both alike.

    mkdir -p /tmp/before && git archive a78a205 | tar -x -C /tmp/before   # last NHD commit
    OMP_NUM_THREADS=1 .venv/bin/python -m bench.kv_layout_ab /tmp/before

Same shapes as bench/kv_layout.py. The NHD pool holds the same K/V as the HND pool
(pool_nhd = pool_hnd.transpose(2, 3).contiguous()); outputs are checked equal.
"""
from __future__ import annotations

import importlib.util
import statistics
import sys
import time
from pathlib import Path

if not __package__:                     # run as a script: import from the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import parser  # noqa: E402
from kernels.attention import AttentionBatch, TorchPagedAttention  # noqa: E402
from kernels.page_table import PageTable  # noqa: E402
from kernels.sparse_attention import TorchSparseDecode  # noqa: E402


def _load(root: Path, name: str):
    spec = importlib.util.spec_from_file_location(f"nhd_{name}", root / "kernels" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("nhd_root", type=Path, help="checkout with the NHD kernels")
    ap.add_argument("--slots", type=int, default=4000)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--inner", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    old_attn = _load(args.nhd_root, "attention")
    old_sparse = _load(args.nhd_root, "sparse_attention")
    b, h, kvh, d, ps, n, dense_pages = 8, 9, 3, 64, 16, 64, 440
    group, scale = h // kvh, d ** -0.5
    hnd = torch.randn(args.slots, 2, kvh, ps, d).to(torch.bfloat16)
    nhd = hnd.transpose(2, 3).contiguous()
    q = torch.randn(b, h, d).to(torch.bfloat16)
    rows = b * kvh
    slots = torch.stack([torch.randperm(args.slots)[:n].sort().values for _ in range(rows)])
    table = PageTable(torch.arange(rows + 1, dtype=torch.int32) * n,
                      slots.view(-1).to(torch.int32), torch.full((rows,), ps // 2,
                                                                 dtype=torch.int32), ps)
    perm = torch.randperm(args.slots)[:b * dense_pages].view(b, dense_pages)
    batch = AttentionBatch.build(perm.tolist(), [dense_pages * ps - i for i in range(b)],
                                 [1] * b, ps)
    s_old, s_new = old_sparse.TorchSparseDecode(), TorchSparseDecode()
    d_old, d_new = old_attn.TorchPagedAttention(), TorchPagedAttention()
    d_new.plan(batch)
    d_old.plan(old_attn.AttentionBatch(batch.qo_indptr, batch.page_table, batch.slot_mapping))
    old_batch = d_old._planned
    cases = {
        "sparse NHD": lambda: s_old.forward(q, nhd, table, group, scale),
        "sparse HND": lambda: s_new.forward(q, hnd, table, group, scale),
        "dense NHD": lambda: d_old.forward(q, nhd, old_batch, scale),
        "dense HND": lambda: d_new.forward(q, hnd, batch, scale),
    }
    assert torch.equal(cases["sparse NHD"](), cases["sparse HND"]())
    assert torch.equal(cases["dense NHD"](), cases["dense HND"]())
    # the gathers alone (the kernels' own index_select into their workspaces)
    nhd_rows, hnd_rows = s_old._plan.rows, s_new._plan.rows
    nhd_ws = torch.empty(nhd_rows.numel(), d, dtype=hnd.dtype)
    hnd_ws = torch.empty(hnd_rows.numel(), ps * d, dtype=hnd.dtype)
    cases["  gather NHD"] = lambda: torch.index_select(nhd.view(-1, d), 0, nhd_rows, out=nhd_ws)
    cases["  gather HND"] = lambda: torch.index_select(hnd.view(-1, ps * d), 0, hnd_rows,
                                                       out=hnd_ws)
    cases["  dense gather NHD"] = lambda: d_old._gather(nhd, d_old._decode.k_rows)
    cases["  dense gather HND"] = lambda: d_new._gather(hnd, d_new._decode.rows[kvh])
    times = {k: [] for k in cases}
    for _ in range(args.rounds):
        for name, fn in cases.items():
            fn()
            for _ in range(args.inner):
                t0 = time.perf_counter()
                fn()
                times[name].append((time.perf_counter() - t0) * 1e3)
    print(f"pool {args.slots} slots, B={b}, heads {h}/{kvh}, D={d}, page {ps}, bf16, 1 thread; "
          f"sparse {rows} rows x {n} pages, dense {b} x {dense_pages} pages; "
          f"{args.rounds} x {args.inner} interleaved samples")
    for name, t in times.items():
        q1, med, q3 = statistics.quantiles(t, n=4)
        print(f"{name:<19} median {med:7.3f} ms  (IQR {q1:.3f}-{q3:.3f}, min {min(t):.3f})")


if __name__ == "__main__":
    main()
