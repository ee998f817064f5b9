"""Payload codecs for all-to-all traffic (ScheMoE section 3.1, "AbsCompressor").

A codec turns a ``(rows, cols)`` tensor into one or more payload tensors whose first dimension
is still ``rows`` (so the same split sizes route them), and back. It declares its wire size so a
planner can tell whether it pays. Built in: ``none``, ``fp16``, ``bf16``, ``int8``, ``fp8``,
``fp8-row``, ``zfp`` (our fixed-rate ZFP, any device) and ``zfpy`` (LLNL's, CPU only).
"""

from moeflow.comm.codecs.base import CODECS, Codec, register_codec
from moeflow.comm.codecs import none as _none  # noqa: F401  (registers "none")
from moeflow.comm.codecs import cast as _cast  # noqa: F401  (registers "fp16", "bf16")
from moeflow.comm.codecs import int8 as _int8  # noqa: F401  (registers "int8")
from moeflow.comm.codecs import fp8 as _fp8  # noqa: F401  (registers "fp8", "fp8-row")

__all__ = ["CODECS", "Codec", "register_codec"]
from moeflow.comm.codecs import zfp_codec as _zfp_codec  # noqa: F401,E402  ("zfp", "zfpy")
