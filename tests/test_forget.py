"""``proteus kb forget`` (issue 15): a task's contribution to the head is subtracted exactly, its key is
removed (never retrieved), its classes are never predicted; a commit like any other, undone by ``kb undo``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from proteus import Proteus
from proteus.cli import main
from proteus.heads import RanPACHead
from proteus.kb import KnowledgeBase
from tiny import TINY, folder_args, folder_cfg, folder_stream, make_tree, write_spec

TASKS = [["a", "b"], ["c", "d"], ["e", "f"]]


# ---------------------------------------------------------------------------------------------- the head
def _updates(seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    sizes, out = (40, 25, 60), []  # unequal tasks: the per-task prototypes differ from the sums
    for k, n in enumerate(sizes):
        H = torch.randn(n, 12, generator=g, dtype=torch.float64) + k
        y = torch.tensor([2 * k + (i % 2) for i in range(n)])
        out.append((H, y))
    return out


@pytest.mark.parametrize("prototypes", ["sum", "task-mean"])
def test_downdate_equals_a_head_accumulated_without_the_task(prototypes: str) -> None:
    ups = _updates()
    full = RanPACHead(12, rp_dim=64, selection="task", prototypes=prototypes)
    for H, y in ups:
        full.update(H, y, num_classes=int(y.max()) + 1)
    without = RanPACHead(12, rp_dim=64, selection="task", prototypes=prototypes)
    for H, y in (ups[0], ups[2]):
        without.update(H, y, num_classes=int(y.max()) + 1)
    full.downdate(*ups[1], classes=[2, 3])
    without.refit(full.gamma_)  # the same noise level: the data that chose it is gone
    assert full.G_ is not None and without.G_ is not None
    torch.testing.assert_close(full.G_, without.G_, rtol=1e-10, atol=1e-9)
    torch.testing.assert_close(full.Q_, without.Q_, rtol=1e-10, atol=1e-9)
    assert torch.equal(full.Q_[:, [2, 3]], torch.zeros_like(full.Q_[:, [2, 3]]))
    assert full.counts_ is not None and torch.equal(full.counts_, without.counts_)
    if prototypes == "task-mean":
        torch.testing.assert_close(full.P_, without.P_, rtol=1e-10, atol=1e-9)
    torch.testing.assert_close(full.W_out_, without.W_out_, rtol=1e-7, atol=1e-9)
    assert full.n_samples_ == without.n_samples_ and full.n_updates_ == without.n_updates_


def test_downdate_refuses_labels_it_never_saw() -> None:
    ups = _updates()
    head = RanPACHead(12, rp_dim=32, selection="task").update(*ups[0], num_classes=2)
    G = head.G_.clone()  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="not all accumulated"):
        head.downdate(ups[1][0], torch.zeros(len(ups[1][1]), dtype=torch.long), classes=[0])
    assert torch.equal(head.G_, G)  # atomic


# ---------------------------------------------------------------------------------------------- the learner
def _learned(tmp_path: Path, method: str, *sets: str) -> tuple[Proteus, object]:
    tree = make_tree(tmp_path / "data", classes="abcdef", n_train=8, n_test=3)
    cfg = folder_cfg(
        tree, write_spec(tmp_path / "spec.yaml", TASKS), "head.forgettable=true", *sets, method=method
    )
    stream = folder_stream(cfg)
    clf = Proteus(cfg, progress=False)
    for t in stream.tasks:
        clf.fit_task(t)
    return clf, stream


@pytest.mark.slow
@pytest.mark.parametrize(
    "method",
    ["proteus-dpgmm", "proteus-lda", "proteus"],
    ids=["gaussian-keys", "lda-keys", "default-soft"],
)
def test_a_forgotten_task_is_never_retrieved_nor_predicted(tmp_path: Path, method: str) -> None:
    clf, stream = _learned(tmp_path, method)
    images = [img for t in stream.tasks for img, _ in t.test]  # type: ignore[attr-defined]
    x = clf.transform_images(images)
    before = clf.predict(x)
    clf.forget_task(1)
    after = clf.predict(x)
    assert after.task is not None and not bool((after.task == 1).any())
    gone = clf.records_[1].classes
    assert not any(int(c) in gone for c in after.label)
    assert torch.isinf(after.logits[:, gone]).all()
    # with the best task alone (combine=hard), inputs that retrieved another task before keep their task
    # (the other keys are untouched); the soft combination re-weighs the candidates that remain
    assert before.task is not None
    kept = before.task != 1
    if clf.config.retrieval.combine == "hard":
        assert torch.equal(after.task[kept], before.task[kept])
    with pytest.raises(Exception, match="already forgotten"):
        clf.forget_task(1)
    # the forgotten state survives the knowledge base
    clf.save(tmp_path / "kb")
    again = Proteus.load(tmp_path / "kb")
    p = again.predict(x)
    assert torch.equal(p.task, after.task) and torch.equal(p.label, after.label)
    assert again.records_[1].forgotten and 1 not in again.heads_.inputs


@pytest.mark.slow
def test_forgetting_needs_the_task_kept(tmp_path: Path) -> None:
    tree = make_tree(tmp_path / "data", classes="abcd", n_train=6, n_test=2)
    cfg = folder_cfg(tree, write_spec(tmp_path / "spec.yaml", TASKS[:2]))
    clf = Proteus(cfg, progress=False)
    for t in folder_stream(cfg).tasks:
        clf.fit_task(t)
    with pytest.raises(Exception, match="head.forgettable=true"):
        clf.forget_task(0)
    assert not clf.records_[0].forgotten


# ---------------------------------------------------------------------------------------------- the CLI
@pytest.mark.slow
def test_cli_forget_then_undo(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tree = make_tree(tmp_path / "data", classes="abcdef", n_train=6, n_test=2)
    spec = write_spec(tmp_path / "spec.yaml", TASKS)
    kb = tmp_path / "kb"
    for k in (1, 2, 3):
        args = ["learn", "--kb", str(kb), "--task", str(k), *folder_args(tree, spec), *TINY]
        assert main([*args, "--set", "head.forgettable=true"]) == 0
    learned = KnowledgeBase.open(kb).manifest
    # prediction rows carry the class's index in its source dataset (here: the sorted class folders)
    capsys.readouterr()
    assert main(["predict", "--kb", str(kb), "--json", "-q", str(tree / "test" / "e" / "0.png")]) == 0
    row = json.loads(capsys.readouterr().out)[0]
    assert row["class_index"] == "abcdef".index(row["class"])
    assert main(["kb", "forget", str(kb), "--task", "2"]) == 0
    m = KnowledgeBase.open(kb).manifest
    assert m["tasks"][1].get("forgotten") is True and not m["tasks"][0].get("forgotten")
    assert m["tasks"][0]["sha256"] == learned["tasks"][0]["sha256"]  # other tasks untouched
    capsys.readouterr()
    assert main(["kb", "list", str(kb)]) == 0
    assert "task 2:" in capsys.readouterr().out.split("[forgotten]")[0]
    assert main(["kb", "forget", str(kb), "--task", "2"]) == 2  # one line, exit 2
    assert "already forgotten" in capsys.readouterr().err
    assert main(["kb", "verify", str(kb)]) == 0
    assert main(["kb", "undo", str(kb)]) == 0
    back = KnowledgeBase.open(kb).manifest
    assert [t["sha256"] for t in back["tasks"]] == [t["sha256"] for t in learned["tasks"]]
    assert back["head"]["sha256"] == learned["head"]["sha256"]
    assert main(["kb", "verify", str(kb)]) == 0
