"""Communication: all-to-all algorithms, payload codecs, and the differentiable exchange."""
