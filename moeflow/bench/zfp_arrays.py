"""``moeflow bench zfp-arrays``: our ZFP (``moeflow.comm.codecs.zfp``) against LLNL's zfpy on
whole 1-, 2- and 3-D arrays (zfp's own use: a d-dimensional field coded in blocks of ``4^d``
values, Lindstrom 2014; ScheMoE section 3.1 uses the 1-D case on payload rows).

For each shape (its number of axes is ``dims``) and each kind of data (Gaussian noise, and a
smooth field: a sum of low-frequency sines over all axes): median compress and decompress
times of both coders over ``reps`` repetitions after ``warmup``, timed round robin inside every
repetition (a shared machine's load hits both alike), as MB/s of float32 input and as ratios
ours / zfpy (above 1: ours is faster), and which of our coders ran (``zfp.backend``). Every
run also checks that both produce the same bytes and the same decoded values (the comparison
is only meaningful if they do). zfpy runs on CPU; with ``--device cuda`` ours runs on the GPU
and zfpy on a CPU copy.
"""

from __future__ import annotations

import math
import statistics
import time

import torch

from moeflow.bench.codecs_bench import _device_name, _sync
from moeflow.comm.codecs import zfp


def parse_shapes(text: str) -> list[tuple[int, ...]]:
    out = []
    for item in text.split(","):
        parts = item.strip().lower().split("x")
        if not 1 <= len(parts) <= 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError(f"--shapes item {item!r} is invalid: write 1 to 3 sizes joined by "
                             "'x', e.g. 1048576,1024x1024,64x128x128")
        out.append(tuple(int(p) for p in parts))
    return out


def make(kind: str, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "gaussian":
        return torch.randn(*shape, generator=g)
    if kind != "smooth":
        raise ValueError(f"unknown data kind {kind!r}; use gaussian or smooth")
    grids = torch.meshgrid(*[torch.linspace(0, 1, s) for s in shape], indexing="ij")
    out = torch.zeros(shape)
    for _ in range(3):
        f = torch.rand(len(shape), generator=g) * 4 + 0.5
        ph = float(torch.rand(1, generator=g)) * 2 * math.pi
        out += float(torch.randn(1, generator=g)) * torch.sin(
            2 * math.pi * sum(fi * gi for fi, gi in zip(f.tolist(), grids)) + ph)
    return out


def _zfpy():
    try:
        import zfpy
    except ImportError as err:
        raise RuntimeError("moeflow bench zfp-arrays compares against zfpy: pip install "
                           "'moeflow[zfp]'") from err
    return zfpy


def run(shapes: list[tuple[int, ...]], rate: float = 8.0, device: str = "cpu",
        warmup: int = 1, reps: int = 5, kinds: tuple[str, ...] = ("gaussian", "smooth")) -> dict:
    zfpy = _zfpy()
    dev = torch.device(device)
    rows = []
    for shape in shapes:
        d = len(shape)
        for kind in kinds:
            x = make(kind, shape)
            xn = x.numpy()
            xd = x.to(dev)
            ours = zfp.compress(xd, rate, dims=d)
            ref = zfpy.compress_numpy(xn, rate=rate, write_header=False)
            same_bytes = bytes(ours.cpu().numpy().tobytes()) == ref
            dec = zfp.decompress(ours, shape, rate, dims=d).cpu()
            zdec = zfpy._decompress(ref, zfpy.type_float, list(shape), rate=rate)
            same_values = bool(torch.equal(dec.view(torch.int32),
                                           torch.from_numpy(zdec.copy()).view(torch.int32)))
            fns = {"enc": lambda: zfp.compress(xd, rate, dims=d),
                   "dec": lambda: zfp.decompress(ours, shape, rate, dims=d),
                   "zenc": lambda: zfpy.compress_numpy(xn, rate=rate, write_header=False),
                   "zdec": lambda: zfpy._decompress(ref, zfpy.type_float, list(shape),
                                                    rate=rate)}
            times = {k: [] for k in fns}
            for rep in range(warmup + reps):
                for k, f in fns.items():
                    _sync(dev)
                    t0 = time.perf_counter()
                    f()
                    _sync(dev)
                    if rep >= warmup:
                        times[k].append(time.perf_counter() - t0)
            med = {k: statistics.median(v) for k, v in times.items()}
            mb = x.numel() * 4 / 1e6
            rows.append({"shape": list(shape), "dims": d, "data": kind, "rate": rate,
                         "coder": zfp.backend(dev, d),
                         "bytes": len(ref), "same_bytes": same_bytes,
                         "same_values": same_values,
                         "encode_mbs": mb / med["enc"], "decode_mbs": mb / med["dec"],
                         "zfpy_encode_mbs": mb / med["zenc"], "zfpy_decode_mbs": mb / med["zdec"],
                         "encode_vs_zfpy": med["zenc"] / med["enc"],
                         "decode_vs_zfpy": med["zdec"] / med["dec"]})
    return {"device": str(dev), "device_name": _device_name(dev), "rate": rate, "warmup": warmup,
            "reps": reps, "results": rows}


def format_table(res: dict) -> str:
    head = (f"{'shape':>14} {'data':<9} {'enc MB/s':>9} {'zfpy':>8} {'ours/zfpy':>9} "
            f"{'dec MB/s':>9} {'zfpy':>8} {'ours/zfpy':>9}  {'coder':<12} same")
    lines = [f"device: {res['device_name']}, rate {res['rate']:g}, medians of {res['reps']}",
             head, "-" * len(head)]
    for r in res["results"]:
        same = "bytes+values" if r["same_bytes"] and r["same_values"] else "DIFFERENT"
        lines.append(f"{'x'.join(map(str, r['shape'])):>14} {r['data']:<9} "
                     f"{r['encode_mbs']:>9.1f} {r['zfpy_encode_mbs']:>8.1f} "
                     f"{r['encode_vs_zfpy']:>9.2f} {r['decode_mbs']:>9.1f} "
                     f"{r['zfpy_decode_mbs']:>8.1f} {r['decode_vs_zfpy']:>9.2f}  "
                     f"{r['coder']:<12} {same}")
    return "\n".join(lines)
