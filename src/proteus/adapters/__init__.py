"""Adapters: LoRA with knowledge transfer S and orthogonal new directions (Eq. 9, Eq. 15)."""

from proteus.lazy import exports

__all__ = ["AdaptedBackbone", "LoRAUnit", "LoRAWrapper"]

__getattr__, __dir__ = exports(
    __name__,
    {
        "AdaptedBackbone": "model",
        "LoRAUnit": "lora",
        "LoRAWrapper": "lora",
    },
)
