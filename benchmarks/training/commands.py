"""``moeflow bench parm-train``, ``moeflow bench group-limited``, ``moeflow bench
recompute``, ``moeflow bench dense-shard`` and ``moeflow bench hecate-train``: benchmarks whose
options live beside their code (:mod:`benchmarks.parm.parm_train`,
:mod:`benchmarks.deepseek_v3.group_limited`, :mod:`benchmarks.training.recompute`,
:mod:`benchmarks.training.dense_shard`, :mod:`benchmarks.hecate.hecate_train`), started the same way as
every other bench."""

from __future__ import annotations

import shlex
import sys


def register_bench(bsub) -> None:
    from benchmarks.deepseek_v3 import group_limited
    from benchmarks.hecate import hecate_train
    from benchmarks.parm import parm_train
    from benchmarks.training import dense_shard, recompute

    p = bsub.add_parser("parm-train", help="Parm's Table V analog: moeflow train step time per "
                                           "MP / ESP layout on an emulated cluster (as root)",
                        description=parm_train.__doc__.split("\n\n")[0])
    parm_train.add_arguments(p)
    p.set_defaults(func=lambda args: parm_train.run(args, "moeflow " + shlex.join(sys.argv[1:])))

    p = bsub.add_parser("group-limited", help="inter-node bytes and step time of DeepSeek-V3's "
                                              "node-limited routing vs plain top-k, per "
                                              "all-to-all (--algorithms direct,node_dedup; "
                                              "under moeflow cluster run)",
                        description=group_limited.__doc__.splitlines()[0])
    group_limited.add_arguments(p)
    p.set_defaults(func=group_limited.run)

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

    p = bsub.add_parser("hecate-train", help="HECATE end to end: moeflow train's step under EP, "
                                             "shadowing, re-placement, HECATE and HECATE-RM "
                                             "(interleaved, paired ratios over EP, losses, loads)",
                        description=hecate_train.__doc__.splitlines()[0])
    hecate_train.add_arguments(p)
    p.set_defaults(func=hecate_train.run)
