"""Weight-update cost on a warm vLLM engine with requests in flight: the naive path
(``pause_generation`` → vLLM's layerwise ``reload_weights`` → set version →
``resume_generation``, each awaited) against FluxRL's ``keep`` path (the same four engine
calls sent back to back, and a direct copy into the live parameters), side by side on
one engine, alternating, so machine noise hits both alike.

    .venv/bin/python bench/weight_update.py [--updates 20] [--requests 32]

"Stall" is what the requests see: the longest wait for a next token that overlaps the
update, minus the request's usual gap between tokens (median over requests, then over
updates). "Load" is the time inside the engine's worker spent loading the weights.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from transformers import AutoModelForCausalLM

from workers.rollout.engine import RolloutEngine
from workers.rollout.engine_args import configure_cpu_environment
from workers.models.tinymodel import encode, ensure_tiny_model
from workers.weights.sync import serialize_state_dict
from workers.weights.update import InlineWeights


async def naive_update(engine: RolloutEngine, blob: bytes, version: int) -> float:
    llm = engine.engine
    await llm.pause_generation(mode="keep", clear_cache=False)
    loaded = await llm.collective_rpc("fluxrl_load_weights", args=(blob, True))  # vLLM's layerwise reload
    await llm.engine_core.set_weight_version_async(str(version))
    await llm.resume_generation()
    engine.version = version
    return loaded[0]["load_ms"]


async def stream(engine: RolloutEngine, i: int, times: list[float], stop: asyncio.Event) -> None:
    while not stop.is_set():  # keep the engine busy with long requests
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(max_tokens=180, temperature=1.0, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
        async for _ in engine.engine.generate(TokensPrompt(prompt_token_ids=encode(f"{i}+{i}=")), params,
                                              request_id=f"bench-{i}-{time.monotonic_ns()}"):
            times.append(time.perf_counter())
            if stop.is_set():
                break


def stall_ms(streams: list[list[float]], t0: float, t1: float) -> float:
    """Per stream: the longest wait between two tokens that overlaps the update window
    [t0, t1], minus the stream's usual gap. Tokens that arrive inside the window (the
    step that was running when the update was requested) are progress, not stall."""
    samples = []
    for times in streams:
        gaps = [b - a for a, b in zip(times, times[1:]) if b <= t0]
        spanning = [b - a for a, b in zip(times, times[1:]) if b >= t0 and a <= t1]
        if spanning and len(gaps) > 3 and times[-1] >= t1:
            samples.append((max(spanning) - statistics.median(gaps[-20:])) * 1000)
    return statistics.median(samples) if samples else float("nan")


async def main(updates: int, requests: int) -> None:
    configure_cpu_environment(None, 1.0)
    path = str(ensure_tiny_model())
    engine = RolloutEngine(path, update_mode="keep")
    await engine.start()
    blob = serialize_state_dict(AutoModelForCausalLM.from_pretrained(path).state_dict())
    # warm-up: the first load of a process is slow, and it is the one that goes through
    # vLLM's layerwise reload; later loads copy into the live parameters (weight_sync.py)
    await engine.update_weights(InlineWeights(blob), 0)
    results = {"naive": [], "keep": []}
    version = 0
    for _ in range(updates):
        for name in ("naive", "keep"):
            streams = [[] for _ in range(requests)]
            stop = asyncio.Event()
            tasks = [asyncio.create_task(stream(engine, i, streams[i], stop)) for i in range(requests)]
            await asyncio.sleep(0.4)
            version += 1
            t0 = time.perf_counter()
            if name == "naive":
                load_ms = await naive_update(engine, blob, version)
            else:
                load_ms = (await engine.update_weights(InlineWeights(blob), version)).load_ms
            t1 = time.perf_counter()
            await asyncio.sleep(0.3)
            stop.set()
            await asyncio.gather(*tasks)
            results[name].append(((t1 - t0) * 1000, stall_ms(streams, t0, t1), load_ms))
    engine.shutdown()
    print(f"{'path':<8} {'call ms (median)':>17} {'load ms (median)':>17} {'stall ms (median)':>18}")
    for name, rows in results.items():
        call = statistics.median(r[0] for r in rows)
        load = statistics.median(r[2] for r in rows)
        stall = statistics.median(r[1] for r in rows if r[1] == r[1])
        print(f"{name:<8} {call:>17.1f} {load:>17.1f} {stall:>18.1f}")
    keep = statistics.median(r[1] for r in results["keep"] if r[1] == r[1])
    naive = statistics.median(r[1] for r in results["naive"] if r[1] == r[1])
    print(f"stall ratio naive/keep: {naive / keep:.2f}×  ({updates} updates each, {requests} requests in flight)")


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--updates", type=int, default=20)
    p.add_argument("--requests", type=int, default=32)
    a = p.parse_args()
    asyncio.run(main(a.updates, a.requests))
