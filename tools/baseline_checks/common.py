"""Shared helpers for the side-by-side checks of the baselines against the authors' released code.

The authors' checkouts are looked up in ``$PROTEUS_THEIRS`` (a folder holding ``theirs_inflora``,
``theirs_sdlora``, ``theirs_l2p``, ``theirs_dualprompt``, ``theirs_coda``, ``theirs_adapromptcl``); default:
this script's folder.
See README.md.
"""

import contextlib
import os
import sys
import types
import warnings

import numpy as np
import torch
from PIL import Image

from proteus.config import RunConfig, apply_method
from proteus.experiment.store import build_learner
from proteus.streams.base import Task

# one thread (torch is imported above, so OMP_NUM_THREADS=1 belongs on the command line)
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
        cfg.baseline[k] = v
    torch.manual_seed(0)
    clf = build_learner(cfg, progress=False)
    clf._build()
    clf._stream_tasks = 10
    return clf


def setup_ours(method, epochs, batch_size):
    """our learner for `method` (build), set to train `epochs` epochs of batches of batch_size, its ViT
    perturbed (perturb_backbone); returns (clf, plain), plain: the ViT their side is built from"""
    clf = build(method)
    clf.config.train.epochs, clf.config.train.batch_size = epochs, batch_size
    return clf, perturb_backbone(clf)


def perturb_backbone(clf, scale=0.05, seed=1):
    """adds scale * N(0, 1) noise (a generator of its own, seeded) to every weight of the learner's ViT, so
    that the random ViT is less degenerate; returns plain_vit(clf) of the result (their side's weights)"""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in clf.backbone_.vit.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))
    return plain_vit(clf)


def random_tasks(n):
    """n tasks of 4 random 32x32 RGB images (numpy seed 0): task k has classes 2k, 2k+1 and the labels
    2k, 2k+1, 2k, 2k+1"""
    rng = np.random.default_rng(0)
    tasks = []
    for k in range(n):
        imgs = [Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)) for _ in range(4)]
        labels = [2 * k, 2 * k + 1, 2 * k, 2 * k + 1]
        tasks.append(Task(k, [2 * k, 2 * k + 1], ["a", "b"], list(zip(imgs, labels)), []))
    return tasks


def task_images(clf, task):
    """the task's training images through the learner's eval transform, stacked"""
    return torch.stack([clf.eval_transform_(im) for im, _ in task.train])


@contextlib.contextmanager
def recording_optimizer(name):
    """inside the block, torch.optim.<name> (e.g. "Adam", "SGD") is a subclass that records, at each
    construction, the parameters (rec["params"]), copies of their initial values (rec["init"]) and the
    keyword arguments (rec["kw"]): one list entry per construction, in order (their code's as well where it
    looks the class up in torch.optim). Yields rec; torch.optim.<name> is restored on exit."""
    base = getattr(torch.optim, name)
    rec = {"init": [], "params": [], "kw": []}

    class Recording(base):
        def __init__(self, params, *a, **k):
            params = list(params)
            rec["init"].append([p.detach().clone() for p in params])
            rec["params"].append(params)
            rec["kw"].append(k)
            super().__init__(params, *a, **k)

    setattr(torch.optim, name, Recording)
    try:
        yield rec
    finally:
        setattr(torch.optim, name, base)


def port_prompt_pool(length, pool_size, top_k, batchwise):
    """the prompt-pool keyword arguments of the L2P / DualPrompt ports' VisionTransformer that both checks
    use: queries from the cls feature, prompts and keys initialised uniform"""
    return dict(
        prompt_length=length,
        embedding_key="cls",
        prompt_init="uniform",
        prompt_pool=True,
        prompt_key=True,
        pool_size=pool_size,
        top_k=top_k,
        batchwise_prompt=batchwise,
        prompt_key_init="uniform",
    )


def load_port_vit(m, state, optional):
    """loads state into the port's model m, every key but those in optional (heads, prompts: set by the
    caller) required; returns m in eval mode"""
    missing, unexpected = m.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= set(optional), (missing, unexpected)
    return m.eval()


def port_adam(m, lr):
    """the optimiser of the L2P / DualPrompt PyTorch ports (JH-LEE-KR): main.py freezes blocks, patch_embed,
    cls_token, norm and pos_embed of the model m; Adam over the rest (betas (0.9, 0.999), eps 1e-8, no weight
    decay)"""
    for n, p in m.named_parameters():
        p.requires_grad = not n.startswith(("blocks", "patch_embed", "cls_token", "norm", "pos_embed"))
    return torch.optim.Adam(
        [p for p in m.parameters() if p.requires_grad],
        lr=lr,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=0.0,
    )


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


# ---------------------------------------------------------------- parallel-adapter releases (TUNA, MOS)
class OurOrder(torch.utils.data.Sampler):
    """the order ours trains in: one torch.randperm per epoch from the generator seeded with the task's seed
    (ContinualClassifier.batches); the dropout masks fall on the same images only in the same order"""

    def __init__(self, n, seed):
        self.n, self.g = n, torch.Generator().manual_seed(seed)

    def __len__(self):
        return self.n

    def __iter__(self):
        return iter(torch.randperm(self.n, generator=self.g).tolist())


def ordered_loaders(module, clf, learner):
    """make ``module.DataLoader`` (their models/*.py's) go through a shuffled set (their training loader) in
    our order for the learner's current task; other loaders unchanged. ``learner()`` returns their Learner."""
    from proteus.engine.runtime import task_seed

    their = module.DataLoader

    def data_loader(ds, batch_size=1, shuffle=False, **kw):
        if shuffle:
            order = OurOrder(len(ds), task_seed(clf.config.seed, learner()._cur_task))
            return their(ds, batch_size=batch_size, sampler=order, **kw)
        return their(ds, batch_size=batch_size, shuffle=False, **kw)

    module.DataLoader = data_loader


def load_adapter_vit(m, plain, d, adapter="adapter"):
    """our timm ViT's weights into their AdaptFormer-style VisionTransformer ``m`` (qkv split into q/k/v,
    mlp.fc* renamed, as their in21k builders do), only heads and adapters (the parameters whose name holds
    ``adapter``) left trainable; returns ``m``"""
    state = {k: v for k, v in plain.state_dict().items() if not k.startswith("head")}
    for key in list(state):
        if "qkv." in key:
            w = state.pop(key)
            for j, n in enumerate("qkv"):
                state[key.replace("qkv.", f"{n}_proj.")] = w[j * d : (j + 1) * d]
        elif "mlp.fc" in key:
            state[key.replace("mlp.", "")] = state.pop(key)
    missing, unexpected = m.load_state_dict(state, strict=False)
    assert not unexpected and all(adapter in k or k.startswith("head") for k in missing), (
        missing,
        unexpected,
    )
    for name, p in m.named_parameters():
        p.requires_grad = "head" in name or adapter in name
    return m
