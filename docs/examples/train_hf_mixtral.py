"""Train a Mixtral-style transformers model with moeflow on N ranks with expert parallelism,
save it as a Mixtral checkpoint, and load that back with transformers (docs/hf.md).

    torchrun --standalone --nproc-per-node 2 docs/examples/train_hf_mixtral.py --out ckpt

Each rank holds num_local_experts / N experts of every MoE layer and everything else
replicated; tokens reach their experts through moeflow's all-to-all. The checkpoint is an
ordinary MixtralForCausalLM one (experts gathered by global id when saving).
"""

from __future__ import annotations

import argparse
import json
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from transformers import MixtralConfig, MixtralForCausalLM

import moeflow as mf
from moeflow.data import Corpus
from moeflow.integrations import hf


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True, help="directory of the saved checkpoint")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--json", default=None, help="write the losses and checks here")
    args = p.parse_args()

    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    topo = mf.Topology.from_env()                 # ep_size = world: experts split over ranks
    config = MixtralConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                           num_local_experts=4, num_experts_per_tok=2,
                           max_position_embeddings=128, router_aux_loss_coef=0.02,
                           pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)                          # the same replicated weights on every rank
    model = MixtralForCausalLM(config)
    aux = hf.replace_moe_blocks(model, topo, codec="none", schedule="optsche",
                                pipeline_degree=2)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    corpus = Corpus.load()
    losses, t0 = [], time.perf_counter()
    for step in range(args.steps):
        x, _ = corpus.batch("train", 8, 64, seed=0, step=step, rank=topo.rank)
        out = model(input_ids=x, labels=x)        # transformers shifts the labels
        (out.loss + aux()).backward()
        mf.sync_gradients(model, topo)            # replicated: averaged; experts: their own
        opt.step()
        opt.zero_grad()
        losses.append(out.loss.item())
        if topo.rank == 0 and step % 10 == 0:
            print(f"step {step}: lm loss {losses[-1]:.3f}, aux {aux().item():.4f}")
    seconds = time.perf_counter() - t0

    hf.save_pretrained(model, args.out, topo)     # collective; rank 0 writes
    dist.barrier()
    model.eval()
    x, _ = corpus.batch("val", 2, 64, seed=0, step=0, rank=0)
    with torch.no_grad():
        ours = model(input_ids=x).logits           # collective: every rank runs it
    if topo.rank == 0:
        loaded = MixtralForCausalLM.from_pretrained(args.out).eval()
        with torch.no_grad():
            theirs = loaded(input_ids=x).logits
        diff = (ours - theirs).abs().max().item()
        print(f"{args.steps} steps in {seconds:.1f} s; lm loss {losses[0]:.3f} -> "
              f"{losses[-1]:.3f}; transformers' reload: max |logit diff| {diff:.2e}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"world": topo.world_size, "steps": args.steps,
                           "seconds": seconds, "lm_loss_rank0": losses,
                           "reload_max_abs_logit_diff": diff}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
