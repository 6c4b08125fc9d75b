"""Layer 0, core math: FP8 formats, dynamic range expansion, quantized arrays, the Adam
recurrence, the FP8 recipe, and the one timing / device-memory reader. Imports nothing of the
project above it; everything else builds on it (see ``tests/test_layers.py``)."""
