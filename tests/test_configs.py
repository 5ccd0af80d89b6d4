"""Packaged configs: every file resolves, and the benchmark presets carry the paper's hyper-parameters
(Appendix "Datasets, Hyperparameters, and Pre-Trained Models")."""

from __future__ import annotations

import pytest

from proteus.backbones import BACKBONES
from proteus.backbones.vit import VIT_TAGS
from proteus.config import RunConfig, learner_of, packaged_config, packaged_configs
from proteus.experiment import resolve_config
from proteus.streams import BENCHMARKS

CONFIGS = sorted(packaged_configs())

#: benchmark preset -> (benchmark, num_tasks, rank, lr, batch size), from the paper's appendix
PAPER = {
    "cifar100": ("cifar100", 10, 4, 1e-3, 32),
    "imagenet-r": ("imagenet-r", 10, 4, 1e-3, 32),
    "imagenet-a": ("imagenet-a", 10, 16, 5e-4, 16),
    "vtab5t": ("vtab5t", 5, 16, 5e-4, 16),
    "vtab5t-large": ("vtab5t", 5, 16, 1e-4, 24),
    "vtab-sim50": ("vtab-sim50", None, 4, 1e-4, 24),
    "cifar10": ("cifar10", 5, 4, 1e-3, 32),
    "cifar100-50": ("cifar100", 50, 4, 1e-3, 32),
    "imagenet-r-100": ("imagenet-r", 100, 4, 1e-3, 32),
    "cifar100-budget": ("cifar100", 20, 10, 1e-3, 32),
    "imagenet-r-budget": ("imagenet-r", 20, 10, 1e-3, 32),
}
#: the multi-domain streams on local data (issue 23) -> (rank, lr, batch size) of the paper's benchmark of
#: the same shape: VTAB5T for the abrupt ones, VTAB-Sim50 for the varying one
DOMAINS = {"domains5": (16, 5e-4, 16), "domains-sim": (4, 1e-4, 24), "domains-mixed": (16, 5e-4, 16)}
ADD_ON = {"mobilenet_cpu"}  # applied on top of a benchmark with --config
#: a baseline's official setting on a paper benchmark (--config NAME on top of --benchmark / --method):
#: name -> (method, benchmark, epochs, batch size, optimizer, lr), from the authors' released code
BASELINE = {
    "inflora-cifar100": ("inflora", "cifar100", 20, 128, "adam", 5e-4),
    "inflora-imagenet-r": ("inflora", "imagenet-r", 50, 128, "adam", 5e-4),
    "sd-lora-cifar100": ("sd-lora", "cifar100", 20, 128, "sgd", 8e-3),
    "sd-lora-imagenet-r": ("sd-lora", "imagenet-r", 20, 128, "sgd", 1e-2),
    "l2p-cifar100": ("l2p", "cifar100", 5, 16, "adam", 0.03 * 16 / 256),
    "dualprompt-cifar100": ("dualprompt", "cifar100", 5, 24, "adam", 0.03 * 24 / 256),
    "dualprompt-imagenet-r": ("dualprompt", "imagenet-r", 50, 24, "adam", 0.005 * 24 / 256),
    "coda-prompt-cifar100": ("coda-prompt", "cifar100", 20, 128, "adam", 1e-3),
    "coda-prompt-imagenet-r": ("coda-prompt", "imagenet-r", 50, 128, "adam", 1e-3),
    "s-prompt-cifar100": ("s-prompt", "cifar100", 20, 128, "sgd", 1e-2),
    "s-prompt-imagenet-r": ("s-prompt", "imagenet-r", 30, 128, "sgd", 1e-2),
    "adapromptcl-cifar100": ("adapromptcl", "cifar100", 50, 128, "adam", 0.025 * 128 / 256),
    "adapromptcl-imagenet-r": ("adapromptcl", "imagenet-r", 50, 128, "adam", 0.025 * 128 / 256),
    "hide-prompt-cifar100": ("hide-prompt", "cifar100", 50, 192, "adam", 0.03 * 24 / 256),
    "hide-prompt-imagenet-r": ("hide-prompt", "imagenet-r", 150, 192, "adam", 0.03 * 24 / 256),
    "tuna-cifar100": ("tuna", "cifar100", 15, 16, "sgd", 0.01),
    "tuna-imagenet-r": ("tuna", "imagenet-r", 10, 32, "sgd", 0.02),
    "mos-cifar100": ("mos", "cifar100", 20, 48, "sgd", 0.03),
    "mos-imagenet-r": ("mos", "imagenet-r", 10, 16, "sgd", 0.05),
    "tosca-cifar100": ("tosca", "cifar100", 20, 48, "sgd", 0.025),
    "tosca-imagenet-r": ("tosca", "imagenet-r", 20, 48, "sgd", 0.025),
    "moal-cifar100": ("moal", "cifar100", 80, 48, "sgd", 0.01),
    "moal-imagenet-r": ("moal", "imagenet-r", 80, 48, "sgd", 0.01),
    "moal-imagenet-a": ("moal", "imagenet-a", 80, 48, "sgd", 0.01),
}


def test_every_config_is_known() -> None:
    assert set(CONFIGS) == set(PAPER) | set(DOMAINS) | ADD_ON | set(BASELINE) | {"quickstart"}


@pytest.mark.parametrize("name", sorted(DOMAINS))
def test_domain_streams_take_the_settings_of_their_paper_shape(name: str) -> None:
    cfg = resolve_config(name)
    assert (cfg.adapter.rank, cfg.train.lr, cfg.train.batch_size) == (
        DOMAINS[name][0],
        pytest.approx(DOMAINS[name][1]),
        DOMAINS[name][2],
    )
    assert cfg.backbone.name == "vit_b16" and cfg.head.rp_dim == 10000 and cfg.train.augment is True


@pytest.mark.parametrize("name", sorted(BASELINE))
def test_baseline_configs_carry_the_released_settings(name: str) -> None:
    method, bench, epochs, bs, opt, lr = BASELINE[name]
    cfg = resolve_config(bench, method=method, config_files=[name])
    assert (cfg.method, cfg.benchmark.name, cfg.train.epochs, cfg.train.batch_size) == (
        method,
        bench,
        epochs,
        bs,
    )
    options = learner_of(cfg)(cfg).options_
    assert (options.optimizer, options.lr) == (opt, pytest.approx(lr))


@pytest.mark.parametrize("name", CONFIGS)
def test_every_packaged_config_resolves(name: str) -> None:
    if name in ADD_ON:
        cfg = resolve_config("quickstart", config_files=[name])
    elif name in BASELINE:
        cfg = resolve_config(BASELINE[name][1], method=BASELINE[name][0], config_files=[name])
    else:
        cfg = resolve_config(name)  # picked up by benchmark name (runner.packaged_config)
    assert cfg.benchmark.name in BENCHMARKS
    assert cfg.backbone.name in BACKBONES
    assert RunConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize("name", sorted(PAPER))
def test_paper_hyperparameters(name: str) -> None:
    bench, tasks, rank, lr, bs = PAPER[name]
    cfg = resolve_config(name)
    assert (cfg.benchmark.name, cfg.benchmark.num_tasks) == (bench, tasks)
    assert (cfg.adapter.rank, cfg.train.lr, cfg.train.batch_size) == (rank, pytest.approx(lr), bs)
    assert cfg.backbone.name == "vit_b16"
    assert VIT_TAGS["vit_b16"] == "vit_base_patch16_224.augreg2_in21k_ft_in1k"
    assert cfg.backbone.adapt_last is None and cfg.backbone.img_size is None  # q, v of every block, 224 px
    assert (cfg.adapter.lam, cfg.adapter.lam_decay, cfg.adapter.alpha) == (0.006, 0.8, 0.8)
    assert cfg.train.augment is True and cfg.head.rp_dim == 10000
    assert cfg.adapter.budget_decay is None  # the budget schedule belongs to --method proteus-budget
    assert resolve_config(name, method="proteus-budget").adapter.budget_decay == 0.05


def test_long_presets_equal_their_base_but_for_the_tasks() -> None:
    for preset, base in (("cifar100-50", "cifar100"), ("imagenet-r-100", "imagenet-r")):
        a, b = resolve_config(preset).to_dict(), resolve_config(base).to_dict()
        a["benchmark"].pop("num_tasks"), b["benchmark"].pop("num_tasks")
        a["signature"].pop("max_components"), b["signature"].pop("max_components")
        assert a == b


def test_signature_components_as_the_paper_states() -> None:
    """T = 20 (Appendix memory example), T = 100 on the 10-task ImageNet-R (the latency table's "T = 100,
    the largest T in all settings") and in the 100-task run, tau = 20 / 50 in the CIFAR-100 / ImageNet-R
    budget runs."""
    expected = {"cifar100": 20, "imagenet-r": 100, "imagenet-r-100": 100, "cifar100-budget": 20,
                "imagenet-r-budget": 50}  # fmt: skip
    for name, t in expected.items():
        assert resolve_config(name).signature.max_components == t, name


def test_mobilenet_cpu_on_top_of_a_vit_benchmark_config() -> None:
    cfg = resolve_config("cifar10", config_files=["mobilenet_cpu"])
    assert (cfg.backbone.name, cfg.backbone.img_size, cfg.backbone.adapt_last) == ("mobilenet_v2", 96, 6)
    assert cfg.train.augment is False and cfg.train.batch_size == 64  # the prefix cache stays on
    assert cfg.head.rp_dim == 2000 and cfg.signature.max_components == 10
    # the same as before cifar10.yaml existed: defaults + mobilenet_cpu
    plain = resolve_config(None, config_files=["mobilenet_cpu"])
    for section in ("backbone", "adapter", "train", "signature", "head", "retrieval"):
        assert getattr(cfg, section) == getattr(plain, section), section


def test_quickstart_config_is_unchanged() -> None:
    text = packaged_config("quickstart", "benchmarks").read_text()
    assert "backbone: {name: mobilenet_v2, img_size: 64, adapt_last: 6}" in text
    cfg = resolve_config("quickstart")
    assert (cfg.backbone.name, cfg.backbone.img_size, cfg.backbone.adapt_last) == ("mobilenet_v2", 64, 6)
    assert (cfg.train.epochs, cfg.train.batch_size, cfg.train.augment) == (3, 32, False)
    assert (cfg.signature.max_components, cfg.signature.max_iter, cfg.head.rp_dim) == (5, 50, 2000)


def test_report_section_defaults() -> None:
    r = RunConfig().report
    assert (r.figures, r.theory, r.latency, r.latency_batch) == (True, True, True, 32)
    assert resolve_config("quickstart", sets=["report.latency=false"]).report.latency is False


def test_a_stored_config_without_a_later_key_keeps_the_old_behaviour() -> None:
    """A knowledge base or run written before a key existed reads it as what that release did."""
    from proteus.config import sections
    from proteus.options import NO_LEGACY, options_of

    old = resolve_config("quickstart").to_dict()
    for section, cls in sections().items():
        for f, opt in options_of(cls):
            if opt.legacy is not NO_LEGACY:
                del old[section][f.name]
    cfg = RunConfig.from_stored(old)
    assert (cfg.signature.prior, cfg.signature.prior_scale) == ("ridge", "sklearn")
    assert cfg.head.prototypes == "sum" and cfg.head.forgettable is False
    # a key that is there is kept, and a config of today reads back unchanged
    now = resolve_config("quickstart")
    assert RunConfig.from_stored(now.to_dict()) == now
    assert now.signature.prior == "oas"
