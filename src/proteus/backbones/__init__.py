"""Backbones (registry): torchvision MobileNetV2 and timm Vision Transformers."""

from proteus.lazy import exports

__all__ = ["AdaptTarget", "BACKBONES", "Backbone", "DataConfig", "build_backbone", "has_tokens"]

__getattr__, __dir__ = exports(
    __name__,
    {
        "BACKBONES": "base",
        "AdaptTarget": "base",
        "Backbone": "base",
        "DataConfig": "base",
        "build_backbone": "base",
        "has_tokens": "base",
    },
)
