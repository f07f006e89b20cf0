"""Fused ops of the domain ai.ctropt: schema, ONNX function body (reference decomposition), numpy reference.

Each fused op ships as a model-local ONNX function, so a saved model stays valid ONNX any runtime can inline.
"""

DOMAIN = "ai.ctropt"
