"""Model weights: the built-in demo model builder and the loader that resolves modelWeightPath."""
