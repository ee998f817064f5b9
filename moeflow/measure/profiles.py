"""Hardware profiles: a cluster stated by its datasheet, for predicting where no cluster can run.

The measured models of a cluster come from ``moeflow bench links`` (alpha-beta per link class)
and ``moeflow bench compute`` (alpha-beta per kernel kind). A profile states the same
quantities from a datasheet, in a small TOML file, so that a cluster the user does not have,
or a paper's testbed, can be modelled:

.. code-block:: toml

    name = "schemoe-32gpu"
    source = "ScheMoE Section 6.1, Table 3"     # where the stated numbers come from
    nodes = 8
    gpus_per_node = 4

    [gpu]
    model = "NVIDIA GeForce RTX 2080 Ti"
    memory_gib = 11                              # stated: a plain number
    fp32_tflops = { value = 13.4, assumption = "NVIDIA datasheet peak, not in the paper" }
    fp16_tflops = { value = 53.8, assumption = "..." }
    memory_bandwidth_gbps = { value = 616, assumption = "..." }
    gemm_efficiency = { value = 0.6, assumption = "..." }

    [intra_node]                                 # GB/s per direction, microseconds
    kind = "PCIe 3.0 x16"
    bandwidth_gbps = { value = 15.75, assumption = "..." }
    latency_us = { value = 10, assumption = "..." }

    [inter_node]                                 # per node; omitted for one node
    kind = "InfiniBand"
    bandwidth_gbps = 12.5
    latency_us = { value = 5, assumption = "..." }

Every number the source does not state is written ``{value, assumption}``, and
:attr:`Profile.assumptions` lists them, so a prediction can say what it rests on. No number is
fitted to a paper's results. The paper testbeds ship in ``moeflow/measure/profiles/``
(:func:`builtin_profiles`).
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from moeflow.errors import ConfigError
from moeflow.measure.linkmodel import AlphaBeta

PROFILES_DIR = Path(__file__).with_name("profiles")

_GPU = ("memory_gib", "fp32_tflops", "fp16_tflops", "memory_bandwidth_gbps", "gemm_efficiency")
_LINK = ("bandwidth_gbps", "latency_us")


@dataclass(frozen=True)
class Link:
    kind: str
    bandwidth_Bps: float           # bytes per second, one direction
    latency_s: float

    def alpha_beta(self) -> AlphaBeta:
        """The link as the alpha-beta model ``bench links`` fits: ``t = latency + bytes / bw``."""
        return AlphaBeta(alpha=self.latency_s, beta=1.0 / self.bandwidth_Bps)


@dataclass(frozen=True)
class Profile:
    name: str
    source: str
    nodes: int
    gpus_per_node: int
    gpu_model: str
    memory_bytes: float
    peak_flops: dict[str, float]   # {"fp32": FLOP/s, "fp16": FLOP/s}
    memory_bandwidth_Bps: float
    gemm_efficiency: float
    intra: Link
    inter: Link | None
    assumptions: dict[str, str] = field(default_factory=dict)   # field path -> why

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    def gemm_flops(self, dtype: str = "fp16") -> float:
        """FLOP/s a large matrix product reaches: peak x ``gemm_efficiency``."""
        if dtype not in self.peak_flops:
            raise ConfigError(f"Profile {self.name!r}: no peak for dtype {dtype!r}; use one of "
                              f"{', '.join(sorted(self.peak_flops))}")
        return self.peak_flops[dtype] * self.gemm_efficiency


def _number(data: dict, key: str, where: str, path: str, assumptions: dict) -> float:
    if key not in data:
        raise ConfigError(f"{where}: {path}.{key} is missing; state it as a number, or as "
                          f"{{ value = ..., assumption = \"why\" }} if the source does not")
    v = data[key]
    if isinstance(v, dict):
        if set(v) != {"value", "assumption"} or not str(v.get("assumption", "")).strip():
            raise ConfigError(f"{where}: {path}.{key}={v!r} is invalid: write "
                              "{ value = NUMBER, assumption = \"why\" } (both keys, a reason)")
        assumptions[f"{path}.{key}".lstrip(".")] = str(v["assumption"])
        v = v["value"]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
        raise ConfigError(f"{where}: {path}.{key}={v!r} is invalid: it must be a positive "
                          "number")
    return float(v)


def _link(data: dict | None, name: str, where: str, assumptions: dict) -> Link | None:
    if data is None:
        return None
    bw = _number(data, "bandwidth_gbps", where, name, assumptions)
    lat = _number(data, "latency_us", where, name, assumptions)
    return Link(str(data.get("kind", name)), bw * 1e9, lat * 1e-6)


def parse_profile(data: dict, where: str = "profile") -> Profile:
    """A profile from parsed TOML (``where`` names it in errors)."""
    a: dict[str, str] = {}
    nodes = _number(data, "nodes", where, "", a)
    per = _number(data, "gpus_per_node", where, "", a)
    if nodes != int(nodes) or per != int(per):
        raise ConfigError(f"{where}: nodes={nodes} and gpus_per_node={per} must be integers")
    gpu = data.get("gpu")
    if not isinstance(gpu, dict):
        raise ConfigError(f"{where}: the [gpu] table is missing (model, {', '.join(_GPU)})")
    g = {k: _number(gpu, k, where, "gpu", a) for k in _GPU}
    if not 0 < g["gemm_efficiency"] <= 1:
        raise ConfigError(f"{where}: gpu.gemm_efficiency={g['gemm_efficiency']} is invalid: a "
                          "fraction of peak in (0, 1]")
    intra = _link(data.get("intra_node"), "intra_node", where, a)
    if intra is None:
        raise ConfigError(f"{where}: the [intra_node] table is missing ({', '.join(_LINK)})")
    inter = _link(data.get("inter_node"), "inter_node", where, a)
    if inter is None and nodes > 1:
        raise ConfigError(f"{where}: nodes={int(nodes)} needs an [inter_node] table "
                          f"({', '.join(_LINK)})")
    return Profile(name=str(data.get("name", where)), source=str(data.get("source", "")),
                   nodes=int(nodes), gpus_per_node=int(per),
                   gpu_model=str(gpu.get("model", "")), memory_bytes=g["memory_gib"] * 2**30,
                   peak_flops={"fp32": g["fp32_tflops"] * 1e12,
                               "fp16": g["fp16_tflops"] * 1e12},
                   memory_bandwidth_Bps=g["memory_bandwidth_gbps"] * 1e9,
                   gemm_efficiency=g["gemm_efficiency"], intra=intra, inter=inter,
                   assumptions=a)


def load_profile(name_or_path: str | Path) -> Profile:
    """A profile file, or the name of a built-in one (``"schemoe-32gpu"``)."""
    path = Path(name_or_path)
    if not path.is_file():
        builtin = PROFILES_DIR / f"{name_or_path}.toml"
        if not builtin.is_file():
            names = ", ".join(sorted(builtin_profiles()))
            raise FileNotFoundError(f"no profile file {str(name_or_path)!r}, and no built-in "
                                    f"profile of that name (built in: {names})")
        path = builtin
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path}: not valid TOML: {err}") from err
    return parse_profile(data, str(path))


def builtin_profiles() -> list[str]:
    """Names of the shipped profiles (each paper's testbed)."""
    return sorted(p.stem for p in PROFILES_DIR.glob("*.toml"))
