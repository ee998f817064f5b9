"""``moeflow bench group-limited``: DeepSeek-V3's node-limited routing (Section 2.1.2) against
plain top-k, inter-node bytes and step time per all-to-all (:mod:`benchmarks.deepseek_v3.group_limited`)."""

from __future__ import annotations


def register_bench(bsub) -> None:
    from benchmarks.deepseek_v3 import group_limited

    p = bsub.add_parser("group-limited", help="inter-node bytes and step time of DeepSeek-V3's "
                                              "node-limited routing vs plain top-k, per "
                                              "all-to-all (--algorithms direct,node_dedup; "
                                              "under moeflow cluster run)",
                        description=group_limited.__doc__.splitlines()[0])
    group_limited.add_arguments(p)
    p.set_defaults(func=group_limited.run)
