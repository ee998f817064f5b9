"""ZFP fixed-rate compression of float arrays, on any torch device (ScheMoE section 3.1 uses ZFP
[Lindstrom 2014] for all-to-all payloads; this is our own implementation of LLNL zfp's
fixed-rate mode, bit-compatible with ``zfpy``).
"""
