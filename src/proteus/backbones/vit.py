"""timm Vision Transformers as PROTEUS backbones (the paper's ViT-B/16, Sec. 5.1).

The adapted maps are the query and value projections of every attention block (the q and v rows of
timm's fused ``qkv`` linear). Embedding: timm's pre-logits feature (the class token after the final norm).
Pretrained tags are data: the paper's backbone is ViT-B/16 pre-trained on ImageNet-21k and fine-tuned on
ImageNet-1k; timm >= 0.9 maps the bare ``vit_base_patch16_224`` to ``augreg2_in21k_ft_in1k``, older
versions to ``augreg_in21k_ft_in1k``, so configs always name the full tag.
"""

from __future__ import annotations

import torch

from proteus.backbones.base import BACKBONES, AdaptTarget, Backbone, DataConfig

#: registry name -> exact timm model tag
VIT_TAGS: dict[str, str] = {
    "vit_b16": "vit_base_patch16_224.augreg2_in21k_ft_in1k",
    "vit_b16_in21k_ft_in1k_augreg": "vit_base_patch16_224.augreg_in21k_ft_in1k",
    "vit_s16": "vit_small_patch16_224.augreg_in21k_ft_in1k",
    "vit_ti16": "vit_tiny_patch16_224.augreg_in21k_ft_in1k",
}


class TimmViTBackbone(Backbone):
    def __init__(self, tag: str, name: str, pretrained: bool = True, weights: str | None = None) -> None:
        super().__init__()
        import timm

        self.name = name
        self.tag = tag
        use_hub = pretrained and weights is None
        self.vit = timm.create_model(tag, pretrained=use_hub, num_classes=0)
        if weights is not None:
            from timm.models.vision_transformer import checkpoint_filter_fn

            from proteus.backbones.weights import load_state_dict_file, sha256_file

            state = checkpoint_filter_fn(load_state_dict_file(weights), self.vit)
            missing, _ = self.vit.load_state_dict(state, strict=False)
            if missing:
                raise ValueError(f"{weights}: does not fit {tag} (missing keys such as {missing[:3]})")
            self.weights_id = f"file:{weights}"
            self.weights_sha256 = sha256_file(weights)
        elif use_hub:
            self.weights_id = f"timm:{tag}"
        self.embed_dim = int(self.vit.num_features)
        cfg = timm.data.resolve_data_config({}, model=self.vit)
        self.data_config = DataConfig(
            input_size=int(cfg["input_size"][-1]),
            mean=tuple(cfg["mean"]),
            std=tuple(cfg["std"]),
            interpolation=str(cfg.get("interpolation", "bicubic")),
            crop_pct=float(cfg.get("crop_pct", 0.9)),
        )

    @property
    def num_blocks(self) -> int:
        return len(self.vit.blocks)

    def set_input_size(self, size: int) -> None:
        super().set_input_size(size)
        if tuple(self.vit.patch_embed.img_size) != (size, size):
            self.vit.set_input_size(img_size=(size, size))  # resamples the position embedding

    def adapt_targets(self) -> list[AdaptTarget]:
        d = self.embed_dim
        out = []
        for i in range(self.split, self.num_blocks):
            qkv = self.vit.blocks[i].attn.qkv
            out.append(AdaptTarget(f"vit.blocks.{i}.attn.qkv", qkv, {"q": (0, d), "v": (2 * d, 3 * d)}))
        return out

    def forward_prefix(self, x: torch.Tensor) -> torch.Tensor:
        v = self.vit
        x = v.patch_embed(x)
        x = v._pos_embed(x)
        x = v.patch_drop(x)
        x = v.norm_pre(x)
        for blk in v.blocks[: self.split]:
            x = blk(x)
        return x

    def forward_suffix(self, z: torch.Tensor) -> torch.Tensor:
        v = self.vit
        for blk in v.blocks[self.split :]:
            z = blk(z)
        z = v.norm(z)
        return v.forward_head(z, pre_logits=True)


def _make(name: str, tag: str):
    def factory(pretrained: bool = True, weights: str | None = None) -> Backbone:
        return TimmViTBackbone(tag, name, pretrained=pretrained, weights=weights)

    factory.__doc__ = f"timm {tag}"
    return factory


for _name, _tag in VIT_TAGS.items():
    BACKBONES.register(_name, help=f"timm {_tag}")(_make(_name, _tag))
