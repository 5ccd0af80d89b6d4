"""MOS: ours (proteus.baselines.mos.MOS) against the released code (sun-hailong/AAAI25-MOS @ 8d5e07c:
models/mos.py Learner, backbone/vit_mos.py, backbone/linears.py, utils/inc_net.py MOSNet), executed on CPU.

Their Learner is built by its own __init__ and trained by its own incremental_train (the epoch loop, SGD with
CosineAnnealingLR, the masked cross-entropy, orth_loss, reweight_adapter's pulls in every forward,
adapter_merge after every step, adapter_update and sum_adapter_param, _compute_mean, classifer_align,
replace_fc) over three tasks; ours by its real fit_task. At test time their _eval_cnn runs as it is (the
prototype classifier, the self-refined retrieval, the ensemble). Harness adaptations (their files are not
edited):
  * utils.inc_net.get_backbone builds their VisionTransformer (backbone/vit_mos.py) at ViT-Ti/16, 32 px,
    with our perturbed random ViT-Ti's weights, qkv split into q/k/v and mlp.fc* renamed as their
    vit_base_patch16_224_mos does, and its freeze loop; it does not load a pretrained ViT-B (and needs no
    easydict: the tuning config is a SimpleNamespace); MOSNet's out_dim, which it sets to ViT-B's 768, is
    set to the ViT-Ti's 192;
  * their DataLoaders run without worker processes (num_workers 0); a stub data manager gives their loaders
    our images (one batch per epoch: 4 images, 2 classes a task); their shuffled training loader goes
    through them in our order (our task generator's randperm per epoch);
  * dropout: before every training forward (theirs: their backbone in train mode; ours: fit_task's) torch's
    global stream is seeded with the step's number, so both draw the same dropout masks (the release's 0.1);
  * replace_fc after task t >= 1 runs, in the release, with the backbone still in train mode (their
    classifer_align calls model.train() and nothing sets eval again), so the prototypes of those tasks see
    dropout on the first adapter's bottleneck. The harness runs their replace_fc as it is, records what it
    wrote (INFO: its distance to ours), then runs it once more in eval mode, which the PASS lines and the
    test time use (ours never drops out outside training);
  * the random draws no seed can make equal are copied from their side into ours: their adapter
    initialisation (their __init__; compared in distribution first) and each task's head rows (their one
    nn.Linear over all classes as the task starts; the first task's also in distribution); the alignment's
    draws: their MultivariateNormal and torch.randperm are swapped, during classifer_align only, for draws
    of the generator ours uses (eps N(0, I) per class, then one permutation), factored by their own
    covariance (their Cholesky);
  * the features under each task's adapter at test time are taken from a deep copy of their backbone (their
    test forward rewrites the stored adapters in place), so their _eval_cnn sees the adapters as stored.
  * each task's images are two random images and a near copy of each (blends at 0.08), the later tasks'
    blends at 0.12 of the first task's: on unrelated random images orth_loss's contrastive term is 0 to
    float precision on both sides, which would compare nothing.
Settings: their exps/mos_cifar.json (SGD lr 0.03, head 0.1 lr, weight decay 5e-4, reg 0.1, adapter_momentum
0.1, ca_lr 0.005, ensemble, ffn_num 16), 3 epochs of batch 4 and 3 alignment epochs (the release: 20, 48, 30).

Compared per task: the cross-entropy and the orth_loss term of every step, the open adapter after every step
(after adapter_merge's pull), the open and stored adapters after the task (the open one after
_compute_mean's pulls), the prefix sums of the adapters, every head (weights, biases) after the task, every
class's mean and covariance, the alignment's losses, the prototypes (replace_fc); after the third task, on
held-out images: each task's adapter block by block as their first test forward uses it, the features under
it, the prototype logits, the prototype-picked task, the self-refined task and logits, the ensemble
probabilities and their _eval_cnn's predictions; the same again with constructed heads (set alike on both
sides) under which, from task t's adapter, the best class is in task t + 1, so every input's refinement runs
its 4 looks (the trained heads give one or two).
"""

import copy
import types
from functools import partial

import common
import numpy as np
import torch
import torch.nn as nn
from common import info, mad, report
from PIL import Image

EPOCHS, BS, CA_EPOCHS, TASKS = 3, 4, 3, 3
SETTINGS = dict(lr=0.03, ortho_weight=0.1, adapter_momentum=0.1, ca_lr=0.005, ca_epochs=CA_EPOCHS)
clf = common.build("mos", **SETTINGS)
clf.config.train.epochs, clf.config.train.batch_size = EPOCHS, BS
clf.config.train.weight_decay = 5e-4
plain = common.perturb_backbone(clf)
b = clf.options_
D = clf.embed_dim

import proteus.baselines.adaptformer as af  # noqa: E402
import proteus.baselines.mos as ours_mos  # noqa: E402

common.add_path("theirs_mos")
import backbone.vit_mos as vm  # noqa: E402
import models.mos as mm  # noqa: E402
import utils.inc_net as inc  # noqa: E402

mm.num_workers = 0


common.ordered_loaders(mm, clf, lambda: L)
ARGS = {
    "memory_size": 0, "device": ["cpu"], "model_name": "mos", "backbone_type": "vit_base_patch16_224_mos",
    "nb_classes": 2 * TASKS, "init_cls": 2, "increment": 2, "tuned_epoch": EPOCHS, "init_lr": 0.03,
    "batch_size": BS, "weight_decay": 5e-4, "min_lr": 0, "optimizer": "sgd", "scheduler": "cosine",
    "reg": 0.1, "adapter_momentum": 0.1, "ensemble": True, "crct_epochs": CA_EPOCHS, "ca_lr": 0.005,
    "ca_storage_efficient_method": "covariance", "ffn_num": 16,
}  # fmt: skip
info(
    "our settings",
    f"{b.optimizer} lr={b.lr} head x{ours_mos.MOS.head_lr_scale} momentum={b.momentum} schedule={b.schedule} "
    f"wd={clf.config.train.weight_decay} rank={b.adapter_rank} s={b.adapter_scale} "
    f"dropout={b.adapter_dropout} beta={b.adapter_momentum} reg={b.ortho_weight} ca_lr={b.ca_lr} "
    f"ca_draws={b.ca_draws} ensemble={b.ensemble} refine_steps={b.refine_steps}",
    "theirs: exps/mos_cifar.json (3 epochs, 3 alignment epochs here), MAX_ITER 4 in _eval_cnn",
)


def their_backbone(args, pretrained=False):
    """their VisionTransformer at ViT-Ti/16, 32 px, with our weights (their builder's key mapping)"""
    cfg = types.SimpleNamespace(
        ffn_adapt=True, ffn_option="parallel", ffn_adapter_layernorm_option="none",
        ffn_adapter_init_option="lora", ffn_adapter_scalar="0.1", ffn_num=args["ffn_num"], d_model=D,
        _device="cpu", adapter_momentum=args["adapter_momentum"], vpt_on=False, vpt_num=0,
    )  # fmt: skip
    m = vm.VisionTransformer(
        img_size=32, patch_size=16, embed_dim=D, depth=12, num_heads=3, mlp_ratio=4, qkv_bias=True,
        norm_layer=partial(nn.LayerNorm, eps=1e-6), num_classes=args["nb_classes"], global_pool=False,
        drop_path_rate=0.0, tuning_config=cfg,
    )  # fmt: skip
    return common.load_adapter_vit(m, plain, D)


inc.get_backbone = their_backbone
torch.manual_seed(5)
L = mm.Learner(ARGS)
net = L._network
vit = net.backbone
vit.out_dim = D  # MOSNet writes ViT-B's 768
head0 = (vit.head.weight.detach().clone(), vit.head.bias.detach().clone())


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


def ks(a, b_):
    """two-sample Kolmogorov-Smirnov statistic and its critical value at alpha = 0.001"""
    a, b_ = (np.sort(torch.as_tensor(v).detach().double().numpy().ravel()) for v in (a, b_))
    grid = np.concatenate([a, b_])
    d = np.abs(np.searchsorted(a, grid, "right") / len(a) - np.searchsorted(b_, grid, "right") / len(b_))
    return float(d.max()), 1.949 * np.sqrt((len(a) + len(b_)) / (len(a) * len(b_)))


# ------------------------------------------------------------------ the initial adapter
init_adapter = af.clone_set(their_set(vit.cur_adapter))
torch.manual_seed(7)
own = af.init_set(clf.sites_, b.adapter_rank, torch.device("cpu"))
report(
    "initial adapter: up projections and biases (ours' own init_set, theirs' Adapter 'lora'), exact",
    max(mad(o[k], t[k]) for o, t in zip(own, init_adapter) for k in ("down_b", "up_w", "up_b")),
    0,
)
stat, crit = ks(
    torch.cat([a["down_w"].ravel() for a in own]), torch.cat([a["down_w"].ravel() for a in init_adapter])
)
report(
    "initial adapter: down projections in distribution (two-sample KS against its 0.001 critical value)",
    max(0.0, stat - crit),
    0,
    f"KS {stat:.4f}, critical {crit:.4f}",
)


# ------------------------------------------------------------------ recording and the shared random draws
their_steps = {"n": 0}
_their_forward = vit.forward
feat_rec = {}  # adapter id -> features of their last forward with it (test time)
looks = []  # the features their self-refinement looked up (fc_only calls at test time)
phase = {"now": "train"}


def their_forward(x, adapter_id=-1, train=False, fc_only=False):
    if train and vit.training and not fc_only:
        torch.manual_seed(1000 + their_steps["n"])
        their_steps["n"] += 1
    out = _their_forward(x, adapter_id, train, fc_only)
    if phase["now"] == "test":
        if fc_only:
            looks.append(x.detach().clone())
        else:
            feat_rec[adapter_id] = out["features"].detach().clone()
    return out


vit.forward = their_forward
our_steps = {"n": 0}
_our_embed = clf.embed


def our_embed(z, adapter, train=False, **kw):
    if train:
        torch.manual_seed(1000 + our_steps["n"])
        our_steps["n"] += 1
    return _our_embed(z, adapter, train, **kw)


clf.embed = our_embed

rec = {"train": [], "align": [], "orth": [], "our_align": [], "their_open": [], "our_open": []}


class Functional(types.ModuleType):
    """their module's F with a recording cross_entropy (the training step's and the alignment's; orth_loss
    calls torch.nn.functional's directly)"""

    def __getattr__(self, name):
        return getattr(torch.nn.functional, name)

    @staticmethod
    def cross_entropy(*a, **k):
        out = torch.nn.functional.cross_entropy(*a, **k)
        rec[phase["now"]].append(float(out))
        return out


mm.F = Functional("F")
_orth = mm.Learner.orth_loss


def orth(self, features, targets):
    out = _orth(self, features, targets)
    rec["orth"].append(float(out))
    return out


mm.Learner.orth_loss = orth
_merge = vit.adapter_merge


def adapter_merge():
    _merge()
    rec["their_open"].append(af.clone_set(their_set(vit.cur_adapter)))


vit.adapter_merge = adapter_merge
_align = mm.Learner.classifer_align
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
    mm.MultivariateNormal, torch.randperm = MVN, perm
    phase["now"] = "align"
    try:
        return _align(self, model)
    finally:
        mm.MultivariateNormal, torch.randperm = torch.distributions.MultivariateNormal, _randperm
        phase["now"] = "train"


mm.Learner.classifer_align = their_align
_replace_fc = mm.Learner.replace_fc
released_protos = {}


def replace_fc(self):
    """their replace_fc as it is (recorded), then once more in eval mode (see the docstring)"""
    rows = slice(self._known_classes, self._total_classes)
    _replace_fc(self)
    released_protos[self._cur_task] = (self._network.backbone.training, self._network.fc.weight[rows].clone())
    self._network.eval()
    return _replace_fc(self)


mm.Learner.replace_fc = replace_fc
_our_align = ours_mos.align_heads


def our_align(*a, **kw):
    out = _our_align(*a, **kw)
    rec["our_align"] += out
    return out


ours_mos.align_heads = our_align

# ours starts from their initialisation: the adapter of their __init__, each task's head from their head
af.init_set = lambda sites, rank, device: [
    {k: nn.Parameter(t.clone()) for k, t in a.items()} for a in init_adapter
]
their_head, our_draw = {}, {}
_fit_epochs = ours_mos.fit_epochs


def fit_epochs(c, task, k, groups, step_loss, after_step=None):
    def groups2():
        out = groups()
        w, bias = out[1]["params"][-2:]
        our_draw[k] = w.detach().clone()
        with torch.no_grad():
            w.copy_(their_head[k][0])
            bias.copy_(their_head[k][1])
        return out

    def after_step2():
        after_step()
        rec["our_open"].append(af.clone_set(c.open_))

    return _fit_epochs(c, task, k, groups2, step_loss, after_step2)


ours_mos.fit_epochs = fit_epochs


# ------------------------------------------------------------------ their data
class Items(torch.utils.data.Dataset):
    def __init__(self, x, y):
        self.x, self.y = x, y
        self.labels = y.numpy()

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return i, self.x[i], int(self.y[i])


# each task: two images and a near copy of each (blends at 0.08), so that the contrastive orth_loss term is
# not 0 on the batch; the later tasks' images are blends at 0.12 of the first task's, near its class means
tasks = common.random_tasks(TASKS)
R = [im for t in tasks for im, _ in t.train]
for k, t in enumerate(tasks):
    a, b_ = (
        (R[0], R[1]) if k == 0 else (Image.blend(R[0], R[4 * k], 0.12), Image.blend(R[1], R[4 * k + 1], 0.12))
    )
    ims = [a, b_, Image.blend(a, R[4 * k + 2], 0.08), Image.blend(b_, R[4 * k + 3], 0.08)]
    t.train[:] = list(zip(ims, [2 * k, 2 * k + 1, 2 * k, 2 * k + 1]))
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


def their_sums(t):
    return [
        {
            "down_w": vit.down_weight_sum[i][t],
            "down_b": vit.down_bias_sum[i][t],
            "up_w": vit.up_weight_sum[i][t],
            "up_b": vit.up_bias_sum[i][t],
        }
        for i in range(len(vit.blocks))
    ]


# ------------------------------------------------------------------ three tasks on both sides
for k in range(TASKS):
    print(f"== task {k}")
    for key in rec:
        rec[key] = []
    _update_fc = net.update_fc

    def update_fc(n, nextperiod_initialization=None, _update_fc=_update_fc, k=k):
        _update_fc(n)
        rows = slice(2 * k, 2 * k + 2)
        their_head[k] = (vit.head.weight[rows].detach().clone(), vit.head.bias[rows].detach().clone())

    net.update_fc = update_fc
    L.incremental_train(dm)
    L.after_task()
    net.update_fc = _update_fc
    clf.fit_task(tasks[k], stream_tasks=TASKS)
    log = clf.train_log_
    n = len(log)
    if k == 0:
        stat, crit = ks(our_draw[0], their_head[0][0])
        report(
            "0. the task's initial head weights in distribution (KS against its 0.001 critical value)",
            max(0.0, stat - crit),
            0,
            f"KS {stat:.4f}, critical {crit:.4f}",
        )
    else:
        info(
            f"{k}. their head rows of task {k} when it starts, against their construction (max abs)",
            f"{mad(their_head[k][0], head0[0][2 * k : 2 * k + 2]):.3e}",
            "weight decay and momentum move the not yet used rows of their one head",
        )
    report(
        f"{k}. cross-entropy of each of the {n} steps",
        mad([r["loss"] for r in log], rec["train"]) if n == len(rec["train"]) else float("inf"),
        1e-5,
        f"ours {[round(r['loss'], 5) for r in log]} theirs {[round(x, 5) for x in rec['train']]}",
    )
    report(
        f"{k}. orth_loss term (reg x contrastive) of each step",
        mad([r["penalty"] for r in log], rec["orth"]) if n == len(rec["orth"]) else float("inf"),
        1e-5,
        f"ours {[round(r['penalty'], 5) for r in log]} theirs {[round(x, 5) for x in rec['orth']]}",
    )
    report(
        f"{k}. open adapter after every step's pull (adapter_merge; every block, down/up, weights, biases)",
        max(set_diff(o, t) for o, t in zip(rec["our_open"], rec["their_open"]))
        if len(rec["our_open"]) == len(rec["their_open"]) == n
        else float("inf"),
        1e-5,
    )
    report(
        f"{k}. task {k}'s stored adapter", set_diff(clf.adapters_[k], their_set(vit.adapter_list[k])), 1e-5
    )
    report(
        f"{k}. open adapter after the task (after the statistics' pulls)",
        set_diff(clf.open_, their_set(vit.cur_adapter)),
        1e-5,
    )
    report(
        f"{k}. prefix sums of the adapters (sum_adapter_param), every task so far",
        max(set_diff(clf._sums[t], their_sums(t)) for t in range(k + 1)),
        1e-5,
    )
    total = 2 * (k + 1)
    report(
        f"{k}. every head after the task, weights (seen classes{', after the alignment' if k else ''})",
        mad(torch.cat([h.weight for h in clf.heads_]), vit.head.weight[:total]),
        1e-5,
    )
    report(
        f"{k}. every head after the task, biases",
        mad(torch.cat([h.bias for h in clf.heads_]), vit.head.bias[:total]),
        1e-5,
    )
    if k:
        report(
            f"{k}. alignment: the loss of each of the {len(rec['align'])} steps",
            mad(rec["our_align"], rec["align"])
            if len(rec["align"]) == len(rec["our_align"]) > 0
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
    rows = slice(2 * k, total)
    report(
        f"{k}. prototypes of the task's classes (replace_fc, under the first adapter)",
        mad(clf.prototypes_[rows], net.fc.weight[rows]),
        1e-5,
    )
    was_training, protos_released = released_protos[k]
    info(
        f"{k}. their replace_fc as released (backbone in train mode: {was_training}): prototypes vs ours",
        f"{mad(clf.prototypes_[rows], protos_released):.3e}",
        "dropout on the first adapter's bottleneck" if was_training else "",
    )
info("their prototype classifier's sigma (ours: none, i.e. 1)", float(net.fc.sigma))

# ------------------------------------------------------------------ test time, on held-out images
print("== test time after task 2, on held-out images")
rng = np.random.default_rng(11)
held = [Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)) for _ in range(8)]
train_imgs = [im for t in tasks for im, _ in t.train]
held += [Image.blend(train_imgs[i], train_imgs[j], 0.3) for i, j in ((0, 5), (4, 9), (8, 1), (2, 10))]
Xt = torch.stack([clf.eval_transform_(im) for im in held])
Yt = torch.zeros(len(held), dtype=torch.long)
zt = clf.prefix(Xt)
net.eval()

# each task's adapter as their first test forward uses it: block l's adapter when block l runs
used = []
_block_forward = vm.Block.forward


def block_forward(self, x, adapt=None):
    if adapt is not None:
        used.append(af.clone_set(their_set([adapt]))[0])
    return _block_forward(self, x, adapt)


with torch.no_grad():
    for t in range(TASKS):
        copy_vit = copy.deepcopy(vit)
        copy_vit.forward = types.MethodType(type(vit).forward, copy_vit)
        used.clear()
        vm.Block.forward = block_forward
        try:
            feats = copy_vit(Xt, adapter_id=t, train=False)["features"]
        finally:
            vm.Block.forward = _block_forward
        report(
            f"task {t}'s adapter as their first test forward uses it (block l pulled l + 1 times)",
            set_diff(clf.test_adapter(t), used),
            1e-5,
        )
        report(f"features under task {t}'s adapter", mad(clf.embed(zt, clf.test_adapter(t)), feats), 1e-5)
    their_orig = net.forward_orig(Xt)["logits"][:, : 2 * TASKS]
    ours_orig = torch.nn.functional.normalize(clf.embed(zt, clf.adapters_[0]), dim=1) @ (
        torch.nn.functional.normalize(clf.prototypes_, dim=1).T
    )
    report(
        "prototype classifier's logits (cosine to the prototypes, first adapter)",
        mad(ours_orig, their_orig),
        1e-5,
    )

refine = []
_self_refine = ours_mos.self_refine


def self_refine(logits, owner, start, steps):
    out = _self_refine(logits, owner, start, steps)
    refine.append((start.clone(), out[0].clone(), out[1].clone()))
    return out


ours_mos.self_refine = self_refine
tops = []
_topk = torch.topk


def topk(x, *a, **kw):
    tops.append(x.detach().clone())
    return _topk(x, *a, **kw)


loader = torch.utils.data.DataLoader(Items(Xt, Yt), batch_size=len(Yt), shuffle=False)
stored = copy.deepcopy(vit.adapter_list)  # their adapters as stored, before their test forwards pull them


def their_eval():
    """their _eval_cnn as it is on the held-out images (one batch): the adapters each input's
    self-refinement looked at (each fc_only call's feature is a row of their features under one adapter),
    the ensemble probabilities and the predictions"""
    looks.clear()
    phase["now"] = "test"
    torch.topk = topk
    try:
        y_pred, _ = L._eval_cnn(loader)
    finally:
        torch.topk = _topk
        phase["now"] = "train"
    seq = [[] for _ in range(len(Yt))]
    for f in looks:
        hits = [(i, t) for t in range(TASKS) for i in range(len(Yt)) if torch.equal(feat_rec[t][i], f[0])]
        assert len(hits) == 1, hits
        seq[hits[0][0]].append(hits[0][1])
    return seq, tops[-1], torch.as_tensor(y_pred[:, 0])


def compare(tag, tol_logits=1e-4, tol_probs=1e-4, note=""):
    seq, probs, pred = their_eval()
    logits, our_picks = clf.infer(zt)
    our_start, our_final, _ = refine[-1]
    their_start = torch.as_tensor([s[0] for s in seq])
    their_picks = torch.as_tensor([s[-1] for s in seq])
    info(f"{tag}their self-refinement, the adapters looked at per input", str(seq))
    info(
        f"{tag}inputs whose retrieved task differs from the prototype's",
        int((their_start != their_picks).sum()),
        f"of {len(Yt)}; looks per input {[len(s) for s in seq]}",
    )
    report(
        f"{tag}the prototype-picked task of every input (mismatches)",
        float((our_start != their_start).sum()),
        0,
    )
    report(
        f"{tag}the retrieved task (self-refinement) of every input (mismatches)",
        float((our_picks != their_picks).sum()),
        0,
    )
    with torch.no_grad():
        their_final = torch.cat(
            [vit.head(feat_rec[t][i : i + 1])[:, : 2 * TASKS] for i, t in enumerate(their_picks.tolist())]
        )
    report(
        f"{tag}the self-refined logits (the last look's head logits), every class",
        mad(our_final, their_final),
        tol_logits,
        note,
    )
    report(
        f"{tag}softmax(refined) + softmax(T x prototype logits), every class",
        mad(2 * logits.exp(), probs),
        tol_probs,
    )
    report(f"{tag}their _eval_cnn's prediction (mismatches)", float((logits.argmax(1) != pred).sum()), 0)
    return logits, probs


# the features agree to a few 1e-6: logits (heads over 192 dimensions) to about 2e-5
logits, probs = compare("")
_, probs2, _ = their_eval()
info(
    "their _eval_cnn a second time on the same images: ensemble probabilities moved by (max abs)",
    f"{mad(probs2, probs):.3e}",
    "their test forward pulls the stored adapters in place; ours does not change (deliberate)",
)
info("ours a second time on the same images (max abs)", f"{mad(clf.infer(zt)[0], logits):.3e}")

# constructed heads (both sides the same) under which the refinement goes on: under task t's adapter the
# best class is in task t + 1's block, so every look moves to the next task until MAX_ITER ends it
print("== test time with constructed heads (longer self-refinement)")
vit.adapter_list = copy.deepcopy(stored)
with torch.no_grad():
    F_t = torch.stack([clf.embed(zt, clf.test_adapter(t)) for t in range(TASKS)])  # (T, N, d)
    centre = F_t.mean(0)  # (N, d)
    # each task's mean offset, without the inputs' own directions (so that the input does not decide)
    Q = torch.linalg.qr((centre - centre.mean(0)).T.double()).Q.float()
    offsets = [(F_t[t] - centre).mean(0) for t in range(TASKS)]
    offsets = [o - Q @ (Q.T @ o) for o in offsets]
    SCALE = 4 / min(float(o.norm()) for o in offsets) ** 2
    W, B = torch.zeros(2 * TASKS, D), torch.zeros(2 * TASKS)
    for t in range(TASKS):
        for j, s in ((0, 1.0), (1, 0.9)):
            row = 2 * ((t + 1) % TASKS) + j
            W[row] = SCALE * s * offsets[t]
            B[row] = -(W[row] * centre).sum(1).mean()
    vit.head.weight[: 2 * TASKS] = W
    vit.head.bias[: 2 * TASKS] = B
    for t, h in enumerate(clf.heads_):
        h.weight.copy_(W[2 * t : 2 * t + 2])
        h.bias.copy_(B[2 * t : 2 * t + 2])
# the features agree to 1e-5 (above); through heads of row norm up to |W| the logits to 1e-5 |W|
norm = float(W.norm(dim=1).max())
compare(
    "constructed heads: ",
    1e-5 * norm,
    5e-3,
    f"heads' largest row norm {norm:.0f} (they amplify adapter offsets of norm "
    f"{min(float(o.norm()) for o in offsets):.1e})",
)
common.summary()
