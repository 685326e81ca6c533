"""What a LoRA adapter costs a decode step: the bundled GGUF in-process (as `make serve`
runs it), the same prompts decoded greedily by the base model, by an adapter (random, rank 8,
q/v/down: a typical PEFT target set) and half and half, each with the decode layers in one C
call each (the default) and op by op (the reference), in turns, the median step of each.

    .venv/bin/python bench/lora_decode.py [--context 1000] [--steps 64] [--batch 1 4]
        [--rounds 2] [--rank 8]
"""
from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

if not __package__:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (add_out_arg, cpu_line, essay_ids, model_folder, parser, result_header,
                          tokenizer, write_json)

MODES = ("base", "adapter", "mixed")


def write_adapter(folder: Path, cfg: dict, rank: int) -> None:
    """A random PEFT adapter of q_proj, v_proj and down_proj for a model of `cfg`."""
    import torch
    from safetensors.torch import save_file
    g = torch.Generator().manual_seed(0)
    hid, inter = cfg["hidden_size"], cfg["intermediate_size"]
    head_dim = cfg.get("head_dim") or hid // cfg["num_attention_heads"]
    shapes = {"self_attn.q_proj": (hid, hid), "mlp.down_proj": (hid, inter),
              "self_attn.v_proj": (cfg["num_key_value_heads"] * head_dim, hid)}
    tensors = {}
    for i in range(cfg["num_hidden_layers"]):
        for name, (out, inp) in shapes.items():
            key = f"base_model.model.model.layers.{i}.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, inp, generator=g) * 0.02
            tensors[f"{key}.lora_B.weight"] = torch.randn(out, rank, generator=g) * 0.02
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
        "target_modules": ["q_proj", "v_proj", "down_proj"]}))


def decode_steps(engine, prompts: list[list[int]], loras: list[str | None],
                 steps: int) -> list[float]:
    """Seconds of each decode step (every request past its prompt) of `prompts`."""
    from scheduler.sampling_params import SamplingParams
    ids = [f"r{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    for rid, p, lora in zip(ids, prompts, loras):
        engine.add_request(rid, p, SamplingParams(max_tokens=steps, temperature=0.0,
                                                  ignore_eos=True, lora=lora))
    started, times = set(), []
    while engine.has_unfinished():
        decoding = len(started) == len(ids)
        t0 = time.perf_counter()
        outs = engine.step()
        if decoding:
            times.append(time.perf_counter() - t0)
        started |= {o.request_id for o in outs if o.new_token_ids}
    return times[:-1]           # (the last step finishes the requests)


def run(context: int, steps: int, batches: list[int], rounds: int, rank: int) -> dict:
    from engine.args import EngineArgs
    from engine.llm_engine import LLMEngine
    from kernels.decode_layer import FusedLayers
    folder = model_folder()
    cfg = json.loads((folder / "config.json").read_text())
    ids = essay_ids(tokenizer())
    with tempfile.TemporaryDirectory() as tmp:
        write_adapter(Path(tmp) / "bench", cfg, rank)
        args = EngineArgs(model="bundled", prefix_cache="off",
                          lora_modules=f"bench={tmp}/bench")
        engine = LLMEngine(args)
        engine.use_threads(*args.torch_threads())       # as the server's
        rows: dict[str, list[float]] = {}
        for r in range(rounds):
            for b in batches:
                prompts = [ids[i * 7919:i * 7919 + context] for i in range(b)]
                for mode in MODES:
                    loras = {"base": [None] * b, "adapter": ["bench"] * b,
                             "mixed": [None if i % 2 else "bench" for i in range(b)]}[mode]
                    for fused in (True, False):
                        FusedLayers.enabled = fused
                        try:
                            t = decode_steps(engine, prompts, loras, steps)
                        finally:
                            FusedLayers.enabled = True
                        key = f"{mode}|{b}|{'one-call' if fused else 'op-by-op'}"
                        rows.setdefault(key, []).append(1e3 * statistics.median(t))
                        print(f"round {r + 1}/{rounds} {key}: {rows[key][-1]:.2f} ms a step",
                              flush=True)
    return {"rows": rows, "dtype": engine.weight_plan.dtype}


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--context", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--rank", type=int, default=8)
    add_out_arg(ap, "lora_decode")
    args = ap.parse_args()
    result = {**result_header("lora_decode"), "context": args.context, "steps": args.steps,
              "rank": args.rank, **run(args.context, args.steps, args.batch, args.rounds,
                                       args.rank)}
    write_json(args.out, result)
    print(f"\n{cpu_line(result['machine'])}; activations {result['dtype']}; median decode step "
          f"(ms) per round, {args.context}-token prompts")
    print("| mode | rows | layers | " + " | ".join(f"round {i + 1}" for i in range(args.rounds))
          + " |")
    print("|---|---|---|" + "---|" * args.rounds)
    for key, ms in result["rows"].items():
        print("| " + " | ".join(key.split("|")) + " | " + " | ".join(f"{m:.2f}" for m in ms)
              + " |")
    print(f"(JSON: {args.out})")


if __name__ == "__main__":
    main()
