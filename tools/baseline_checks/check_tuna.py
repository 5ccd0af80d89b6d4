"""TUNA: ours (proteus.baselines.tuna.TUNA) against the released code (the authors' last commit 77d4f10 of
ICCV2025-TUNA, as kept by the fork Ngahoang2005/ICCV2025-TUNA: models/tuna.py Learner, backbone/vit_tuna.py,
backbone/linears.py, utils/inc_net.py TUNANet), executed on CPU.

Their Learner is built by its own __init__ and trained by its own incremental_train (the epoch loop, SGD with
CosineAnnealingLR, CosFace, the orthogonality term, adapter_update, merge, _compute_mean, classifer_align)
over three tasks; ours by its real fit_task. Harness adaptations (their files are not edited):
  * utils.inc_net.get_backbone builds their VisionTransformer (backbone/vit_tuna.py) at ViT-Ti/16, 32 px,
    with our perturbed random ViT-Ti's weights, qkv split into q/k/v and mlp.fc* renamed as their
    vit_base_patch16_224_in21k_adapter does, and its freeze loop; it does not load a pretrained ViT-B;
  * timm.models.layers.weight_init (timm < 0.9, imported by backbone/linears.py) is given timm.layers'
    trunc_normal_; their DataLoaders run without worker processes (models.tuna.num_workers = 0); TUNANet's
    out_dim, which it sets to ViT-B's 768, is set to the ViT-Ti's 192;
  * a stub data manager gives their loaders our images (one batch per epoch: 4 images, 2 classes a task);
    their shuffled training loader goes through them in our order (our task generator's randperm per epoch);
  * dropout: before every training forward (theirs: their backbone in train mode; ours: fit_task's) torch's
    global stream is seeded with the step's number, so both draw the same dropout masks (the release's 0.1);
  * the random draws: their adapter initialisation (their __init__) and their head of each task (their
    update_fc's trunc_normal_) are copied into ours; the alignment's draws: their MultivariateNormal and
    torch.randperm are swapped, during classifer_align only, for draws of the same generator ours uses
    (eps N(0, I) per class, then one permutation), factored by their own covariance (their Cholesky).
Settings: their exps/tuna_imga.json (SGD lr 0.01, CosFace margin 0.3, scale 20, use_orth with reg 1e-3,
decay on, ca_lr 0.01, weight decay 5e-4, r 16), 3 epochs and 3 alignment epochs.

Compared per task: the CosFace loss and the orthogonality term of every step, the open adapter and every head
after the task, the merged adapter (EMR), every class's mean and covariance, the alignment's losses; after
the third task, on held-out images: the features under every adapter, the entropy-selected adapter, their
"universal" features, the combined probabilities and the predictions of their _eval_cnn.
"""

import types
from functools import partial

import common
import numpy as np
import torch
import torch.nn as nn
from common import info, mad, report

EPOCHS, BS, CA_EPOCHS, TASKS = 3, 4, 3, 3
SETTINGS = dict(lr=0.01, margin=0.3, cos_scale=20.0, ortho_weight=1e-3, ca_lr=0.01, ca_epochs=CA_EPOCHS)
clf = common.build("tuna", **SETTINGS)
clf.config.train.epochs, clf.config.train.batch_size = EPOCHS, BS
clf.config.train.weight_decay = 5e-4
plain = common.perturb_backbone(clf)
b = clf.options_
D = clf.embed_dim

import timm.layers  # noqa: E402

import proteus.baselines.adaptformer as af  # noqa: E402
import proteus.baselines.tuna as ours_tuna  # noqa: E402

common.add_path("theirs_tuna")
common.stub("timm.models.layers.weight_init", trunc_normal_=timm.layers.trunc_normal_)
import backbone.vit_tuna as vt  # noqa: E402
import models.tuna as mt  # noqa: E402
import utils.inc_net as inc  # noqa: E402

mt.num_workers = 0


common.ordered_loaders(mt, clf, lambda: L)
ARGS = {
    "memory_size": 0, "device": ["cpu"], "model_name": "tuna",
    "backbone_type": "vit_base_patch16_224_in21k_tuna", "nb_classes": 2 * TASKS, "init_cls": 2,
    "increment": 2,
    "tuned_epoch": EPOCHS, "init_lr": 0.01, "batch_size": BS, "weight_decay": 5e-4, "min_lr": 0,
    "optimizer": "sgd", "scheduler": "cosine", "reg": 0.001, "use_orth": True, "crct_epochs": CA_EPOCHS,
    "ca_lr": 0.01, "ca_storage_efficient_method": "covariance", "decay": True, "r": 16, "scale": 20.0,
    "m": 0.3,
}  # fmt: skip
info(
    "our settings",
    f"sgd lr={b.lr} momentum={b.momentum} schedule={b.schedule} wd={clf.config.train.weight_decay} "
    f"rank={b.adapter_rank} s={b.cos_scale} m={b.margin} reg={b.ortho_weight} ca_lr={b.ca_lr} "
    f"decay={b.ca_mean_decay} universal={b.universal}",
    "theirs: exps/tuna_imga.json (3 epochs, 3 alignment epochs here)",
)


def their_backbone(args, pretrained=False):
    """their VisionTransformer at ViT-Ti/16, 32 px, with our weights (their in21k builder's key mapping)"""
    cfg = types.SimpleNamespace(
        ffn_adapt=True, ffn_option="parallel", ffn_adapter_layernorm_option="none",
        ffn_adapter_init_option="lora", ffn_adapter_scalar="0.1", ffn_num=16, d_model=D, _device="cpu",
        vpt_on=False, vpt_num=0,
    )  # fmt: skip
    m = vt.VisionTransformer(
        img_size=32, patch_size=16, embed_dim=D, depth=12, num_heads=3, mlp_ratio=4, qkv_bias=True,
        norm_layer=partial(nn.LayerNorm, eps=1e-6), num_classes=args["nb_classes"], global_pool=False,
        drop_path_rate=0.0, tuning_config=cfg, r=args["r"],
    )  # fmt: skip
    return common.load_adapter_vit(m, plain, D)


inc.get_backbone = their_backbone
torch.manual_seed(5)
L = mt.Learner(ARGS)
net = L._network
vit = net.backbone
vit.out_dim = D  # TUNANet writes ViT-B's 768
init_adapter = [
    {
        "down_w": a.down_proj.weight,
        "down_b": a.down_proj.bias,
        "up_w": a.up_proj.weight,
        "up_b": a.up_proj.bias,
    }
    for a in vit.cur_adapter
]
init_adapter = [{k: t.detach().clone() for k, t in a.items()} for a in init_adapter]


def their_set(modules):
    return [
        {
            "down_w": a.down_proj.weight,
            "down_b": a.down_proj.bias,
            "up_w": a.up_proj.weight,
            "up_b": a.up_proj.bias,
        }
        for a in modules
    ]


def set_diff(a, b_):
    return max(mad(x[k], y[k]) for x, y in zip(a, b_) for k in af.KEYS)


# ------------------------------------------------------------------ recording and the shared random draws
their_steps = {"n": 0}
_their_forward = vit.forward


def their_forward(x, adapter_id=-1, train=False, fc_only=False):
    if train and vit.training and not fc_only:
        torch.manual_seed(1000 + their_steps["n"])
        their_steps["n"] += 1
    return _their_forward(x, adapter_id, train, fc_only)


vit.forward = their_forward
our_steps = {"n": 0}
_our_embed = clf.embed


def our_embed(z, adapter, train=False, **kw):
    if train:
        torch.manual_seed(1000 + our_steps["n"])
        our_steps["n"] += 1
    return _our_embed(z, adapter, train, **kw)


clf.embed = our_embed

rec = {"cosface": [], "orth": [], "align": [], "our_align": []}
_cos_forward = mt.AngularPenaltySMLoss.forward


def cos_forward(self, wf, labels):
    out = _cos_forward(self, wf, labels)
    rec["cosface"].append(float(out))
    return out


mt.AngularPenaltySMLoss.forward = cos_forward
_orth = mt.Learner.orth_loss


def orth(self, features):
    out = _orth(self, features)
    rec["orth"].append(float(out))
    return out


mt.Learner.orth_loss = orth


class Functional(types.ModuleType):
    """their module's F with a recording cross_entropy (the alignment's only use of it)"""

    def __getattr__(self, name):
        return getattr(torch.nn.functional, name)

    @staticmethod
    def cross_entropy(*a, **k):
        out = torch.nn.functional.cross_entropy(*a, **k)
        rec["align"].append(float(out))
        return out


mt.F = Functional("F")
_align = mt.Learner.classifer_align
_randperm = torch.randperm


def shared_draws(k):
    """during their classifer_align after task k: MultivariateNormal(mean, cov).sample((n,)) = mean + L eps
    and torch.randperm(N), eps and the permutation drawn from ours' generator of the task"""
    g = clf._generator(k)
    real = torch.distributions.MultivariateNormal

    class MVN:
        def __init__(self, loc, covariance_matrix):
            self.m = real(loc, covariance_matrix)

        def sample(self, sample_shape):
            eps = torch.randn(sample_shape[0], self.m.loc.shape[0], generator=g)
            return self.m.loc + (self.m._unbroadcasted_scale_tril @ eps.T).T

    return MVN, (lambda n, *a, **kw: _randperm(n, generator=g))


def their_align(self, model):
    MVN, perm = shared_draws(self._cur_task)
    mt.MultivariateNormal, torch.randperm = MVN, perm
    try:
        return _align(self, model)
    finally:
        mt.MultivariateNormal, torch.randperm = torch.distributions.MultivariateNormal, _randperm


mt.Learner.classifer_align = their_align
_our_align = ours_tuna.align_heads


def our_align(*a, **kw):
    out = _our_align(*a, **kw)
    rec["our_align"] += out
    return out


ours_tuna.align_heads = our_align

# ours starts from their initialisation: the adapter of their __init__, each task's head from their update_fc
af.init_set = lambda sites, rank, device: [
    {k: nn.Parameter(t.clone()) for k, t in a.items()} for a in init_adapter
]
their_head = {}
_fit_epochs = ours_tuna.fit_epochs


def fit_epochs(c, task, k, groups, step_loss, after_step=None):
    def groups2():
        out = groups()
        with torch.no_grad():
            out[1]["params"][-1].copy_(their_head[k])
        return out

    return _fit_epochs(c, task, k, groups2, step_loss, after_step)


ours_tuna.fit_epochs = fit_epochs


# ------------------------------------------------------------------ their data
class Items(torch.utils.data.Dataset):
    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return i, self.x[i], int(self.y[i])


tasks = common.random_tasks(TASKS)
X = {k: common.task_images(clf, t) for k, t in enumerate(tasks)}
Y = {k: torch.as_tensor([y for _, y in t.train]) for k, t in enumerate(tasks)}


class DataManager:
    def get_task_size(self, t):
        return 2

    def get_dataset(self, indices, source, mode, ret_data=False):
        xs, ys = [], []
        for k in range(TASKS):
            keep = torch.as_tensor(np.isin(Y[k].numpy(), indices))
            xs.append(X[k][keep])
            ys.append(Y[k][keep])
        ds = Items(torch.cat(xs), torch.cat(ys))
        return (ds.x, ds.y, ds) if ret_data else ds


dm = DataManager()

# ------------------------------------------------------------------ three tasks on both sides
their_stored = {}  # their adapter_list[k] as task k ended
for k in range(TASKS):
    print(f"== task {k}")
    rec["cosface"], rec["orth"], rec["align"], rec["our_align"] = [], [], [], []
    _update_fc = net.update_fc

    def update_fc(n, nextperiod_initialization=None, _update_fc=_update_fc, k=k):
        _update_fc(n)
        their_head[k] = net.fc.heads[-1][0].weight.detach().clone()

    net.update_fc = update_fc
    L.incremental_train(dm)
    L.after_task()
    net.update_fc = _update_fc
    clf.fit_task(tasks[k], stream_tasks=TASKS)
    log = clf.train_log_
    report(
        f"{k}. CosFace loss of each of the {len(log)} steps",
        mad([r["loss"] for r in log], rec["cosface"]) if len(log) == len(rec["cosface"]) else float("inf"),
        1e-5,
        f"ours {[round(r['loss'], 5) for r in log]} theirs {[round(x, 5) for x in rec['cosface']]}",
    )
    if k:
        # the release trains the earlier adapters too: adapter_update deep-copies cur_adapter with
        # requires_grad on, and get_optimizer takes every parameter named "adapter" that requires grad, so the
        # orthogonality term's gradient (and weight decay, momentum) moves their up projections; ours keeps
        # them as their task left them. The term is compared where both sides hold the same adapters: the
        # first step of task 1 (later, theirs has moved the old adapters it is measured against)
        scale = 1e-3 * np.exp(-(k + 1))
        ours_orth = [r["penalty"] / scale for r in log]
        if k == 1:
            report(
                f"{k}. orthogonality term at the task's first step (before reg exp(-(t+1)))",
                mad(ours_orth[:1], rec["orth"][:1]),
                1e-6,
                f"ours {ours_orth[0]:.6f} theirs {rec['orth'][0]:.6f}",
            )
        info(
            f"{k}. orthogonality term of each step (theirs also trains the old adapters against it)",
            f"ours {[round(float(x), 6) for x in ours_orth]} theirs {[round(x, 6) for x in rec['orth']]}",
        )
        info(
            f"{k}. their earlier adapters moved since their tasks ended (max abs, every block)",
            f"{max(set_diff(their_stored[j], their_set(vit.adapter_list[j])) for j in range(k)):.3e}",
            "ours: unchanged (0)",
        )
    report(
        f"{k}. open adapter after the task (every block, down/up, weights and biases)",
        set_diff(clf.open_, their_set(vit.cur_adapter)),
        1e-5,
    )
    report(
        f"{k}. task {k}'s stored adapter", set_diff(clf.adapters_[k], their_set(vit.adapter_list[k])), 1e-5
    )
    their_stored[k] = [{n: t.detach().clone() for n, t in a.items()} for a in their_set(vit.adapter_list[k])]
    ours_w = torch.cat([h.weight for h in clf.heads_])
    theirs_w = torch.cat([h[0].weight for h in net.fc.heads])
    report(
        f"{k}. every head after the task (rows of the seen classes{', after the alignment' if k else ''})",
        mad(ours_w, theirs_w),
        1e-5,
    )
    if k:
        report(
            f"{k}. universal adapter: our emr_merge of their task adapters against their merge",
            set_diff(af.emr_merge([their_set(a) for a in vit.adapter_list]), their_set(vit.merged_adapter)),
            1e-6,
        )
        info(
            f"{k}. our merged adapter against theirs (max abs; theirs merges adapters it moved)",
            f"{set_diff(clf.merged_, their_set(vit.merged_adapter)):.3e}",
        )
        report(
            f"{k}. alignment: the loss of each of the {len(rec['align'])} steps",
            mad(rec["our_align"], rec["align"])
            if len(rec["align"]) == len(rec["our_align"])
            else float("inf"),
            1e-4,
        )
    for c in tasks[k].classes:
        report(f"{k}. class {c}: mean", mad(clf.stats_[c].mean, L.cls_mean[c]), 1e-5)
        report(
            f"{k}. class {c}: covariance + 1e-4 I",
            mad(clf.stats_[c].covariance("covariance"), L.cls_cov[c]),
            5e-5,
        )

# ------------------------------------------------------------------ test time, on held-out images
print("== test time after task 2, on held-out images")
rng = np.random.default_rng(11)
from PIL import Image  # noqa: E402

held = [Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)) for _ in range(8)]
train_imgs = [im for t in tasks for im, _ in t.train]
held += [Image.blend(train_imgs[i], train_imgs[j], 0.3) for i, j in ((0, 5), (4, 9), (8, 1), (2, 10))]
Xt = torch.stack([clf.eval_transform_(im) for im in held])
Yt = torch.zeros(len(held), dtype=torch.long)
zt = clf.prefix(Xt)
with torch.no_grad():
    vit.eval()
    for t in range(TASKS):
        report(
            f"features under task {t}'s adapter",
            mad(clf.embed(zt, clf.adapters_[t]), _their_forward(Xt, t, False)["features"]),
            1e-5,
        )
    their_uni = _their_forward(Xt, TASKS, False)["features"]
    report(
        "their universal branch (adapter id t + 1) = our task t's adapter",
        mad(clf.embed(zt, clf.adapters_[-1]), their_uni),
        1e-5,
    )
    info(
        "their universal branch against the EMR-merged adapter (max abs diff)",
        f"{mad(clf.embed(zt, clf.merged_), their_uni):.3e}",
        "the release never evaluates the merge",
    )

picks, tops = [], []
_argmin, _topk = torch.argmin, torch.topk


def argmin(x, *a, **kw):
    out = _argmin(x, *a, **kw)
    picks.append(out.clone())
    return out


def topk(x, *a, **kw):
    tops.append(x.detach().clone())
    return _topk(x, *a, **kw)


torch.argmin, torch.topk = argmin, topk
try:
    loader = torch.utils.data.DataLoader(Items(Xt, Yt), batch_size=len(Yt), shuffle=False)
    y_pred, _ = L._eval_cnn(loader)
finally:
    torch.argmin, torch.topk = _argmin, _topk
logits, our_picks = clf.infer(zt)
their_picks = picks[-1]
info(
    "entropy-selected adapters (theirs)",
    str(their_picks.tolist()),
    f"{len(set(their_picks.tolist()))} distinct",
)
report("the entropy-selected adapter of every input (mismatches)", float((our_picks != their_picks).sum()), 0)
# features agree to a few 1e-6, so logits (s = 20) to about 1e-4 and probabilities to a few 1e-5
report("softmax(universal) + softmax(selected), every class", mad(2 * logits.exp(), tops[-1]), 2e-4)
report(
    "their _eval_cnn's prediction (mismatches)",
    float((logits.argmax(1) != torch.as_tensor(y_pred[:, 0])).sum()),
    0,
)
clf.config.baseline["universal"] = "merged"
clf.__dict__.pop("options_", None)
merged_pred = clf.infer(zt)[0].argmax(1)
info(
    "predictions that change with the merged adapter as universal",
    int((merged_pred != logits.argmax(1)).sum()),
)
common.summary()
