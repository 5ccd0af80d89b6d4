"""Backbone interface: a frozen pre-trained feature extractor, split into a shared prefix and an
adapted suffix.

The paper adapts a frozen ViT-B/16 (Sec. 5.1). Every backbone here exposes what the adapters and the
learner need: the embedding dimension d, the feature function h(x) (prefix then suffix), the linear maps
that LoRA may wrap, and its data config (input size, normalisation, interpolation). Adapting only the
last L blocks lets the frozen prefix be computed once for all tasks (an option beyond the paper).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from proteus.errors import ConfigError
from proteus.registry import Registry


@dataclass
class DataConfig:
    input_size: int = 224
    mean: tuple[float, float, float] = (0.485, 0.456, 0.406)
    std: tuple[float, float, float] = (0.229, 0.224, 0.225)
    interpolation: str = "bilinear"
    crop_pct: float = 0.875

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class AdaptTarget:
    """A linear map that LoRA may wrap: a module (nn.Linear or 1x1 nn.Conv2d) and output-row slices.

    ``slices`` name parts of the output that are separate maps in the paper's sense, e.g. the q and v
    rows of timm's fused qkv projection: ``{"q": (0, d), "v": (2 * d, 3 * d)}``.
    """

    name: str
    module: nn.Module
    slices: dict[str, tuple[int, int]] = field(default_factory=dict)


def pooled_stats(h: torch.Tensor) -> torch.Tensor:
    """(N, 2C): each channel's mean and standard deviation over the positions of a feature map
    (N, C, H, W) or the tokens of a sequence (N, L, C), in float32 (the channel statistics of Lee et al.,
    "A Simple Unified Framework for Detecting Out-of-Distribution Samples", NeurIPS 2018, and of style
    statistics: they tell image sources apart by resolution, colour and texture)."""
    h = h.float()
    if h.dim() == 4:
        h = h.flatten(2)
    elif h.dim() == 3:
        h = h.transpose(1, 2)
    else:
        return h.flatten(1)
    return torch.cat([h.mean(2), h.std(2, correction=0)], 1)


def tap_indices(n: int) -> list[int]:
    """The taps among n prefix blocks: the last block of each third (n = 12: 3, 7, 11)."""
    return [i for i in sorted({-(-n * j // 3) - 1 for j in (1, 2, 3)}) if i >= 0]


def block_indices(spec: str, n: int | None, key: str = "adapter.blocks") -> tuple[int, ...]:
    """The blocks ``spec`` picks among ``n`` adaptable ones (0-based, counted from the first adaptable
    block): ``all``; ``first:K`` / ``last:K`` (K blocks, or ``P/Q`` of them rounded, at least one); or
    comma-separated indices. ``n`` None checks the spelling only. A bad spec raises a ConfigError naming
    ``key`` and the forms allowed."""
    forms = "all, first:K, last:K (K a count or a share P/Q) or block indices such as 0,1,5"
    text = str(spec).strip().replace(" ", "")
    try:
        if text == "all":
            return tuple(range(n or 0))
        if text.startswith(("first:", "last:")):
            side, _, amount = text.partition(":")
            num, slash, den = amount.partition("/")
            share = int(num) / int(den) if slash else None
            if (share is not None and not 0 < share <= 1) or (share is None and int(num) < 1):
                raise ValueError(amount)
            k = (max(1, round(n * share)) if share is not None else int(num)) if n is not None else 0
        else:
            side, idx = "", tuple(sorted({int(i) for i in text.split(",")}))
    except (ValueError, ZeroDivisionError):
        raise ConfigError(f"{key} must be {forms}; got {spec!r}") from None
    if side:
        if n is None:
            return ()
        if k > n:
            raise ConfigError(f"{key}={spec}: {k} blocks, but the backbone adapts {n}")
        return tuple(range(k)) if side == "first" else tuple(range(n - k, n))
    if not idx or idx[0] < 0 or (n is not None and idx[-1] >= n):
        raise ConfigError(f"{key}={spec}: block indices must lie in 0..{'n-1' if n is None else n - 1}")
    return idx


class Backbone(nn.Module):
    """A frozen backbone: ``forward_prefix`` (shared by all tasks) then ``forward_suffix`` (adapted)."""

    name: str = "backbone"
    embed_dim: int = 0
    weights_id: str = "random"
    weights_sha256: str | None = None

    def __init__(self) -> None:
        super().__init__()
        self.data_config = DataConfig()
        self.split = 0  # index of the first adapted block
        #: the blocks that carry adapters, counted from ``split`` (None: every block from ``split`` on)
        self.adapted: tuple[int, ...] | None = None

    # -- structure -----------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        raise NotImplementedError

    def set_adapt_last(self, last: int | None) -> None:
        """Adapt the last ``last`` blocks (None: all). Blocks before that form the frozen prefix."""
        n = self.num_blocks
        if last is None:
            self.split = 0
            return
        if not 1 <= last <= n:
            raise ConfigError(f"backbone.adapt_last must be in 1..{n} for {self.name}, got {last}")
        self.split = n - last

    def set_adapted_blocks(self, spec: str) -> None:
        """Carry adapters on the blocks ``spec`` picks among the adaptable ones (:func:`block_indices`,
        ``adapter.blocks``); "all" every one."""
        picked = block_indices(spec, self.num_blocks - self.split)
        self.adapted = None if len(picked) == self.num_blocks - self.split else picked

    def adapted_block_indices(self) -> list[int]:
        """The backbone's indices of the blocks whose maps :meth:`adapt_targets` returns."""
        if self.adapted is None:
            return list(range(self.split, self.num_blocks))
        return [self.split + i for i in self.adapted]

    def set_input_size(self, size: int) -> None:
        self.data_config.input_size = int(size)

    def adapt_targets(self) -> list[AdaptTarget]:
        """The linear maps of the adapted suffix that LoRA wraps."""
        raise NotImplementedError

    def prefix_blocks(self) -> list[nn.Module]:
        """The frozen prefix's blocks in order (their outputs are the detector's taps); [] when the
        backbone does not say, or nothing is frozen (``adapt_last`` null)."""
        return []

    def tap_blocks(self) -> list[nn.Module]:
        """The prefix blocks whose outputs the detector of inputs from no learned task reads
        (:mod:`proteus.engine.novelty`): the last block of each third of the frozen prefix (for
        MobileNetV2 with 6 adapted blocks, blocks 4, 8 and 12 of 18)."""
        blocks = self.prefix_blocks()
        return [blocks[i] for i in tap_indices(len(blocks))]

    # -- features ------------------------------------------------------------------------------
    def forward_prefix(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward_prefix_taps(self, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """:meth:`forward_prefix` and the :func:`pooled_stats` of each :meth:`tap_blocks` output, in order.
        This default reads them with forward hooks; a backbone whose prefix is a loop over its blocks
        computes them in the loop (one function, which ``torch.compile`` can compile)."""
        stats: list[torch.Tensor] = []
        hooks = [
            b.register_forward_hook(lambda _m, _i, out: stats.append(pooled_stats(out)))
            for b in self.tap_blocks()
        ]
        try:
            z = self.forward_prefix(x)
        finally:
            for h in hooks:
                h.remove()
        return z, stats

    def forward_suffix(self, z: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_suffix(self.forward_prefix(x))

    def freeze(self) -> Backbone:
        for p in self.parameters():
            p.requires_grad_(False)
        self.eval()
        return self

    def train(self, mode: bool = True) -> Backbone:  # noqa: D401 - a frozen backbone never leaves eval mode
        """Keep batch-norm statistics and dropout frozen: the backbone is always in eval mode."""
        return super().train(False)

    def identity(self) -> dict:
        """What a knowledge base records to refuse loading under another backbone."""
        return {
            "name": self.name,
            "weights_id": self.weights_id,
            "weights_sha256": self.weights_sha256,
            "embed_dim": self.embed_dim,
            "split": self.split,
            **({} if self.adapted is None else {"adapted": list(self.adapted)}),
            "data_config": self.data_config.to_dict(),
        }


#: the registered presets (the family modules register theirs when the registry is first listed or missed)
BACKBONES: Registry = Registry("backbone", plugins=("proteus.backbones.mobilenet", "proteus.backbones.vit"))

#: name prefix -> the factory of any model it names (``timm:<tag>``, ``hf-hub:<repo>``): timm's names beside
#: the registered presets, each resolved by the module that knows the family (:mod:`.vit`)
FAMILIES: dict[str, Callable[[str], Callable[..., Backbone]]] = {}


def backbone_factory(name: str) -> Callable[..., Backbone]:
    """The registered preset ``name``, or the factory of a family prefix (:data:`FAMILIES`)."""
    BACKBONES.discover()  # the family modules register their prefixes too
    for prefix, family in FAMILIES.items():
        if name.startswith(prefix) and len(name) > len(prefix):
            return family(name)
    try:
        return BACKBONES.get(name)
    except KeyError as e:
        families = ", ".join(f"{p}<name>" for p in FAMILIES)
        raise type(e)(f"{e.args[0]}; or a family name: {families}") from None


def has_tokens(name: str) -> bool:
    """Whether backbone ``name`` (a preset or a family's) gives tokens, as a ViT does (its factory's
    ``tokens`` trait): the prompt methods need them."""
    return bool(getattr(backbone_factory(name), "tokens", False))


def _load_error_summary(exc: BaseException) -> str:
    """A one-line digest of torch's ``load_state_dict`` error (counts, a few names), else its first line."""
    text = str(exc)
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    sizes = [ln for ln in lines if ln.startswith("size mismatch for ")]
    if sizes:
        names = [ln[len("size mismatch for ") :].split(":", 1)[0] for ln in sizes]
        shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
        return f"{len(sizes)} shape mismatch(es) (e.g. {shown}); {sizes[0]}"
    return lines[0] if lines else type(exc).__name__


def _call_factory(
    factory: Callable[..., Backbone], name: str, pretrained: bool, weights: str | None
) -> Backbone:
    """``factory(pretrained=..., weights=...)``; weight failures become a WeightsError naming ``name``."""
    from proteus.backbones.weights import WeightsError

    try:
        return factory(pretrained=pretrained, weights=weights)
    except WeightsError as exc:
        if name in str(exc):
            raise
        raise type(exc)(f"backbone {name}: {exc}") from exc
    except (RuntimeError, ValueError) as exc:
        # a family that loads a --weights file itself reports a misfit as torch's RuntimeError (shapes)
        # or its own ValueError (missing keys); either way the file does not fit this backbone
        if weights is None:
            raise
        detail = _load_error_summary(exc).removeprefix(f"{weights}: ")
        raise WeightsError(
            f"weights file {weights} does not fit backbone {name}: {detail}. Pass a "
            "checkpoint of this architecture, or pick the backbone the file belongs to (--backbone; "
            "`proteus list backbones`)"
        ) from exc


def build_backbone(
    name: str,
    *,
    pretrained: bool = True,
    weights: str | None = None,
    img_size: int | None = None,
    adapt_last: int | None = None,
    adapt_blocks: str = "all",
) -> Backbone:
    """Build a registered backbone, frozen, with its data config resolved.

    A weights problem (``weights`` file missing, unreadable or not fitting; preset weights neither cached
    nor downloadable) raises :class:`~proteus.backbones.weights.WeightsError` (a ``ValueError``) whose
    message names the backbone and, for a file, the file.
    """
    factory = backbone_factory(name)
    if pretrained or weights is not None:
        bb: Backbone = _call_factory(factory, name, pretrained, weights)
    else:  # random weights (timing, tests): seeded, so that every process builds the same network
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            bb = factory(pretrained=False, weights=None)
        bb.weights_id = "random:seed0"
    if img_size is not None:
        bb.set_input_size(int(img_size))
    bb.set_adapt_last(adapt_last)
    bb.set_adapted_blocks(adapt_blocks)
    return bb.freeze()
