"""CODA-Prompt: ours (proteus.baselines.prompts.CodaPrompt) against the released code (GT-RIPL/CODA-Prompt:
models/zoo.py CodaPrompt, ortho_penalty, gram_schmidt, ViTZoo.forward; models/vit.py VisionTransformer /
Attention with prompt; learners/prompt.py CODAPrompt / Prompt.update_model / init_optimizer;
learners/default.py NormalNN.learn_batch; utils/schedulers.py CosineSchedule, through init_optimizer), on CPU.

Ours runs fit_task for task 0 (10 tasks x 10 components of a pool of 100, prompt length 8, blocks 0-4); task 1
is compared (task_count = 1: components 0-9 frozen, 10-19 trained). Task 1 trains 3 epochs of 2 batches of 2
on each side: ours through fit_task, theirs through their learner's learn_batch (their epoch loop, with
scheduler.step() at the start of every epoch after the first, init_optimizer's Adam and CosineSchedule, and
update_model for every batch) on a harness object made with CODAPrompt.__new__, with the settings of their
configs/cifar-100_prompt.yaml. The cosine schedule changes the lr within the compared steps; its lr per
epoch over longer tasks is compared separately, from the same learn_batch with an empty loader.
Attention weights are read from both sides' torch.einsum('bk,kld->bld', weights, P) call (the same equation
string in both codes).
"""

import contextlib
import importlib.util
import io
import os

import common
import torch
import torch.nn as nn
import yaml
from common import info, mad, report

from proteus.baselines.learner import epoch_lr
from proteus.baselines.prompts import gram_schmidt

clf, plain = common.setup_ours("coda-prompt", epochs=2, batch_size=4)
b = clf.options_
common.add_path("theirs_coda")
common.cpu_cuda()
# their code, importable only after add_path:
import models.zoo as zoo  # noqa: E402
from learners.prompt import CODAPrompt as TheirLearner  # noqa: E402
from models.vit import VisionTransformer as CodaViT  # noqa: E402

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

tasks = common.random_tasks(3)  # tasks 0, 1 trained; task 2: held-out images for the test
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
Y = torch.tensor([0, 1, 0, 1])  # local labels; their learner trains on the global ones, 2 and 3
z = clf.prefix(X)
# the released settings (configs/cifar-100_prompt.yaml; experiments/cifar-100.sh: --prompt_param 100 8 0.0)
with open(os.path.join(common.theirs("theirs_coda"), "configs", "cifar-100_prompt.yaml")) as f:
    THEIR_CFG = yaml.safe_load(f)
# task 1: 3 epochs x 2 batches of 2 = 6 Adam steps at lr, lr, lr cos(99 pi / 400) per epoch: the schedule
# changes the lr within the compared steps
EPOCHS, BS = 3, 2
clf.config.train.epochs, clf.config.train.batch_size = EPOCHS, BS
with common.recording_optimizer("Adam") as opt_rec:
    stats = clf.fit_task(task, stream_tasks=T)
init = opt_rec["init"][-1]  # trainable(): P_l for l in layers, then K_l, then A_l; then head w, b
nl = len(b.prompt_layers)
P0, K0, A0 = init[:nl], init[nl : 2 * nl], init[2 * nl : 3 * nl]
n_steps = len(clf.train_log_)
assert n_steps == len(feat_calls) == EPOCHS * len(X) // BS, (n_steps, len(feat_calls))


def rows_of(zb):
    """the indices into X of a batch of ours' prefix outputs (ours shuffles every epoch)"""
    d = (z[None] - zb[:, None]).abs().flatten(2).amax(2)  # (len(zb), len(X))
    assert float(d.min(1).values.max()) < 1e-5
    return d.argmin(1).tolist()


batches = [rows_of(c[0]) for c in feat_calls]
info(f"samples of the {n_steps} batches (ours shuffles every epoch; their loader follows)", str(batches))


def their_model(P, K, A, ortho=0.0):
    feat = CodaViT(
        img_size=32, patch_size=16, embed_dim=192, depth=12, num_heads=3, ckpt_layer=0, drop_path_rate=0
    )
    missing, unexpected = feat.load_state_dict(plain.state_dict(), strict=False)
    assert not missing, missing
    pr = zoo.CodaPrompt(192, T, [b.pool_size, b.prompt_length, ortho], key_dim=192)
    pr.task_count = 1  # trainer.py: prompt.process_task_count() once task 1 opens (its Gram-Schmidt draws
    # are random: both sides start from ours' state, and Gram-Schmidt is compared at the end)
    with torch.no_grad():
        for j, l in enumerate(b.prompt_layers):
            getattr(pr, f"e_p_{l}").copy_(P[j])
            getattr(pr, f"e_k_{l}").copy_(K[j])
            getattr(pr, f"e_a_{l}").copy_(A[j])
    m = zoo.ViTZoo.__new__(zoo.ViTZoo)
    nn.Module.__init__(m)
    m.feat, m.prompt, m.prompt_flag, m.task_id = feat.eval(), pr, "coda", 1
    # the classifier over the 4 classes seen: rows 0-1 task 0's head (ours'), rows 2-3 task 1's at its start
    m.last = nn.Linear(192, 4)
    with torch.no_grad():
        m.last.weight.copy_(torch.cat([clf.heads_[0].weight, init[-2]]))
        m.last.bias.copy_(torch.cat([clf.heads_[0].bias, init[-1]]))
    return m


# ---------------------------------------------------------------- the initial state (ours' first batch)
m = their_model(P0, K0, A0)
z0, h0, w0, aux0 = feat_calls[0]
with torch.no_grad():
    rec.clear()
    h_t, pl = zoo.ViTZoo.forward(m, X[batches[0]], pen=True, train=True)
    w_t = [w.clone() for w in rec[-nl:]]  # the prompted pass (the query pass has no prompt)
report("train features (task 1: comps 0-9 frozen, 10-19 trained; first batch)", mad(h0, h_t), 1e-5)
report(
    "attention weights cos(q*A_m, K_m), 5 layers x 20 components",
    max(mad(a, bb) for a, bb in zip(w0, w_t)),
    1e-5,
    f"shape {tuple(w_t[0].shape)}",
)
info(
    "aux loss with ortho_weight 0 (released: 0): ours / theirs",
    f"{float(aux0)} / {float(pl.sum())}",
    "both zero by construction; the penalty is compared at weight 0.1 below",
)


# ---------------------------------------------------------------- task 1 through their learner
class EpochLoader:
    """their DataLoader(shuffle=True) draws a new order every epoch; this one gives epoch e ours' batches of
    epoch e, as (x, y, task) like their dataset"""

    def __init__(self, epochs):
        self.epochs, self.i = epochs, 0

    def __iter__(self):
        self.i += 1
        return iter(self.epochs[self.i - 1])


def their_learner(model, epochs, logs):
    """their CODAPrompt learner without its __init__ (which builds a ViT-B/16 and loads its weights): the
    attributes __init__ sets, from the released config; `epochs`: the schedule's length (config schedule)"""
    L = TheirLearner.__new__(TheirLearner)
    nn.Module.__init__(L)
    L.log = lambda *a, **k: logs.append(a)
    L.config = {k: THEIR_CFG[k] for k in ("lr", "momentum", "weight_decay", "optimizer", "schedule_type")}
    L.config.update(schedule=[epochs], gpuid=[0])
    L.prompt_param = [T, [b.pool_size, b.prompt_length, 0.0]]
    L.model, L.out_dim = model, 4
    L.reset_optimizer, L.overwrite, L.memory_size, L.dw, L.top_k = True, True, 0, False, 1
    L.criterion_fn = nn.CrossEntropyLoss(reduction="none")
    L.gpu = False  # CPU: learn_batch leaves the batches where they are
    L.schedule_type, L.schedule = L.config["schedule_type"], L.config["schedule"]
    L.task_count, L.valid_out_dim, L.last_valid_out_dim = 0, 0, 0
    L.add_valid_output_dim(2)  # task 0 (trainer.py before learn_batch); learn_batch then sets last_valid
    L.last_valid_out_dim, L.task_count = 2, 1
    L.add_valid_output_dim(2)  # task 1
    return L


logs, their_losses, their_lrs = [], [], []
L = their_learner(their_model(P0, K0, A0), EPOCHS, logs)


def rec_update_model(x, y):
    their_lrs.append(L.optimizer.param_groups[0]["lr"])
    loss, out = TheirLearner.update_model(L, x, y)  # their step: CE on the seen slice, old classes -inf
    their_losses.append(float(loss))
    return loss, out


L.update_model = rec_update_model
Yg = torch.tensor([c for _, c in task.train])  # 2, 3, 2, 3
loader = EpochLoader(
    [
        [
            (X[i], Yg[i], torch.ones(len(i), dtype=torch.long))
            for i in batches[e * (len(X) // BS) :][: len(X) // BS]
        ]
        for e in range(EPOCHS)
    ]
)
with contextlib.redirect_stdout(io.StringIO()):  # init_optimizer prints a row of asterisks
    L.learn_batch(loader, None, "unused (overwrite)", None)
m = L.model
assert len(their_losses) == n_steps, (len(their_losses), n_steps)
ours_lrs = [r["lr"] for r in clf.train_log_]
report(
    f"lr of each of the {n_steps} steps: our training loop vs their learn_batch (CosineSchedule, K={EPOCHS})",
    max(abs(x - y) for x, y in zip(their_lrs, ours_lrs)),
    1e-12,
    f"theirs {[f'{x:.3e}' for x in their_lrs]} ours {[f'{x:.3e}' for x in ours_lrs]}",
)
for i in range(n_steps):
    report(
        f"loss: CE step {i + 1} (their update_model)", abs(clf.train_log_[i]["loss"] - their_losses[i]), 1e-5
    )
dP = dK = dA = 0.0
for l in b.prompt_layers:
    dP = max(dP, mad(clf.P_[l], getattr(m.prompt, f"e_p_{l}")))
    dK = max(dK, mad(clf.K_[l], getattr(m.prompt, f"e_k_{l}")))
    dA = max(dA, mad(clf.A_[l], getattr(m.prompt, f"e_a_{l}")))
tag = f"{n_steps} Adam steps, their learn_batch"
tol = 0.1 * b.lr  # Adam's first step lr*g/(|g|+1e-8) amplifies fp32 round-off where |g| ~ 1e-8
report(f"{tag}: P, all 100 components x 5 layers", dP, tol, "tol 0.1*lr")
report(f"{tag}: K", dK, tol, "tol 0.1*lr (Adam first-step sensitivity at |g|~eps)")
report(f"{tag}: A", dA, tol)
report(
    f"{tag}: head (their rows 2-3)",
    max(mad(clf.heads_[1].weight, m.last.weight[2:]), mad(clf.heads_[1].bias, m.last.bias[2:])),
    1e-5,
)
# the schedule over several task lengths (CODA / InfLoRA configs use 20 epochs). CODA: their learn_batch's
# epoch loop itself, on an empty loader (no update), its lr read from the 'LR:' line it logs every epoch.
# InfLoRA: its CosineSchedule stepped after each epoch, as its train_function does (check_inflora.py runs
# that loop).
common.add_path(os.path.join("theirs_inflora", "utils"))
spec = importlib.util.spec_from_file_location(
    "inflora_sched", os.path.join(common.theirs("theirs_inflora"), "utils", "schedulers.py")
)
isch = importlib.util.module_from_spec(spec)
spec.loader.exec_module(isch)


def coda_epoch_lrs(E):
    logs = []
    Ls = their_learner(m, E, logs)
    with contextlib.redirect_stdout(io.StringIO()):
        Ls.learn_batch([], None, "unused (overwrite)", None)
    return [a[1] / THEIR_CFG["lr"] for a in logs if a and a[0] == "LR:"]


def inflora_epoch_lrs(E):
    o = torch.optim.Adam([nn.Parameter(torch.zeros(1))], lr=1.0)
    sc = isch.CosineSchedule(o, K=E)
    lrs = []
    for _ in range(E):
        lrs.append(o.param_groups[0]["lr"])
        sc.step()
    return lrs


for name, their_lrs_of, how in (
    ("CODA", coda_epoch_lrs, "their learn_batch on an empty loader"),
    ("InfLoRA", inflora_epoch_lrs, "their CosineSchedule stepped after each epoch"),
):
    diff = 0.0
    for E in (2, 3, 5, 10, 20):
        lrs = their_lrs_of(E)
        ours = [epoch_lr(1.0, "cosine", e, E) for e in range(E)]
        assert len(lrs) == E, (name, E, len(lrs))
        diff = max(diff, max(abs(x - y) for x, y in zip(lrs, ours)))
    report(
        f"cosine schedule, E = 2, 3, 5, 10, 20 epochs: lr/lr0 per epoch, our epoch_lr vs {name} ({how})",
        diff,
        1e-9,
        f"E=20: theirs e0..2 {[round(x, 4) for x in lrs[:3]]} last {lrs[-1]:.4f}; "
        f"ours e0..2 {[round(x, 4) for x in ours[:3]]} last {ours[-1]:.4f}",
    )
info("our optimiser", f"Adam {opt_rec['kw'][-1]}")
od = L.optimizer.defaults
info(
    "their optimiser (init_optimizer, released config)",
    f"{type(L.optimizer).__name__} lr={od['lr']} betas={od['betas']} wd={od['weight_decay']}",
)

# test time after training (task 1 model: components 0..19) on held-out images: features and the
# prompt-component weights
X2 = common.task_images(clf, tasks[2])
with torch.no_grad():
    z2 = clf.prefix(X2)
    rec.clear()
    h_o = clf.features(z2, train=False)
    w_o = [w.clone() for w in rec]
    rec.clear()
    h_t = zoo.ViTZoo.forward(m, X2, pen=True, train=False)
    w_t = [w.clone() for w in rec[-nl:]]
report(f"test features after {n_steps} steps, held-out images (components 0..19)", mad(h_o, h_t), 1e-5)
report(
    f"test component weights after {n_steps} steps, held-out images (5 layers x 20 components)",
    max(mad(a, bb) for a, bb in zip(w_o, w_t)),
    1e-5,
)

# ortho penalty with weight > 0
clf.config.baseline["ortho_weight"] = 0.1
del clf.options_  # read again from the config
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
