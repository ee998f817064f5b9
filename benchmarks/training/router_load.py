"""Expert loads of trained models: max/mean tokens per expert before and after training.

For each ``moeflow train`` run folder: the model of its ``config.json`` at initialisation
(step 0: the seeded initial weights) and at its latest checkpoint, routed on the same
validation batches (eval mode, one process). Per MoE layer, ``max_e load_e / mean_e load_e``
over all top-k choices (1.0 is perfect balance, ``E / k`` the worst). Used to show DeepSeek-V3's
auxiliary-loss-free balancing (section 2.1.2; docs/hf.md):

    moeflow bench router-load RUN [RUN ...] --out docs/results/x.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from moeflow import checkpoint
from moeflow.config import ModelConfig
from moeflow.data import Corpus
from moeflow.models.gpt import GPT
from moeflow.routing import Router
from moeflow.trainer import latest_checkpoint


def layer_loads(model: GPT, corpus: Corpus, batches: int, batch_size: int) -> list[list[int]]:
    """Tokens routed to each expert (all top-k choices), per MoE layer, on validation data."""
    routers = [m for m in model.modules() if isinstance(m, Router)]
    counts = [torch.zeros(r.cfg.num_experts, dtype=torch.long) for r in routers]

    def counter(c: torch.Tensor):
        def hook(mod, inp, out) -> None:          # returns None: the output is unchanged
            c.add_(torch.bincount(out.experts.reshape(-1), minlength=c.numel()))
        return hook

    hooks = [r.register_forward_hook(counter(c)) for r, c in zip(routers, counts)]
    model.eval()
    try:
        with torch.no_grad():
            for i in range(batches):
                x, _ = corpus.batch("val", batch_size, model.cfg.seq_len, 0, i, 0)
                model(x)
    finally:
        for h in hooks:
            h.remove()
    return [c.tolist() for c in counts]


def max_over_mean(load: list[int]) -> float:
    t = torch.tensor(load, dtype=torch.float64)
    return float(t.max() / t.mean())


def run_loads(run: str | Path, batches: int, batch_size: int) -> dict:
    saved = json.loads((Path(run) / "config.json").read_text())
    cfg = ModelConfig.from_dict(saved["model"], f"{Path(run) / 'config.json'}")
    corpus = Corpus.load()
    out = {"run": str(run), "model": saved["model"], "train": saved["train"]}
    model = GPT(cfg)
    before = layer_loads(model, corpus, batches, batch_size)
    path, step = latest_checkpoint(run)
    checkpoint.load(str(path), model, None)
    after = layer_loads(model, corpus, batches, batch_size)
    out.update(step=step, loads_before=before, loads_after=after,
               max_over_mean_before=[max_over_mean(v) for v in before],
               max_over_mean_after=[max_over_mean(v) for v in after])
    biases = {n: b.tolist() for n, b in model.named_buffers()
              if n.endswith("e_score_correction_bias")}
    if biases:
        out["score_correction_bias"] = biases
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``moeflow bench router-load``'s arguments."""
    p.add_argument("runs", nargs="+", help="moeflow train --out folders")
    p.add_argument("--batches", type=int, default=8, help="validation batches")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per validation batch")
    p.add_argument("--out", default=None, help="write the JSON here")


def run(args: argparse.Namespace) -> int:
    """Each run's per-expert loads before and after training; prints max/mean per MoE layer."""
    for name in ("batches", "batch_size"):
        if getattr(args, name) < 1:
            raise SystemExit(f"moeflow bench router-load: --{name.replace('_', '-')} "
                             f"{getattr(args, name)} must be >= 1")
    results = [run_loads(r, args.batches, args.batch_size) for r in args.runs]
    for r in results:
        b = ", ".join(f"{v:.2f}" for v in r["max_over_mean_before"])
        a = ", ".join(f"{v:.2f}" for v in r["max_over_mean_after"])
        print(f"{r['run']}: max/mean load per MoE layer, step 0: {b}; step {r['step']}: {a}")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
        print(f"wrote {args.out}")
    return 0
