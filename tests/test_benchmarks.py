"""Benchmarks and task streams (paper Sec. 5.1, Appendix "Datasets, Hyperparameters")."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image

from proteus.config import BenchmarkConfig
from proteus.streams import (
    BENCHMARKS,
    ArrayImageDataset,
    BenchmarkError,
    CorruptImageError,
    DataNotFoundError,
    SubsetByLabels,
    TaskSpecError,
    TaskStream,
    TransformedDataset,
    build_abrupt_sequence,
    build_benchmark,
    load_image,
)
from proteus.streams.vtab import sim50_partition

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
CIFAR_SUBSET = SHARED / "data" / "cifar10-subset"
needs_shared = pytest.mark.skipif(
    not CIFAR_SUBSET.is_dir(), reason=f"shared data not found at {CIFAR_SUBSET} (../shared is absent)"
)

ALL_NAMES = {
    "quickstart",
    "cifar10",
    "cifar100",
    "imagenet-r",
    "imagenet-a",
    "vtab5t",
    "vtab-sim50",
    "folder",
    "domains5",
    "domains-sim",
    "domains-mixed",
}


# ---------------------------------------------------------------------------------------------- helpers
def _png(path: Path, value: int, mode: str = "RGB") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    arr = np.full((8, 8, 3), value % 256, dtype=np.uint8)
    img = Image.fromarray(arr)
    if mode != "RGB":
        img = img.convert(mode)
    img.save(path)


def make_tree(root: Path, train: dict[str, int], test: dict[str, int], mode: str = "RGB") -> Path:
    """``root/{train,test}/<class>/<i>.png`` with the given number of 8x8 images per class."""
    for split, counts in (("train", train), ("test", test)):
        for ci, (cls, n) in enumerate(counts.items()):
            (root / split / cls).mkdir(parents=True, exist_ok=True)
            for i in range(n):
                _png(root / split / cls / f"{i:03d}.png", 20 * ci + i, mode)
    return root


def write_tasks(path: Path, tasks: object, **extra: object) -> Path:
    path.write_text(yaml.safe_dump({"tasks": tasks, **extra}))
    return path


def labels_of(ds: object) -> set[int]:
    return {int(y) for _, y in ds}  # type: ignore[attr-defined]


def check_stream(stream: TaskStream, num_tasks: int, per_task: int) -> None:
    assert len(stream.tasks) == num_tasks
    seen: set[int] = set()
    for i, t in enumerate(stream.tasks):
        assert t.index == i
        assert len(t.classes) == per_task
        assert not seen & set(t.classes)
        seen |= set(t.classes)
        assert t.class_names == [stream.class_names[c] for c in t.classes]
        assert set(t.train.targets) == set(t.classes)  # type: ignore[attr-defined]
        assert set(t.test.targets) == set(t.classes)  # type: ignore[attr-defined]
    assert seen == set(range(stream.num_classes))
    json.dumps(stream.manifest)


# ---------------------------------------------------------------------------------------------- registry
def test_registry_lists_all_names() -> None:
    assert set(BENCHMARKS.names()) == ALL_NAMES
    assert all(BENCHMARKS.describe()[n] for n in ALL_NAMES)


def test_unknown_name_lists_choices() -> None:
    with pytest.raises(KeyError) as e:
        build_benchmark(BenchmarkConfig(name="no-such-benchmark"))
    for n in ALL_NAMES:
        assert n in str(e.value)


# ---------------------------------------------------------------------------------------------- quickstart
def test_quickstart_stream() -> None:
    s = build_benchmark(BenchmarkConfig())
    check_stream(s, 5, 2)
    # labels remapped: global label = position in the seeded order of the original digits
    order = np.random.RandomState(1993).permutation(10).tolist()
    assert s.class_names == [f"digit_{d}" for d in order]
    assert s.manifest["class_order"] == s.class_names
    assert s.manifest["tasks"] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]
    assert s.manifest["splits"]["train"]["count"] + s.manifest["splits"]["test"]["count"] == 1797
    assert s.manifest["split"]["split_seed"] == 0
    img, y = s.tasks[0].train[0]
    assert isinstance(img, Image.Image) and img.mode == "RGB" and img.size == (8, 8)
    assert y in s.tasks[0].classes
    assert max(np.asarray(img).max() for img, _ in (s.tasks[0].train[i] for i in range(20))) > 200
    assert s.task_of_label()[s.tasks[3].classes[1]] == 3


def test_quickstart_manifest_stable_and_seeded(tmp_path: Path) -> None:
    a = build_benchmark(BenchmarkConfig())
    b = build_benchmark(BenchmarkConfig())
    assert a.manifest == b.manifest
    c = build_benchmark(BenchmarkConfig(class_order_seed=7))
    assert c.manifest["splits"]["train"]["sha256"] != a.manifest["splits"]["train"]["sha256"]
    assert c.manifest["splits"]["train"]["count"] == a.manifest["splits"]["train"]["count"]
    a.write_manifest(tmp_path / "sub" / "manifest.json")
    assert json.loads((tmp_path / "sub" / "manifest.json").read_text()) == a.manifest


def test_quickstart_num_tasks_must_divide() -> None:
    assert len(build_benchmark(BenchmarkConfig(num_tasks=10)).tasks) == 10
    with pytest.raises(TaskSpecError, match=r"num_tasks=3.*\[1, 2, 5, 10\]"):
        build_benchmark(BenchmarkConfig(num_tasks=3))


def test_max_train_per_class() -> None:
    s = build_benchmark(BenchmarkConfig(max_train_per_class=10))
    assert s.manifest["max_train_per_class"] == 10
    assert s.manifest["splits"]["train"]["per_class"] == [10] * 10
    assert s.manifest["splits"]["test"]["count"] == 540  # test sets are never capped
    assert len(s.tasks[0].train) == 20
    s2 = build_benchmark(BenchmarkConfig(max_train_per_class=10))
    assert s2.manifest["splits"]["train"]["sha256"] == s.manifest["splits"]["train"]["sha256"]


# ---------------------------------------------------------------------------------------------- CIFAR
@pytest.mark.shared
@needs_shared
def test_cifar10_on_shared_subset() -> None:
    cfg = BenchmarkConfig(name="cifar10", data=str(CIFAR_SUBSET), max_train_per_class=20)
    s = build_benchmark(cfg)
    check_stream(s, 5, 2)
    classes = sorted(p.name for p in (CIFAR_SUBSET / "train").iterdir() if p.is_dir())
    order = np.random.RandomState(1993).permutation(10).tolist()
    assert s.class_names == [classes[i] for i in order]
    assert s.manifest["format"] == "imagefolder"
    assert s.manifest["splits"]["train"]["count"] == 200
    assert s.manifest["splits"]["test"]["count"] == 2000
    img, y = s.tasks[2].test[0]
    assert img.mode == "RGB" and img.size == (32, 32) and y in s.tasks[2].classes
    assert s.tasks[0].train.keys[0].startswith("train/")  # type: ignore[attr-defined]


def test_cifar_missing_data_error(tmp_path: Path) -> None:
    with pytest.raises(DataNotFoundError) as e:
        build_benchmark(BenchmarkConfig(name="cifar100", data=str(tmp_path)))
    msg = str(e.value)
    assert "cifar-100-python" in msg and "train/<class>" in msg and "benchmark.download=true" in msg
    assert str(tmp_path) in msg


def test_cifar_torchvision_format(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torchvision

    (tmp_path / "cifar-10-batches-py").mkdir()
    with pytest.raises(DataNotFoundError, match="incomplete or corrupted"):
        build_benchmark(BenchmarkConfig(name="cifar10", data=str(tmp_path)))

    class FakeCIFAR10:  # torchvision's attributes: data (N, 32, 32, 3) uint8, targets, classes
        def __init__(self, root: str, train: bool = True, download: bool = False) -> None:
            n = 20 if train else 10
            self.data = np.random.RandomState(int(train)).randint(0, 255, (n, 32, 32, 3)).astype(np.uint8)
            self.targets = [i % 10 for i in range(n)]
            self.classes = [f"k{i}" for i in range(10)]

    monkeypatch.setattr(torchvision.datasets, "CIFAR10", FakeCIFAR10)
    s = build_benchmark(BenchmarkConfig(name="cifar10", data=str(tmp_path / "cifar-10-batches-py")))
    check_stream(s, 5, 2)
    assert s.manifest["format"] == "torchvision" and s.manifest["root"] == str(tmp_path.resolve())
    assert s.manifest["splits"]["train"]["count"] == 20
    img, y = s.tasks[0].train[0]
    assert img.mode == "RGB" and img.size == (32, 32) and y in s.tasks[0].classes


def test_cifar_imagefolder_wrong_class_count(tmp_path: Path) -> None:
    make_tree(tmp_path, {"a": 1, "b": 1}, {"a": 1, "b": 1})
    with pytest.raises(BenchmarkError, match="expected 10 classes"):
        build_benchmark(BenchmarkConfig(name="cifar10", data=str(tmp_path)))


def test_imagenet_missing_and_imagefolder(tmp_path: Path) -> None:
    with pytest.raises(DataNotFoundError, match="RevisitingCIL"):
        build_benchmark(BenchmarkConfig(name="imagenet-r", data=str(tmp_path / "nothing")))
    classes = {f"n{i:02d}": 1 for i in range(4)}
    make_tree(tmp_path / "imagenet-a", classes, classes)
    with pytest.warns(UserWarning, match="expected 200 classes"):
        s = build_benchmark(BenchmarkConfig(name="imagenet-a", data=str(tmp_path), num_tasks=2))
    check_stream(s, 2, 2)
    missing_test = {f"n{i:02d}": 1 for i in range(3)}
    make_tree(tmp_path / "x", classes, missing_test)
    with pytest.raises(BenchmarkError, match="n03"):
        build_benchmark(BenchmarkConfig(name="imagenet-r", data=str(tmp_path / "x"), num_tasks=2))


# ---------------------------------------------------------------------------------------------- folder
@pytest.fixture
def tree(tmp_path: Path) -> Path:
    return make_tree(tmp_path / "data", {c: 3 for c in "abcde"}, {c: 2 for c in "abcde"})


def test_folder_benchmark(tree: Path, tmp_path: Path) -> None:
    spec = write_tasks(tmp_path / "t.yaml", [["c", "a"], ["e", "b"]], description="tiny")
    s = build_benchmark(BenchmarkConfig(name="folder", data=str(tree), tasks_file=str(spec)))
    check_stream(s, 2, 2)
    assert s.class_names == ["c", "a", "e", "b"]  # YAML order, no permutation
    assert s.manifest["tasks"] == [[0, 1], [2, 3]]
    assert s.manifest["description"] == "tiny"
    assert len(s.tasks[0].train) == 6 and len(s.tasks[1].test) == 4
    assert labels_of(s.tasks[1].train) == {2, 3}
    # default spec location: <root>/tasks.yaml
    write_tasks(tree / "tasks.yaml", [["d"], ["a", "b"]])
    with pytest.warns(UserWarning, match="single class"):
        s2 = build_benchmark(BenchmarkConfig(name="folder", data=str(tree)))
    assert s2.class_names == ["d", "a", "b"]
    # shuffle_tasks permutes the task order, seeded
    spec3 = write_tasks(tmp_path / "t3.yaml", [["a"], ["b"], ["c"], ["d"], ["e"]], shuffle_tasks=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        s3 = build_benchmark(BenchmarkConfig(name="folder", data=str(tree), tasks_file=str(spec3)))
    perm = np.random.RandomState(1993).permutation(5).tolist()
    assert s3.class_names == ["abcde"[i] for i in perm]


@pytest.mark.parametrize(
    ("tasks", "pattern"),
    [
        ([["a", "zebra"], ["b", "yak"]], r"'zebra', 'yak'.*exist: a, b, c, d, e"),
        ([["a", "b"], ["c", "a"]], r"class 'a' is in task 1 and in task 2"),
        ([["a", "b"], []], r"task 2 is empty"),
        ([["a", "a"]], r"listed twice in task 1"),
        ([], r"no task"),
        ("a", r"list of lists"),
    ],
)
def test_folder_validation_errors(tree: Path, tmp_path: Path, tasks: object, pattern: str) -> None:
    spec = write_tasks(tmp_path / "t.yaml", tasks)
    with pytest.raises(TaskSpecError, match=pattern):
        build_benchmark(BenchmarkConfig(name="folder", data=str(tree), tasks_file=str(spec)))


def test_folder_records_each_class_index_in_its_dataset(tree: Path, tmp_path: Path) -> None:
    """The source index is ImageFolder's (sorted class folders), whatever order the tasks list them in."""
    folders = sorted(p.name for p in (tree / "train").iterdir() if p.is_dir())
    tasks = [[folders[2], folders[0]], [folders[3], folders[1]]]
    spec = write_tasks(tmp_path / "t.yaml", tasks)
    s = build_benchmark(BenchmarkConfig(name="folder", data=str(tree), tasks_file=str(spec)))
    assert [t.source_classes for t in s.tasks] == [[2, 0], [3, 1]]
    assert s.manifest["source_index"] == [2, 0, 3, 1]


def test_folder_more_errors(tree: Path, tmp_path: Path) -> None:
    cfg = BenchmarkConfig(name="folder", data=str(tree), tasks_file=str(tmp_path / "t.yaml"))
    write_tasks(tmp_path / "t.yaml", [["a"], ["b"]], shuffle=True)
    with pytest.raises(TaskSpecError, match="unknown key.*shuffle"):
        build_benchmark(cfg)
    write_tasks(tmp_path / "t.yaml", [["a", "b"], ["c", "d"]])
    cfg.num_tasks = 3
    with pytest.raises(TaskSpecError, match="num_tasks=3"):
        build_benchmark(cfg)
    cfg.num_tasks = None
    for f in (tree / "test" / "d").iterdir():
        f.unlink()
    (tree / "test" / "d").rmdir()
    with pytest.raises(BenchmarkError, match=r"class 'd' has no test folder"):
        build_benchmark(cfg)
    with pytest.raises(TaskSpecError, match="no task spec"):
        build_benchmark(BenchmarkConfig(name="folder", data=str(tree)))
    with pytest.raises(TaskSpecError, match="benchmark.data"):
        build_benchmark(BenchmarkConfig(name="folder"))


def test_grayscale_and_alpha_become_rgb(tmp_path: Path) -> None:
    for mode in ("L", "RGBA", "P", "LA"):
        root = make_tree(tmp_path / mode, {"a": 1, "b": 1}, {"a": 1, "b": 1}, mode=mode)
        spec = write_tasks(tmp_path / f"{mode}.yaml", [["a", "b"]])
        s = build_benchmark(BenchmarkConfig(name="folder", data=str(root), tasks_file=str(spec)))
        img, _ = s.tasks[0].train[0]
        assert img.mode == "RGB" and img.size == (8, 8)


def test_corrupt_image_names_path(tree: Path, tmp_path: Path) -> None:
    bad = tree / "train" / "a" / "zzz_corrupt.png"
    bad.write_bytes(b"this is not a png")
    spec = write_tasks(tmp_path / "t.yaml", [["a", "b"]])
    s = build_benchmark(BenchmarkConfig(name="folder", data=str(tree), tasks_file=str(spec)))
    ds = s.tasks[0].train
    idx = ds.keys.index("train/a/zzz_corrupt.png")  # type: ignore[attr-defined]
    with pytest.raises(CorruptImageError, match="zzz_corrupt.png") as e:
        ds[idx]
    assert str(bad) in str(e.value)
    with pytest.raises(CorruptImageError, match="missing.png"):
        load_image(tree / "missing.png")


def test_wrappers() -> None:
    images = np.arange(4 * 2 * 2, dtype=np.uint8).reshape(4, 2, 2)
    ds = ArrayImageDataset(images, [0, 1, 0, 2])
    sub = SubsetByLabels(ds, [0, 2])
    assert len(sub) == 3 and sub.targets == [0, 0, 2] and sub.indices == [0, 2, 3]
    tds = TransformedDataset(sub, lambda im: np.asarray(im).shape, lambda y: y + 10)
    assert tds[2] == ((2, 2, 3), 12)
    assert tds.targets == [0, 0, 2]
    assert ds.select([3, 1]).keys == [3, 1]
    assert ds.relabel({2: 0, 0: 1}).targets == [1, 1, 0]


# ---------------------------------------------------------------------------------------------- VTAB
def test_vtab5t_prefix_groups_and_fallback(tmp_path: Path) -> None:
    classes = {f"ds{d}_c{c}": 1 for d in range(5) for c in range(2)}
    root = make_tree(tmp_path / "vtab-cil" / "vtab", classes, classes)
    with pytest.warns(UserWarning, match="50 classes"):
        s = build_benchmark(BenchmarkConfig(name="vtab5t", data=str(tmp_path)))
    check_stream(s, 5, 2)
    assert s.manifest["task_sources"] == ["ds0", "ds1", "ds2", "ds3", "ds4"]
    assert s.tasks[1].class_names == ["ds1_c0", "ds1_c1"]
    flat = {f"class{i}": 1 for i in range(10)}
    root = make_tree(tmp_path / "flat", flat, flat)
    with pytest.warns(UserWarning, match="consecutive chunks"), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*50 classes")
        s = build_benchmark(BenchmarkConfig(name="vtab5t", data=str(root)))
    assert s.tasks[0].class_names == ["class0", "class1"]


def test_vtab_sim50_recipe(tmp_path: Path) -> None:
    sizes = {"aa": 4, "bb": 6, "cc": 5, "pc": 2}
    classes = {f"{g}_{i}": 1 for g, n in sizes.items() for i in range(n)}
    root = make_tree(tmp_path / "vt", classes, classes)
    with pytest.warns(UserWarning, match="excluded.*pc"):
        s = build_benchmark(BenchmarkConfig(name="vtab-sim50", data=str(root)))
    assert len(s.tasks) == 3
    comp = s.manifest["sim50"]["composition"]
    all_names: list[str] = []
    for t, rec in zip(s.tasks, comp):
        g = rec["source"]
        n = sizes[g]
        assert len(rec["kept"]) == -(-n // 2)  # ceil(n / 2) kept from its own dataset
        assert all(k.startswith(g + "_") for k in rec["kept"])
        assert all(h != g and c.startswith(h + "_") for h, c in rec["borrowed"])
        assert t.class_names == rec["kept"] + [c for _, c in rec["borrowed"]]
        all_names += t.class_names
    assert len(all_names) == len(set(all_names))  # disjoint classes
    assert not any(n.startswith("pc_") for n in all_names)
    with pytest.warns(UserWarning):
        again = build_benchmark(BenchmarkConfig(name="vtab-sim50", data=str(root)))
    assert again.manifest == s.manifest
    groups = {"g1": [f"aa_{i}" for i in range(4)], "g2": [f"bb_{i}" for i in range(6)]}
    with pytest.warns(UserWarning, match="borrow only 2 of 3"):
        tasks, _ = sim50_partition(groups, seed=3)
    assert [len(t) for t in tasks] == [4, 5]  # g2 can borrow only 2 of 3 from g1's pool
    # groups file
    gfile = tmp_path / "groups.yaml"
    gfile.write_text(yaml.safe_dump({"groups": groups}))
    with pytest.warns(UserWarning, match="borrow only"):
        s2 = build_benchmark(BenchmarkConfig(name="vtab-sim50", data=str(root), tasks_file=str(gfile)))
    assert s2.manifest["sim50"]["composition"][0]["source"] == "g1"
    gfile.write_text(yaml.safe_dump({"groups": {"g1": ["aa_0", "nope"], "g2": ["bb_0", "bb_1", "bb_2"]}}))
    with pytest.raises(TaskSpecError, match="'nope'"):
        build_benchmark(BenchmarkConfig(name="vtab-sim50", data=str(root), tasks_file=str(gfile)))


# ---------------------------------------------------------------------------------------------- abrupt
def _listing(root: Path) -> dict[str, str]:
    out = {}
    for dirpath, _, files in os.walk(root):
        for f in files:
            p = Path(dirpath) / f
            out[p.relative_to(root).as_posix()] = (
                os.readlink(p) if p.is_symlink() else str(p.stat().st_mtime_ns)
            )
    return out


def test_abrupt_sequence(tmp_path: Path) -> None:
    names = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
    cifar = make_tree(tmp_path / "cifar", {n: 2 for n in names}, {n: 2 for n in names})
    out = tmp_path / "abrupt"
    assert build_abrupt_sequence(cifar, out, seed=0) == out
    spec = yaml.safe_load((out / "tasks.yaml").read_text())
    tasks = spec["tasks"]
    assert [len(t) for t in tasks] == [4, 4, 4, 4, 4]
    assert all(c.startswith("cifar_") for t in (tasks[0], tasks[2]) for c in t)
    assert all(c.startswith("digit_") for t in (tasks[1], tasks[3]) for c in t)
    assert [c.split("_")[0] for c in tasks[4]] == ["cifar", "cifar", "digit", "digit"]
    flat = [c for t in tasks for c in t]
    assert len(set(flat)) == 20
    link = next((out / "train" / tasks[0][0]).iterdir())
    assert link.is_symlink() and Path(os.readlink(link)).parent == cifar.resolve() / "train" / tasks[0][0][6:]
    stamp = json.loads((out / "abrupt_manifest.json").read_text())
    assert stamp["files"]["train"] + stamp["files"]["test"] == 40 + 1797
    digit_png = next((out / "test" / tasks[1][0]).iterdir())
    assert Image.open(digit_png).size == (8, 8)

    # idempotent: nothing changes on a re-run; a stale file is removed
    before = _listing(out)
    (out / "train" / tasks[0][0] / "stale.png").write_bytes(b"x")
    build_abrupt_sequence(cifar, out, seed=0)
    assert _listing(out) == before

    # usable as a folder benchmark (tasks.yaml picked up by default)
    s = build_benchmark(BenchmarkConfig(name="folder", data=str(out)))
    check_stream(s, 5, 4)
    img, _ = s.tasks[1].train[0]
    assert img.mode == "RGB" and img.size == (8, 8)

    # another seed changes the class choice; a foreign non-empty folder is refused
    other = build_abrupt_sequence(cifar, tmp_path / "abrupt1", seed=1)
    assert yaml.safe_load((other / "tasks.yaml").read_text())["tasks"] != tasks
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "keep.txt").write_text("mine")
    with pytest.raises(BenchmarkError, match="refusing"):
        build_abrupt_sequence(cifar, tmp_path / "foreign")
    with pytest.raises(DataNotFoundError):
        build_abrupt_sequence(tmp_path / "nothing", tmp_path / "abrupt2")


@pytest.mark.shared
@needs_shared
def test_abrupt_on_shared_subset(tmp_path: Path) -> None:
    out = build_abrupt_sequence(CIFAR_SUBSET, tmp_path / "abrupt")
    stamp = json.loads((out / "abrupt_manifest.json").read_text())
    assert stamp["files"]["train"] + stamp["files"]["test"] == 12000 + 1797
    s = build_benchmark(BenchmarkConfig(name="folder", data=str(out), max_train_per_class=5))
    check_stream(s, 5, 4)


# ------------------------------------------------------------------ ImageNet-R split conventions
def test_the_shipped_coda_split_list_is_whole() -> None:
    from proteus.streams.splits import coda_test_files

    files = coda_test_files()
    assert len(files) == 6000 and len(set(files)) == 6000 and files == sorted(files)
    assert len({f.split("/")[0] for f in files}) == 200  # every ImageNet-R class has test images


def test_coda_split_of_a_raw_tree(tmp_path: Path, monkeypatch) -> None:
    from proteus.streams import build_benchmark, splits
    from proteus.streams.errors import BenchmarkError
    from tiny import write_image

    root = tmp_path / "imagenet-r"
    for c in ("n01", "n02", "n03", "n04"):
        (root / c).mkdir(parents=True)
        for i in range(3):
            write_image(root / c / f"art_{i}.jpg", seed=i)
    listed = ["n01/art_0.jpg", "n02/art_1.jpg", "n03/art_2.jpg", "n04/art_0.jpg"]
    train, test, classes = splits.coda_imagenet_r(tmp_path, listed)
    assert classes == ["n01", "n02", "n03", "n04"]
    assert sorted(test.paths) == listed and len(train.paths) == 8 and not set(train.paths) & set(listed)
    with pytest.raises(BenchmarkError, match="n05/art_9.jpg"):
        splits.coda_imagenet_r(tmp_path, [*listed, "n05/art_9.jpg"])
    # through the benchmark: benchmark.split=coda reads the raw tree; imagenet-a refuses it by name
    raw = splits.coda_imagenet_r
    monkeypatch.setattr("proteus.streams.splits.coda_imagenet_r", lambda given: raw(given, listed))
    stream = build_benchmark(
        BenchmarkConfig(name="imagenet-r", data=str(tmp_path), split="coda", num_tasks=2)
    )
    assert sum(len(t.test) for t in stream.tasks) == 4 and sum(len(t.train) for t in stream.tasks) == 8
    with pytest.raises(BenchmarkError, match="imagenet-r only"):
        build_benchmark(BenchmarkConfig(name="imagenet-a", data=str(tmp_path), split="coda"))


def test_cifar_imagefolder_of_another_dataset_is_refused(tmp_path: Path) -> None:
    """An ImageFolder tree of ten classes that are not CIFAR-10's (Imagenette's, here) is refused naming both
    lists, instead of being learned and labelled cifar10."""
    names = ["n01440764", "n02102040", "n02979186", "n03000684", "n03028079", "n03394916", "n03417042",
             "n03425413", "n03445777", "n03888605"]  # fmt: skip
    make_tree(tmp_path, dict.fromkeys(names, 1), dict.fromkeys(names, 1))
    with pytest.raises(BenchmarkError, match=r"holds the classes n01440764.*not cifar10's \(airplane"):
        build_benchmark(BenchmarkConfig(name="cifar10", data=str(tmp_path)))
