"""``moeflow bench codecs``: codec throughput against the device's copy bandwidth, bits per
value, and error on three kinds of payload (ScheMoE section 3.1 / Table 6 compare codecs by
volume and accuracy; the question here is whether a codec runs near memory speed).

For each codec and size ``rows x cols`` (float32 input): median encode and decode times over
``reps`` runs after a warm-up, the codecs and the copy timed round robin within each repetition
(so a shared machine's load hits all alike); throughput in GB/s of input; the ratio of the
bytes a codec reads plus writes per second to the copy bandwidth measured the same way
(``dst.copy_(x)`` into a preallocated buffer: ``2 * nbytes / t``), for encode, decode, and both
together; bits per value on the wire. Errors (relative Frobenius ``||x^ - x|| / ||x||`` and the
largest ``|x^ - x| / max|x|``) on Gaussian rows, smooth rows (sums of low-frequency sines) and
real activations: the inputs of the
MoE layers of the tiny GPT on a batch of the embedded corpus (optionally after a few training
steps). For ZFP codecs the error of LLNL's zfpy at the same rate on the same data (computed on
CPU) is reported beside it.
"""

from __future__ import annotations

import json
import math
import platform
import statistics

import torch

from moeflow.comm.codecs import CODECS
from moeflow.devices import Stopwatch, synchronize

DEFAULT_CODECS = ["fp16", "bf16", "int8", "fp8", "fp8-row", "zfp", "zfpy"]
ZFP_CODECS = ("zfp", "zfpy")
DEFAULT_SIZES_CPU = [(2048, 128), (8192, 512)]
DEFAULT_SIZES_CUDA = [(8192, 1024), (65536, 1024), (65536, 4096)]


def parse_sizes(text: str) -> list[tuple[int, int]]:
    out = []
    for item in text.split(","):
        r, sep, c = item.strip().lower().partition("x")
        if not sep or not r.isdigit() or not c.isdigit() or int(r) < 1 or int(c) < 1:
            raise ValueError(f"--sizes item {item!r} is invalid: write ROWSxCOLS, e.g. "
                             "4096x1024,65536x1024")
        out.append((int(r), int(c)))
    return out


def _sync(device: torch.device) -> None:
    synchronize(device)


def _time(fn, device, warmup: int, reps: int) -> float:
    """Median seconds of ``fn`` on ``device`` (CUDA events on GPUs, the host clock on CPU)."""
    for _ in range(warmup):
        fn()
    _sync(device)
    ts = []
    for _ in range(reps):
        watch = Stopwatch(device).start()
        fn()
        ts.append(watch.stop())
    return statistics.median(ts)


def gaussian(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))


def smooth(rows: int, cols: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    t = torch.linspace(0, 1, cols).unsqueeze(0)
    out = torch.zeros(rows, cols)
    for _ in range(3):
        f = torch.rand(rows, 1, generator=g) * 4 + 0.5
        ph = torch.rand(rows, 1, generator=g) * 2 * math.pi
        out += torch.randn(rows, 1, generator=g) * torch.sin(2 * math.pi * f * t + ph)
    return out


def activations(batch_size: int = 8, train_steps: int = 0, seed: int = 0) -> torch.Tensor:
    """Inputs of every MoE layer of the tiny GPT on a corpus batch: ``(tokens, d_model)``."""
    from moeflow.config import model_preset
    from moeflow.data import Corpus
    from moeflow.layer import MoELayer
    from moeflow.models import GPT

    cfg = model_preset("tiny")
    model = GPT(cfg)
    corpus = Corpus.load()
    if train_steps:
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        for step in range(train_steps):
            x, y = corpus.batch("train", batch_size, cfg.seq_len, seed, step, 0)
            _, loss = model(x, y)
            (loss + model.aux_loss).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    captured = []
    hooks = [m.register_forward_hook(lambda mod, inp, out: captured.append(
        inp[0].detach().reshape(-1, inp[0].shape[-1]))) for m in model.modules()
        if isinstance(m, MoELayer)]
    with torch.no_grad():
        x, _ = corpus.batch("val", batch_size, cfg.seq_len, seed, 0, 0)
        model(x)
    for h in hooks:
        h.remove()
    return torch.cat(captured).float().contiguous()


def _errors(x: torch.Tensor, y: torch.Tensor) -> dict:
    d = (y.double() - x.double())
    return {"rel_error": float(d.norm() / x.double().norm().clamp(min=1e-300)),
            "max_error_over_max": float(d.abs().max() / x.double().abs().max().clamp(min=1e-300))}


def _zfpy_errors(x: torch.Tensor, rate: float) -> dict | None:
    try:
        codec = CODECS["zfpy"](rate=rate, check_finite=False)
    except Exception:                                   # zfpy missing
        return None
    xc = x.cpu()
    return _errors(xc, codec.decode(codec.encode(xc), torch.float32))


def _make(name: str, zfp_rate: float):
    """A fresh codec; the ZFP ones at ``zfp_rate`` bits per value."""
    return CODECS[name](rate=zfp_rate) if name in ZFP_CODECS else CODECS[name]()


def run(codecs: list[str], sizes: list[tuple[int, int]], device: str = "cpu", warmup: int = 1,
        reps: int = 5, train_steps: int = 0, error_rows: int = 2048,
        zfp_rate: float = 8.0) -> dict:
    dev = torch.device(device)
    data = {"gaussian": gaussian(error_rows, 512), "smooth": smooth(error_rows, 512),
            "activations": activations(train_steps=train_steps)}
    results = []
    for rows, cols in sizes:
        x = gaussian(rows, cols).to(dev)
        dst = torch.empty_like(x)
        nbytes = x.numel() * 4
        live, payloads = [], {}
        for name in codecs:
            codec = _make(name, zfp_rate)
            if not codec.supports(torch.float32, dev):
                results.append({"codec": name, "rows": rows, "cols": cols, "device": str(dev),
                                "skipped": f"{name} does not run on {dev.type}"})
                continue
            live.append((name, codec))
            payloads[name] = codec.encode(x)
        # Round robin: every repetition times the copy and each codec back to back, so a
        # shared machine's changing load hits all of them alike (ratios stay meaningful).
        t_copy, t_enc, t_dec = [], {n: [] for n, _ in live}, {n: [] for n, _ in live}
        for rep in range(warmup + reps):
            tc = _time(lambda: dst.copy_(x), dev, 0, 1)
            te = {n: _time(lambda c=c: c.encode(x), dev, 0, 1) for n, c in live}
            td = {n: _time(lambda c=c, n=n: c.decode(payloads[n], torch.float32), dev, 0, 1)
                  for n, c in live}
            if rep >= warmup:
                t_copy.append(tc)
                for n, _ in live:
                    t_enc[n].append(te[n])
                    t_dec[n].append(td[n])
        copy_gbs = 2 * nbytes / statistics.median(t_copy) / 1e9
        for name, codec in live:
            wire = codec.wire_bytes(rows, cols, torch.float32)
            te, td = statistics.median(t_enc[name]), statistics.median(t_dec[name])
            moved = nbytes + wire                             # input bytes + wire bytes
            results.append({
                "codec": name, "rows": rows, "cols": cols, "device": str(dev),
                "bits_per_value": 8 * wire / x.numel(), "copy_gbs": copy_gbs,
                "encode_ms": 1e3 * te, "decode_ms": 1e3 * td,
                "encode_gbs": nbytes / te / 1e9, "decode_gbs": nbytes / td / 1e9,
                "encode_vs_copy": moved / te / 1e9 / copy_gbs,
                "decode_vs_copy": moved / td / 1e9 / copy_gbs,
                "roundtrip_vs_copy": 2 * moved / (te + td) / 1e9 / copy_gbs})
    errors = []
    for name in codecs:
        codec = _make(name, zfp_rate)
        if not codec.supports(torch.float32, dev):
            continue
        for kind, d in data.items():
            xd = d.to(dev)
            e = {"codec": name, "data": kind, "rows": d.shape[0], "cols": d.shape[1],
                 **_errors(xd, codec.decode(codec.encode(xd), torch.float32))}
            if name in ZFP_CODECS:
                ref = _zfpy_errors(d, codec.rate)
                if ref is not None:
                    e["zfpy_rel_error"] = ref["rel_error"]
            errors.append(e)
    return {"device": str(dev), "device_name": _device_name(dev), "threads":
            torch.get_num_threads(), "warmup": warmup, "reps": reps, "zfp_rate": zfp_rate,
            "throughput": results,
            "errors": errors}


def _device_name(dev: torch.device) -> str:
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    return f"{platform.processor() or platform.machine()} ({torch.get_num_threads()} threads)"


def format_table(res: dict) -> str:
    head = (f"{'codec':<8} {'size':>12} {'bits/val':>8} {'enc GB/s':>9} {'dec GB/s':>9} "
            f"{'enc/copy':>8} {'dec/copy':>8} {'rt/copy':>8}")
    lines = [f"device: {res['device_name']}, zfp rate {res.get('zfp_rate', 8.0):g}", head,
             "-" * len(head)]
    for r in res["throughput"]:
        size = f"{r['rows']}x{r['cols']}"
        if "skipped" in r:
            lines.append(f"{r['codec']:<8} {size:>12}  skipped: {r['skipped']}")
            continue
        lines.append(f"{r['codec']:<8} {size:>12} {r['bits_per_value']:>8.2f} "
                     f"{r['encode_gbs']:>9.3f} {r['decode_gbs']:>9.3f} "
                     f"{r['encode_vs_copy']:>8.3f} {r['decode_vs_copy']:>8.3f} "
                     f"{r['roundtrip_vs_copy']:>8.3f}")
    copies = sorted({(r['rows'], r['cols'], r['copy_gbs']) for r in res["throughput"]
                     if "copy_gbs" in r})
    lines.append("copy bandwidth (read+write GB/s): " + ", ".join(
        f"{r}x{c}: {g:.2f}" for r, c, g in copies))
    lines.append("x/copy = (input bytes + wire bytes) per second / copy bandwidth")
    lines.append("")
    eh = f"{'codec':<8} {'data':<12} {'rel err':>10} {'max/max':>10} {'zfpy rel':>10}"
    lines += [eh, "-" * len(eh)]
    for e in res["errors"]:
        z = e.get("zfpy_rel_error")
        lines.append(f"{e['codec']:<8} {e['data']:<12} {e['rel_error']:>10.3e} "
                     f"{e['max_error_over_max']:>10.3e} "
                     f"{'' if z is None else format(z, '.3e'):>10}")
    return "\n".join(lines)


def write_json(res: dict, path: str, command: str) -> None:
    from moeflow.cluster.quota import in_force     # one process: a quota only from cluster run

    with open(path, "w") as f:
        json.dump({"command": command, "torch": torch.__version__, "cpu_per_rank": in_force(),
                   **res}, f, indent=2)
