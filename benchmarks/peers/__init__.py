"""Runners of the peer MoE layers that ``moeflow bench layer --compare torchtitan|megatron``
starts under each peer's own interpreter (``torchtitan_runner.py``, ``megatron_runner.py``), and
the case-file and pipe protocol they share with moeflow (``protocol.py``, torch only). The
compared layer is GShard's top-k MoE layer (Lepikhin et al., Section 2.2), dropless SwiGLU."""
