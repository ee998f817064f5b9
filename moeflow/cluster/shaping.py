"""Link shaping for the emulated cluster: rates and latencies as text, and the ``tc`` commands.

A link's rate is limited with a token bucket (``tbf``) on the egress of an interface; latency is
added with ``netem`` as the root qdisc and the ``tbf`` as its child (netem delays, then the
bucket paces); kernels built without netem (the project's machine is one) refuse a latency
with a clear error. Each direction of a link is the egress of one of its two ends, so shaping both
ends limits both directions independently (full duplex, like a real NIC).

tbf counts bytes at layer 2 (Ethernet + IP + TCP headers included), so TCP's goodput over a
``1gbit`` link is about 4-5 % lower than the rate with a 1500-byte MTU.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from moeflow.config import ConfigError

_RATE_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
               "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9}
_TIME_UNITS = {"s": 1.0, "sec": 1.0, "ms": 1e-3, "msec": 1e-3, "us": 1e-6, "usec": 1e-6,
               "ns": 1e-9}


def parse_rate(text: str, field: str = "rate") -> float:
    """``'1gbit'`` -> 1e9 bits per second (tc's units: bit/kbit/mbit/gbit; bps.. = bytes/s)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]+)\s*", str(text))
    if not m or m.group(2).lower() not in _RATE_UNITS or float(m.group(1)) <= 0:
        raise ConfigError(f"{field}={text!r} is invalid: write a positive number with a unit "
                          f"({', '.join(_RATE_UNITS)}), e.g. 1gbit or 100mbit")
    return float(m.group(1)) * _RATE_UNITS[m.group(2).lower()]


def parse_latency(text: str, field: str = "latency") -> float:
    """``'200us'`` -> 2e-4 seconds."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]+)\s*", str(text))
    if not m or m.group(2).lower() not in _TIME_UNITS:
        raise ConfigError(f"{field}={text!r} is invalid: write a number with a unit "
                          f"({', '.join(_TIME_UNITS)}), e.g. 200us or 1ms")
    return float(m.group(1)) * _TIME_UNITS[m.group(2).lower()]


def format_rate(bits_per_s: float) -> str:
    for unit, scale in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if bits_per_s >= scale:
            return f"{bits_per_s / scale:g}{unit}"
    return f"{bits_per_s:g}bit"


QUEUE_S = 0.010     # tbf queue: 10 ms of traffic, a switch-like buffer. With 200 ms, the ACKs
                    # of a reverse flow wait behind data (bufferbloat) and bidirectional
                    # goodput fell to ~85 MB/s per direction at 1gbit (vs ~105 with 10 ms).


@dataclass(frozen=True)
class LinkShape:
    """The limits of one link direction; ``None`` means unlimited."""
    rate_bps: float | None = None        # bits per second
    latency_s: float | None = None       # one-way added delay

    @property
    def limited(self) -> bool:
        return self.rate_bps is not None or bool(self.latency_s)

    def burst_bytes(self, mtu: int) -> int:
        """Bucket size: 2 ms of traffic (256 KB at 1gbit), at least 4 packets.

        The bucket lets a burst this big through at memory speed, so messages below it are not
        limited (a real NIC never allows that). Smaller buckets were measured on the project's
        loaded 2-core machine (docs/benchmarks/cluster.md): 64 KB and 25 KB cut large-transfer
        goodput at 1gbit from ~115 to 55-80 MB/s because the qdisc timer fires late.
        """
        assert self.rate_bps is not None
        return int(max(self.rate_bps / 8 * 2e-3, 4 * (mtu + 100)))

    def tc_commands(self, netns: str, dev: str, mtu: int) -> list[list[str]]:
        """``tc`` argument lists that put this shape on ``dev``'s egress inside ``netns``."""
        tc = ["tc", "-n", netns, "qdisc", "add", "dev", dev]
        cmds: list[list[str]] = []
        parent = ["root"]
        if self.latency_s:
            cmds.append(tc + ["root", "handle", "1:", "netem", "delay",
                              f"{self.latency_s * 1e6:.0f}us", "limit", "100000"])
            parent = ["parent", "1:"]
        if self.rate_bps is not None:
            cmds.append(tc + parent + ["handle", "2:", "tbf", "rate", f"{self.rate_bps:.0f}bit",
                                       "burst", str(self.burst_bytes(mtu)), "latency",
                                       f"{QUEUE_S * 1e3:g}ms"])
        return cmds
