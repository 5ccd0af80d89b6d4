"""MoAL: ours (proteus.baselines.moal.MoAL) against the released code (Zi-Jian-Gao/Moal @ d83d3d6: the folder
Moal/: models/adapt_ac_com_sdc_EMA_auto.py Learner, utils/AC_net.py SimpleVitNet_AL, utils/inc_net.py
MultiBranchCosineIncrementalNet_adapt_AC, backbone/vision_transformer_adapter.py, backbone/linears.py),
executed on CPU.

Their Learner is built by its own __init__ and runs its own incremental_train over three tasks: task 1's
_init_train (SGD under CosineAnnealingLR, the cosine classifier's cross-entropy),
construct_dual_branch_network, update_fc, _compute_means and cls_align (optimise_ridge_parameter, the inverse,
0.9 R A^T Y); the later tasks' _progreessive_train (the cosine classifier over every seen class, the adapter's
moving average after every epoch, the average copied back), _compute_means, cali_prototye_model (the mean-
drift map: 1000 epochs of SGD, the best held-out epoch), _compute_relations, _build_feature_set, IL_align and
cali_weight (the rumination); after_task between tasks. Ours runs its real fit_task. Harness adaptations
(their files are not edited):
  * utils.AC_net.get_backbone and utils.inc_net.get_backbone build their VisionTransformer
    (backbone/vision_transformer_adapter.py) at ViT-Ti/16, 32 px with our perturbed random ViT-Ti's weights
    (qkv split, mlp.fc* renamed, only the adapters trainable, as their builder does), out_dim the ViT-Ti's
    192; the tuning config is a SimpleNamespace (no easydict);
  * numpy 2 has no np.mat, which their cls_align inverts with: np.mat is given np.asmatrix;
  * their DataLoaders run without worker processes; a stub data manager gives their loaders our images
    (24 per task, 2 classes) as (index, image, label) items through our evaluation transform. Their shuffled
    training loader goes through them in our order (our task generator's randperm per pass, the passes after
    training included); their mean-drift map's random_split, its shuffled loader and the rumination's shuffled
    loader draw from the generator ours draws from (task_seed(seed, k, 800));
  * dropout: before every training forward torch's global stream is seeded with the step's number on both
    sides, so both draw the same masks (the release's 0.1 on the adapter's bottleneck);
  * the random draws no seed can make equal are copied from their side into ours (compared in distribution
    first): the initial adapter, task 1's cosine classifier, the later tasks' cosine classifier and the
    random expansion (drawn after task 1), and each later task's drift map's initial weights.
Settings: their exps/Moal_cifar224.json (SGD lr 0.01, weight decay 5e-4, alpha 0.999, ffn_num 64, the
release's 1000 drift epochs), Hidden 16 (the release: 5000; fewer than the 19 rows the ridge is fitted on, so
that its choice is not float32 round-off), 3 epochs of batches of 8 (the release: 80 of 48).

Compared per task: the cross-entropy of every step, the adapter after the task (after the moving average), the
later tasks' cosine classifier's rows and sigma, the chosen ridge, R and W after the head's first fit or
after the recursive update and after the rumination, every class mean (the earlier ones after the drift map),
the drift map's weights, the relations; after the third task, on held-out images: the embedding, the logits
and their _eval_cnn's predictions.
"""

import types
from functools import partial

import common
import numpy as np
import torch
import torch.nn as nn
from common import info, mad, report
from PIL import Image

from proteus.engine.runtime import task_seed

EPOCHS, BS, TASKS, PER_CLASS, HIDDEN, RANK = 3, 8, 3, 12, 16, 64
SETTINGS = dict(lr=0.01, hidden=HIDDEN, adapter_rank=RANK, adapter_ema=0.999, drift_epochs=1000)
clf = common.build("moal", **SETTINGS)
clf.config.train.epochs, clf.config.train.batch_size = EPOCHS, BS
clf.config.train.weight_decay = 5e-4
plain = common.perturb_backbone(clf)
b = clf.options_
D = clf.embed_dim

import proteus.baselines.adaptformer as af  # noqa: E402
import proteus.baselines.moal as ours  # noqa: E402

common.add_path("theirs_moal/Moal")
import backbone.vision_transformer_adapter as vta  # noqa: E402
import models.adapt_ac_com_sdc_EMA_auto as mt  # noqa: E402
import utils.AC_net as acn  # noqa: E402
import utils.inc_net as inc  # noqa: E402

np.mat = np.asmatrix  # numpy 2 removed the alias their cls_align inverts with
ARGS = {
    "memory_size": 0,
    "device": ["cpu"],
    "model_name": "adapt_ac_com_sdc_ema_auto",
    "backbone_type": "pretrained_vit_b16_224_adapter",
    "init_cls": 2,
    "increment": 2,
    "Hidden": HIDDEN,
    "alpha": 0.999,
    "tuned_epoch": EPOCHS,
    "progreesive_epoch": EPOCHS,
    "init_lr": 0.01,
    "progressive_lr": 0.01,
    "batch_size": BS,
    "weight_decay": 5e-4,
    "min_lr": 0,
    "ffn_num": RANK,
    "optimizer": "sgd",
}
info(
    "our settings",
    f"{b.optimizer} lr={b.lr} momentum={b.momentum} schedule={b.schedule} wd={clf.config.train.weight_decay} "
    f"rank={b.adapter_rank} s={b.adapter_scale} dropout={b.adapter_dropout} alpha={b.adapter_ema} "
    f"hidden={b.hidden} drift_epochs={b.drift_epochs} rumination={b.rumination}",
    f"theirs: exps/Moal_cifar224.json (Hidden {HIDDEN}, {EPOCHS} epochs of batch {BS} here)",
)


def their_backbone(args, pretrained=False):
    """their VisionTransformer at ViT-Ti/16, 32 px, with our weights (their builder's key mapping)"""
    cfg = types.SimpleNamespace(
        ffn_adapt=True,
        ffn_option="parallel",
        ffn_adapter_layernorm_option="none",
        ffn_adapter_init_option="lora",
        ffn_adapter_scalar="0.1",
        ffn_num=args["ffn_num"],
        d_model=D,
        vpt_on=False,
        vpt_num=0,
    )
    m = vta.VisionTransformer(
        img_size=32,
        patch_size=16,
        embed_dim=D,
        depth=12,
        num_heads=3,
        mlp_ratio=4,
        qkv_bias=True,
        norm_layer=partial(nn.LayerNorm, eps=1e-6),
        num_classes=0,
        global_pool=False,
        drop_path_rate=0.0,
        tuning_config=cfg,
    )
    m = common.load_adapter_vit(m, plain, D, adapter="adaptmlp")
    m.out_dim = D
    return m.eval()


acn.get_backbone = inc.get_backbone = their_backbone


def their_set(vit):
    return [
        {
            "down_w": blk.adaptmlp.down_proj.weight,
            "down_b": blk.adaptmlp.down_proj.bias,
            "up_w": blk.adaptmlp.up_proj.weight,
            "up_b": blk.adaptmlp.up_proj.bias,
        }
        for blk in vit.blocks
    ]


def set_diff(a, b_):
    return max(mad(x[k], y[k]) for x, y in zip(a, b_) for k in af.KEYS)


def ks(a, b_):
    """two-sample Kolmogorov-Smirnov statistic and its critical value at alpha = 0.001"""
    a, b_ = (np.sort(torch.as_tensor(v).detach().double().numpy().ravel()) for v in (a, b_))
    grid = np.concatenate([a, b_])
    d = np.abs(np.searchsorted(a, grid, "right") / len(a) - np.searchsorted(b_, grid, "right") / len(b_))
    return float(d.max()), 1.949 * np.sqrt((len(a) + len(b_)) / (len(a) * len(b_)))


def in_distribution(name, mine, theirs):
    stat, crit = ks(mine, theirs)
    report(
        f"{name} in distribution (two-sample KS against its 0.001 critical value)",
        max(0.0, stat - crit),
        0,
        f"KS {stat:.4f}, critical {crit:.4f}",
    )


def rel(a, b_):
    """max abs difference over the largest magnitude of b_"""
    return mad(a, b_) / max(float(torch.as_tensor(b_).detach().abs().max()), 1e-30)


torch.manual_seed(5)
L = mt.Learner(ARGS)
vit = L._network.backbone

# ------------------------------------------------------------------ the data
rng = np.random.default_rng(0)
tasks = []
for k in range(TASKS):
    protos = [rng.integers(0, 256, (32, 32, 3)) for _ in range(2)]
    items = []
    for i in range(2 * PER_CLASS):  # each class: noisy copies of its own random image
        c = i % 2
        a = 0.6 * protos[c] + 0.4 * rng.integers(0, 256, (32, 32, 3))
        items.append((Image.fromarray(a.astype(np.uint8)), 2 * k + c))
    tasks.append(common.Task(k, [2 * k, 2 * k + 1], ["a", "b"], items, []))
held_out = []
for t in tasks:
    for im, y in t.train[:4]:
        a = 0.9 * np.asarray(im, dtype=np.float64) + 0.1 * rng.integers(0, 256, (32, 32, 3))
        held_out.append((Image.fromarray(a.astype(np.uint8)), y))


class Items(torch.utils.data.Dataset):
    def __init__(self, items):
        self.x = torch.stack([clf.eval_transform_(im) for im, _ in items])
        self.y = torch.as_tensor([y for _, y in items])
        self.labels = self.y.numpy()

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return i, self.x[i], int(self.y[i])


class DataManager:
    def get_task_size(self, t):
        return 2

    def get_dataset(self, indices, source, mode, ret_data=False):
        items = [it for t in tasks for it in t.train] if source == "train" else held_out
        ds = Items([it for it in items if it[1] in {int(i) for i in indices}])
        return (ds.x, ds.y, ds) if ret_data else ds


# ------------------------------------------------------------------ their loaders and draws in our order
gens = {}  # task -> the generator ours draws the drift map's split and orders and the rumination's from


def task_gen():
    k = L._cur_task
    if k not in gens:
        gens[k] = torch.Generator().manual_seed(task_seed(clf.config.seed, k, 800))
    return gens[k]


class Order(torch.utils.data.Sampler):
    def __init__(self, n, g):
        self.n, self.g = n, g

    def __len__(self):
        return self.n

    def __iter__(self):
        return iter(torch.randperm(self.n, generator=self.g).tolist())


_DataLoader = mt.DataLoader


def data_loader(ds, batch_size=1, shuffle=False, **kw):
    kw["num_workers"] = 0
    if not shuffle:
        return _DataLoader(ds, batch_size=batch_size, shuffle=False, **kw)
    if isinstance(ds, Items):  # their training loader: our task generator, one randperm per pass
        g = torch.Generator().manual_seed(task_seed(clf.config.seed, L._cur_task))
    else:  # the drift map's training subset, the rumination's features: ours' generator of the task
        g = task_gen()
    return _DataLoader(ds, batch_size=batch_size, sampler=Order(len(ds), g), **kw)


mt.DataLoader = data_loader
_random_split = mt.random_split
mt.random_split = lambda ds, lengths: _random_split(ds, lengths, generator=task_gen())

# dropout: torch's global stream seeded with the step's number before every training forward, both sides
their_steps = {"n": 0}
_their_forward = vta.VisionTransformer.forward


def their_forward(self, x):
    if self.training:
        torch.manual_seed(1000 + their_steps["n"])
        their_steps["n"] += 1
    return _their_forward(self, x)


vta.VisionTransformer.forward = their_forward
our_steps = {"n": 0}
_our_embed = clf.embed


def our_embed(z, adapter, train=False):
    if train:
        torch.manual_seed(1000 + our_steps["n"])
        our_steps["n"] += 1
    return _our_embed(z, adapter, train)


clf.embed = our_embed

# ------------------------------------------------------------------ recording
rec = {"ce": [], "ridge": [], "il": [], "cali": [], "drift_init": [], "drift": [], "rel": [], "our": {}}


class Functional(types.ModuleType):
    """their module's F with a recording cross_entropy (their training steps' only)"""

    def __getattr__(self, name):
        return getattr(torch.nn.functional, name)

    @staticmethod
    def cross_entropy(*a, **k):
        out = torch.nn.functional.cross_entropy(*a, **k)
        rec["ce"].append(float(out))
        return out


mt.F = Functional("F")
_ridge = mt.Learner.optimise_ridge_parameter
mt.Learner.optimise_ridge_parameter = lambda self, X, Y: (
    rec["ridge"].append(_ridge(self, X, Y)) or rec["ridge"][-1]
)


def after(name, method):
    """record (W, R) after their method"""
    base = getattr(mt.Learner, name)

    def wrapped(self, *a):
        out = base(self, *a)
        rec[method].append((self._network.ac_model.fc[-1].weight.t().detach().clone(), self.R.clone()))
        return out

    setattr(mt.Learner, name, wrapped)


after("IL_align", "il")
after("cali_weight", "cali")


_simple_nn = mt.SimpleNN.__init__


def simple_nn(self, *a, **k):
    """their drift map's __init__: its initial weights recorded and the instance kept (its best weights are
    loaded in it)"""
    _simple_nn(self, *a, **k)
    rec["drift_init"].append((self.fc.weight.detach().clone(), self.fc.bias.detach().clone()))
    rec["drift"].append(self)


mt.SimpleNN.__init__ = simple_nn
_relations = mt.Learner._compute_relations


def relations(self):
    _relations(self)
    rec["rel"].append(np.asarray(self._relations) - self._known_classes)


mt.Learner._compute_relations = relations

# ------------------------------------------------------------------ ours starts from their draws
init_adapter = af.clone_set(their_set(vit))
torch.manual_seed(7)
own = af.init_set(clf.sites_, b.adapter_rank, torch.device("cpu"))
report(
    "initial adapter: up projections and biases (ours' own init_set, theirs' Adapter 'lora'), exact",
    max(mad(o[k], t[k]) for o, t in zip(own, init_adapter) for k in ("down_b", "up_w", "up_b")),
    0,
)
in_distribution(
    "initial adapter: down projections",
    torch.cat([a["down_w"].ravel() for a in own]),
    torch.cat([a["down_w"].ravel() for a in init_adapter]),
)
ours.init_set = lambda sites, rank, device: [
    {k: nn.Parameter(t.clone()) for k, t in a.items()} for a in init_adapter
]
their_fc = {}
_new_rows = clf._new_rows


def new_rows(n, g=None):
    mine = _new_rows(n, g)
    if g is None:  # task 1's classifier, drawn as training starts
        in_distribution("task 1's cosine classifier rows", mine, their_fc["first"])
        return their_fc["first"].clone()
    return mine


clf._new_rows = new_rows


class CosineLinear(mt.CosineLinear):
    """their task-1 classifier, its initial rows recorded"""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        their_fc["first"] = self.weight.detach().clone()


mt.CosineLinear = CosineLinear
_draw_head = clf._draw_head


def draw_head(n, g):
    E, rows = _draw_head(n, g)
    net = L._network
    theirs_E, theirs_rows = net.ac_model.fc[0].weight.detach().clone(), net.fc.weight.detach().clone()
    in_distribution("the random expansion E", E, theirs_E)
    in_distribution("the later tasks' cosine classifier's first rows", rows, theirs_rows)
    return theirs_E, theirs_rows


clf._draw_head = draw_head
_drift_init = ours.drift_init


def drift_init(d, g):
    """their drift map's initial weights (ours' own rule drawn from another generator, compared first: the
    task's generator then goes on as theirs, which draws the map from torch's global stream)"""
    in_distribution(
        "the drift map's initial weights",
        _drift_init(d, torch.Generator().manual_seed(3))[0],
        rec["drift_init"][-1][0],
    )
    return rec["drift_init"][-1]


ours.drift_init = drift_init
for name in ("drift_map", "relations"):
    base = getattr(ours, name)

    def recording(*a, _base=base, _name=name):
        out = _base(*a)
        rec["our"].setdefault(_name, []).append(out)
        return out

    setattr(ours, name, recording)
_ruminate = clf._ruminate


def ruminate(R, W, *a):
    rec["our"]["il"] = (W.clone(), R.clone())
    out = _ruminate(R, W, *a)
    rec["our"]["ruminated"] = out[2]
    return out


clf._ruminate = ruminate

# ------------------------------------------------------------------ three tasks side by side
dm = DataManager()
for k in range(TASKS):
    print(f"== task {k + 1}")
    n_ce = len(rec["ce"])
    rec["our"] = {}
    frozen_before = {n: p.detach().clone() for n, p in vit.named_parameters() if "adaptmlp" not in n}
    L.incremental_train(dm)
    stats = clf.fit_task(tasks[k], stream_tasks=TASKS)
    net = L._network
    ce = rec["ce"][n_ce:]
    log = clf.train_log_
    report(f"{k + 1}. steps", abs(len(log) - len(ce)), 0)
    report(
        f"{k + 1}. cross-entropy of every step",
        mad([r["loss"] for r in log], ce) if len(log) == len(ce) else float("inf"),
        1e-5,
        f"ours {[round(r['loss'], 4) for r in log]}",
    )
    their_vit = net.backbones[0]
    report(
        f"{k + 1}. the adapter after the task (the moving average from task 2 on)",
        set_diff(clf.adapter_, their_set(their_vit)),
        1e-5,
    )
    if k:
        info(
            f"{k + 1}. their frozen ViT weights after the moving average (max abs change)",
            f"{max(mad(p, frozen_before[n]) for n, p in their_vit.named_parameters() if n in frozen_before):.3e}",  # noqa: E501
            "alpha x + (1 - alpha) x is not always x in float32: their average runs over every weight",
        )
        report(
            f"{k + 1}. the later tasks' cosine classifier: every row after training, relative",
            rel(clf.rows_, net.fc.weight),
            1e-5,
        )
        info(
            f"{k + 1}. the largest norm of this task's rows after training (ours)",
            f"{float(clf.rows_[-2:].norm(dim=1).max()):.3e}",
            "they start at zero, where the cosine's normalisation has a gradient of 1/eps (1e12)",
        )
        report(f"{k + 1}. its sigma", mad(clf.sigma_, net.fc.sigma), 1e-6)
        f_ours, st = rec["our"]["drift_map"][-1]
        f_theirs = rec["drift"][-1]
        info(
            f"{k + 1}. the drift map's held-out error (ours) against the identity's",
            f"{st['drift_val_mse']:.3e} / {st['identity_val_mse']:.3e}",
        )
        report(
            f"{k + 1}. the drift map after its best epoch (weights and bias)",
            max(mad(f_ours.weight, f_theirs.fc.weight), mad(f_ours.bias, f_theirs.fc.bias)),
            1e-5,
        )
        report(
            f"{k + 1}. the relations (each earlier class's new class, mismatches)",
            float((rec["our"]["relations"][-1].numpy() != rec["rel"][-1]).sum()),
            0,
            f"ours {rec['our']['relations'][-1].tolist()}",
        )
        W_il, R_il = rec["il"][-1]
        report(
            f"{k + 1}. W after the recursive update over the task (IL_align), relative",
            rel(rec["our"]["il"][0], W_il),
            1e-4,
        )
        report(f"{k + 1}. R after it, relative", rel(rec["our"]["il"][1], R_il), 1e-4)
        W_c, R_c = rec["cali"][-1]
        info(f"{k + 1}. rows the rumination updated on (ours)", rec["our"]["ruminated"])
        report(f"{k + 1}. W after the rumination (cali_weight), relative", rel(clf.W_, W_c), 1e-4)
        report(f"{k + 1}. R after it, relative", rel(clf.R_, R_c), 1e-4)
    else:
        report(
            "1. the ridge chosen (optimise_ridge_parameter)",
            abs(np.log10(stats.extra["ridge"]) - np.log10(rec["ridge"][-1])),
            0,
            f"ours {stats.extra['ridge']:g}, theirs {rec['ridge'][-1]:g}",
        )
        report("1. W = 0.9 R A^T Y (cls_align), relative", rel(clf.W_, net.ac_model.fc[-1].weight.t()), 1e-4)
        report("1. R = (A^T A + ridge I)^-1, relative", rel(clf.R_, L.R), 1e-4)
    report(
        f"{k + 1}. every class mean (the earlier ones carried by the drift map)",
        mad(clf.means_, torch.as_tensor(np.array(L._means, dtype=np.float64))),
        1e-5,
    )
    L.after_task()

# ------------------------------------------------------------------ test time
test = Items(held_out)
z = clf.prefix(test.x)
with torch.no_grad():
    theirs_out = L._network(test.x)
    ours_h = clf.embed(z, clf.adapter_)
report("held-out: the embedding under the adapter", mad(ours_h, theirs_out["features"]), 1e-5)
logits = clf.logits_prefix(z)
report("held-out: the logits relu(E h) W over every class, relative", rel(logits, theirs_out["logits"]), 1e-4)
pred, _ = L._eval_cnn(torch.utils.data.DataLoader(test, batch_size=len(test), shuffle=False))
ours_pred = torch.as_tensor(clf.labels_)[logits.argmax(1)]
report(
    "held-out: predictions against their _eval_cnn (mismatches)",
    float((ours_pred != torch.as_tensor(pred[:, 0])).sum()),
    0,
)
info("held-out accuracy (ours)", f"{float((ours_pred == test.y).float().mean()):.3f}", f"of {len(test)}")
common.summary()
