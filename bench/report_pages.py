"""The README Results sections of issue 32's benches (which pages where): residency and
placement. Called by bench/report.py."""
from __future__ import annotations

from pathlib import Path

from bench import residency
from bench.common import RESULTS, read_json


def residency_section(rep: dict, png: str) -> list[str]:
    t = rep["tiers"]
    arms = ", ".join(f"`{a}`: " + " ".join(_flag(k, v) for k, v in over.items())
                     for a, over in rep["arms"].items())
    table = residency.report(rep).splitlines()[1:]          # without its machine line
    return ["### Which pages stay in DRAM: residency and placement", "",
            f"`.venv/bin/python bench/residency.py`: {rep['batch']} x {rep['context']} tokens, "
            f"sparse budget {t['sparse_budget']}, {t['kv_device_gb']} + {t['kv_host_gb']} GB of "
            f"DRAM KV (a quarter of it), the rest on disk, `--pipeline {t['pipeline']}`; each arm "
            f"in its own process, {len(next(iter(rep['runs'].values())))} rounds in "
            f"turns ({arms}). {rep['machine']['cpu']}. Hit rate: pages a step needed that DRAM "
            "held (KVDrive's Table 3); the first 3 steps follow the prefills (placement).", "",
            f"![residency]({png})", "", *table, "", *_folders(RESULTS / "residency_folders.json")]


def _folders(path: Path) -> list[str]:
    """The two-folder run (`--arms score score+2folders --rounds 1 --out ...folders.json`):
    each folder's share of the reads."""
    if not path.exists():
        return []
    rep = read_json(path)
    out = [f"Two folders (`--kv-disk-path A,B`, both on this box's one drive: the split, not a "
           f"second drive's bandwidth): `.venv/bin/python bench/residency.py --arms score "
           f"score+2folders --rounds 1 --out {path.relative_to(RESULTS.parent.parent)}`.", "",
           "| arm | MiB from disk / step | drive MiB / step | per folder | reads / step | "
           "decode step ms |", "|---|---|---|---|---|---|"]
    for a, row in rep["rows"].items():
        folders = row.get("per_path_read_bytes_per_step", {})
        per = ", ".join(f"{p}: {v / 2**20:.1f}" for p, v in folders.items()) \
            if len(folders) > 1 else ""
        out.append(f"| {a} | {row['disk_to_device_bytes_per_step'] / 2**20:.1f} | "
                   f"{row['disk_read_bytes_per_step'] / 2**20:.1f} | {per or 'one folder'} | "
                   f"{row['disk_reads_per_step']:.0f} | {row['step_ms_median']:.0f} |")
    return out + [""]


def _flag(field: str, value) -> str:
    if field == "disk_folders":
        return f"--kv-disk-path over {value} folders"
    return f"--{field.replace('_', '-')} {value}"
