"""timm's names beside the presets (issue 26): ``timm:<tag>`` builds any timm ViT, ``hf-hub:<repo>`` fails
at once and by name when the hub is neither cached nor reachable, and other models are refused by name."""

from __future__ import annotations

import pytest

from proteus.backbones import build_backbone
from proteus.backbones.weights import WeightsError
from proteus.cli import main
from proteus.config import ConfigError


def test_a_timm_name_builds_a_vit() -> None:
    b = build_backbone("timm:vit_tiny_patch16_224", pretrained=False, img_size=32, adapt_last=2)
    assert b.embed_dim == 192 and len(b.adapt_targets()) == 2


def test_a_model_that_is_not_a_vit_or_not_timms_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="timm:resnet18: timm model resnet18 is not a ViT"):
        build_backbone("timm:resnet18", pretrained=False)
    with pytest.raises(ConfigError, match="timm has no model 'no_such_model'"):
        build_backbone("timm:no_such_model", pretrained=False)


def test_an_hf_hub_name_offline_fails_at_once(monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(WeightsError, match="config.json of timm/some_vit is not cached"):
        build_backbone("hf-hub:timm/some_vit", pretrained=False)


def test_list_backbones_shows_the_families(capsys) -> None:
    assert main(["list", "backbones"]) == 0
    out = capsys.readouterr().out
    assert "timm:<name>" in out and "hf-hub:<name>" in out
