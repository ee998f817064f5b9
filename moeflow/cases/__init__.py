"""The layer configurations, inputs and routing of the benchmarks that ``moeflow simulate``
predicts: one definition that the benchmark times and the simulator plans, so that a predicted
row and its measured twin route the same tokens to the same experts. Below the command layer:
the benchmarks (moeflow/bench, benchmarks/) and the simulate commands both import it."""
