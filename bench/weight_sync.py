"""Weight transport, RPC vs collective (``rollout.weight_transport``), on a warm vLLM engine
with requests in flight (update mode keep): the tiny model, and a model ~100x larger
built here (the tiny model's Qwen2 config widened and deepened, random init, the tiny
tokenizer). The two transports alternate within each round (order swapped every round),
so machine noise hits both alike; one engine per model, started once.

    .venv/bin/python bench/weight_sync.py [--rounds 5] [--requests 16] [--models tiny,large]

Per update:
- update ms: the trainer's whole cost until the engine acknowledged, as the controller
  pays it: serialising the safetensors blob + the RPC (rpc), describing + broadcasting
  the state dict while the engine receives (collective);
- engine ms: time inside the engine's worker (collective: receive + load), during which
  generation cannot run;
- stall ms: per request, the longest wait for a token overlapping the update minus its
  usual gap (median over requests);
- tok/s during/before: the running requests' token rate over the update window against
  the second before it (on a shared CPU machine, serialising competes for cores too);
- tokens lost: what the before-rate would have made over the window, minus what came
  (the stall in tokens: a short full stop and a long slow-down compare fairly).
Medians over rounds; the last table gives collective/rpc ratios.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

from workers.rollout.engine import RolloutEngine
from workers.rollout.engine_args import configure_cpu_environment
from workers.models.tinymodel import encode, ensure_tiny_model
from workers.weights.broadcast import WeightBroadcaster
from workers.weights.sync import serialize_state_dict
from workers.weights.update import InlineWeights

logger = logging.getLogger("weight_sync")
TRANSPORTS = ("rpc", "collective")


def build_large_model(tiny: Path, out: Path, hidden: int, layers: int, intermediate: int) -> Path:
    """The tiny model's architecture and tokenizer, widened and deepened, random init."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(tiny)
    heads = max(1, hidden // 64)
    config.update({"hidden_size": hidden, "num_hidden_layers": layers, "intermediate_size": intermediate,
                   "num_attention_heads": heads, "num_key_value_heads": heads, "head_dim": hidden // heads})
    if hasattr(config, "layer_types"):  # per-layer list in recent transformers: one entry per layer
        config.layer_types = [config.layer_types[0]] * layers if config.layer_types else None
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(out, safe_serialization=True)
    for f in tiny.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "generation_config")):
            shutil.copy(f, out / f.name)
    return out


def two_states(path: Path) -> list[dict[str, torch.Tensor]]:
    """Two different state dicts to alternate, so every update really changes the weights."""
    from transformers import AutoModelForCausalLM

    a, b = AutoModelForCausalLM.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in b.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 1e-3)
    return [a.state_dict(), b.state_dict()]  # tied embeddings stay tied, as the trainer's are


async def stream(engine: RolloutEngine, i: int, times: list[tuple[float, int]], stop: asyncio.Event) -> None:
    """Keep one request running (restarted when it ends), logging (time, tokens) per output."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(max_tokens=200, temperature=1.0, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    while not stop.is_set():
        async for out in engine.engine.generate(TokensPrompt(prompt_token_ids=encode(f"{i}+{i}=")), params,
                                                request_id=f"bench-{i}-{time.monotonic_ns()}"):
            times.append((time.perf_counter(), len(out.outputs[0].token_ids)))
            if stop.is_set():
                break


def stall_ms(streams: list[list[tuple[float, int]]], t0: float, t1: float) -> float:
    """Median over requests of the longest gap overlapping [t0, t1] minus the usual gap."""
    samples = []
    for s in streams:
        times = [t for t, _ in s]
        gaps = [b - a for a, b in zip(times, times[1:]) if b <= t0]
        spanning = [b - a for a, b in zip(times, times[1:]) if b >= t0 and a <= t1]
        if spanning and len(gaps) > 3 and times[-1] >= t1:
            samples.append((max(spanning) - statistics.median(gaps[-20:])) * 1000)
    return statistics.median(samples) if samples else float("nan")


def rate(streams: list[list[tuple[float, int]]], a: float, b: float) -> float:
    return sum(n for s in streams for t, n in s if a < t <= b) / max(b - a, 1e-9)


async def one_update(engine: RolloutEngine, broadcaster: WeightBroadcaster, transport: str,
                     state: dict[str, torch.Tensor], version: int, requests: int) -> dict:
    streams: list[list[tuple[float, int]]] = [[] for _ in range(requests)]
    stop = asyncio.Event()
    tasks = [asyncio.create_task(stream(engine, i, streams[i], stop)) for i in range(requests)]
    await asyncio.sleep(1.5)  # running, and one clean second to compare against
    t0 = time.perf_counter()
    if transport == "rpc":
        blob = await asyncio.to_thread(serialize_state_dict, state)  # as the controller does
        timing = await engine.update_weights(InlineWeights(blob), version)
    else:
        [timing] = await broadcaster.broadcast(state, version)
    t1 = time.perf_counter()
    await asyncio.sleep(0.5)
    stop.set()
    await asyncio.gather(*tasks)
    before, during = rate(streams, t0 - 1.0, t0), rate(streams, t0, t1)
    return {"update_ms": (t1 - t0) * 1000, "engine_ms": timing.load_ms, "stall_ms": stall_ms(streams, t0, t1),
            "before": before, "during": during, "lost": (before - during) * (t1 - t0)}


async def bench_model(name: str, path: Path, rounds: int, requests: int) -> dict[str, list[dict]]:
    states = two_states(path)
    unique = {v.untyped_storage().data_ptr(): v for v in states[0].values()}.values()
    params = sum(v.numel() for v in unique)
    mb = sum(v.numel() * v.element_size() for v in unique) / 2**20
    logger.info("%s: %.1fM parameters, %.0f MB state dict; starting its engine", name, params / 1e6, mb)
    engine = RolloutEngine(str(path), update_mode="keep", max_model_len=256)
    await engine.start()
    broadcaster = WeightBroadcaster(timeout_s=120)
    try:
        await broadcaster.open([engine])
        version = 0
        for transport in TRANSPORTS:  # warm-up: the first load of a process is vLLM's layerwise reload
            version += 1
            await one_update(engine, broadcaster, transport, states[version % 2], version, requests)
        results: dict[str, list[dict]] = {t: [] for t in TRANSPORTS}
        for r in tqdm(range(rounds), desc=name, unit="round"):
            for transport in TRANSPORTS if r % 2 == 0 else TRANSPORTS[::-1]:
                version += 1
                results[transport].append(
                    await one_update(engine, broadcaster, transport, states[version % 2], version, requests))
        results["_info"] = [{"params": params, "mb": mb}]
        return results
    finally:
        broadcaster.close()
        engine.shutdown()


def median(rows: list[dict], key: str) -> float:
    values = [r[key] for r in rows if r[key] == r[key]]
    return statistics.median(values) if values else float("nan")


async def main(args: argparse.Namespace) -> None:
    configure_cpu_environment(None, 1.0)
    tiny = ensure_tiny_model()
    all_results = {}
    with tempfile.TemporaryDirectory(prefix="fluxrl-bench-") as tmp:
        for name in args.models.split(","):
            if name == "tiny":
                path = tiny
            else:
                path = build_large_model(tiny, Path(tmp) / "large", args.hidden, args.layers, args.intermediate)
            all_results[name] = await bench_model(name, path, args.rounds, args.requests)

    print(f"\n{'model':<6} {'params':>8} {'MB':>6} {'transport':<11} {'update ms':>10} {'engine ms':>10} "
          f"{'stall ms':>9} {'tok/s before':>13} {'tok/s during':>13} {'during/before':>14} {'tokens lost':>12}")
    for name, res in all_results.items():
        info = res["_info"][0]
        for t in TRANSPORTS:
            rows = res[t]
            before, during = median(rows, "before"), median(rows, "during")
            print(f"{name:<6} {info['params'] / 1e6:>7.2f}M {info['mb']:>6.0f} {t:<11} "
                  f"{median(rows, 'update_ms'):>10.1f} {median(rows, 'engine_ms'):>10.1f} "
                  f"{median(rows, 'stall_ms'):>9.1f} {before:>13.0f} {during:>13.0f} {during / before:>14.2f} "
                  f"{median(rows, 'lost'):>12.0f}")
    print(f"\n{'model':<6} {'collective/rpc: update':>23} {'engine':>7} {'stall':>7} {'tok/s during':>13} "
          f"{'tokens lost':>12}")
    for name, res in all_results.items():
        ratio = {k: median(res["collective"], k) / median(res["rpc"], k)
                 for k in ("update_ms", "engine_ms", "stall_ms", "during", "lost")}
        print(f"{name:<6} {ratio['update_ms']:>23.2f} {ratio['engine_ms']:>7.2f} {ratio['stall_ms']:>7.2f} "
              f"{ratio['during']:>13.2f} {ratio['lost']:>12.2f}")
    print(f"({args.rounds} rounds, {args.requests} requests in flight, update mode keep)")


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5, help="updates per transport and model (after one warm-up each)")
    p.add_argument("--requests", type=int, default=16, help="requests kept in flight during each update")
    p.add_argument("--models", default="tiny,large", help="comma-separated: tiny, large")
    p.add_argument("--hidden", type=int, default=768, help="the large model's hidden size")
    p.add_argument("--layers", type=int, default=10, help="the large model's layers")
    p.add_argument("--intermediate", type=int, default=2048, help="the large model's MLP width")
    asyncio.run(main(p.parse_args()))
