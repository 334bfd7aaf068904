"""Output-length ranker learned online from the run's own finished samples (StreamRL).

Skewness-aware dispatch only needs to know which prompts will be *long*, so the ranker
predicts log(length) from cheap prompt features and is judged by ranking quality.

- Features (generic, no task knowledge): log sizes (characters, words, lines), counts of
  digits, letters, number runs and symbols, and a hashed bag of character 1–3-grams
  (crc32, not ``hash()``, so runs are reproducible across processes).
- Model: ridge regression on standardised features over a sliding window of recent
  observations, refit every ``refit_every`` observations (numpy only, deterministic).
- Prompt memory: a prompt seen before is predicted by shrinking its own mean log length
  towards the model (``memory_prior`` pseudo-observations of the model's guess).
- Quality: every observation first records the prediction made *before* its outcome was
  known (hold-out), so ``spearman()`` and ``top_recall()`` measure what dispatch saw.
"""
from __future__ import annotations

import math
import re
import threading
import zlib
from collections import OrderedDict, deque
from typing import Iterable, Sequence

import numpy as np

_NUMBER = re.compile(r"\d+")
_N_DENSE = 8  # features before the hashed n-grams (see _dense_features)


def _dense_features(prompt: str) -> list[float]:
    symbols = sum(1 for c in prompt if not c.isalnum() and not c.isspace())
    return [
        math.log1p(len(prompt)),
        math.log1p(len(prompt.split())),
        float(prompt.count("\n")),
        float(sum(c.isdigit() for c in prompt)),
        float(sum(c.isalpha() for c in prompt)),
        float(len(_NUMBER.findall(prompt))),
        float(symbols),
        math.log1p(symbols),
    ]


def featurize(prompt: str, hash_dim: int = 256, ngram_max: int = 3) -> np.ndarray:
    """One prompt's feature vector: dense counts, then hashed character n-gram counts."""
    x = np.zeros(_N_DENSE + hash_dim)
    x[:_N_DENSE] = _dense_features(prompt)
    for n in range(1, ngram_max + 1):
        for i in range(len(prompt) - n + 1):
            x[_N_DENSE + zlib.crc32(prompt[i : i + n].encode("utf-8")) % hash_dim] += 1.0
    return x


def _add_outer(sxx: np.ndarray, x: np.ndarray, k: float) -> None:
    """``sxx += k * outer(x, x)``, on x's non-zero entries only where they are few: a short
    prompt's hashed n-grams fill a few dozen of the 264 features, and the full outer
    product, once per observed group, was most of the ranker's cost."""
    nz = np.flatnonzero(x)
    if 2 * len(nz) < len(x):
        sxx[np.ix_(nz, nz)] += k * np.outer(x[nz], x[nz])
    else:
        sxx += k * np.outer(x, x)


def rank(values: Sequence[float]) -> np.ndarray:
    """Ranks from 1, ties get their average rank (as in Spearman's definition)."""
    v = np.asarray(values, dtype=float)
    order = np.argsort(v, kind="stable")
    ranks = np.empty(len(v))
    sorted_v = v[order]
    start = 0
    while start < len(v):
        end = start
        while end + 1 < len(v) and sorted_v[end + 1] == sorted_v[start]:
            end += 1
        ranks[order[start : end + 1]] = (start + end) / 2 + 1
        start = end + 1
    return ranks


def spearman(predicted: Sequence[float], actual: Sequence[float]) -> float:
    """Spearman's rank correlation; 0 when either side has no spread (e.g. a constant predictor)."""
    if len(predicted) < 2:
        return 0.0
    rp, ra = rank(predicted), rank(actual)
    rp, ra = rp - rp.mean(), ra - ra.mean()
    denom = math.sqrt(float(rp @ rp) * float(ra @ ra))
    return float(rp @ ra) / denom if denom else 0.0


def top_recall(predicted: Sequence[float], actual: Sequence[float], q: float = 0.1) -> float:
    """Share of the predictor's top ⌈q·n⌉ that are truly long (length ≥ the ⌈q·n⌉-th longest).

    Ties in the predictions are split evenly (a constant predictor scores about q, like a
    random one); with distinct actual lengths this is the recall of the true top-q.
    """
    n = len(predicted)
    if n == 0:
        return 0.0
    k = max(1, math.ceil(q * n))
    p, a = np.asarray(predicted, dtype=float), np.asarray(actual, dtype=float)
    threshold = np.sort(p)[::-1][k - 1]
    above, tied = p > threshold, p == threshold
    weight = above.astype(float) + tied * ((k - above.sum()) / tied.sum())
    truly_long = a >= np.sort(a)[::-1][k - 1]
    return float(weight[truly_long].sum()) / k


class LengthRanker:
    """Online predictor of completion length from the prompt.

    ``observe(prompt, length)`` after each finished sample (or ``observe_group`` for the
    completions of one prompt), ``predict(prompts)`` before dispatch, ``metrics()`` per step.
    """

    def __init__(self, hash_dim: int = 256, ngram_max: int = 3, window: int = 2048, refit_every: int = 64,
                 ridge: float = 1.0, memory_prompts: int = 100_000, memory_prior: float = 2.0,
                 quality_window: int = 512):
        if window < 2 or refit_every < 1 or ridge <= 0:
            raise ValueError("window must be ≥ 2, refit_every ≥ 1 and ridge > 0")
        self.hash_dim, self.ngram_max, self.ridge, self.window = hash_dim, ngram_max, ridge, window
        self.refit_every, self.memory_prompts, self.memory_prior = refit_every, memory_prompts, memory_prior
        d = _N_DENSE + hash_dim
        # Sliding-window sufficient statistics (Σx, Σxxᵀ, Σxy, Σy): a refit costs one d×d
        # solve instead of a pass over the whole window.
        # One entry per observed group: its features and the lengths still in the window,
        # oldest first (a group's samples share x: evicting them is one outer product).
        self._window: deque[tuple[np.ndarray, deque[float]]] = deque()
        self._window_n = 0  # samples in the window
        self._sx, self._sxx, self._sxy, self._sy = np.zeros(d), np.zeros((d, d)), np.zeros(d), 0.0
        self._memory: OrderedDict[str, tuple[float, int]] = OrderedDict()  # prompt -> (sum of log lengths, count)
        self._held_out: deque[tuple[float, float]] = deque(maxlen=quality_window)  # (predicted, actual)
        self._since_fit = 0
        self.observations = 0
        self._coef: np.ndarray | None = None
        self._x_mean = self._x_scale = None
        self._y_mean = 0.0
        # observe_group and state_dict hold it: a checkpoint taken while another thread
        # learns must see the window and its sums of the same moment.
        self._lock = threading.Lock()

    # -- learning -------------------------------------------------------------------
    def observe(self, prompt: str, length: int) -> None:
        self.observe_group(prompt, [length])

    def observe_group(self, prompt: str, lengths: Iterable[int]) -> None:
        """Completions of one prompt: predicted once before any of them is learnt from,
        so siblings do not leak into each other's hold-out prediction."""
        ys = [math.log1p(max(0, int(n))) for n in lengths]
        if not ys:
            return
        x = featurize(prompt, self.hash_dim, self.ngram_max)
        with self._lock:
            self._observe_locked(prompt, x, ys)

    def _observe_locked(self, prompt: str, x: np.ndarray, ys: list[float]) -> None:
        guess = float(np.expm1(self._predict_log(x[None, :], [prompt])[0]))
        self._held_out.extend((guess, math.expm1(y)) for y in ys)
        self._add(x, ys)
        total, count = self._memory.pop(prompt, (0.0, 0))
        self._memory[prompt] = (total + sum(ys), count + len(ys))
        while len(self._memory) > self.memory_prompts:
            self._memory.popitem(last=False)  # least recently observed
        self.observations += len(ys)
        self._since_fit += len(ys)
        if self._since_fit >= self.refit_every or self._coef is None:
            self._fit()

    def _add(self, x: np.ndarray, ys: list[float]) -> None:
        k = len(ys)
        self._sx += k * x
        _add_outer(self._sxx, x, k)
        self._sxy += sum(ys) * x
        self._sy += sum(ys)
        self._window.append((x, deque(ys)))
        self._window_n += k
        while self._window_n > self.window:  # the oldest samples leave, a group's at once
            old_x, old_ys = self._window[0]
            m = min(self._window_n - self.window, len(old_ys))
            gone = sum(old_ys.popleft() for _ in range(m))
            if not old_ys:
                self._window.popleft()
            self._sx -= m * old_x
            _add_outer(self._sxx, old_x, -m)
            self._sxy -= gone * old_x
            self._sy -= gone
            self._window_n -= m

    def _fit(self) -> None:
        """Ridge on standardised features, intercept unpenalised (the mean of y)."""
        self._since_fit = 0
        n = self._window_n
        self._y_mean = self._sy / n
        self._x_mean = self._sx / n
        cov = self._sxx / n - np.outer(self._x_mean, self._x_mean)
        std = np.sqrt(np.clip(np.diag(cov), 0.0, None))
        self._x_scale = np.where(std > 1e-9, std, 1.0)  # a feature that never varies gets weight 0 anyway
        gram = n * cov / np.outer(self._x_scale, self._x_scale) + self.ridge * np.eye(len(std))
        rhs = (self._sxy - self._x_mean * self._sy) / self._x_scale
        self._coef = np.linalg.solve(gram, rhs)

    # -- checkpoints ----------------------------------------------------------------
    _CONFIG = ("hash_dim", "ngram_max", "window", "refit_every", "ridge", "memory_prompts", "memory_prior")

    def state_dict(self) -> dict:
        """Everything the ranker knows, copied under the lock (later observations do not
        change it), as what ``torch.load(weights_only=True)`` reads back: float64 tensors,
        lists, numbers, strings, None. The running sums are kept as they are (not
        recomputed from the window), so a restored ranker predicts bit for bit the same."""
        import torch

        def tensor(a):
            return None if a is None else torch.from_numpy(np.array(a, dtype=np.float64))

        with self._lock:
            d = _N_DENSE + self.hash_dim
            return {
                "format": 1,
                "config": {name: getattr(self, name) for name in self._CONFIG} | {"quality_window": self._held_out.maxlen},
                "window_x": tensor(np.stack([x for x, ys in self._window for _ in ys]) if self._window
                                   else np.zeros((0, d))),
                "window_y": tensor([y for _, ys in self._window for y in ys]),
                "sx": tensor(self._sx), "sxx": tensor(self._sxx), "sxy": tensor(self._sxy), "sy": float(self._sy),
                "memory_prompts": list(self._memory),
                "memory_totals": tensor([total for total, _ in self._memory.values()]),
                "memory_counts": [count for _, count in self._memory.values()],
                "held_out": tensor(np.array(self._held_out, dtype=np.float64).reshape(-1, 2)),
                "since_fit": self._since_fit, "observations": self.observations,
                "coef": tensor(self._coef), "x_mean": tensor(self._x_mean), "x_scale": tensor(self._x_scale),
                "y_mean": float(self._y_mean),
            }

    @classmethod
    def from_state_dict(cls, state: dict) -> "LengthRanker":
        ranker = cls(**state["config"])
        ranker.load_state_dict(state)
        return ranker

    def load_state_dict(self, state: dict) -> None:
        """Restore what ``state_dict`` returned (its config must match this ranker's)."""
        config = {name: getattr(self, name) for name in self._CONFIG} | {"quality_window": self._held_out.maxlen}
        if state["config"] != config:
            raise ValueError(f"a ranker state for {state['config']} cannot load into a ranker of {config}")

        def array(t):
            return None if t is None else t.numpy().astype(np.float64, copy=True)

        with self._lock:
            window_x, window_y = array(state["window_x"]), array(state["window_y"])
            self._window, self._window_n = deque(), len(window_y)
            for x, y in zip(window_x, map(float, window_y)):  # a group's samples (the same x) back together
                if self._window and np.array_equal(self._window[-1][0], x):
                    self._window[-1][1].append(y)
                else:
                    self._window.append((x, deque([y])))
            self._sx, self._sxx, self._sxy = array(state["sx"]), array(state["sxx"]), array(state["sxy"])
            self._sy = float(state["sy"])
            self._memory = OrderedDict(
                (prompt, (float(total), int(count)))
                for prompt, total, count in zip(state["memory_prompts"], array(state["memory_totals"]),
                                                state["memory_counts"]))
            self._held_out.clear()
            self._held_out.extend((float(p), float(a)) for p, a in array(state["held_out"]))
            self._since_fit, self.observations = int(state["since_fit"]), int(state["observations"])
            self._coef, self._x_mean, self._x_scale = array(state["coef"]), array(state["x_mean"]), array(state["x_scale"])
            self._y_mean = float(state["y_mean"])

    # -- prediction -----------------------------------------------------------------
    def _predict_log(self, X: np.ndarray, prompts: Sequence[str]) -> np.ndarray:
        if self._coef is None:
            model = np.zeros(len(prompts))  # nothing seen yet: every prompt alike
        else:
            model = self._y_mean + ((X - self._x_mean) / self._x_scale) @ self._coef
        out = model.copy()
        for i, p in enumerate(prompts):
            if p in self._memory:
                total, count = self._memory[p]
                out[i] = (total + self.memory_prior * model[i]) / (count + self.memory_prior)
        return out

    def predict_log(self, prompts: Sequence[str]) -> np.ndarray:
        """Predicted log(1 + length) per prompt."""
        d = _N_DENSE + self.hash_dim
        X = np.stack([featurize(p, self.hash_dim, self.ngram_max) for p in prompts]) if prompts else np.zeros((0, d))
        return self._predict_log(X, prompts)

    def predict(self, prompts: Sequence[str]) -> list[float]:
        """Predicted completion length (tokens) per prompt."""
        return [float(v) for v in np.expm1(self.predict_log(prompts))]

    # -- quality --------------------------------------------------------------------
    def spearman(self) -> float:
        """Rank correlation of hold-out predictions with outcomes over the recent window."""
        pred, actual = zip(*self._held_out) if self._held_out else ((), ())
        return spearman(pred, actual)

    def top_recall(self, q: float = 0.1) -> float:
        """``top_recall`` of the hold-out predictions over the recent window."""
        pred, actual = zip(*self._held_out) if self._held_out else ((), ())
        return top_recall(pred, actual, q)

    def metrics(self) -> dict[str, float]:
        return {"ranker/spearman": self.spearman(), "ranker/top10_recall": self.top_recall(0.1),
                "ranker/observations": float(self.observations)}
