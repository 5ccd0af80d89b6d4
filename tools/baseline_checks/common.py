"""Shared helpers for the side-by-side checks of the baselines against the authors' released code.

The authors' checkouts are looked up in ``$PROTEUS_THEIRS`` (a folder holding ``theirs_inflora``,
``theirs_sdlora``, ``theirs_l2p``, ``theirs_dualprompt``, ``theirs_coda``); default: this script's folder.
See README.md.
"""

import os
import sys
import types
import warnings

import torch

from proteus.baselines import build_baseline
from proteus.config import RunConfig
from proteus.methods import apply_method

# one thread (the scripts import torch before this module, so OMP_NUM_THREADS=1 belongs on the command line)
torch.set_num_threads(1)
warnings.filterwarnings("ignore")

HERE = os.path.dirname(os.path.abspath(__file__))
#: the folder holding the authors' checkouts theirs_<name>
THEIRS = os.path.abspath(os.environ.get("PROTEUS_THEIRS") or HERE)
ROWS = []


def build(method, **over):
    cfg = RunConfig()
    apply_method(cfg, method)
    cfg.backbone.name = "vit_ti16"
    cfg.backbone.pretrained = False
    cfg.backbone.img_size = 32
    cfg.device = "cpu"
    for k, v in over.items():
        setattr(cfg.baseline, k, v)
    torch.manual_seed(0)
    clf = build_baseline(cfg, progress=False)
    clf._build()
    clf._stream_tasks = 10
    return clf


def mad(a, b):
    a = torch.as_tensor(a).detach().double()
    b = torch.as_tensor(b).detach().double()
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((a - b).abs().max()) if a.numel() else 0.0


def report(name, diff, tol, note=""):
    ok = diff <= tol
    ROWS.append((name, diff, tol, "PASS" if ok else "FAIL", note))
    print(
        f"{'PASS' if ok else 'FAIL'} | {name} | {diff:.3e} | tol {tol:.0e} {('| ' + note) if note else ''}",
        flush=True,
    )


def info(name, value, note=""):
    ROWS.append((name, value, None, "INFO", note))
    print(f"INFO | {name} | {value} {('| ' + note) if note else ''}", flush=True)


def theirs(sub):
    """the path of the authors' checkout ``sub`` (e.g. theirs_l2p) under $PROTEUS_THEIRS"""
    p = os.path.join(THEIRS, sub)
    if not os.path.isdir(p):
        sys.exit(f"{p} not found: set PROTEUS_THEIRS to the folder holding {sub} (see README.md)")
    return p


def add_path(sub):
    p = theirs(sub)
    if p not in sys.path:
        sys.path.insert(0, p)


def stub(name, **attrs):
    m = types.ModuleType(name)
    m.__dict__.update(attrs)
    sys.modules[name] = m
    return m


def cpu_cuda():
    """their code calls .cuda(); on this CPU-only check it is the identity"""
    torch.nn.Module.cuda = lambda self, *a, **k: self
    torch.Tensor.cuda = lambda self, *a, **k: self.clone()  # a copy, like a real CPU->GPU move


def plain_vit(clf):
    """a deep copy of the learner's timm ViT with every LoRA wrapper replaced by its frozen base layer"""
    import copy

    from proteus.adapters.lora import LoRAWrapper

    v = copy.deepcopy(clf.backbone_.vit)
    for blk in v.blocks:
        if isinstance(blk.attn.qkv, LoRAWrapper):
            blk.attn.qkv = blk.attn.qkv.base
    return v


def summary():
    n_fail = sum(r[3] == "FAIL" for r in ROWS)
    n_pass = sum(r[3] == "PASS" for r in ROWS)
    n_info = sum(r[3] == "INFO" for r in ROWS)
    print(f"SUMMARY: {n_pass} pass, {n_fail} fail, {n_info} info")
    if n_fail:
        sys.exit(1)
