"""How an evaluation set's n samples per prompt are generated (workers/coord/evaluation.py):
one vLLM request of n samples per prompt (``SamplingParams.n``, what FluxRL does) against n
requests of one sample each, on one warm engine of the tiny model, alternating rounds so
machine noise hits both alike. Every prompt of the set is in flight at once in both.

    .venv/bin/python bench/eval_sampling.py [--prompts 64] [--n 8] [--max-tokens 12] [--rounds 5]

Prints each way's median seconds per evaluation and completions per second.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import time

from workers.models.tinymodel import ensure_tiny_model
from workers.rollout.engine import RolloutEngine
from workers.rollout.engine_args import configure_cpu_environment
from workers.tasks.datasets import GENERATORS
from workers.tasks.prompts import PromptRenderer, load_tokenizer

logger = logging.getLogger("bench.eval_sampling")


async def one_evaluation(engine: RolloutEngine, prompts: list[list[int]], n: int, max_tokens: int,
                         grouped: bool) -> float:
    t0 = time.perf_counter()
    if grouped:
        await asyncio.gather(*(engine.generate_group(p, n, max_tokens, 1.0) for p in prompts))
    else:
        await asyncio.gather(*(engine.generate(p, max_tokens, 1.0) for p in prompts for _ in range(n)))
    return time.perf_counter() - t0


async def main(args) -> None:
    path = str(ensure_tiny_model())
    configure_cpu_environment(None, 1.0)
    renderer = PromptRenderer(load_tokenizer(path), "raw", None, None)
    prompts = [renderer.ids(r) for r in GENERATORS["add"](args.prompts, seed=3)]
    engine = RolloutEngine(path, update_mode="keep", max_model_len=256)
    await engine.start()
    try:
        for grouped in (True, False):  # warm-up, not counted
            await one_evaluation(engine, prompts, args.n, args.max_tokens, grouped)
        times = {True: [], False: []}
        for _ in range(args.rounds):
            for grouped in (True, False):
                times[grouped].append(await one_evaluation(engine, prompts, args.n, args.max_tokens, grouped))
    finally:
        engine.shutdown()
    completions = args.prompts * args.n
    for grouped, label in ((True, "one request of n per prompt"), (False, "n requests of 1 per prompt")):
        median = statistics.median(times[grouped])
        logger.info("%-30s %6.3f s per evaluation  %7.0f completions/s  (%d prompts x n %d, %d rounds)",
                    label, median, completions / median, args.prompts, args.n, args.rounds)
    logger.info("speed-up of n-sampling: %.2fx", statistics.median(times[False]) / statistics.median(times[True]))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=5)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    asyncio.run(main(parser.parse_args()))
