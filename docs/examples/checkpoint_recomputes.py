"""How many times one forward + backward of a MoELayer runs the layer's forward under
activation checkpointing (counted by a hook on the router), per checkpointing mode.

    python docs/examples/checkpoint_recomputes.py --json docs/results/hf/checkpoint_recomputes.json

Non-reentrant checkpointing recomputes the region once per backward graph task that unpacks
one of its saved tensors; the layer's backward differentiates the experts' (and the shared
experts') graphs with nested ``torch.autograd.grad`` calls (the ScheMoE task executor,
moeflow/schedule/pipeline.py), each of which is such a task, so the layer keeps only the
experts' inputs while saved-tensor hooks are active and recomputes them in its backward: 2
forwards in every case. See docs/hf.md.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.utils.checkpoint as cp

import moeflow as mf

CASES = {"sequential r=1": {}, "pipelined r=4": dict(schedule="pipelined", pipeline_degree=4),
         "1 shared expert": dict(num_shared_experts=1)}


def count(kw: dict, checkpoint: bool | None) -> int:
    cfg = mf.MoEConfig(d_model=8, d_expert=16, num_experts=4, top_k=2, capacity_factor=None,
                       **kw)
    layer = mf.MoELayer(cfg, attach_aux_loss=True).double().train()
    calls = [0]
    layer.router.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    x = torch.randn(16, 8, dtype=torch.float64, requires_grad=True)
    y = layer(x) if checkpoint is None else cp.checkpoint(layer, x, use_reentrant=checkpoint)
    y.square().sum().backward()
    return calls[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None, help="write the counts here")
    args = p.parse_args()
    out = {name: {mode: count(kw, ck) for mode, ck in (("none", None), ("reentrant", True),
                                                        ("non_reentrant", False))}
           for name, kw in CASES.items()}
    out["torch"] = torch.__version__
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
