"""timm Vision Transformers as PROTEUS backbones (the paper's ViT-B/16, Sec. 5.1).

The adapted maps are the query and value projections of every attention block (the q and v rows of
timm's fused ``qkv`` linear). Embedding: timm's pre-logits feature (the class token after the final norm).
Pretrained tags are data: the paper's backbone is ViT-B/16 pre-trained on ImageNet-21k and fine-tuned on
ImageNet-1k; timm >= 0.9 maps the bare ``vit_base_patch16_224`` to ``augreg2_in21k_ft_in1k``, older
versions to ``augreg_in21k_ft_in1k``, so configs always name the full tag.

Weights, in order: a local ``--weights FILE`` (checked tensor by tensor against the architecture); else,
for a pretrained preset, the file in the Hugging Face hub cache (loaded without any network access);
else, when the hub answers within a couple of seconds, timm's own download; else a
:class:`~proteus.backbones.weights.WeightsError` that names the backbone, the expected cache path and
repo, ``--weights FILE`` and the MobileNetV2 alternative (instead of a minute of hub retries).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import torch

from proteus.backbones.base import (
    BACKBONES,
    FAMILIES,
    AdaptTarget,
    Backbone,
    DataConfig,
    pooled_stats,
    tap_indices,
)

#: registry name -> exact timm model tag
VIT_TAGS: dict[str, str] = {
    "vit_b16": "vit_base_patch16_224.augreg2_in21k_ft_in1k",
    "vit_b16_in21k_ft_in1k_augreg": "vit_base_patch16_224.augreg_in21k_ft_in1k",
    "vit_s16": "vit_small_patch16_224.augreg_in21k_ft_in1k",
    "vit_ti16": "vit_tiny_patch16_224.augreg_in21k_ft_in1k",
}


#: files timm tries, in order, in a hub repo that names none (``load_state_dict_from_hf``)
_HUB_FILES: tuple[str, ...] = ("model.safetensors", "pytorch_model.bin")


class TimmViTBackbone(Backbone):
    def __init__(self, tag: str, name: str, pretrained: bool = True, weights: str | None = None) -> None:
        super().__init__()
        import timm

        self.name = name
        self.tag = tag
        #: the timm model: any ViT with fused qkv attention (duck-typed: not always a VisionTransformer)
        self.vit: Any = _create(tag, name)
        if weights is not None:
            from proteus.backbones.weights import sha256_file

            self._load_file(weights)
            self.weights_id = f"file:{weights}"
            self.weights_sha256 = sha256_file(weights)
        elif pretrained:
            self._load_pretrained()
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

    # -- weights -------------------------------------------------------------------------------
    def _load_file(self, path: str | Path) -> None:
        """Load a local state dict (timm's checkpoint filter, then an exact key and shape check)."""
        from timm.models.vision_transformer import checkpoint_filter_fn

        from proteus.backbones.checkpoints import load_checked, load_state_dict_file
        from proteus.backbones.weights import WeightsError

        where = f"{self.name} (timm {self.tag})"
        state = load_state_dict_file(path, backbone=f"{self.name}, timm {self.tag}")
        try:
            state = checkpoint_filter_fn(state, self.vit)
        except Exception as exc:  # timm reshapes/resamples: any failure means the file is not such a ViT
            raise WeightsError(
                f"weights file {path} does not fit backbone {where}: timm cannot adapt it "
                f"({type(exc).__name__}: {exc}); pass a checkpoint of {self.tag}"
            ) from exc
        # the classifier of an ImageNet checkpoint is unused: the backbone has no head (num_classes=0)
        load_checked(self.vit, state, path=path, backbone=where, ignore_unexpected=("head.",))

    def _load_pretrained(self) -> None:
        """The preset's published weights: from the local caches, else downloaded when the host answers."""
        from proteus.backbones.hub import (
            find_cached_hub_file,
            hf_endpoint,
            hub_unreachable_reason,
            hub_weights_missing_message,
        )
        from proteus.backbones.weights import WeightsError, hub_checkpoint_dir

        cfg = dict(getattr(self.vit, "pretrained_cfg", None) or {})
        hub_id = cfg.get("hf_hub_id")
        url = cfg.get("url")
        model = f"timm {self.tag}"
        if hub_id:
            repo, _, revision = str(hub_id).partition("@")
            files = (cfg["hf_hub_filename"],) if cfg.get("hf_hub_filename") else _HUB_FILES
            cached = find_cached_hub_file(repo, files, revision or None)
            if cached is not None:
                self._load_file(cached)
                return
            reason = hub_unreachable_reason(hf_endpoint())
            if reason is not None:
                raise WeightsError(
                    hub_weights_missing_message(self.name, model, repo, files, reason, revision or None)
                )
        elif url:
            cached = hub_checkpoint_dir() / os.path.basename(urlsplit(str(url)).path)
            if cached.is_file():
                self._load_file(cached)
                return
            reason = hub_unreachable_reason(str(url))
            if reason is not None:
                raise WeightsError(
                    f"backbone {self.name}: the pre-trained weights of {model} are not in {cached} and "
                    f"cannot be downloaded from {url}: {reason}. Download that url elsewhere and place "
                    "the file there, pass --weights FILE, or use --config mobilenet_cpu (MobileNetV2, "
                    "whose weights `proteus weights fetch mobilenet_v2` obtains offline)"
                )
        else:
            raise WeightsError(
                f"backbone {self.name}: timm publishes no pre-trained weights for {self.tag}; pass "
                "--weights FILE or set backbone.pretrained to false"
            )
        self._download_with_timm()

    def _download_with_timm(self) -> None:
        """timm's own download (the host answered); failures become a WeightsError naming the backbone."""
        import timm

        from proteus.backbones.weights import WeightsError

        try:
            net = timm.create_model(self.tag, pretrained=True, num_classes=0)
        except Exception as exc:  # hub/http/timeouts/corrupt downloads: too many types to list
            raise WeightsError(
                f"backbone {self.name}: downloading the pre-trained weights of timm {self.tag} failed "
                f"({type(exc).__name__}: {exc}). Retry, pass --weights FILE, or use --config mobilenet_cpu "
                "(MobileNetV2, whose weights `proteus weights fetch mobilenet_v2` obtains offline)"
            ) from exc
        self.vit.load_state_dict(net.state_dict(), strict=True)

    @property
    def num_blocks(self) -> int:
        return len(self.vit.blocks)

    def set_input_size(self, size: int) -> None:
        super().set_input_size(size)
        if tuple(self.vit.patch_embed.img_size) != (size, size):
            self.vit.set_input_size(img_size=(size, size))  # resamples the position embedding

    #: which rows of the fused qkv projection LoRA adapts (PROTEUS, SD-LoRA: q and v; InfLoRA: k and v)
    attention_rows: tuple[str, ...] = ("q", "v")

    def adapt_targets(self) -> list[AdaptTarget]:
        d = self.embed_dim
        offset = {"q": 0, "k": d, "v": 2 * d}
        rows = {r: (offset[r], offset[r] + d) for r in self.attention_rows}
        out = []
        for i in self.adapted_block_indices():
            qkv = self.vit.blocks[i].attn.qkv
            out.append(AdaptTarget(f"vit.blocks.{i}.attn.qkv", qkv, dict(rows)))
        return out

    def prefix_blocks(self) -> list[torch.nn.Module]:
        return list(self.vit.blocks[: self.split])

    def forward_prefix(self, x: torch.Tensor) -> torch.Tensor:
        v = self.vit
        x = v.patch_embed(x)
        x = v._pos_embed(x)
        x = v.patch_drop(x)
        x = v.norm_pre(x)
        for blk in v.blocks[: self.split]:
            x = blk(x)
        return x

    def forward_prefix_taps(self, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        v, taps, stats = self.vit, set(tap_indices(self.split)), []
        x = v.norm_pre(v.patch_drop(v._pos_embed(v.patch_embed(x))))
        for i, blk in enumerate(v.blocks[: self.split]):
            x = blk(x)
            if i in taps:
                stats.append(pooled_stats(x))
        return x, stats

    def forward_suffix(self, z: torch.Tensor) -> torch.Tensor:
        v = self.vit
        for blk in v.blocks[self.split :]:
            z = blk(z)
        z = v.norm(z)
        return v.forward_head(z, pre_logits=True)


def _create(tag: str, name: str) -> Any:
    """timm's model ``tag`` without weights; a ViT with fused qkv attention, or a ConfigError/WeightsError
    naming the backbone (``hf-hub:`` names need the hub for their config). Typed ``Any``: the model is
    duck-typed (timm's ViTs are not one class)."""
    import timm

    from proteus.backbones.weights import WeightsError
    from proteus.errors import ConfigError

    if tag.startswith(
        "hf-hub:"
    ):  # its config comes from the hub: fail at once when neither cached nor reachable
        from proteus.backbones.hub import find_cached_hub_file, hf_endpoint, hub_unreachable_reason

        repo = tag[len("hf-hub:") :].partition("@")[0]
        reason = (
            None if find_cached_hub_file(repo, ("config.json",)) else hub_unreachable_reason(hf_endpoint())
        )
        if reason is not None:
            raise WeightsError(
                f"backbone {name}: the hub's config.json of {repo} is not cached and the hub cannot be "
                f"reached ({reason}); use a preset (proteus list backbones) or timm:<tag> with --weights FILE"
            )
    try:
        net = timm.create_model(tag, pretrained=False, num_classes=0)
    except RuntimeError as e:  # timm: "Unknown model"
        raise ConfigError(f"backbone {name}: timm has no model {tag!r} ({e})") from None
    except Exception as e:  # the hub's config of an hf-hub: name, offline or missing
        raise WeightsError(
            f"backbone {name}: cannot get timm's config of {tag} ({type(e).__name__}: {e})"
        ) from None
    blocks = getattr(net, "blocks", None)
    if not blocks or not hasattr(getattr(blocks[0], "attn", None), "qkv"):
        raise ConfigError(f"backbone {name}: timm model {tag} is not a ViT with fused qkv attention")
    return net


class _Timm:
    """The factory of timm ViT ``tag`` under the name ``name``."""

    #: a ViT's blocks give tokens (:func:`~proteus.backbones.base.has_tokens`)
    tokens = True

    def __init__(self, name: str, tag: str) -> None:
        self.name, self.tag = name, tag
        self.__doc__ = f"timm {tag}"

    def __call__(self, pretrained: bool = True, weights: str | None = None) -> Backbone:
        return TimmViTBackbone(self.tag, self.name, pretrained=pretrained, weights=weights)


for _name, _tag in VIT_TAGS.items():
    BACKBONES.register(_name, help=f"timm {_tag}")(_Timm(_name, _tag))

#: any timm ViT by name beside the presets: ``timm:<tag>`` (e.g. ``timm:vit_small_patch16_224.augreg_in1k``),
#: ``hf-hub:<repo>`` (e.g. ``hf-hub:timm/vit_base_patch16_224.augreg2_in21k_ft_in1k``, timm's own syntax)
FAMILIES["timm:"] = lambda name: _Timm(name, name[len("timm:") :])
FAMILIES["hf-hub:"] = lambda name: _Timm(name, name)
