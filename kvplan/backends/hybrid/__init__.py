"""The hybrid attention family: sliding window + compressed + sparse (DeepSeek-V4 layers)."""

from kvplan.backends.hybrid.api import (
    LAYER_KINDS,
    CompressWindows,
    HybridFamily,
    HybridLayerSpec,
    HybridSeq,
    HybridStepContext,
)

__all__ = [
    "LAYER_KINDS",
    "CompressWindows",
    "HybridFamily",
    "HybridLayerSpec",
    "HybridSeq",
    "HybridStepContext",
]
