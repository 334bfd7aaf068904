"""Draw a run's learning curves from its metrics.jsonl: held-out greedy accuracy and
sampled reward (mean over a window of steps) against trained samples, with the
staleness bound the run kept. Writes an SVG (no plotting library needed):

    .venv/bin/python -m workers run examples/add-async.yaml --out /tmp/add
    .venv/bin/python bench/rl_curve.py /tmp/add --out bench/results/add_async.svg --title examples/add-async.yaml
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from simulator.plot import Panel, Series, svg_chart  # noqa: E402
from workers.io.checkpoint import read_metrics  # noqa: E402


def curves(run_dir: Path, window: int) -> dict[str, list[tuple[int, float]]]:
    by_key: dict[str, dict[int, float]] = {}
    for p in read_metrics(run_dir / "metrics.jsonl"):
        by_key.setdefault(p["key"], {})[p["step"]] = p["value"]  # a resumed run may repeat a step
    reward = sorted(by_key.get("reward/mean", {}).items())
    windows = [reward[i:i + window] for i in range(0, len(reward) - window + 1, window)]
    return {
        "accuracy": sorted(by_key.get("eval/accuracy", {}).items()),
        "reward": [(w[-1][0], sum(v for _, v in w) / len(w)) for w in windows],
        "staleness": sorted(by_key.get("staleness/max", {}).items()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", type=Path, help="the --out folder of a run (holds metrics.jsonl, result.json)")
    ap.add_argument("--out", type=Path, default=Path("curve.svg"))
    ap.add_argument("--title", help="chart title (default: the run folder's name)")
    ap.add_argument("--window", type=int, default=50, help="steps per sampled-reward mean")
    args = ap.parse_args()
    c = curves(args.run_dir, args.window)
    if not c["accuracy"]:
        sys.exit(f"{args.run_dir / 'metrics.jsonl'} has no eval/accuracy points (was eval.every_steps set?)")
    result = json.loads((args.run_dir / "result.json").read_text())
    per_step = result["trained_samples"] / max(1, result["steps"])
    x = lambda pts: [s * per_step / 1000 for s, _ in pts]  # noqa: E731
    y = lambda pts: [v for _, v in pts]  # noqa: E731
    stale = max(y(c["staleness"]), default=0)
    panel = Panel(f"{result['steps']} steps, {result['seconds']:.0f} s, max staleness {stale:g}",
                  "trained samples (thousands)", f"share right (sampled: mean of {args.window} steps)",
                  [Series("greedy, held-out", x(c["accuracy"]), y(c["accuracy"]), "#1f77b4"),
                   Series("sampled, training", x(c["reward"]), y(c["reward"]), "#ff7f0e")])
    title = args.title or args.run_dir.name
    args.out.write_text(svg_chart([panel], f"{title}: held-out greedy accuracy {result['accuracy_before']:.3f} -> "
                                           f"{result['accuracy_after']:.3f}", width=640))
    print(f"accuracy {' '.join(f'{v:.3f}' for v in y(c['accuracy']))}; "
          f"sampled reward {' '.join(f'{v:.3f}' for v in y(c['reward']))}; max staleness {stale:g} -> {args.out}")


if __name__ == "__main__":
    main()
