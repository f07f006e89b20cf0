"""Lower precision, opt-in and accuracy-gated: `quantize.py` (INT8 FC layers on the CPU) and `float16.py` (FP16 on
the GPU, reusing quantize's gate).

Imported for registration by ctropt/passes/__init__.py (FAMILIES), module by module: a family's modules import
helpers across families (attention ↔ dense), which package-level imports here would turn into import cycles.
"""
