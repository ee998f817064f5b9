"""``moeflow simulate``: predict a step from measured fits by running the library's task graphs
on modelled lanes (ScheMoE Section 4's two-lane model, on every rank, with collectives).

:mod:`.costs` turns ``moeflow bench links`` / ``bench compute`` fits or a hardware profile into
task times, :mod:`.engine` runs lanes, dependencies and collectives, :mod:`.layer` builds one
expert-parallel layer's step from the schedulers and the dispatch planning code, :mod:`.exchange`
the steps of each all-to-all (the hierarchical ones' intra- and inter-node phases), :mod:`.loads`
skewed routing samples (Zipf, a trained router's loads), :mod:`.parm` Parm's schedules (every
rank's collectives under MP + EP + ESP), :mod:`.fssdp` HECATE's placement, spAG and spRS.
"""

from moeflow.simulate.costs import CostModel, cost_model
from moeflow.simulate.layer_model import LayerSpec, lane_orders, simulate_layer

__all__ = ["CostModel", "LayerSpec", "cost_model", "lane_orders", "simulate_layer"]
