"""Dense layers: FC layers, their products and sums, and the user side computed once.

- `fc.py`: `fuse-fc`, `fold-fc-affine`, `static-reshape-targets` (FC layers → Gemm, scale/shift folded);
- `user_layer.py`, `dedup.py`: a first FC layer split into its user and item parts, and `dedup-user-side`;
- `fm.py`, `dot_sum.py`, `experts.py`, `small_products.py`, `mul_add.py`: an FM's second order, width-1 GEMMs,
  a mixture of experts' mix, small batched products, `a * b + c` → ctropt's kernels for onnxruntime.

Imported for registration by ctropt/passes/__init__.py (FAMILIES), module by module: a family's modules import
helpers across families (attention ↔ dense), which package-level imports here would turn into import cycles.
"""
