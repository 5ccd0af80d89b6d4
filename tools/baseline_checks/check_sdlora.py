"""SD-LoRA: ours (proteus.baselines.lora_methods.SDLoRA) against the released code
(WuYichen-97/SD-Lora-CL: backbone/lora.py LoRA_ViT_timm, _LoRA_qkv_timm_train; models/sdlora.py
Learner._train, _update_representation), executed on CPU (.cuda() made the identity; einops stubbed: imported
but unused by these classes).

Ours runs its real fit_task for tasks 0 and 1 (SGD, momentum 0.9, lr 8e-3); the two old tasks' A, B are then
saved in the released code's file format (lora_w_a_i.pt / lora_w_b_i.pt: a list [A_q, A_v] per block of
nn.Linear) and LoRA_ViT_timm(cur_task_index=2) loads them, as its learner does at task 2.
  0. the initial state of task 2, each side from its OWN initialisation (nothing copied): magnitudes
     alpha_0..alpha_2 (exactly), new B (exactly 0), new A (shape, bound, distribution: two-sample
     Kolmogorov-Smirnov), and the features of the task's first forward (B = 0, so A drops out)
  1. qkv output of every block with 2 old tasks (alpha_j B_j A_j / (||B_j|| ||A_j||)) + alpha_2 B_2 A_2
     (a forward-formula check: the same A, B, alpha on both sides)
  2./3. task 2 trained by THEIR Learner._train (their update_network builds LoRA_ViT_timm on our ViT-Ti
     instead of a pretrained ViT-B; SGD over the network, MultiStepLR, _update_representation: CE on
     logits[:, known:]) for 2 epochs of one batch, and by our fit_task. Their initial A (random, drawn by
     their reset_parameters) and their head initialisation are copied into ours; magnitudes and B start
     from each side's own initialisation. Compared: features and losses of both steps, A, B, magnitudes,
     head after the 2 SGD steps, inference features.
"""

import copy
import shutil
import tempfile

import common
import torch
import torch.nn as nn
import torch.nn.functional as F
from common import info, mad, report

# 2 epochs x 1 batch: 2 SGD steps per task
clf, plain = common.setup_ours("sd-lora", epochs=2, batch_size=4)
b = clf.options_
common.add_path("theirs_sdlora")
common.cpu_cuda()
common.stub("einops", rearrange=None)
import backbone.lora as their_lora  # noqa: E402  (their code, importable only after add_path)

info(
    "our config",
    f"optimizer={b.optimizer} lr={b.lr} momentum={b.momentum} wd={clf.config.train.weight_decay} "
    f"rank={b.rank} magnitude_init={b.magnitude_init}",
    "theirs (task>0): SGD lr 8e-3 momentum 0.9, no wd; r=10; 0.8",
)

cap = {}
_feat = clf.features


def rec_features(z, train):
    h = _feat(z, train)
    if train:
        cap.setdefault("our_z", []).append(z.detach().clone())
        cap.setdefault("our_h", []).append(h.detach().clone())
    return h


clf.features = rec_features

tasks = common.random_tasks(3)
for k in range(2):  # two old tasks, trained by our real loop
    clf.fit_task(tasks[k], stream_tasks=3)
info(
    "our magnitudes after tasks 0, 1 (alpha_0..alpha_k)",
    str([[round(x, 5) for x in m] for m in clf.magnitudes_]),
)

units = clf.model_.units
blocks = len(clf.backbone_.vit.blocks)
tmp = tempfile.mkdtemp(prefix="sdlora_") + "/"  # their loader concatenates filepath + file name


def lin(W):
    m = nn.Linear(W.shape[1], W.shape[0], bias=False)
    with torch.no_grad():
        m.weight.copy_(W)
    return m


for t in range(2):  # their file format: list over blocks of [A_q, A_v] (nn.Linear r x d) and [B_q, B_v]
    As, Bs = [], []
    for i in range(blocks):
        for row in ("q", "v"):
            u = units[f"vit.blocks.{i}.attn.qkv:{row}"]
            c = u.columns(t)
            As.append(lin(u.A[:, c].T))
            Bs.append(lin(u.B[:, c]))
    torch.save(As, f"{tmp}lora_w_a_{t}.pt")
    torch.save(Bs, f"{tmp}lora_w_b_{t}.pt")
_load = torch.load
torch.load = lambda *a, **k: _load(*a, **{**k, "weights_only": False})  # their pickled nn.Linear lists


def their_model(alpha, A_new, B_new):
    """LoRA_ViT_timm at task 2 with the given magnitudes and new branch (dict row -> list over blocks)"""
    m = their_lora.LoRA_ViT_timm(
        vit_model=copy.deepcopy(plain), r=b.rank, filepath=tmp, index=False, cur_task_index=2
    )
    with torch.no_grad():
        for j in range(2):
            m.wrapped_param_prev[j].param.copy_(alpha[j : j + 1])
        m.wrapped_param[0].param.copy_(alpha[2:3])
        for i, blk in enumerate(m.lora_vit.blocks):
            w = blk.attn.qkv
            w.linear_a_q.weight.copy_(A_new["q"][i].T)
            w.linear_b_q.weight.copy_(B_new["q"][i])
            w.linear_a_v.weight.copy_(A_new["v"][i].T)
            w.linear_b_v.weight.copy_(B_new["v"][i])
    m.eval()
    return m


def ks_statistic(a, b):
    """two-sample Kolmogorov-Smirnov statistic sup |F_a - F_b| of the values of a and b"""
    a, b = a.flatten().double().sort().values, b.flatten().double().sort().values
    grid = torch.cat([a, b])
    fa = torch.searchsorted(a, grid, right=True).double() / len(a)
    fb = torch.searchsorted(b, grid, right=True).double() / len(b)
    return float((fa - fb).abs().max())


def their_state(m):
    """the new task's A (d x r, ours' layout), B (d x r) per row and block, and alpha_0..alpha_2 of a
    LoRA_ViT_timm at task 2"""
    A = {
        r: [getattr(blk.attn.qkv, f"linear_a_{r}").weight.detach().T for blk in m.lora_vit.blocks]
        for r in "qv"
    }
    B = {
        r: [getattr(blk.attn.qkv, f"linear_b_{r}").weight.detach() for blk in m.lora_vit.blocks] for r in "qv"
    }
    alpha = torch.cat(
        [m.wrapped_param_prev[0].param, m.wrapped_param_prev[1].param, m.wrapped_param[0].param]
    )
    return A, B, alpha.detach()


X = common.task_images(clf, tasks[2])
Y = torch.as_tensor([y for _, y in tasks[2].train]) - 4
z = clf.prefix(X)

# ============================================================== 0. initial state, each side's own init
print("== 0. initial state of task 2: ours from our begin_task, theirs from LoRA_ViT_timm's own init")
clf.begin_task(2, None, None)
torch.manual_seed(7)
tm0 = their_lora.LoRA_ViT_timm(
    vit_model=copy.deepcopy(plain), r=b.rank, filepath=tmp, index=False, cur_task_index=2
)
tA, tB, talpha = their_state(tm0)
oA = {r: [units[f"vit.blocks.{i}.attn.qkv:{r}"].A_new.detach() for i in range(blocks)] for r in "qv"}
oB = {r: [units[f"vit.blocks.{i}.attn.qkv:{r}"].B_new.detach() for i in range(blocks)] for r in "qv"}
report(
    "0. magnitudes alpha_0, alpha_1, alpha_2 at the start of task 2 (exact)",
    mad(clf.alpha_, talpha) if clf.alpha_.shape == talpha.shape else float("inf"),
    0,
    f"ours {clf.alpha_.tolist()} theirs {talpha.tolist()}",
)
report(
    "0. new B at the start of task 2, all blocks, q and v (exact: theirs zeros_)",
    max(mad(oB[r][i], tB[r][i]) for r in "qv" for i in range(blocks)),
    0,
)
report(
    "0. new A shapes (d x r per block and row) equal",
    float(sum(oA[r][i].shape != tA[r][i].shape for r in "qv" for i in range(blocks))),
    0,
    f"{tuple(tA['q'][0].shape)}",
)
oa, ta = (
    torch.cat([a.flatten() for r in "qv" for a in oA[r]]),
    torch.cat([a.flatten() for r in "qv" for a in tA[r]]),
)
n_a = oa.numel()
ks_tol = 1.95 * (2.0 / n_a) ** 0.5  # the KS two-sample critical value at level 0.001
report(
    "0. new A: two-sample KS statistic, ours vs their kaiming_uniform_(a=sqrt 5) draws",
    ks_statistic(oa, ta),
    ks_tol,
    f"{n_a} values each; tol = KS critical value at level 0.001",
)
report(
    "0. new A: max |A| (the uniform bound 1/sqrt(d))",
    abs(float(oa.abs().max()) - float(ta.abs().max())),
    1e-3 / blocks**0.5,
    f"ours {float(oa.abs().max()):.5f} theirs {float(ta.abs().max()):.5f} "
    f"1/sqrt(d) {oA['q'][0].shape[0] ** -0.5:.5f}",
)
report(
    "0. new A: std, relative difference",
    abs(float(oa.std()) / float(ta.std()) - 1),
    0.02,
    f"ours {float(oa.std()):.5f} theirs {float(ta.std()):.5f}",
)
with torch.no_grad():
    report(
        "0. features of task 2's first forward, each side from its own init (B = 0: alpha, old tasks only)",
        mad(clf.features(z, train=True), tm0.eval().lora_vit(X)),
        1e-5,
    )

# ============================================================== 1. qkv output with 2 old tasks
print("== 1. qkv output with 2 old tasks (normalised, magnitudes) + current unnormalised branch")
gq = torch.Generator().manual_seed(3)
with torch.no_grad():
    clf.alpha_.copy_(torch.tensor([0.7, 1.3, 0.9]))
    for u in units.values():
        u.B_new.copy_(0.05 * torch.randn(u.B_new.shape, generator=gq))
A_new = {r: [units[f"vit.blocks.{i}.attn.qkv:{r}"].A_new.detach() for i in range(blocks)] for r in "qv"}
B_new = {r: [units[f"vit.blocks.{i}.attn.qkv:{r}"].B_new.detach() for i in range(blocks)] for r in "qv"}
tm = their_model(clf.alpha_.detach(), A_new, B_new)
h_our = clf.features(z, train=True)  # sets the training composition (alpha / norms) on every unit
xin = {}
hooks = [
    blk.attn.qkv.register_forward_pre_hook(lambda m, a, i=i: xin.__setitem__(i, a[0].detach()))
    for i, blk in enumerate(clf.backbone_.vit.blocks)
]
clf.features(z, train=True)
for h in hooks:
    h.remove()
dq = 0.0
for i in range(blocks):
    o = clf.backbone_.vit.blocks[i].attn.qkv(xin[i])
    t_ = tm.lora_vit.blocks[i].attn.qkv(xin[i])
    dq = max(dq, mad(o, t_))
report("1. qkv output, all 12 blocks (q,v rows adapted)", dq, 1e-5)
report("1. features (train forward: 2 old + current branch)", mad(h_our, tm.lora_vit(X)), 1e-5)
with torch.no_grad():
    tm2 = their_model(torch.tensor([0.7, 1.3, 0.0]), A_new, B_new)
    clf.alpha_.copy_(torch.tensor([0.7, 1.3, 0.0]))
    report(
        "1. features with alpha_2 = 0 (only the normalised old branches)",
        mad(clf.features(z, train=True), tm2.lora_vit(X)),
        1e-5,
    )
clf.model_.truncate(2)  # drop the open task: fit_task below re-opens it

# ============================================================== 2./3. task 2 by their Learner._train
print("== 2./3. task 2: their Learner._train and our fit_task, 2 epochs of one batch (2 SGD steps)")
import models.sdlora as their_sd  # noqa: E402
from utils.inc_net import IncrementalNet  # noqa: E402

their_init = {}


def their_update_network(index=True):
    """their update_network with our ViT-Ti (random, perturbed) instead of a pretrained ViT-B"""
    m = their_lora.LoRA_ViT_timm(
        vit_model=copy.deepcopy(plain).eval(), r=b.rank, num_classes=10, index=index, increment=2,
        filepath=tmp, cur_task_index=learner._cur_task,
    )  # fmt: skip
    m.out_dim = 192
    their_init["A"], _, _ = their_state(m)
    their_init["A"] = {r: [a.clone() for a in v] for r, v in their_init["A"].items()}
    return m


class Shell(nn.Module):
    out_dim = 192


net = IncrementalNet.__new__(IncrementalNet)
nn.Module.__init__(net)
net.model_type, net.gradcam, net.fc, net.backbone = "vit", False, None, Shell()
torch.manual_seed(11)
net.update_fc(6)  # their head over the 6 classes seen: SimpleLinear (kaiming_uniform linear, bias 0)
head_init = (net.fc.weight.detach()[4:].clone(), net.fc.bias.detach()[4:].clone())
learner = their_sd.Learner.__new__(their_sd.Learner)
learner.args = {
    "lrate": 8e-3,  # exps/sdlora_c100.json (not our config's lr)
    "milestones": [100],
    "lrate_decay": 0.1,
    "epochs": 2,
    "filepath": tmp,
    "increment": 2,
}
learner._cur_task, learner._known_classes, learner._total_classes = 2, 4, 6
learner._device, learner._multiple_gpus, learner._network = "cpu", ["cpu"], net
learner._compute_accuracy = lambda *a, **k: 0.0
learner.update_network = their_update_network
their_losses, their_feats = [], []
their_sd.F = type("F", (), {"cross_entropy": staticmethod(lambda *a, **k: _ce(*a, **k))})


def _ce(*a, **k):
    loss = F.cross_entropy(*a, **k)
    their_losses.append(float(loss))
    return loss


hook = net.fc.register_forward_pre_hook(lambda m, a: their_feats.append(a[0].detach().clone()))
Yg = Y + 4
torch.manual_seed(12)
learner._train([(None, X, Yg)], None)  # their whole task>0 step: network, SGD, _update_representation, save
hook.remove()
tm = net.backbone.eval()

# ours: their initial A and head copied in (drawn from different generators); alpha and B from our own init
_begin = clf.begin_task


def begin_with_their_A(k, z_, loader):
    _begin(k, z_, loader)
    with torch.no_grad():
        for i in range(blocks):
            for r in "qv":
                units[f"vit.blocks.{i}.attn.qkv:{r}"].A_new.copy_(their_init["A"][r][i])


class TheirHeadInit(nn.Linear):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        with torch.no_grad():
            self.weight.copy_(head_init[0])
            self.bias.copy_(head_init[1])


clf.begin_task = begin_with_their_A
cap.pop("our_z", None)
cap.pop("our_h", None)
_Linear, nn.Linear = nn.Linear, TheirHeadInit
try:
    with common.recording_optimizer("SGD") as opt_rec:
        stats = clf.fit_task(tasks[2], stream_tasks=3)
finally:
    nn.Linear = _Linear
    clf.begin_task = _begin
info(
    "head initialisation differs (our shared learner): theirs SimpleLinear kaiming_uniform(linear), bias 0; "
    "ours nn.Linear default",
    f"their bias {head_init[1].tolist()}",
    "their head copied into ours for the steps below",
)
perm = [int(((cap["our_z"][0] - z[j]).abs().flatten(1).amax(1) == 0).nonzero()[0]) for j in range(4)]
report(
    "2. features at step 1 (their A copied; alpha, B from each side's init)",
    mad(cap["our_h"][0][perm], their_feats[0]),
    1e-5,
)
perm2 = [int(((cap["our_z"][1] - z[j]).abs().flatten(1).amax(1) == 0).nonzero()[0]) for j in range(4)]
report("2. features at step 2", mad(cap["our_h"][1][perm2], their_feats[1]), 1e-5)
report(
    "2. CE loss, step 1",
    abs(stats.extra["loss_first"] - their_losses[0]) if stats.extra["steps"] == 2 else 1.0,
    1e-5,
    f"ours {stats.extra['loss_first']:.6f} theirs {their_losses[0]:.6f} (loss_first: the first 10% = step 1)",
)
report("2. CE loss, step 2", abs(stats.extra["loss_last"] - their_losses[1]), 1e-5)
_, tB, talpha = their_state(tm)
tA = {
    r: [getattr(blk.attn.qkv, f"linear_a_{r}").weight.detach().T for blk in tm.lora_vit.blocks] for r in "qv"
}
dA = dB = 0.0
for i in range(blocks):
    for r in "qv":
        u = units[f"vit.blocks.{i}.attn.qkv:{r}"]
        c = u.columns(2)
        dA = max(dA, mad(u.A[:, c], tA[r][i]))
        dB = max(dB, mad(u.B[:, c], tB[r][i]))
report("3. A_2 after 2 SGD steps (all blocks, q and v)", dA, 1e-6)
report("3. B_2 after 2 SGD steps", dB, 1e-6)
report(
    "3. magnitudes alpha_0, alpha_1, alpha_2 after 2 SGD steps",
    mad(torch.tensor(clf.magnitudes_[-1]), talpha) if len(clf.magnitudes_[-1]) == 3 else float("inf"),
    1e-6,
    f"ours {[round(x, 6) for x in clf.magnitudes_[-1]]}",
)
untouched = max(mad(tm.wrapped_param_prev[j].param, torch.tensor([0.8])) for j in range(2, 20))
info("3. their unused alpha_prev[2:20] stay 0.8", f"{untouched:.1e}")
report(
    "3. head after 2 SGD steps (their fc rows of the task's classes)",
    max(mad(clf.heads_[2].weight, net.fc.weight[4:]), mad(clf.heads_[2].bias, net.fc.bias[4:])),
    1e-6,
)
# inference with the frozen task-2 model (row C[2]) against their training module after training
with torch.no_grad():
    report(
        "3. inference features of the frozen task-2 model vs theirs after training",
        mad(clf.features(z, train=False), tm.lora_vit(X)),
        1e-5,
    )
kw = opt_rec["kw"][-1]
info("our optimiser", f"SGD lr={kw.get('lr')} momentum={kw.get('momentum')} wd={kw.get('weight_decay')}")
shutil.rmtree(tmp)
common.summary()
