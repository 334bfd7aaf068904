"""Discrete-event simulator of RL training: where does the time go at cluster scale?

    .venv/bin/python -m bench.simulator                       # the modes side by side, one setup
    .venv/bin/python -m bench.simulator --calibrate           # fit costs to bench/results/sync_vs_async.json
    .venv/bin/python -m bench.simulator --recommend --model-size 7e9 --gpus 8..256

  model.py        the simulation (rollout engines, trainer, weight updates; the modes), completion
                  length distributions, and the cluster-scale costs and split sweep (recommend)
  calibration.py  the costs fitted to the measured CPU runs
  plot.py         a tiny SVG line-chart writer and the split chart
  cli.py          the command line (__main__.py runs it)
"""
