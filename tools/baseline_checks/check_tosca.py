"""TOSCA: ours (proteus.baselines.tosca.TOSCA) against the released code (the first commit 176f123 of
ladka6/continious_learning, which holds the authors' files: models/tosca.py Learner, backbone/vit_tosca.py,
backbone/linears.py, utils/inc_net.py SimpleVitNet), executed on CPU.

Their Learner is built by its own __init__ and trained by its own incremental_train (the epoch loop, SGD with
CosineAnnealingLR, the cross-entropy over every seen class plus the L1 term, _save_tosca, replace_fc) and
after_task (reset_tosca) over three tasks; ours by its real fit_task. Harness adaptations (their files are
not edited):
  * utils.inc_net.get_backbone wraps our perturbed random ViT-Ti/16 (32 px) in their ToscaViT instead of
    loading a pretrained ViT-B; SimpleVitNet's out_dim, which it sets to ViT-B's 768, is the ViT-Ti's 192;
  * their DataLoaders run without worker processes (models.tosca.num_workers = 0); a stub data manager gives
    their loaders our images (one batch per epoch: the task's 4 images, 2 classes a task) through our
    evaluation transform, their shuffled loaders in our order; their _save_tosca writes to a temporary
    folder;
  * the random draws no seed can make equal are copied from their side into ours, after a comparison in
    distribution: their module before each task (torch's default initialisation at their __init__, Xavier
    after each reset_tosca) and the first task's classifier rows (their CosineLinear's uniform draws);
  * held-out images are near copies of the training images (blends at 0.1 with fresh noise), so that the
    entropy selection has a right answer to find.
Settings: their exps/tosca_inr.json (SGD lr 0.025, momentum 0.9, weight decay 0, l1 5e-4, mlp_ratio and
se_ratio 16, flow tosca), 3 epochs of batch 4. Their scheduler's eta_min is 1e-8, ours 0: the learning rates
differ by at most 1e-8.

Compared per task: the module's and the first rows' initial draws (in distribution), the cross-entropy and
the L1 term of every step, the module after training, every classifier row and sigma after replace_fc; after
the third task, on held-out images: every task's logits, their batch's least-entropy task and logits
(get_lowentropy_logits) against ours with baseline.selection=batch, their _eval_cnn's predictions, and the
per-input least-entropy task against ours with selection=input.
"""

import copy
import os
import tempfile

import common
import numpy as np
import torch
from common import info, mad, report
from PIL import Image

EPOCHS, BS, TASKS = 3, 4, 3
SETTINGS = dict(lr=0.025, l1=5e-4, mlp_ratio=16, se_ratio=16, flow="tosca", selection="batch")
clf = common.build("tosca", **SETTINGS)
clf.config.train.epochs, clf.config.train.batch_size = EPOCHS, BS
plain = common.perturb_backbone(clf)
b = clf.options_
D = clf.embed_dim

import proteus.baselines.tosca as ours  # noqa: E402

common.add_path("theirs_tosca")
import backbone.vit_tosca as vt  # noqa: E402
import models.tosca as mt  # noqa: E402
import utils.inc_net as inc  # noqa: E402

mt.num_workers = 0
common.ordered_loaders(mt, clf, lambda: L)
ARGS = {
    "device": ["cpu"], "model_name": "tosca", "backbone_type": "vit_base_patch16_224_in21k",
    "mlp_ratio": 16, "se_ratio": 16, "l1": 5e-4, "flow": "tosca", "epochs": EPOCHS, "batch_size": BS,
    "optimizer": "sgd", "scheduler": "cosine", "lr": 0.025, "weight_decay": 0, "milestones": [10, 15],
}  # fmt: skip
info(
    "our settings",
    f"{b.optimizer} lr={b.lr} momentum={b.momentum} schedule={b.schedule} wd={clf.config.train.weight_decay} "
    f"l1={b.l1} mlp_ratio={b.mlp_ratio} se_ratio={b.se_ratio} flow={b.flow} selection={b.selection}",
    "theirs: exps/tosca_inr.json (3 epochs of batch 4 here)",
)


def their_backbone(args, pretrained=False):
    """their ToscaViT around a copy of our ViT (its freeze loop, its module drawn here)"""
    return vt.ToscaViT(copy.deepcopy(plain), args["mlp_ratio"], args["se_ratio"], args["flow"]).eval()


inc.get_backbone = their_backbone
torch.manual_seed(5)
L = mt.Learner(ARGS)
net = L._network
net.backbone.out_dim = D

# ---------------------------------------------------------------- the data
tasks = common.random_tasks(TASKS)
rng = np.random.default_rng(1)


def near_copy(im):
    a = np.asarray(im, dtype=np.float64)
    noise = rng.integers(0, 256, a.shape)
    return Image.fromarray((0.9 * a + 0.1 * noise).astype(np.uint8))


test_items = [(near_copy(im), y) for t in tasks for im, y in t.train[:2]]


class Images(torch.utils.data.Dataset):
    def __init__(self, items):
        self.x = torch.stack([clf.eval_transform_(im) for im, _ in items])
        self.labels = np.array([y for _, y in items])

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return i, self.x[i], int(self.labels[i])


class Manager:
    def get_task_size(self, t):
        return len(tasks[t].classes)

    def get_dataset(self, indices, source, mode):
        items = [it for t in tasks for it in t.train] if source == "train" else test_items
        return Images([it for it in items if it[1] in set(int(i) for i in indices)])


# ---------------------------------------------------------------- their losses, their draws
their_ce, their_l1 = [], []
F_their = mt.F


class RecordingF:
    """models.tosca's torch.nn.functional, recording each step's cross-entropy and (the module unchanged
    until the step) its L1 term"""

    def __getattr__(self, name):
        return getattr(F_their, name)

    def cross_entropy(self, logits, targets, *a, **k):
        loss = F_their.cross_entropy(logits, targets, *a, **k)
        their_ce.append(float(loss))
        their_l1.append(float(ARGS["l1"] * sum(p.abs().sum() for p in net.backbone.tosca.parameters())))
        return loss


mt.F = RecordingF()
their_rows0 = {}
update_fc = net.update_fc


def recording_update_fc(n):
    update_fc(n)
    their_rows0[L._cur_task] = net.fc.weight.detach().clone()


net.update_fc = recording_update_fc

# ---------------------------------------------------------------- our draws compared, then theirs copied
their_init = {}
our_new_module, our_new_rows = clf._new_module, clf._new_rows


def init_like(ours_m, theirs_sd, k):
    """the draw rule: each weight's largest magnitude against theirs (0.8 .. 1.25 of it) and each bias
    exactly zero or not as theirs; returns the worst log-ratio (0 when equal)"""
    worst = 0.0
    for n, t in ours_m.state_dict().items():
        th = theirs_sd[n]
        if n.startswith("norm"):
            worst = max(worst, mad(t, th))  # LayerNorm (1, 0) on both
        elif n.endswith("bias"):
            worst = max(worst, float(bool(t.abs().max() == 0) != bool(th.abs().max() == 0)))
        else:
            worst = max(worst, abs(float(torch.log(t.abs().max() / th.abs().max()))))
    return worst


def new_module(k):
    mine = our_new_module(k)
    report(f"task {k + 1}: our module's initial draw in distribution (max |w| log-ratio)",
           init_like(mine, their_init[k], k), 0.25, "default init for task 1, Xavier after")  # fmt: skip
    mine.load_state_dict(their_init[k])
    return mine


def new_rows(k, n):
    mine = our_new_rows(k, n)
    theirs = their_rows0[k][-n:].to(mine)
    if k == 0:
        ratio = abs(float(torch.log(mine.abs().max() / theirs.abs().max())))
        report("task 1: our first rows' draw in distribution (max |w| log-ratio)", ratio, 0.25)
        return theirs.clone()
    report(f"task {k + 1}: the new rows start at zero as theirs", mad(mine, theirs), 0.0)
    return mine


clf._new_module, clf._new_rows = new_module, new_rows

# ---------------------------------------------------------------- three tasks side by side
scratch = tempfile.mkdtemp(prefix="tosca-check-")
os.makedirs(os.path.join(scratch, "tosca"))
os.chdir(scratch)  # their _save_tosca writes tosca/task<t>.pth here
dm = Manager()
for k in range(TASKS):
    their_init[k] = copy.deepcopy(net.backbone.tosca.state_dict())
    n_ce = len(their_ce)
    L.incremental_train(dm)
    clf.fit_task(tasks[k], stream_tasks=TASKS)
    ce = their_ce[n_ce:]
    l1 = their_l1[n_ce:]
    log = clf.train_log_
    report(f"task {k + 1}: steps", abs(len(log) - len(ce)), 0)
    report(f"task {k + 1}: cross-entropy of every step", mad([r["loss"] for r in log], ce), 1e-5)
    report(f"task {k + 1}: L1 term of every step", mad([r["penalty"] for r in log], l1), 1e-6)
    their_mod = net.backbone.tosca.state_dict()
    report(f"task {k + 1}: the module after training",
           max(mad(t, their_mod[n]) for n, t in clf.modules_[k].state_dict().items()), 1e-5)  # fmt: skip
    report(f"task {k + 1}: every classifier row after replace_fc", mad(clf._rows(), net.fc.weight), 1e-5)
    report(f"task {k + 1}: sigma", mad(clf.sigma_, net.fc.sigma), 1e-6)
    L.after_task()

# ---------------------------------------------------------------- test time
test = Images(test_items)
z = clf.prefix(test.x)
their_feat = net.backbone.forward_features(test.x)
report("the embedding their ToscaViT reads (our prefix)", mad(z, their_feat), 1e-5)
with torch.no_grad():
    theirs_per_task = []
    for i in range(TASKS):
        L._load_tosca(i)
        theirs_per_task.append(net(test.x)["logits"])
    theirs_per_task = torch.stack(theirs_per_task)
    rows = clf._rows()
    ours_per_task = torch.stack([ours.cosine_logits(m(z), rows, clf.sigma_) for m in clf.modules_])
    report("every task's logits on held-out images", mad(ours_per_task, theirs_per_task), 1e-5)
    their_pick = theirs_per_task.new_tensor(
        [
            float(-(torch.softmax(x, 1) * torch.log(torch.softmax(x, 1) + 1e-9)).sum(1).mean())
            for x in theirs_per_task
        ]
    ).argmin()
    their_batch = L.get_lowentropy_logits(test.x)
clf.config.eval.batch_size = len(test)  # one batch, as their loader's
logits, task = clf.infer(z)
report("batch selection: our task against their least mean entropy", float((task != their_pick).sum()), 0)
report("batch selection: the logits against get_lowentropy_logits", mad(logits, their_batch), 1e-5)
loader = torch.utils.data.DataLoader(test, batch_size=len(test), shuffle=False)
pred, _ = L._eval_cnn(loader)
ours_pred = torch.as_tensor(clf.labels_)[logits.argmax(1)]
report(
    "batch selection: predictions against their _eval_cnn",
    float((ours_pred != torch.as_tensor(pred[:, 0])).sum()),
    0,
)
ent = -(torch.softmax(theirs_per_task, 2) * torch.log(torch.softmax(theirs_per_task, 2) + 1e-9)).sum(2)
clf.config.baseline["selection"] = "input"  # (an option of prediction alone)
clf.__dict__.pop("options_", None)
_, task_input = clf.infer(z)
report(
    "input selection: our task against the least entropy of each input",
    float((task_input != ent.argmin(0)).sum()),
    0,
)
info("tasks chosen per input (ours)", task_input.tolist(), f"true tasks {[y // 2 for _, y in test_items]}")
common.summary()
