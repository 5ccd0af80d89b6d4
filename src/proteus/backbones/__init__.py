"""Backbones (registry): torchvision MobileNetV2 and timm Vision Transformers."""

from proteus.backbones import mobilenet, vit  # noqa: F401  (register the families)
from proteus.backbones.base import BACKBONES, AdaptTarget, Backbone, DataConfig, build_backbone

__all__ = ["BACKBONES", "AdaptTarget", "Backbone", "DataConfig", "build_backbone"]
