"""``moeflow bench recompute``, ``moeflow bench dense-shard`` and ``moeflow bench router-load``:
end-to-end ``moeflow train`` experiments whose options live beside their code
(:mod:`benchmarks.training.recompute`, :mod:`benchmarks.training.dense_shard`,
:mod:`benchmarks.training.router_load`)."""

from __future__ import annotations

import shlex
import sys


def register_bench(bsub) -> None:
    from benchmarks.training import dense_shard, recompute, router_load

    p = bsub.add_parser("recompute", help="memory and step time of moeflow train --recompute "
                                          "none / full / moe_act (fresh launches, interleaved)",
                        description=recompute.__doc__.splitlines()[0])
    recompute.add_arguments(p)
    p.set_defaults(func=lambda args: (recompute.run(args), 0)[1])

    p = bsub.add_parser("dense-shard", help="per-rank memory of moeflow train --dense-shard "
                                            "replicate vs fsdp (fresh launches, interleaved)",
                        description=dense_shard.__doc__.splitlines()[0])
    dense_shard.add_arguments(p)
    p.set_defaults(func=lambda args: (dense_shard.run(args, "moeflow "
                                                      + shlex.join(sys.argv[1:])), 0)[1])

    p = bsub.add_parser("router-load", help="max/mean tokens per expert of trained runs, "
                                            "before and after training (DeepSeek-V3's "
                                            "auxiliary-loss-free balancing)",
                        description=router_load.__doc__.splitlines()[0])
    router_load.add_arguments(p)
    p.set_defaults(func=router_load.run)
