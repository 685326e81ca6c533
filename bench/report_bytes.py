"""The README Results sections of issue 31's benches (fewer bytes per step): the KV tier codec,
low-rank selection metadata, KV recompute. Called by bench/report.py."""
from __future__ import annotations

from pathlib import Path

from bench.common import RESULTS, read_json


def _load(path: Path) -> dict | None:
    return read_json(path) if path.exists() else None


def _needle_pct(results: Path, name: str, config: str) -> dict[str, float]:
    """length -> accuracy % of a config in bench/needle.py's JSON `name` (missing: {})."""
    rep = _load(results / name)
    if rep is None:
        return {}
    acc = next(iter(rep["formats"].values()))["accuracy_pct"].get(config, {})
    return {k: v for k, v in acc.items() if k != "all"}


def _needle_counts(results: Path, names: list[str]) -> str:
    """"~4000: 25 prompts, ..." of the needle JSONs that exist."""
    out = []
    for name in names:
        rep = _load(results / name)
        if rep is not None:
            n = rep["per_depth"] * len(rep["depths"])
            out += [f"~{length}: {n} prompts" for length in rep["lengths"]]
    return ", ".join(out) or "not run yet"


def _needle_cells(accs: dict[str, float], base: dict[str, float]) -> str:
    return " / ".join(f"{v:.1f}% ({v - base[k]:+.1f})" if k in base else f"{v:.1f}%"
                      for k, v in sorted(accs.items(), key=lambda kv: int(kv[0])))


def _arm_name(codec: str, mod: str, row: dict) -> str:
    """bench/kv_codec.py's arm -> its row's name."""
    if mod == "host":
        return f"{codec}, host tier too"
    coded = row.get("disk_coded_layers")
    if mod == "auto":
        return f"{codec}, share auto ({len(coded)} layers coded)" if coded is not None \
            else f"{codec}, share auto"
    if mod:
        return f"{codec}, share {mod[1:]}" + (f" ({len(coded)} layers coded)"
                                               if coded is not None else "")
    return codec


def codec_section(rep: dict, png: str, results: Path = RESULTS) -> list[str]:
    m = rep["machine"]
    out = ["### Fewer bytes per step: the KV tier codec", "",
           f"`.venv/bin/python bench/kv_codec.py`: {rep['batch']} x {rep['context']} tokens, "
           f"sparse budget {rep['tiers']['sparse_budget']}, {rep['tiers']['kv_device_gb']} + "
           f"{rep['tiers']['kv_host_gb']} GB of DRAM KV, the rest on disk "
           f"(`--pipeline {rep['pipeline']}`); each codec in its own process, in turns "
           f"({next(iter(rep['codecs'].values())).get('rounds', 1)} rounds, the median "
           "step). "
           f"{m['cpu']}. Needle accuracy: `bench/needle.py --configs sparse-1024 "
           "sparse-1024-int8 sparse-1024-int4` (every page through the codec: the worst case; "
           f"{_needle_counts(results, ['needle_codec_4k.json', 'needle_codec_7k.json'])}; "
           "change against uncompressed in brackets).", "",
           f"![codec]({png})", "",
           "| `--kv-tier-codec` | disk bytes a page | pages from disk a step | MiB from disk "
           "a step | fewer bytes | MiB host -> device a step | decode step ms | "
           "needle ~4K / ~7K |",
           "|---|---|---|---|---|---|---|---|"]
    base = {}
    for length in ("4k", "7k"):
        base.update(_needle_pct(results, f"needle_codec_{length}.json", "sparse-1024"))
    for arm, row in rep["codecs"].items():
        codec, _, mod = arm.partition("-")
        cfg = "sparse-1024" if codec == "none" else f"sparse-1024-{codec}"
        accs = {}
        for length in ("4k", "7k"):
            accs.update(_needle_pct(results, f"needle_codec_{length}.json", cfg))
        name = _arm_name(codec, mod, row)
        if mod.startswith("s"):             # a share of the layers
            group = 32 if codec == "int4" else 64
            accs = {}
            for length in ("4k", "7k"):
                accs.update(_needle_pct(results, f"needle_codec_{length}_share.json",
                                        f"sparse-1024-{codec}g{group}{mod}"))
        out.append(f"| {name} | {row['disk_page_bytes']} | "
                   f"{row['disk_to_device_bytes_per_step'] / row['disk_page_bytes']:.0f} | "
                   f"{row['disk_to_device_bytes_per_step'] / 2**20:.1f} | "
                   f"{row.get('fewer_disk_bytes_x', 1.0):.2f}x | "
                   f"{row.get('host_to_device_bytes_per_step', 0) / 2**20:.1f} | "
                   f"{row['step_ms_median']:.0f} | "
                   f"{_needle_cells(accs, base if codec != 'none' else {}) or '-'} |")
    if any(arm.endswith("-host") for arm in rep["codecs"]):
        out += ["", "\"host tier too\": `--kv-host-pool separate`, the DRAM split into a "
                f"{rep['tiers']['kv_device_gb']} GB pool of pages and a "
                f"{rep['tiers']['kv_host_gb']} GB host tier of codes (1.9x the pages at int8), "
                "which fills decode into the device pool; its pages carry the codec's error "
                "too (the needle column is every page through the codec)."]
    if any(not arm.endswith("-host") and "-" in arm for arm in rep["codecs"]):
        out += ["", "\"share\": `--kv-tier-codec-share`, the part of the layers whose pages the "
                "disk tier stores as codes (the rest as they are); `auto` is the share the "
                "start-up cost model picked on this machine (drive against decoding CPU: "
                "[docs/kvstore.md](docs/kvstore.md#the-share-of-coded-layers---kv-tier-codec-share"
                ")). The share's needle: `bench/needle.py --lengths 4000 (7000) --per-depth 5 "
                "--configs sparse-1024-int4g32s0.5` (the coded layers' pages through the codec "
                "at int4's default groups of 32); `auto` coded every layer here, so its cells "
                "are the all-coded row's."]
        same = [arm for arm in rep["codecs"] if arm.endswith("-auto")
                and rep["codecs"][arm].get("disk_coded_layers")
                == rep["codecs"].get(arm[:-5], {}).get("disk_coded_layers")]
        if same:
            steps = [rep["codecs"][a]["step_ms_median"] for a in (same[0], same[0][:-5])]
            out[-1] += (f" Here `{same[0]}` ran the same configuration as `{same[0][:-5]}`: "
                        f"their steps ({steps[0]:.0f} and {steps[1]:.0f} ms) show this "
                        "machine's noise between runs.")
    g32 = _needle_pct(results, "needle_codec_4k_int4g32.json", "sparse-1024-int4g32")
    if g32:
        out += ["", "The ~4K int4 needle was measured at groups of 64 channels, the ~7K one "
                "at 32 (int4's default since: the same disk bytes, twice the scales in "
                f"memory; the bytes and steps above are at the defaults). int4 at 32, ~4K: "
                f"{_needle_cells(g32, base)} (`--configs sparse-1024-int4g32`)."]
    return out + [""]


def selector_section(rep: dict, png: str, results: Path = RESULTS) -> list[str]:
    quick = " --quick" if png.endswith("_quick.png") else ""
    shares = rep.get("index_share_of_kv") or rep["summary_share_of_kv"]
    sels = list(shares)
    out = ["### Smaller selection metadata: low-rank keys, the centroid index", "",
           f"`.venv/bin/python bench/selector_recall.py{quick}`: needle and RULER prompts, "
           f"{rep['steps']} greedy decode steps each; at each step, layer and KV head, each "
           f"selector's top pages at budget {rep['budget']} against the pages holding the most "
           f"attention (page recall / attention-mass recall). `lowrank` is rank {rep['rank']} "
           "(`strata calibrate` on the bundled essays); `centroid` is KVDrive's index, one "
           f"centroid per {rep.get('centroid_pages', 4)} pages. Index bytes: what each "
           "selector reads to rank the pages, against the KV. Needle accuracy at budget 1024: "
           "`bench/needle.py --configs sparse-1024 sparse-1024-mean sparse-1024-centroid` "
           f"({_needle_counts(results, ['needle_centroid_4k.json'])}; lowrank: "
           "`--selector lowrank`, against `quest` on its own prompts).", "",
           f"![selectors]({png})", "",
           "| | " + " | ".join(sels) + " |", "|---|" + "---|" * len(sels)]
    for name, by_sel in rep["sets"].items():
        out.append(f"| recall, {name} | " + " | ".join(
            f"{by_sel[s]['page_recall']:.2f} / {by_sel[s]['mass_recall']:.2f}" for s in sels)
            + " |")
    out.append("| index bytes / KV | " + " | ".join(f"1/{1 / shares[s]:.0f}" for s in sels)
               + " |")
    out.append("| select ms per layer, 8 x 7K | " + " | ".join(
        f"{rep['select_ms_per_layer'][s]:.2f}" for s in sels) + " |")
    same = {s: _needle_pct(results, "needle_centroid_4k.json", cfg) for s, cfg in
            (("quest", "sparse-1024"), ("mean", "sparse-1024-mean"),
             ("centroid", "sparse-1024-centroid"))}
    if same["quest"]:
        out.append("| needle ~4K, budget 1024 | " + " | ".join(
            _needle_cells(same[s], same["quest"] if s != "quest" else {}) if same.get(s)
            else "-" for s in sels) + " |")
    quest, low = {}, {}
    for length in ("4k", "7k"):
        quest.update(_needle_pct(results, f"needle_codec_{length}.json", "sparse-1024"))
        low.update(_needle_pct(results, f"needle_lowrank_{length}.json", "sparse-1024"))
    if low:
        out.append("| needle ~4K / ~7K, budget 1024, lowrank's prompts | "
                   + " | ".join(_needle_cells(quest, {}) if s == "quest" else
                                _needle_cells(low, quest) if s == "lowrank" else "-"
                                for s in sels) + " |")
    return out + [""] + plan_section(results)


def plan_section(results: Path = RESULTS) -> list[str]:
    """--sparse-budget-plan against the uniform budget (budget_plan_1024.json of `strata
    profile`, needle_plan_4k.json of bench/needle.py)."""
    plan, needle = _load(results / "budget_plan_1024.json"), _load(results / "needle_plan_4k.json")
    if plan is None or needle is None:
        return []
    fmt = next(iter(needle["formats"].values()))
    heads = [b for layer in plan["budgets"][plan["dense_layers"]:] for b in layer]
    spread = ", ".join(f"{b}: {heads.count(b)}" for b in sorted(set(heads)))
    out = ["### A budget per layer and KV head", "",
           "`.venv/bin/python -m server.cli profile --sparse-budget 1024 --out "
           "bench/results/budget_plan_1024.json` (16K tokens of the bundled essays), then "
           "`bench/needle.py --budget-plan bench/results/budget_plan_1024.json --configs "
           "sparse-1024 sparse-1024-plan sparse-1024-p0 sparse-1024-plan-p0` "
           f"({_needle_counts(results, ['needle_plan_4k.json'])}; `-p0`: the selector alone, "
           f"without the prompt's prior; the change against the same config without the "
           f"plan in brackets). The plan's heads per budget: {spread}.", "",
           "![plan](bench/results/needle_plan_4k.png)", "",
           "| config | needle ~4K | selected tokens a head | pages looked up a step |",
           "|---|---|---|---|"]
    rows = [(cfg, fmt) for cfg in needle["configs"]]
    floor = _load(results / "needle_plan_floor512_4k.json")
    if floor is not None:                 # the same recall table, no head below 512 tokens
        ffmt = next(iter(floor["formats"].values()))
        rows += [(cfg, ffmt) for cfg in floor["configs"]]
    for cfg, f in rows:
        t = f["timing_s"][cfg]
        acc = {k: v for k, v in f["accuracy_pct"][cfg].items() if k != "all"}
        base = {k: v for k, v in fmt["accuracy_pct"].get(cfg.replace("-plan", ""), {}).items()
                if k != "all"} if "-plan" in cfg else {}
        pages = t["pages_looked_up"] / t["steps"] if t.get("steps") else float("nan")
        name = cfg + (" (no head below 512)" if f is not fmt else "")
        out.append(f"| {name} | {_needle_cells(acc, base)} | {t['mean_selected_tokens']:.0f} | "
                   f"{pages:.0f} |")
    return out + [""]


def recompute_section(rep: dict, png: str, results: Path = RESULTS) -> list[str]:
    """KV recompute (bench/recompute.py): the SmolLM2-shaped MHA run, and the narrow
    model's (recompute_small.json) when there is one."""
    out = ["### Recompute instead of fetch: KV recompute (KVPR)", "",
           "`.venv/bin/python bench/recompute.py` (and `--shape small`): random-weight "
           "multi-head models (the bundled SmolLM2 is GQA, where `auto` recomputes nothing: its "
           "layer inputs are larger than its K/V), dense decode with every page on disk, so each "
           "step reads every page of every layer; `--kv-recompute off`, `auto` and fixed "
           "shares, each in its own process, in turns. \"model\": the step the cost model "
           "predicts from its (measured) per-page costs.", ""]
    small = png.replace("recompute", "recompute_small")
    for r, image in ((rep, png), (_load(results / "recompute_small.json"), small)):
        if r is None:
            continue
        out += [f"![recompute]({image})", "",f"{r['model']}, {r['batch']} x {r['context']} tokens "
                f"({r['pages_per_fill']} pages a layer's fill):", "",
                "| `--kv-recompute` | pages recomputed a step | MiB from disk a step | decode "
                "step ms | vs off | model's step ms |", "|---|---|---|---|---|---|"]
        for mode, row in r["modes"].items():
            out.append(f"| {mode} | {row['recomputed_per_step']:.0f} | "
                       f"{row['disk_to_device_bytes_per_step'] / 2**20:.1f} | "
                       f"{row['step_ms_median']:.0f} | {row.get('step_vs_off', 1.0):.2f}x | "
                       f"{row.get('predicted_step_ms', row['step_ms_median']):.0f} |")
        out.append("")
    return out
