"""The GPU path's precision, reproduced on the CPU (``precision=bf16`` autocasts there too): every way an
image reaches the backbone runs under the same autocast, and ``--precision`` reaches the learner.

Found by the first ``make gpu-check`` (issue 22): ``predict`` ran the frozen prefix outside autocast while
training and evaluation ran it under bf16 autocast, so a prediction did not see the embeddings its
signatures and head were fitted on.
"""

from __future__ import annotations

import pytest
import torch
import yaml
from torch.utils.data import Subset

from proteus import Proteus, devices
from proteus.config import ConfigError
from proteus.streams import build_benchmark
from tiny import TINY_SETS


def _learner(precision: str, method: str = "proteus") -> tuple[Proteus, object]:
    sets = {k: yaml.safe_load(v) for k, v in (s.split("=", 1) for s in TINY_SETS)}
    clf = Proteus.from_method(
        method, progress=False, **sets, **{"benchmark.max_train_per_class": 20, "precision": precision,
                                           "device": "cpu"}
    )  # fmt: skip
    stream = build_benchmark(clf.config.benchmark)
    clf.fit_task(stream.tasks[0])
    return clf, stream


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_predict_embeds_as_evaluation_does(precision: str) -> None:
    clf, stream = _learner(precision)
    test = Subset(stream.tasks[0].test, range(6))
    z, _ = clf.prefix_dataset(test)  # the evaluation path: cached prefix, then the suffix
    H_eval = clf.embed_prefix(z, [0], shard=False)
    x = clf.transform_images([test[i][0] for i in range(6)])
    H_pred, _ = clf.embed(x)  # the prediction path
    assert torch.equal(H_pred, H_eval)


def test_bf16_changes_the_numbers_and_fp32_does_not_autocast() -> None:
    cpu = torch.device("cpu")
    assert devices.autocast_dtype(cpu, "auto") is None and devices.autocast_dtype(cpu, "fp32") is None
    assert devices.autocast_dtype(cpu, "bf16") is torch.bfloat16
    assert devices.autocast_dtype(torch.device("cuda"), "auto") is torch.bfloat16
    bf, _ = _learner("bf16")
    fp, stream = _learner("fp32")
    x = fp.transform_images([stream.tasks[0].test[i][0] for i in range(4)])
    h_bf, h_fp = bf.embed(x)[0], fp.embed(x)[0]
    rel = float((h_bf - h_fp).norm() / h_fp.norm())
    assert 0 < rel < 0.1  # a bf16 forward, not another model


def test_precision_is_per_task_and_recorded(tmp_path) -> None:
    clf, _ = _learner("bf16")
    assert clf.records_[0].settings["precision"] == "bf16"
    clf.save(tmp_path / "kb")
    loaded = Proteus.load(tmp_path / "kb", precision="fp32")
    assert loaded.config.precision == "fp32" and loaded.embedder_.precision == "fp32"
    with pytest.raises(ConfigError, match="precision must be one of auto, bf16, fp32"):
        Proteus.load(tmp_path / "kb", precision="fp16")


def test_peak_memory_is_none_off_cuda() -> None:
    cpu = torch.device("cpu")
    devices.reset_peak_memory(cpu)
    assert devices.peak_memory_mb(cpu) is None and devices.clock(cpu) > 0


@pytest.mark.parametrize("dim", [0, 1])
def test_index_add_by_one_hot_product_equals_index_add(dim: int) -> None:
    """The order-fixed sum used on CUDA (a one-hot product) is the sum ``index_add_`` computes."""
    g = torch.Generator().manual_seed(0)
    src = torch.randn((50, 7) if dim == 0 else (7, 50), generator=g, dtype=torch.float64)
    idx = torch.randint(0, 5, (50,), generator=g)
    shape = (5, 7) if dim == 0 else (7, 5)
    base = torch.randn(shape, generator=g, dtype=torch.float64)
    a = devices.index_add(base.clone(), dim, idx, src, one_hot=True)
    b = base.clone().index_add_(dim, idx, src)
    assert torch.allclose(a, b, rtol=0, atol=1e-12)
    assert torch.equal(devices.index_add(base.clone(), dim, idx, src), b)  # the CPU keeps index_add_


def test_torchrun_backend_follows_the_requested_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """``torchrun ... --device cpu`` on a GPU machine joins gloo (it joined NCCL and bound rank 1 to a GPU
    the machine did not have: the first test run on a GPU)."""
    import torch.distributed as tdist

    from proteus import distributed

    chosen: list[str] = []
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    monkeypatch.setattr(tdist, "is_initialized", lambda: False)
    monkeypatch.setattr(tdist, "init_process_group", lambda backend, timeout: chosen.append(backend))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: None)
    for device, backend in (("cpu", "gloo"), ("cuda", "nccl"), (None, "nccl"), ("auto", "nccl")):
        assert distributed.init_from_env(device=device)
        assert chosen.pop() == backend, device


def test_tf32_switches_tensor_cores_on_cuda_only_inside_the_forward() -> None:
    """``precision=tf32``: float32 tensors (no autocast), TF32 matmuls on CUDA while the backbone runs, the
    switches as they were afterwards; elsewhere the same as fp32."""
    from proteus.devices import autocast, autocast_dtype

    assert autocast_dtype(torch.device("cpu"), "tf32") is None
    assert autocast_dtype(torch.device("cuda"), "tf32") is None
    before = torch.backends.cuda.matmul.allow_tf32
    with autocast(torch.device("cpu"), "tf32"):
        assert torch.backends.cuda.matmul.allow_tf32 == before
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with autocast(torch.device("cuda"), "tf32"):
            assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
        assert torch.backends.cuda.matmul.allow_tf32 is False
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
