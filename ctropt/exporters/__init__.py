"""Exporters: TensorFlow (tf2onnx) and PyTorch (torch.onnx) to ONNX, each checked against the framework.

    from ctropt.exporters import tf, torch, check_export
    exp = tf.export_path("saved_model_dir")            # or tf.from_keras(model), tf.from_checkpoint(...)
    checks = check_export(exp, sample)                 # onnxruntime vs TensorFlow at batch 1, 7, 256
"""

from .common import CHECK_ATOL, CHECK_BATCHES, DEFAULT_OPSET, Export, ExportCheck, check_export

__all__ = ["CHECK_ATOL", "CHECK_BATCHES", "DEFAULT_OPSET", "Export", "ExportCheck", "check_export"]
