"""Lowering for a target runtime, and reads of rows made cheaper.

- `lower_ort.py`: forms onnxruntime's own fusions would make slower; `row_kernels.py`: row lookups and distinct
  rows → ctropt's `GatherRows` and `UniqueRows` kernels;
- `lookup_rows.py`: a selection of a lookup's rows → the lookup of the selected ids; `read_rows.py`: a sequence read
  at a few positions → the row-wise ops before the read on those positions only;
- `lower_openvino.py`: what OpenVINO cannot load or runs wrong, for `--target openvino`.

Imported for registration by ctropt/passes/__init__.py (FAMILIES), module by module: a family's modules import
helpers across families (attention ↔ dense), which package-level imports here would turn into import cycles.
"""
