"""DeepSpeed-MoE against Parm's schedules (Parm section V, whose baseline is DeepSpeed-MoE):
:mod:`.parm_deepspeed` (DeepSpeed's own layer beside moeflow's, ``moeflow bench parm --compare
deepspeed``) and :mod:`.parm_deepspeed_trace` (the collectives each layer runs, recorded)."""
