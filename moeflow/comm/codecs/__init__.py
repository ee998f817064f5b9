"""Payload codecs for all-to-all traffic (ScheMoE section 3.1, "AbsCompressor").

A codec turns a ``(rows, cols)`` tensor into one or more payload tensors whose first dimension
is still ``rows`` (so the same split sizes route them), and back. It declares its wire size so a
planner can tell whether it pays.
"""

from moeflow.comm.codecs.base import CODECS, Codec, register_codec
from moeflow.comm.codecs import none as _none  # noqa: F401  (registers "none")

__all__ = ["CODECS", "Codec", "register_codec"]
