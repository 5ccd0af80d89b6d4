"""Multi-domain task streams (issue 23): ``domains5`` (uniformly abrupt, VTAB5T's shape), ``domains-sim``
(varying, VTAB-Sim50's shape, the same partition code) and ``domains-mixed`` (mild and abrupt steps), on
generated domain folders of different image sizes and channels, and on ``../shared/data`` when present."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

from proteus.backbones import build_backbone
from proteus.backbones.transforms import build_transform
from proteus.config import BenchmarkConfig, ConfigError, resolve_config
from proteus.streams import DataNotFoundError, TaskSpecError, build_benchmark
from proteus.streams.domains import mixed_order

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
DOMAINS = ("cifar10-subset", "dtd", "fashion-mnist", "imagenette")
needs_shared = pytest.mark.skipif(
    not all((SHARED_DATA / d).is_dir() for d in DOMAINS),
    reason=f"the four image domains are not all under {SHARED_DATA} (../shared is absent)",
)


def _domain(
    root: Path, name: str, classes: int, size: int, mode: str, n_train: int = 3, n_test: int = 2
) -> None:
    rng = np.random.default_rng(len(name))
    for split, n in (("train", n_train), ("test", n_test)):
        for c in range(classes):
            d = root / name / split / f"k{c}"
            d.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                arr = rng.integers(0, 255, (size, size) if mode == "L" else (size, size, 3), dtype=np.uint8)
                Image.fromarray(arr, mode).save(d / f"{i}.png")


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """Three folder domains (28 px grayscale, 16 px colour, 40 px colour) beside the built-in digits."""
    _domain(tmp_path, "gray", 4, 28, "L")
    _domain(tmp_path, "small", 2, 16, "RGB", n_train=5)
    _domain(tmp_path, "big", 3, 40, "RGB")
    (tmp_path / "not-a-domain").mkdir()  # no train/ and test/: ignored
    return tmp_path


def _stream(name: str, root: Path, **kw: object):  # type: ignore[no-untyped-def]
    return build_benchmark(BenchmarkConfig(name=name, data=str(root), **kw))  # type: ignore[arg-type]


def test_domains5_one_task_per_domain_with_every_class(root: Path) -> None:
    s = _stream("domains5", root)
    doms = s.manifest["task_domains"]
    assert sorted(doms) == ["big", "digits", "gray", "small"]
    sizes = {"gray": 4, "small": 2, "big": 3, "digits": 10}
    for t, d in zip(s.tasks, doms):
        assert len(t.classes) == sizes[d] and all(n.startswith(d + "/") for n in t.class_names)
        assert set(t.train.targets) == set(t.classes) == set(t.test.targets)  # type: ignore[attr-defined]
    assert sorted(c for t in s.tasks for c in t.classes) == list(range(19))
    again = _stream("domains5", root)
    assert again.manifest == s.manifest  # seeded: the same order and split
    other = _stream("domains5", root, class_order_seed=7)
    assert other.manifest["class_order"] != s.manifest["class_order"]
    assert len(_stream("domains5", root, num_tasks=2).tasks) == 2


def test_images_of_every_size_and_channel_count_reach_the_backbone_alike(root: Path) -> None:
    s = _stream("domains5", root)
    tf = build_transform(
        build_backbone("mobilenet_v2", pretrained=False, img_size=32).data_config, train=False
    )
    shapes = {tuple(tf(t.train[0][0]).shape) for t in s.tasks}
    assert shapes == {(3, 32, 32)}


def test_domains_sim_is_the_vtab_sim50_partition(root: Path) -> None:
    """The vtab-sim50 rules apply as they are: a domain of fewer than 3 classes is left out (``small``)."""
    with pytest.warns(UserWarning, match="fewer than 3 classes: small"):
        s = _stream("domains-sim", root)
    comp = s.manifest["sim50"]["composition"]
    sizes = {"gray": 4, "big": 3, "digits": 10}
    assert len(s.tasks) == len(comp) == 3 and {r["source"] for r in comp} == set(sizes)
    for t, rec in zip(s.tasks, comp):
        own = [c for c in t.class_names if c.startswith(rec["source"] + "/")]
        assert own == rec["kept"] and len(own) == -(-sizes[rec["source"]] // 2)
        assert all(not c.startswith(rec["source"] + "/") for _, c in rec["borrowed"])
    names = [c for t in s.tasks for c in t.class_names]
    assert len(names) == len(set(names))


def test_domains_mixed_alternates_mild_and_abrupt_steps(root: Path) -> None:
    assert mixed_order(5) == [(0, 0), (0, 1), (1, 0), (2, 0), (1, 1), (2, 1), (3, 0), (3, 1), (4, 0), (4, 1)]
    s = _stream("domains-mixed", root)
    doms = [d.split(":")[0] for d in s.manifest["task_domains"]]
    assert len(s.tasks) == 8 and doms[0] == doms[1] and doms[2] != doms[3] and doms[2] == doms[4]
    assert s.manifest["steps"] == ["mild", "abrupt", "abrupt", "abrupt", "abrupt", "abrupt", "mild"]
    per_domain: dict[str, list[str]] = {}
    for d, t in zip(doms, s.tasks):
        per_domain.setdefault(d, []).extend(t.class_names)
    assert all(len(v) == len(set(v)) for v in per_domain.values())


def test_groups_file_picks_and_orders_domains(root: Path, tmp_path: Path) -> None:
    f = tmp_path / "groups.yaml"
    f.write_text(yaml.safe_dump({"domains": ["small", "digits"]}))
    s = _stream("domains5", root, tasks_file=str(f))
    assert s.manifest["task_domains"] == ["small", "digits"]
    f.write_text(yaml.safe_dump({"domains": ["small", "nope"]}))
    with pytest.raises(TaskSpecError, match="nope not found under .*available: big, digits, gray, small"):
        _stream("domains5", root, tasks_file=str(f))
    f.write_text(yaml.safe_dump({"domains": ["small"], "extra": 1}))
    with pytest.raises(TaskSpecError, match="unknown key"):
        _stream("domains5", root, tasks_file=str(f))


def test_missing_or_too_few_domains_say_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(DataNotFoundError, match="no data root .* --data"):
        _stream("domains5", tmp_path / "absent")
    _domain(tmp_path / "one", "gray", 2, 8, "L")
    s = _stream("domains5", tmp_path / "one")  # one folder + the built-in digits: two domains
    assert sorted(s.manifest["task_domains"]) == ["digits", "gray"]
    f = tmp_path / "g.yaml"
    f.write_text(yaml.safe_dump({"domains": ["gray"]}))
    with pytest.raises(DataNotFoundError, match="needs at least two"):
        _stream("domains5", tmp_path / "one", tasks_file=str(f))
    with pytest.raises(TaskSpecError, match="num_tasks=3"):
        _stream("domains-mixed", tmp_path / "one", num_tasks=3)


def test_cpu_config_caps_the_domain_streams_only() -> None:
    for name in ("domains5", "domains-sim", "domains-mixed"):
        cfg = resolve_config(name, config_files=["mobilenet_cpu"])
        assert cfg.benchmark.max_train_per_class == 150 and cfg.backbone.name == "mobilenet_v2"
        assert resolve_config(name).benchmark.max_train_per_class is None  # the GPU default: full size
        assert resolve_config(name).backbone.name == "vit_b16"
    assert resolve_config("cifar10", config_files=["mobilenet_cpu"]).benchmark.max_train_per_class is None


def test_per_benchmark_section_must_map_names_to_sections(tmp_path: Path) -> None:
    f = tmp_path / "bad.yaml"
    f.write_text(yaml.safe_dump({"benchmarks": {"domains5": 3}}))
    with pytest.raises(ConfigError, match="'benchmarks' must map benchmark names"):
        resolve_config("domains5", config_files=[str(f)])


@pytest.mark.shared
@needs_shared
def test_the_five_real_domains() -> None:
    cfg = resolve_config("domains5", config_files=["mobilenet_cpu"], sets=[f"benchmark.data={SHARED_DATA}"])
    s = build_benchmark(cfg.benchmark)
    assert sorted(s.manifest["task_domains"]) == sorted([*DOMAINS, "digits"])
    assert s.manifest["max_train_per_class"] == 150 and s.num_classes == 46
    assert all(max(np.bincount(np.asarray(t.train.targets))) <= 150 for t in s.tasks)  # type: ignore[attr-defined]
    tf = build_transform(
        build_backbone("mobilenet_v2", pretrained=False, img_size=32).data_config, train=False
    )
    x = torch.stack([tf(t.test[0][0]) for t in s.tasks])
    assert x.shape == (5, 3, 32, 32) and torch.isfinite(x).all()
    mixed = build_benchmark(resolve_config("domains-mixed", sets=[f"benchmark.data={SHARED_DATA}"]).benchmark)
    assert len(mixed.tasks) == 10 and mixed.manifest["max_train_per_class"] is None


@needs_shared
def test_the_orthogonal_room_table_gives_each_presets_own_stream_length() -> None:
    """docs/performance.md's orthogonal-room table: its "stream" column is the length of the preset's stream
    as built (``tools/studies/orthogonal_room.py``: ``num_tasks``, the benchmark's default, or the tasks the
    data gives), and "fits" follows from it."""
    import re
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools" / "studies"))
    from orthogonal_room import stream_length

    page = (Path(__file__).resolve().parents[1] / "docs" / "performance.md").read_text()
    row = r"^\| ([\w-]+)( \+ mobilenet_cpu)? \| \w+ \| \d+ \(\w+\) \| [\d-]+ \| (\d+) \| (\d+) \| "
    row += r"([\d?]+) \| (\w+|\?) \|"
    rows = re.findall(row, page, re.M)
    assert len(rows) >= 20, "the orthogonal-room table was not found"
    for preset, cpu, full, room, stream, fits in rows:
        cfg = resolve_config(preset, config_files=["mobilenet_cpu"] if cpu else [])
        n = stream_length(cfg.benchmark, SHARED_DATA)
        assert stream == str(n or "?"), (preset, cpu, stream, n)
        want = "?" if n is None else "yes" if n <= int(full) else ("partly" if n <= int(room) else "no")
        assert fits == want, (preset, cpu, fits, want)
