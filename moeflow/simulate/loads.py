"""Skewed expert loads for the step simulator: routing samples drawn from an expert popularity.

HECATE (Section 2.2, "the skewness of token assignment in MoE gates") shows expert parallelism's
step bound by its most loaded rank; to predict that, the simulator plans a routing sample whose
choices follow a popularity ``p_e`` through the layer's own planning code
(:func:`moeflow.dispatch.plan.make_plan`, capacity drops included), so the heaviest rank's
experts set the critical path. Two popularities:

* **Zipf** (``--zipf S``): ``p_e ~ rank_e^-S``, the skew ``moeflow bench hecate`` puts on its
  router (expert ``e``'s popularity rank is the same fixed shuffle, ``permutation(E) + 1`` of
  ``numpy.random.default_rng(7)``), here as a distribution, not as router weights;
* **a router trace** (``--router-trace FILE[:RUN[:LAYER]]``): the measured tokens per expert of a
  trained model, the JSON that ``moeflow bench router-load --out`` writes (a list of
  runs, each with ``loads_after`` / ``loads_before``: per MoE layer, tokens per expert). The
  schema is read here, not imported: the simulator sits below the command layer.

Each token picks ``top_k`` distinct experts, sampled without replacement in proportion to
``p_e`` (the Gumbel-top-k trick: the ``k`` largest ``log p_e + Gumbel`` keys), seeded.
"""

from __future__ import annotations

import json

import numpy as np

from moeflow.errors import ConfigError

HECATE_SHUFFLE_SEED = 7         # moeflow bench hecate's fixed popularity shuffle


def zipf_popularity(num_experts: int, s: float) -> np.ndarray:
    """``p_e`` proportional to ``rank_e^-s`` (``s = 0``: uniform), ranks shuffled as
    ``moeflow bench hecate`` shuffles them."""
    if not (isinstance(s, (int, float)) and s >= 0 and np.isfinite(s)):
        raise ConfigError(f"--zipf {s!r} is invalid: a finite exponent >= 0 (0: uniform)")
    ranks = np.random.default_rng(HECATE_SHUFFLE_SEED).permutation(num_experts) + 1
    w = ranks.astype(np.float64) ** -float(s)
    return w / w.sum()


def parse_trace_spec(spec: str) -> tuple[str, int, int]:
    """``FILE[:RUN[:LAYER]]`` -> (file, run index, MoE layer index); RUN and LAYER default to 0."""
    parts = spec.split(":")
    idx = []
    while len(parts) > 1 and len(idx) < 2 and parts[-1].lstrip("-").isdigit():
        idx.insert(0, int(parts.pop()))
    run, layer = (idx + [0, 0])[:2]
    return ":".join(parts), run, layer


def trace_popularity(spec: str, num_experts: int, when: str = "after") -> tuple[np.ndarray, str]:
    """``p_e`` from a ``moeflow bench router-load`` JSON: run ``RUN``'s tokens per expert of MoE
    layer ``LAYER`` (``when``: after training, the default, or before), and a description."""
    path, run, layer = parse_trace_spec(spec)
    key = f"loads_{when}"
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"--router-trace {spec}: cannot read {path} ({e}); give the JSON of "
                          "`moeflow bench router-load RUN --out FILE`") from e
    if not isinstance(data, list) or not data or not all(isinstance(r, dict) for r in data):
        raise ConfigError(f"--router-trace {spec}: {path} is not a router_load JSON (a list of "
                          "runs, each with 'loads_after'); write it with "
                          "`moeflow bench router-load RUN --out FILE`")
    if not 0 <= run < len(data):
        raise ConfigError(f"--router-trace {spec}: run {run} is out of range; the file has "
                          f"{len(data)} run(s) (0..{len(data) - 1})")
    entry = data[run]
    if key not in entry:
        raise ConfigError(f"--router-trace {spec}: run {run} has no {key!r}; the file is not a "
                          "router_load JSON")
    layers = entry[key]
    if not 0 <= layer < len(layers):
        raise ConfigError(f"--router-trace {spec}: MoE layer {layer} is out of range; run {run} "
                          f"has {len(layers)} MoE layer(s) (0..{len(layers) - 1})")
    loads = np.asarray(layers[layer], dtype=np.float64)
    if loads.shape != (num_experts,):
        raise ConfigError(f"--router-trace {spec}: the trace has {loads.size} experts, the "
                          f"simulated layer {num_experts}; choose a layer with {num_experts} "
                          "experts or a trace of a model with as many")
    if (loads < 0).any() or loads.sum() <= 0:
        raise ConfigError(f"--router-trace {spec}: the loads {loads.tolist()} are not counts "
                          "(non-negative, not all zero)")
    return loads / loads.sum(), (f"{path} run {run} ({entry.get('run', '?')}, step "
                                 f"{entry.get('step', '?')}) MoE layer {layer}, {key}")


def sample_routing(popularity: np.ndarray, world: int, tokens: int, top_k: int,
                   seed: int = 0) -> list[np.ndarray]:
    """Per rank, ``(tokens, top_k)`` distinct expert ids drawn from ``popularity`` without
    replacement (Gumbel-top-k), from ``numpy.random.default_rng(seed)``."""
    p = np.asarray(popularity, dtype=np.float64)
    E = p.size
    if top_k > E:
        raise ConfigError(f"top_k={top_k} exceeds the {E} experts of the popularity")
    if (p > 0).sum() < top_k:
        raise ConfigError(f"the popularity has {(p > 0).sum()} experts with a load > 0, fewer "
                          f"than top_k={top_k}: a token could not pick {top_k} distinct experts")
    rng = np.random.default_rng(seed)
    with np.errstate(divide="ignore"):
        logp = np.log(p)
    out = []
    for _ in range(world):
        keys = logp + rng.gumbel(size=(tokens, E))
        out.append(np.argsort(-keys, axis=1, kind="stable")[:, :top_k].astype(np.int64))
    return out
