"""SD-LoRA: ours (proteus.baselines.lora_methods.SDLoRA) against the released code
(WuYichen-97/SD-Lora-CL: backbone/lora.py LoRA_ViT_timm, _LoRA_qkv_timm_train), executed on CPU
(.cuda() made the identity; einops stubbed: imported but unused by these classes).

Ours runs its real fit_task for tasks 0 and 1 (SGD, momentum 0.9, lr 8e-3); the two old tasks' A, B are then
saved in the released code's file format (lora_w_a_i.pt / lora_w_b_i.pt: a list [A_q, A_v] per block of
nn.Linear) and LoRA_ViT_timm(cur_task_index=2) loads them, as its learner does at task 2.
  1. qkv output of every block with 2 old tasks (alpha_j B_j A_j / (||B_j|| ||A_j||)) + alpha_2 B_2 A_2
  2. features / loss of task 2 (CE on the task's classes through its head)
  3. two SGD steps of task 2 (ours: fit_task, 1 epoch of 2 batches... see below; theirs: SGD over
     the LoRA_ViT_timm parameters + head, loss as models/sdlora.py _update_representation)
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
b = clf.config.baseline
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


# ============================================================== 1. qkv output with 2 old tasks
print("== 1. qkv output with 2 old tasks (normalised, magnitudes) + current unnormalised branch")
X = common.task_images(clf, tasks[2])
Y = torch.as_tensor([y for _, y in tasks[2].train]) - 4
clf._begin_task(2, None, None)
gq = torch.Generator().manual_seed(3)
with torch.no_grad():
    clf.alpha_.copy_(torch.tensor([0.7, 1.3, 0.9]))
    for u in units.values():
        u.B_new.copy_(0.05 * torch.randn(u.B_new.shape, generator=gq))
A_new = {r: [units[f"vit.blocks.{i}.attn.qkv:{r}"].A_new.detach() for i in range(blocks)] for r in "qv"}
B_new = {r: [units[f"vit.blocks.{i}.attn.qkv:{r}"].B_new.detach() for i in range(blocks)] for r in "qv"}
tm = their_model(clf.alpha_.detach(), A_new, B_new)
z = clf.prefix(X)
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

# ============================================================== 2./3. loss and two SGD steps at task 2
print("== 2./3. task 2: loss and two SGD steps")
cap.pop("our_z", None)
cap.pop("our_h", None)
with common.recording_optimizer("SGD") as opt_rec:
    stats = clf.fit_task(tasks[2], stream_tasks=3)
init = opt_rec["init"][-1]
n_lora = 4 * blocks
A0 = {r: [init[4 * i + (0 if r == "q" else 2)] for i in range(blocks)] for r in "qv"}
B0 = {r: [init[4 * i + (1 if r == "q" else 3)] for i in range(blocks)] for r in "qv"}
alpha0 = init[n_lora]
tm = their_model(alpha0, A0, B0)
head = nn.Linear(192, 2)
with torch.no_grad():
    head.weight.copy_(init[-2])
    head.bias.copy_(init[-1])
# their _update_representation: SGD(self._network.parameters(), lr, momentum=0.9);
# loss = CE(logits[:, known:])
opt = torch.optim.SGD(list(tm.parameters()) + list(head.parameters()), lr=b.lr, momentum=0.9)
losses = []
for step in range(2):
    feats = tm.lora_vit(X)
    if step == 0:
        perm = [int(((cap["our_z"][0] - z[j]).abs().flatten(1).amax(1) == 0).nonzero()[0]) for j in range(4)]
        report("2. features at the start of task 2 (B_2 = 0)", mad(cap["our_h"][0][perm], feats), 1e-5)
    loss = F.cross_entropy(head(feats), Y)
    losses.append(float(loss))
    opt.zero_grad()
    loss.backward()
    opt.step()
report(
    "2. CE loss, step 1",
    abs(stats["loss_first"] - losses[0]) if stats["steps"] == 2 else 1.0,
    1e-5,
    f"ours {stats['loss_first']:.6f} theirs {losses[0]:.6f} (loss_first = mean of the first 10% = step 1)",
)
report("2. CE loss, step 2", abs(stats["loss_last"] - losses[1]), 1e-5)
dA = dB = 0.0
for i, blk in enumerate(tm.lora_vit.blocks):
    w = blk.attn.qkv
    for r in "qv":
        u = units[f"vit.blocks.{i}.attn.qkv:{r}"]
        c = u.columns(2)
        dA = max(dA, mad(u.A[:, c], getattr(w, f"linear_a_{r}").weight.T))
        dB = max(dB, mad(u.B[:, c], getattr(w, f"linear_b_{r}").weight))
report("3. A_2 after 2 SGD steps (all blocks, q and v)", dA, 1e-6)
report("3. B_2 after 2 SGD steps", dB, 1e-6)
alpha_their = torch.cat(
    [tm.wrapped_param_prev[0].param, tm.wrapped_param_prev[1].param, tm.wrapped_param[0].param]
)
report(
    "3. magnitudes alpha_0, alpha_1, alpha_2 after 2 SGD steps",
    mad(torch.tensor(clf.magnitudes_[-1]), alpha_their),
    1e-6,
    f"ours {[round(x, 6) for x in clf.magnitudes_[-1]]}",
)
untouched = max(mad(tm.wrapped_param_prev[j].param, torch.tensor([0.8])) for j in range(2, 20))
info("3. their unused alpha_prev[2:20] stay 0.8", f"{untouched:.1e}")
report(
    "3. head after 2 SGD steps",
    max(mad(clf.heads_[2].weight, head.weight), mad(clf.heads_[2].bias, head.bias)),
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
