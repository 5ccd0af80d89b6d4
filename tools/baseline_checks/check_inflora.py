"""InfLoRA: ours (proteus.baselines.lora_methods.InfLoRA / DualGPM) against the released code
(liangyanshuo/InfLoRA: models/vit_inflora.py Attention_LoRA, models/sinet_inflora.py ViT_lora_co / SiNet,
methods/inflora.py InfLoRA._train, train_function, update_DualGPM), executed on a stub learner object.

Part A: tiny random ViT-Ti/16 at 32 px, 3 tasks x 4 images: both sides run their whole task pipeline
        (ours: ContinualClassifier.fit_task; theirs: InfLoRA._train with the real train_function and their
        CosineSchedule), 3 epochs of one batch = 3 Adam steps per task (lr, lr, lr cos(99 pi / 400)), from
        identical weights / heads / inputs.
Part B: DualGPM + design on random activation matrices (their _train on Attention_LoRA modules whose
        cur_matrix is set directly), 4 tasks, remove -> retain switch and retain updates.
Part C: the known deviation: first task already in 'retain' mode.
"""

import types

import common
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from common import info, mad, report

from proteus.baselines.lora_methods import DualGPM

# ours is built first: importing their models/vit.py re-registers timm's vit_* names with their builders.
# Part A: EPOCHS epochs of one batch of 4 per task; the random ViT perturbed (plain: shared by both sides)
EPOCHS = 3
clf, plain = common.setup_ours("inflora", epochs=EPOCHS, batch_size=4)
common.add_path("theirs_inflora")
common.stub("ipdb", set_trace=lambda *a, **k: None)
# their code, importable only after add_path:
import methods.inflora as their_inflora  # noqa: E402
from methods.inflora import InfLoRA as TheirInfLoRA  # noqa: E402
from models.sinet_inflora import SiNet, ViT_lora_co  # noqa: E402
from models.vit_inflora import Attention_LoRA  # noqa: E402

torch.manual_seed(0)
RANK, T = 10, 3


def proj(M):
    M = torch.as_tensor(np.asarray(M)).double()
    return M @ M.T


def align(A, Aref):
    """column signs of A matched to Aref (SVD vectors are defined up to sign)"""
    s = torch.sign((A * Aref).sum(0))
    s[s == 0] = 1
    return A * s, s


def their_stub(net):
    # their class, no __init__ (which builds a ViT-B and loads weights)
    s = TheirInfLoRA.__new__(TheirInfLoRA)
    s._network, s._device, s._multiple_gpus = net, "cpu", []
    s._cur_task, s._known_classes = -1, 0
    s.feature_list, s.project_type, s.feature_mat = [], [], []
    s.optim, s.init_lr, s.lrate, s.init_weight_decay, s.weight_decay = "adam", 5e-4, 5e-4, 0.0, 0.0
    s.init_epoch = s.epochs = EPOCHS  # their CosineSchedule over EPOCHS epochs; run_epoch set below
    s.lamb, s.lame, s.total_sessions, s.debug = 0.95, 1.0, T, False
    return s


# =============================================================================== Part A
print("== Part A: tiny ViT, 3 tasks through both pipelines")

tv = ViT_lora_co(
    img_size=32, patch_size=16, embed_dim=192, depth=12, num_heads=3, num_classes=0, n_tasks=T, rank=RANK
)
missing, unexpected = tv.load_state_dict(plain.state_dict(), strict=False)
assert not unexpected and all(("lora_" in k) or ("_grow" in k) for k in missing), (missing, unexpected)
for m in tv.modules():
    if isinstance(m, Attention_LoRA):
        m.init_param()  # as their InfLoRA.__init__
net = SiNet.__new__(SiNet)
nn.Module.__init__(net)
net.image_encoder, net.class_num, net.numtask = tv, 2, 0
net.classifier_pool = nn.ModuleList([nn.Linear(192, 2) for _ in range(T)])
net.eval()
tv.eval()
their = their_stub(net)
attn_mods = [m for m in tv.modules() if isinstance(m, Attention_LoRA)]
wnames = list(clf.model_.wrappers)

# capture hooks --------------------------------------------------------------------------------
cap = {}
_feat = clf.features


def rec_features(z, train):
    h = _feat(z, train)
    if train and "our_h" not in cap:  # the task's first training forward (popped before each task)
        cap["our_z"], cap["our_h"] = z.detach().clone(), h.detach().clone()
    return h


clf.features = rec_features
_mom = clf.input_moments


def rec_moments(z, loader, tasks=None):
    m = _mom(z, loader, tasks)
    cap.setdefault("our_moments", []).append(m)
    return m


clf.input_moments = rec_moments
_their_tf = TheirInfLoRA.train_function


def rec_train_function(self, train_loader, test_loader, optimizer, scheduler):
    _, x, y = train_loader[0]
    with torch.no_grad():
        out = self._network(x)
        cap["their_h"] = out["features"].clone()
        cap["their_loss"] = float(F.cross_entropy(out["logits"], y - self._known_classes))
    self.run_epoch = EPOCHS  # EPOCHS epochs of one batch: EPOCHS Adam steps under their CosineSchedule
    cap["their_losses"] = []
    return _their_tf(self, train_loader, test_loader, optimizer, scheduler)  # their real training epochs


def _rec_ce(*a, **k):
    loss = F.cross_entropy(*a, **k)
    cap.setdefault("their_losses", []).append(float(loss))
    return loss


their_inflora.F = types.SimpleNamespace(cross_entropy=_rec_ce)


their.train_function = types.MethodType(rec_train_function, their)
_their_gpm = TheirInfLoRA.update_DualGPM


def rec_gpm(self, mat_list):
    cap.setdefault("their_moments", []).append([m.clone() for m in mat_list])
    # their environment's numpy returned ndarrays from np.linalg.svd(torch tensor); today's returns torch
    # tensors (then .transpose() fails), so hand it the float32 arrays it worked on
    return _their_gpm(self, [m.numpy() for m in mat_list])


their.update_DualGPM = types.MethodType(rec_gpm, their)

# data -----------------------------------------------------------------------------------------
tasks = common.random_tasks(T)

# torch.optim.Adam records every construction during the tasks (ours in fit_task, theirs in _train)
with common.recording_optimizer("Adam") as opt_rec:
    for k, task in enumerate(tasks):
        X = common.task_images(clf, task)
        Y = torch.as_tensor([y for _, y in task.train])
        n_opt = len(opt_rec["init"])
        cap.pop("our_h", None)
        # ours: the real fit_task (EPOCHS epochs of one batch of 4 -> EPOCHS Adam steps)
        stats = clf.fit_task(task, stream_tasks=T)
        init = opt_rec["init"][n_opt]  # the first optimiser of this task (ours; theirs follows in _train)
        head0 = init[-2:]  # head weight, bias at the optimiser's construction
        # theirs: same initial head, then their _train (design -> train_function -> DualGPM)
        with torch.no_grad():
            net.classifier_pool[k].weight.copy_(head0[0])
            net.classifier_pool[k].bias.copy_(head0[1])
        net.numtask = k + 1
        their._cur_task, their._known_classes = k, 2 * k
        TheirInfLoRA._train(their, [(None, X, Y)], None)

        # --- compare the training-time input moments (design pass) and the post-training ones
        om_design = cap["our_moments"][2 * k]
        om_after = cap["our_moments"][2 * k + 1]
        tm_after = cap["their_moments"][k]
        report(
            f"A.task{k}: input moments after training (12 layers, C=mean xx^T)",
            max(mad(om_after[n], tm_after[i]) for i, n in enumerate(wnames)),
            1e-5,
        )
        # --- designed A (k and v units share it in both)
        dA, dA_raw, dW, dB, nbig, ntot = 0.0, 0.0, 0.0, 0.0, 0, 0
        for i, n in enumerate(wnames):
            w = clf.model_.wrappers[n]
            for row in ("k", "v"):
                u = w.units[row]
                cols = u.columns(k)
                A_o, B_o = u.A[:, cols].double(), u.B[:, cols].double()
                A_t = getattr(attn_mods[i], f"lora_A_{row}")[k].weight.detach().T.double()
                B_t = getattr(attn_mods[i], f"lora_B_{row}")[k].weight.detach().double()
                A_al, sgn = align(A_o, A_t)
                dA = max(dA, mad(A_al, A_t))
                dA_raw = max(dA_raw, mad(A_o, A_t))
                dB = max(dB, mad(B_o * sgn, B_t))
                nbig += int(((B_o * sgn - B_t).abs() > 1e-6).sum())
                ntot += B_t.numel()
                dW = max(dW, mad(B_o @ A_o.T, B_t @ A_t.T))
        report(
            f"A.task{k}: designed A = U[:,:r]/sqrt3 (sign-aligned, all layers, k&v)",
            dA,
            1e-4,
            "remove" if k else "first task (plain SVD)",
        )
        info(
            f"A.task{k}: designed A raw max diff (no sign alignment)",
            f"{dA_raw:.3e}",
            "SVD sign ambiguity only",
        )
        ADAM_NOTE = (
            "tol 0.1*lr: Adam's first step is lr*g/(|g|+1e-8), so entries whose gradient is ~1e-8 "
            "amplify fp32 round-off; " + f"{nbig}/{ntot} entries differ by > 1e-6"
        )
        report(f"A.task{k}: B after {EPOCHS} Adam steps (sign-aligned; B starts at 0)", dB, 5e-5, ADAM_NOTE)
        report(f"A.task{k}: branch B A^T after {EPOCHS} Adam steps", dW, 3e-5, "tol 0.1*lr*max|A|")
        # --- forward / loss at the training state (before the step)
        zq = clf.prefix(X)
        perm = [int(((cap["our_z"] - zq[j]).abs().flatten(1).amax(1) == 0).nonzero()[0]) for j in range(4)]
        report(
            f"A.task{k}: features (train forward, cls after norm)",
            mad(cap["our_h"][perm], cap["their_h"]),
            1e-5,
        )
        report(
            f"A.task{k}: CE loss on current task's classes",
            abs(stats.extra["loss_first"] - cap["their_loss"]),
            1e-5,
        )
        report(
            f"A.task{k}: CE loss, steps 1..{EPOCHS} (their train_function's)",
            max(abs(r["loss"] - t) for r, t in zip(clf.train_log_, cap["their_losses"]))
            if len(cap["their_losses"]) == len(clf.train_log_) == EPOCHS
            else float("inf"),
            1e-5,
            f"theirs {[round(x, 6) for x in cap['their_losses']]}",
        )
        report(
            f"A.task{k}: head after {EPOCHS} Adam steps",
            max(
                mad(clf.heads_[k].weight, net.classifier_pool[k].weight),
                mad(clf.heads_[k].bias, net.classifier_pool[k].bias),
            ),
            1e-6,
        )
        kw = opt_rec["kw"][-1]
        info(
            f"A.task{k}: our optimiser",
            f"Adam lr={kw.get('lr')} betas={kw.get('betas')} wd={kw.get('weight_decay')}",
            "theirs: Adam lr=5e-4 betas=(0.9,0.999) wd=0",
        )
        # --- DualGPM memory after the task
        dP, modes = 0.0, []
        for i, n in enumerate(wnames):
            gm = clf.gpm_[n]
            modes.append((gm.mode, their.project_type[i], gm.basis.shape[1], their.feature_list[i].shape[1]))
            dP = max(dP, mad(proj(gm.basis), proj(their.feature_list[i])))
        report(f"A.task{k}: DualGPM ||P_ours - P_theirs||_max (12 layers)", dP, 1e-4)
        report(
            f"A.task{k}: DualGPM mode and dim equal in all layers",
            float(sum(a != b or c != d for a, b, c, d in modes)),
            0,
            f"layer0 {modes[0]}",
        )

# inference with the last model: every branch summed
zq = clf.prefix(X)
h_our = clf.features(zq, train=False)
with torch.no_grad():
    h_their = net.extract_vector(X, task=T - 1)
report("A.final: inference features, all 3 branches summed", mad(h_our, h_their), 1e-5)
# block-0 output with task 2's state
x0 = tv.pos_drop(torch.cat((tv.cls_token.expand(4, -1, -1), tv.patch_embed(X)), 1) + tv.pos_embed)
with torch.no_grad(), clf.model_.compose([T - 1]):
    b_our = clf.backbone_.vit.blocks[0](x0)
    b_their = tv.blocks[0](x0, T - 1)
report("A.final: block-0 output (attention with k,v LoRA, task 2 model)", mad(b_our, b_their), 1e-5)

# =============================================================================== Part B
print("== Part B: DualGPM + design on random activation matrices (q=24, 2 layers, 4 tasks)")
q, NT = 24, 4
gB = torch.Generator().manual_seed(7)


def act(rank, n=200, decay=0.7):
    basis = torch.linalg.qr(torch.randn(q, q, generator=gB, dtype=torch.float64))[0][:, :rank]
    X = torch.randn(n, rank, generator=gB, dtype=torch.float64) * (decay ** torch.arange(rank)) @ basis.T
    return (X.T @ X / n).float()


# layer 0: low-rank every task (stays 'remove'); layer 1: low rank first, then full rank (switch to
# 'retain' after task 1, retain-mode design at tasks 2-3, retain-mode updates)
mats = {
    0: [act(3), act(3), act(3), act(3)],
    1: [act(4), act(24, decay=0.97), act(24, decay=0.9), act(24, decay=0.95)],
}
design_C = {L: [act(12, decay=0.8) for _ in range(NT)] for L in (0, 1)}
mods = [Attention_LoRA(q, num_heads=1, r=3, n_tasks=NT) for _ in range(2)]
for m in mods:
    m.init_param()


class FakeNet(nn.Module):
    """their _train reads module.cur_matrix after a pass with get_cur_feat=True; here the pass sets it"""

    def __init__(self):
        super().__init__()
        self.mods = nn.ModuleList(mods)
        self.numtask = 0
        self.calls = 0
        self.k = 0

    def forward(self, x, get_cur_feat=False, **kw):
        src = design_C if self.calls % 2 == 0 else mats
        for L, m in enumerate(self.mods):
            m.cur_matrix = src[L][self.k].clone()
        self.calls += 1
        return {}


fnet = FakeNet()
their2 = their_stub(fnet)
their2.total_sessions = NT
their2.train_function = lambda *a, **k: None
their2.update_DualGPM = types.MethodType(lambda self, ml: _their_gpm(self, [m.numpy() for m in ml]), their2)
ours = [DualGPM(q) for _ in range(2)]
for k in range(NT):
    fnet.k, their2._cur_task = k, k
    fnet.numtask = k + 1
    TheirInfLoRA._train(their2, [(None, torch.zeros(1), torch.zeros(1, dtype=torch.long))], None)
    eps = 0.95 + 0.05 * k / NT
    for L in range(2):
        modeL = ours[L].mode if ours[L].started else "none"
        A_o = ours[L].design(design_C[L][k].double(), 3)
        A_t = mods[L].lora_A_k[k].weight.detach().T.double()
        A_al, _ = align(A_o, A_t)
        report(f"B.task{k}.layer{L}: designed A (projection mode before: {modeL})", mad(A_al, A_t), 1e-4)
        ours[L].update(mats[L][k].double(), eps)
        report(
            f"B.task{k}.layer{L}: DualGPM projector diff (mode {ours[L].mode}/{their2.project_type[L]}, "
            f"dim {ours[L].basis.shape[1]}/{their2.feature_list[L].shape[1]})",
            mad(proj(ours[L].basis), proj(their2.feature_list[L])),
            1e-4,
        )
        report(f"B.task{k}.layer{L}: mode equal", float(ours[L].mode != their2.project_type[L]), 0)

# =============================================================================== Part C
print("== Part C: known deviation: first task already in 'retain' mode")
C0 = act(24, decay=0.99)  # flat spectrum: k >= q/2 at eps=0.95
s3 = their_stub(None)
s3._cur_task = 0
try:
    TheirInfLoRA.update_DualGPM(s3, [C0.numpy()])
    raised = "no error"
except AssertionError:
    raised = "AssertionError in their summary loop (assert retain dim <= q/2)"
o = DualGPM(q)
o.update(C0.double(), 0.95)
info(
    "C: their update_DualGPM on first-task-retain",
    raised,
    f"their stored type {s3.project_type[0]}, dim {s3.feature_list[0].shape[1]}; "
    f"ours {o.mode}, dim {o.basis.shape[1]}",
)
Pt = proj(s3.feature_list[0])
info(
    "C: ||P_ours - P_theirs||_max (expected large: ours keeps the complement)",
    f"{mad(proj(o.basis), Pt):.3e}",
)
report(
    "C: ||P_ours - (I - P_theirs)||_max (ours = complement of theirs)",
    mad(proj(o.basis), torch.eye(q, dtype=torch.float64) - Pt),
    1e-5,
)
common.summary()
