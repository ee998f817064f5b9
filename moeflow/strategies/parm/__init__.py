"""Parm (``docs/parm.md``): MP+EP+ESP layouts and their communication schedules.

``collectives``: the differentiable ESP / MP data movements and the all-to-all; ``baseline``:
DeepSpeed-MoE's order (Fig. 3a), with ``baseline_mp`` its duplicate-token drop under MP;
``ep_esp``: the EP&ESP-AlltoAll with local dump and combine (Section III-C); ``s1`` /
``s2``: the schedules of Fig. 3b / 3c; ``saa``: SAA and AAS (Section III-D); ``ted``: DeepSpeed-TED's order with a node-once EP&ESP exchange (beyond the paper);
``fits`` / ``algorithm1``: the alpha-beta models and Algorithm 1 (Section V);
``measured_choice``: Algorithm 1's candidates timed on the layer (beyond the paper);
``schedules``: how the layer runs them; ``checks``: what is refused.
"""

from moeflow.strategies.parm.algorithm1 import AutoSchedule, Prediction, algorithm1
from moeflow.strategies.parm.baseline import baseline_experts
from moeflow.strategies.parm.checks import check_parm_layer
from moeflow.strategies.parm.fits import ParmFits, measure_parm_fits

__all__ = ["AutoSchedule", "ParmFits", "Prediction", "algorithm1", "baseline_experts",
           "check_parm_layer", "measure_parm_fits"]
