"""Unit tests of moeflow's top-level modules: config, data, devices, the layer's options, the import layering."""
