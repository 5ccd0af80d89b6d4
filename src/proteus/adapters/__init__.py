"""Adapters: LoRA with knowledge transfer S and orthogonal new directions (Eq. 9, Eq. 15)."""

from proteus.adapters.lora import LoRAUnit, LoRAWrapper
from proteus.adapters.model import AdaptedBackbone

__all__ = ["AdaptedBackbone", "LoRAUnit", "LoRAWrapper"]
