"""torchvision MobileNetV2 (ImageNet-1k, IMAGENET1K_V1) as a PROTEUS backbone.

The adapted maps are the pointwise (1x1) convolutions of the inverted-residual blocks: the CNN
counterpart of the ViT's q/v projections. Embedding: global average pool of the last feature map (d=1280).
"""

from __future__ import annotations

import torch
from torch import nn
from torchvision.models import mobilenet_v2

from proteus.backbones.base import BACKBONES, AdaptTarget, Backbone, DataConfig, pooled_stats, tap_indices


class MobileNetV2Backbone(Backbone):
    name = "mobilenet_v2"
    embed_dim = 1280

    def __init__(self, pretrained: bool = True, weights: str | None = None) -> None:
        super().__init__()
        net = mobilenet_v2(weights=None)
        if weights is not None or pretrained:
            from proteus.backbones.checkpoints import load_state_dict_file
            from proteus.backbones.weights import ensure_weights, sha256_file

            path = weights if weights is not None else ensure_weights("mobilenet_v2.tv_in1k")
            state = load_state_dict_file(path)
            missing, unexpected = net.load_state_dict(state, strict=False)
            missing = [k for k in missing if not k.startswith("classifier.")]
            if missing:
                raise ValueError(f"{path}: not MobileNetV2 weights (missing keys such as {missing[:3]})")
            self.weights_id = "mobilenet_v2.tv_in1k" if weights is None else f"file:{path}"
            self.weights_sha256 = sha256_file(path)
        self.stem = net.features[0]
        # features[1..18]: 17 inverted residual blocks and the final 1x1 conv to 1280 channels.
        self.blocks = nn.ModuleList(list(net.features)[1:])
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.data_config = DataConfig(input_size=224, interpolation="bilinear", crop_pct=0.875)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    def adapt_targets(self) -> list[AdaptTarget]:
        targets = []
        for i in self.adapted_block_indices():
            for name, mod in self.blocks[i].named_modules():
                if (
                    isinstance(mod, nn.Conv2d)
                    and mod.kernel_size == (1, 1)
                    and mod.groups == 1
                    and mod.stride == (1, 1)
                ):
                    targets.append(AdaptTarget(f"blocks.{i}.{name}", mod))
        return targets

    def prefix_blocks(self) -> list[nn.Module]:
        return list(self.blocks[: self.split])

    def forward_prefix(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for blk in self.blocks[: self.split]:
            x = blk(x)
        return x

    def forward_prefix_taps(self, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        taps, stats = set(tap_indices(self.split)), []
        x = self.stem(x)
        for i, blk in enumerate(self.blocks[: self.split]):
            x = blk(x)
            if i in taps:
                stats.append(pooled_stats(x))
        return x, stats

    def forward_suffix(self, z: torch.Tensor) -> torch.Tensor:
        for blk in self.blocks[self.split :]:
            z = blk(z)
        return torch.flatten(self.pool(z), 1)


@BACKBONES.register("mobilenet_v2", help="torchvision MobileNetV2, ImageNet-1k IMAGENET1K_V1 (d=1280)")
def _mobilenet_v2(pretrained: bool = True, weights: str | None = None) -> Backbone:
    return MobileNetV2Backbone(pretrained=pretrained, weights=weights)
