"""mtkc: make exported ONNX LLMs ready for MediaTek NPUs (NeuroPilot SDK, MDLA)."""

__version__ = "0.1.0"
