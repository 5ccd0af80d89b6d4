"""CODA-Prompt: ours (proteus.baselines.prompts.CodaPrompt) against the released code (GT-RIPL/CODA-Prompt:
models/zoo.py CodaPrompt, ortho_penalty, gram_schmidt, ViTZoo.forward; models/vit.py VisionTransformer /
Attention with prompt; learners/prompt.py Prompt.update_model; utils/schedulers.py CosineSchedule), on CPU.

Ours runs fit_task for task 0 (10 tasks x 10 components of a pool of 100, prompt length 8, blocks 0-4); task 1
is compared (task_count = 1: components 0-9 frozen, 10-19 trained), 3 epochs of one batch, so that the
cosine schedule changes the lr within the compared steps (their CosineSchedule stepped as learners/default.py
does; its lr per epoch over longer tasks is compared separately).
Attention weights are read from both sides' torch.einsum('bk,kld->bld', weights, P) call (the same equation
string in both codes).
"""

import importlib.util
import os

import common
import torch
import torch.nn as nn
import torch.nn.functional as F
from common import info, mad, report

from proteus.baselines.learner import epoch_lr
from proteus.baselines.prompts import gram_schmidt

clf, plain = common.setup_ours("coda-prompt", epochs=2, batch_size=4)
b = clf.config.baseline
common.add_path("theirs_coda")
common.cpu_cuda()
# their code, importable only after add_path:
import models.zoo as zoo  # noqa: E402
from models.vit import VisionTransformer as CodaViT  # noqa: E402
from utils.schedulers import CosineSchedule  # noqa: E402

T = 10
info(
    "our config",
    f"pool={b.pool_size} L={b.prompt_length} layers={b.prompt_layers} ortho={b.ortho_weight} "
    f"Adam lr={b.lr} schedule={b.schedule}",
    "released cifar: [100, 8, 0.0], Adam lr 1e-3, cosine",
)

rec = []
_einsum = torch.einsum


def einsum_rec(eq, *ops):
    if eq == "bk,kld->bld":
        rec.append(ops[0].detach().clone())
    return _einsum(eq, *ops)


torch.einsum = einsum_rec

tasks = common.random_tasks(2)
clf.fit_task(tasks[0], stream_tasks=T)

feat_calls = []
_feat = clf.features


def rec_features(z, train):
    rec.clear()
    h = _feat(z, train)
    if train:
        feat_calls.append(
            (z.detach().clone(), h.detach().clone(), [w.clone() for w in rec], float(clf.aux_loss))
        )
    return h


clf.features = rec_features
task = tasks[1]
X = common.task_images(clf, task)
Y = torch.tensor([0, 1, 0, 1])
z = clf.prefix(X)
# task 1: 3 epochs x 1 batch = 3 Adam steps at lr, lr, lr cos(99 pi / 400): the schedule changes the lr
# within the compared steps
EPOCHS = 3
clf.config.train.epochs = EPOCHS
with common.recording_optimizer("Adam") as opt_rec:
    stats = clf.fit_task(task, stream_tasks=T)
init = opt_rec["init"][-1]  # trainable(): P_l for l in layers, then K_l, then A_l; then head w, b
nl = len(b.prompt_layers)
P0, K0, A0 = init[:nl], init[nl : 2 * nl], init[2 * nl : 3 * nl]


def their_model(P, K, A, ortho=0.0):
    feat = CodaViT(
        img_size=32, patch_size=16, embed_dim=192, depth=12, num_heads=3, ckpt_layer=0, drop_path_rate=0
    )
    missing, unexpected = feat.load_state_dict(plain.state_dict(), strict=False)
    assert not missing, missing
    pr = zoo.CodaPrompt(192, T, [b.pool_size, b.prompt_length, ortho], key_dim=192)
    pr.task_count = 1
    with torch.no_grad():
        for j, l in enumerate(b.prompt_layers):
            getattr(pr, f"e_p_{l}").copy_(P[j])
            getattr(pr, f"e_k_{l}").copy_(K[j])
            getattr(pr, f"e_a_{l}").copy_(A[j])
    m = zoo.ViTZoo.__new__(zoo.ViTZoo)
    nn.Module.__init__(m)
    m.feat, m.prompt, m.prompt_flag, m.task_id = feat.eval(), pr, "coda", None
    m.last = nn.Linear(192, 2)
    return m


m = their_model(P0, K0, A0)
with torch.no_grad():
    m.last.weight.copy_(init[-2])
    m.last.bias.copy_(init[-1])
z0, h0, w0, aux0 = feat_calls[0]
perm = [int(((z0 - z[j]).abs().flatten(1).amax(1) == 0).nonzero()[0]) for j in range(4)]
with torch.no_grad():
    rec.clear()
    h_t, pl = zoo.ViTZoo.forward(m, X, pen=True, train=True)
    w_t = [w.clone() for w in rec[-nl:]]  # the prompted pass (the query pass has no prompt)
report("train features (task 1: comps 0-9 frozen, 10-19 trained)", mad(h0[perm], h_t), 1e-5)
report(
    "attention weights cos(q*A_m, K_m), 5 layers x 20 components",
    max(mad(a[perm], bb) for a, bb in zip(w0, w_t)),
    1e-5,
    f"shape {tuple(w_t[0].shape)}",
)
info(
    "aux loss with ortho_weight 0 (released: 0): ours / theirs",
    f"{float(aux0)} / {float(pl.sum())}",
    "both zero by construction; the penalty is compared at weight 0.1 below",
)

# their update_model: logits[:, :valid]; logits[:, :last_valid] = -inf; CE (+ prompt_loss); Adam over
# prompt + last. learners/default.py: for epoch in range(E): if epoch > 0: scheduler.step(); ... (one batch
# per epoch here)


def their_steps():
    mm = their_model(P0, K0, A0)
    with torch.no_grad():
        mm.last.weight.copy_(init[-2])
        mm.last.bias.copy_(init[-1])
    opt = torch.optim.Adam(
        list(mm.prompt.parameters()) + list(mm.last.parameters()),
        lr=b.lr,
        weight_decay=0.0,
        betas=(0.9, 0.999),
    )
    sched = CosineSchedule(opt, K=EPOCHS)
    losses, lrs = [], []
    for epoch in range(EPOCHS):
        if epoch > 0:
            sched.step()
        lrs.append(opt.param_groups[0]["lr"])
        logits, prompt_loss = zoo.ViTZoo.forward(mm, X, train=True)
        loss = F.cross_entropy(logits, Y)
        losses.append(float(loss))
        total = loss + prompt_loss.sum()
        opt.zero_grad()
        total.backward()
        opt.step()
    return mm, losses, lrs


m, losses, lrs = their_steps()
ours_lrs = [epoch_lr(b.lr, b.schedule, e, EPOCHS) for e in range(EPOCHS)]
report(
    f"lr per epoch of the {EPOCHS}-epoch task: our epoch_lr vs their CosineSchedule",
    max(abs(x - y) for x, y in zip(lrs, ours_lrs)),
    1e-12,
    f"theirs {[f'{x:.3e}' for x in lrs]} ours {[f'{x:.3e}' for x in ours_lrs]}",
)
report("loss: CE step 1", abs(stats["loss_first"] - losses[0]), 1e-5)
report(f"loss: CE step {EPOCHS}", abs(stats["loss_last"] - losses[-1]), 1e-5)
dP = dK = dA = 0.0
for l in b.prompt_layers:
    dP = max(dP, mad(clf.P_[l], getattr(m.prompt, f"e_p_{l}")))
    dK = max(dK, mad(clf.K_[l], getattr(m.prompt, f"e_k_{l}")))
    dA = max(dA, mad(clf.A_[l], getattr(m.prompt, f"e_a_{l}")))
tag = f"{EPOCHS} Adam steps, their CosineSchedule"
tol = 1e-4  # 0.1*lr: Adam's first step lr*g/(|g|+1e-8) amplifies fp32 round-off where |g| ~ 1e-8
report(f"{tag}: P, all 100 components x 5 layers", dP, tol, "tol 0.1*lr")
report(f"{tag}: K", dK, tol, "tol 0.1*lr (Adam first-step sensitivity at |g|~eps)")
report(f"{tag}: A", dA, tol)
report(
    f"{tag}: head",
    max(mad(clf.heads_[1].weight, m.last.weight), mad(clf.heads_[1].bias, m.last.bias)),
    1e-5,
)
# the schedule over several task lengths (CODA / InfLoRA configs use 20 epochs): their CosineSchedule
# stepped as their learners do
common.add_path(os.path.join("theirs_inflora", "utils"))
spec = importlib.util.spec_from_file_location(
    "inflora_sched", os.path.join(common.theirs("theirs_inflora"), "utils", "schedulers.py")
)
isch = importlib.util.module_from_spec(spec)
spec.loader.exec_module(isch)
for name, cls in (("CODA", CosineSchedule), ("InfLoRA", isch.CosineSchedule)):
    diff = 0.0
    for E in (2, 3, 5, 10, 20):
        o = torch.optim.Adam([nn.Parameter(torch.zeros(1))], lr=1.0)
        sc = cls(o, K=E)
        lrs = []
        for e in range(E):
            if e > 0:
                sc.step()  # CODA: at the start of epoch e > 0; InfLoRA: after each epoch (same sequence)
            lrs.append(o.param_groups[0]["lr"])
        ours = [epoch_lr(1.0, "cosine", e, E) for e in range(E)]
        diff = max(diff, max(abs(x - y) for x, y in zip(lrs, ours)))
    report(
        f"cosine schedule, E = 2, 3, 5, 10, 20 epochs: lr/lr0 per epoch, ours vs their {name} CosineSchedule",
        diff,
        1e-9,
        f"E=20: theirs e0..2 {[round(x, 4) for x in lrs[:3]]} last {lrs[-1]:.4f}; "
        f"ours e0..2 {[round(x, 4) for x in ours[:3]]} last {ours[-1]:.4f}",
    )
info("our optimiser", f"Adam {opt_rec['kw'][-1]}")

# inference (task 1 model: components 0..19) and its attention weights
with torch.no_grad():
    rec.clear()
    h_o = clf.features(z, train=False)
    w_o = [w.clone() for w in rec]
    rec.clear()
    h_t = zoo.ViTZoo.forward(m, X, pen=True, train=False)
    w_t = [w.clone() for w in rec[-nl:]]
report("test features (components 0..f)", mad(h_o, h_t), 1e-5)
report("test attention weights", max(mad(a, bb) for a, bb in zip(w_o, w_t)), 1e-5)

# ortho penalty with weight > 0
clf.config.baseline.ortho_weight = 0.1
clf._task = 1
with torch.no_grad():
    clf.features(z, train=True)
    mo = their_model(
        [clf.P_[l] for l in b.prompt_layers],
        [clf.K_[l] for l in b.prompt_layers],
        [clf.A_[l] for l in b.prompt_layers],
        ortho=0.1,
    )
    _, pl = zoo.ViTZoo.forward(mo, X, train=True)
report(
    "aux: ortho penalty, weight 0.1 (sum over 5 layers of K, A, P)",
    abs(float(clf.aux_loss) - float(pl.sum())),
    1e-6,
    f"ours {float(clf.aux_loss):.6f} theirs {float(pl.sum()):.6f}",
)

# Gram-Schmidt initialisation of task 2's components: their gram_schmidt fed our random draws. Both are
# classical Gram-Schmidt (every projection taken from the raw draw), so they agree from the trained,
# no longer orthogonal, old rows as well as from an orthonormal basis of them.
gen_seed = 123
trained = clf.P_[0].detach().reshape(b.pool_size, -1)[:20].clone()


def both_gs(old):
    ours_gs = gram_schmidt(old, 10, torch.Generator().manual_seed(gen_seed))
    gseq = torch.Generator().manual_seed(gen_seed)
    seq = [torch.randn(old.shape[1], generator=gseq, dtype=torch.float64).float() for _ in range(10)]
    pr = zoo.CodaPrompt(192, T, [b.pool_size, b.prompt_length, 0.0], key_dim=192)
    pr.task_count = 2
    _rl = torch.randn_like
    it = iter(seq)
    torch.randn_like = lambda t, *a, **k: next(it).to(t.dtype)
    vv = torch.zeros(b.pool_size, old.shape[1])
    vv[:20] = old
    their_gs = pr.gram_schmidt(vv).detach()[20:30]
    torch.randn_like = _rl
    return ours_gs, their_gs


orthonormal = torch.linalg.qr(trained.double().T)[0].T.float()
ours_gs, their_gs = both_gs(orthonormal)
report(
    "Gram-Schmidt rows of task 2 (same random draws; old rows = orthonormal basis of the trained rows)",
    mad(ours_gs, their_gs),
    1e-6,
)
gram = trained.double() @ trained.double().T
cos_off = (
    gram / torch.outer(gram.diag().sqrt(), gram.diag().sqrt()) - torch.eye(20, dtype=torch.float64)
).abs()
ours_t, their_t = both_gs(trained)
report(
    "Gram-Schmidt rows of task 2 from the trained (non-orthogonal) old rows",
    mad(ours_t, their_t),
    1e-5,
    f"old rows' max |cos| {float(cos_off.max()):.2e}",
)
oo = float((ours_t.double() @ trained.double().T).abs().max())
tt = float((their_t.double() @ trained.double().T).abs().max())
info("max |<new, old>| after Gram-Schmidt from the trained rows (ours / theirs)", f"{oo:.2e} / {tt:.2e}")
torch.einsum = _einsum
common.summary()
