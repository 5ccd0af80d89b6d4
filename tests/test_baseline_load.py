"""Every baseline supports ``load`` (issue 36): ``proteus learn`` task by task into a knowledge base equals
``proteus run`` (the same stored tensors, bit for bit, the same records and evaluation rows), and
``proteus predict``, ``proteus evaluate`` and ``proteus serve`` (the ASGI app, in process) work on the
knowledge base of each of the nine; a restored learner predicts as the one that wrote it, an earlier
release's knowledge base loads (and says why it cannot learn on), a damaged one is refused by name.

Tiny settings: random MobileNetV2 (the LoRA methods, NCM) or ViT-Ti (the prompt methods) at 32 px, the
quickstart's five tasks of 8 training images per class, one epoch.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from proteus.cli import main
from proteus.config import ConfigError
from proteus.engine.errors import TaskError
from proteus.experiment.store import build_learner
from proteus.kb import KnowledgeBase
from proteus.learners import LearnerState
from proteus.streams import build_benchmark
from tiny import baseline_cfg

#: each baseline with its backbone and the options that keep it small (fewer BIRCH / K-Means runs for
#: AdaPromptCL's grouping, fewer alignment epochs for HiDe-Prompt, a pool that five tasks can share)
BASELINES: dict[str, tuple[str, list[str]]] = {
    "inflora": ("mobilenet_v2", ["baseline.rank=4", "backbone.adapt_last=2"]),
    "sd-lora": ("mobilenet_v2", ["baseline.rank=4", "backbone.adapt_last=2"]),
    "ncm": ("mobilenet_v2", ["backbone.adapt_last=2"]),
    "klda": ("mobilenet_v2", ["backbone.adapt_last=2", "baseline.rff_dim=128"]),
    "l2p": ("vit_ti16", []),
    "dualprompt": ("vit_ti16", []),
    "coda-prompt": ("vit_ti16", ["baseline.pool_size=10"]),
    "s-prompt": ("vit_ti16", []),
    "hide-prompt": ("vit_ti16", ["baseline.tii_epochs=2", "baseline.ca_epochs=2"]),
    "tuna": ("mobilenet_v2", ["backbone.adapt_last=2", "baseline.ca_epochs=2"]),
    "mos": ("mobilenet_v2", ["backbone.adapt_last=2", "baseline.ca_epochs=2"]),
    "tosca": ("mobilenet_v2", ["backbone.adapt_last=2"]),
    "moal": ("mobilenet_v2", ["backbone.adapt_last=2", "baseline.hidden=64", "baseline.drift_epochs=2"]),
    "adapromptcl": (
        "vit_ti16",
        ["baseline.remerge_samples=10", "baseline.kmeans_run=3", "baseline.pool_size=20"],
    ),
}
TINY = [
    "backbone.pretrained=false",
    "backbone.img_size=32",
    "train.epochs=1",
    "benchmark.max_train_per_class=8",
]
TASKS = 5


def _args(method: str) -> list[str]:
    backbone, extra = BASELINES[method]
    sets = [a for s in [*TINY, *extra] for a in ("--set", s)]
    return [
        "--benchmark",
        "quickstart",
        "--method",
        method,
        "--backbone",
        backbone,
        "--device",
        "cpu",
        "-q",
        *sets,
    ]


def _cfg(method: str) -> Any:
    """:func:`_args`' config, for the learners built in the tests."""
    backbone, extra = BASELINES[method]
    cfg = baseline_cfg(method, backbone)
    cfg.benchmark.num_tasks = None
    for s in extra:
        key, _, value = s.partition("=")
        section, _, name = key.partition(".")
        if section == "baseline":
            cfg.baseline[name] = int(value)
        else:
            setattr(getattr(cfg, section), name, int(value))
    return cfg


def _images(tmp_path: Path, n: int = 3) -> list[str]:
    """``n`` test images of the quickstart's last task, saved as PNG files."""
    stream = build_benchmark(_cfg("ncm").benchmark)
    files = []
    for i in range(n):
        path = tmp_path / f"img{i}.png"
        stream.tasks[-1].test[i][0].save(path)
        files.append(str(path))
    return files


def _predict_rows(kb: Path, files: list[str], capsys: pytest.CaptureFixture[str]) -> list[dict[str, Any]]:
    capsys.readouterr()
    assert main(["predict", "--kb", str(kb), *files, "--json", "--top-k", "2"]) == 0
    return json.loads(capsys.readouterr().out)


def _records(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    """The task records without when they were learned (the one field a run and a learn must differ in)."""
    return [{k: v for k, v in t.items() if k != "learned"} for t in manifest["tasks"]]


#: the ViT baselines' round trip is tests/test_baseline_load_vit.py (a file per pytest-xdist worker)
ON_VIT = [m for m, (backbone, _) in BASELINES.items() if backbone.startswith("vit")]


@pytest.mark.slow
@pytest.mark.parametrize("method", [m for m in BASELINES if m not in ON_VIT])
def test_learn_task_by_task_equals_run_and_the_kb_serves(
    method: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    check_learn_equals_run_and_serves(method, tmp_path, capsys)


def check_learn_equals_run_and_serves(
    method: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``learn`` task by task equals ``run``; ``evaluate``, ``predict`` and ``serve`` work on the KB."""
    run = tmp_path / "run"
    assert main(["run", *_args(method), "--out", str(run), "--set", "report.figures=false"]) == 0
    kb = tmp_path / "kb"
    for k in range(1, TASKS + 1):
        assert main(["learn", "--kb", str(kb), "--task", str(k), *_args(method)]) == 0, k
    a, b = KnowledgeBase.open(run / "kb").manifest, KnowledgeBase.open(kb).manifest
    assert len(b["tasks"]) == TASKS
    # the same state, bit for bit: every object's checksum, the head's meta, the records and the rows
    assert [t["sha256"] for t in a["tasks"]] == [t["sha256"] for t in b["tasks"]]
    assert a["head"]["sha256"] == b["head"]["sha256"]
    assert a["head"]["meta"] == b["head"]["meta"] and b["head"]["meta"]["state_version"] == 2
    assert _records(a) == _records(b)
    assert a["evaluation"] == b["evaluation"]
    res = json.loads((run / "results.json").read_text())
    assert [e["row"] for e in b["evaluation"]] == [row[: k + 1] for k, row in enumerate(res["acc_matrix"])]
    assert [t["stats"]["steps"] for t in b["tasks"]] == [t["steps"] for t in res["tasks"]]

    # proteus evaluate measures the last row again, as the run did
    assert main(["evaluate", "--kb", str(kb), "--out", str(tmp_path / "eval"), "-q"]) == 0
    ev = json.loads((tmp_path / "eval" / "results.json").read_text())
    assert ev["acc_matrix"][-1] == res["acc_matrix"][-1]
    assert (ev["retrieval_acc"] or [None])[-1] == (res["retrieval_acc"] or [None])[-1]

    # proteus predict: the same rows from both knowledge bases, each a learned class
    files = _images(tmp_path)
    rows = _predict_rows(kb, files, capsys)
    assert rows == _predict_rows(run / "kb", files, capsys)
    names = [n for t in b["tasks"] for n in t["class_names"]]
    retrieves = method in ("s-prompt", "hide-prompt", "tuna", "mos", "tosca")
    for r, f in zip(rows, files):
        assert r["file"] == f and r["class"] in names and names.index(r["class"]) == r["label"]
        assert (r["task"] is not None) == retrieves and r["component"] is None and r["known"] is None
        assert (
            0 < r["p_all"] <= 1
            and len(r["top_k"]) == 2
            and r["top_k"][0]["p_task"] >= r["top_k"][1]["p_task"]
        )
        assert r["task"] is None or 1 <= r["task"] <= TASKS

    assert main(["predict", "--kb", str(kb), files[0]]) == 0
    out, err = capsys.readouterr()
    assert (
        out.startswith(f"{files[0]}: {rows[0]['class']}") and "kb calibrate" not in err
    )  # it retrieves no task

    # proteus serve (the ASGI app in this process): the same rows, its tasks and health
    from starlette.testclient import TestClient

    from proteus.serve import create_app

    with TestClient(create_app(kb, device="cpu", watch=False)) as client:
        answer = client.post("/predict?top_k=2", content=Path(files[0]).read_bytes())
        assert answer.status_code == 200, answer.text
        assert answer.json()["kb_tasks"] == TASKS and answer.json()["predictions"][0]["file"] == "body"
        images = [{"name": f, "data": base64.b64encode(Path(f).read_bytes()).decode()} for f in files]
        answer = client.post("/predict/batch?top_k=2", json={"images": images})
        assert answer.status_code == 200, answer.text
        assert answer.json()["predictions"] == rows  # the same batch as proteus predict's: the same rows
        assert client.get("/tasks").status_code == 200
        assert client.get("/health").json()["kb_tasks"] == TASKS


# ---------------------------------------------------------------------------------- in-memory round trips
@pytest.fixture(scope="module")
def stream() -> Any:
    return build_benchmark(_cfg("ncm").benchmark)


def _fitted(method: str, stream: Any, tasks: int = 2) -> Any:
    clf = build_learner(_cfg(method), progress=False)
    for k in range(tasks):
        clf.fit_task(stream.tasks[k])
    return clf


def _legacy(state: LearnerState) -> LearnerState:
    """``state`` as the release before issue 36 wrote it: bare records, no state version, stream size,
    generator states, LoRA ranks or DualGPM modes, float32 DualGPM bases."""
    assert state.head is not None
    meta, tensors = state.head
    meta = {k: v for k, v in meta.items() if k in ("method", "task_classes", "groups")}
    keep = ("index", "classes", "class_names", "n_train", "prompt_group")
    tasks = [({k: v for k, v in rec.items() if k in keep}, t) for rec, t in state.tasks]
    old = {
        n: t.float() if n.startswith("gpm.") else t
        for n, t in tensors.items()
        if not n.startswith("rng.") and not n.endswith(".ranks")
    }
    return LearnerState(tasks, (meta, old))


@pytest.mark.parametrize("method", ["inflora", "dualprompt"])
def test_an_earlier_releases_state_predicts_and_refuses_to_learn_on(method: str, stream) -> None:
    clf = _fitted(method, stream)
    x = clf.transform_images([stream.tasks[1].test[i][0] for i in range(6)])
    back = build_learner(_cfg(method), progress=False).restore(_legacy(clf.state()))
    a, b = clf.predict(x), back.predict(x)
    assert torch.equal(a.label, b.label) and torch.equal(a.logits, b.logits)
    if method == "inflora":  # the per-task ranks read off the compositions
        assert all(u.ranks == back.model_.units[n].ranks for n, u in clf.model_.units.items())
    assert back.classes_ == clf.classes_ and [r.classes for r in back.records_] == [
        r.classes for r in clf.records_
    ]
    with pytest.raises(TaskError, match=f"{method}: cannot learn task 3: .*earlier release"):
        back.fit_task(stream.tasks[2])


def test_an_earlier_ncm_state_learns_on(stream) -> None:
    """NCM's heads are all a task reads: an earlier release's knowledge base learns on as a run."""
    clf = _fitted("ncm", stream)
    back = build_learner(_cfg("ncm"), progress=False).restore(_legacy(clf.state()))
    for c in (clf, back):
        c.fit_task(stream.tasks[2])
    sa, sb = clf.state().head, back.state().head
    assert sa is not None and sb is not None
    assert all(torch.equal(sa[1][n], sb[1][n]) for n in sa[1])


def test_a_damaged_state_is_refused_naming_the_tensor(stream) -> None:
    clf = _fitted("sd-lora", stream)
    st = clf.state()
    assert st.head is not None
    name = next(n for n in st.head[1] if n.startswith("lora.") and n.endswith(".B"))
    for tensors, match in (
        ({n: t for n, t in st.head[1].items() if n != "head.1.bias"}, "'head.1.bias' is missing"),
        (
            {**st.head[1], name: st.head[1][name][:, :1]},
            f"{name.removesuffix('.B')}: A .* do not fit 2 tasks",
        ),
    ):
        with pytest.raises(TaskError, match=f"sd-lora: the head object: .*{match}"):
            build_learner(_cfg("sd-lora"), progress=False).restore(
                LearnerState(st.tasks, (st.head[0], tensors))
            )
    other = LearnerState(st.tasks, ({**st.head[0], "method": "inflora"}, st.head[1]))
    with pytest.raises(TaskError, match="state of method 'inflora', not of 'sd-lora'"):
        build_learner(_cfg("sd-lora"), progress=False).restore(other)


def test_a_restored_learner_takes_per_task_keys_only(stream) -> None:
    clf = build_learner(_cfg("ncm"), progress=False).restore(_fitted("ncm", stream, 1).state())
    clf.set_params(**{"train.epochs": 3})
    assert clf.config.train.epochs == 3
    with pytest.raises(ConfigError, match="backbone.img_size: define the learned model"):
        clf.set_params(backbone__img_size=64)
    clf.fit_task(stream.tasks[1])
    assert clf.records_[1].settings["train.epochs"] == 3 and clf.records_[1].stats.extra["steps"] == 0


def test_a_prediction_is_over_the_global_labels(stream) -> None:
    """A baseline's :class:`Prediction`: the label of the best column, the logits re-indexed by global label,
    the retrieved task where the method retrieves one (S-Prompt)."""
    from proteus.baselines.learner import column_prediction

    logits = torch.tensor([[0.1, 0.9, 0.3], [2.0, 0.0, 1.0]])
    p = column_prediction(logits, None, [4, 0, 2])
    assert p.label.tolist() == [0, 4] and p.logits.shape == (2, 5)
    assert p.logits[:, [4, 0, 2]].equal(logits) and bool(torch.isinf(p.logits[:, [1, 3]]).all())
    clf = _fitted("s-prompt", stream)
    x = clf.transform_images([stream.tasks[k].test[0][0] for k in (0, 1)])
    pred = clf.predict(x)
    assert pred.task is not None and pred.logits.shape == (2, 4) and pred.component is None
    assert all(int(c) in clf.task_classes_[int(t)] for c, t in zip(pred.label, pred.task))
