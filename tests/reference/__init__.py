"""Slow or standalone references that only the tests use, kept beside them rather than in the
package: HECATE's FSSDP storage without the layer (``fssdp``, Section 3.2), the bit-plane ZFP
coder in plain torch (``zfp_bitplane``, Lindstrom 2014 section 3.4) and the per-token form of
HECATE's topology-aware dispatch (``destinations``, Section 4.4)."""
