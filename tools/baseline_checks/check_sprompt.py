"""S-Prompt: ours (proteus.baselines.sprompt.SPrompt) against the released code (iamwangyabin/S-Prompts
@ a26e822: models/sinet.py ViT_Prompts, SiNet; methods/sprompt.py SPrompts.incremental_train, _train,
train_function, clustering, _eval_cnn), run on a learner made by their own SPrompts(args).

Their SPrompts.__init__ runs as it is, with the arguments of configs/cddb_sip.json (class_num 2 per task head,
prompt length 10), its missing init_* keys taken from configs/core50_slip.json, and our sizes (embd_dim 192,
3 sessions, 3 epochs, batch = the task). Their ViT builder is replaced by one that builds their ViT_Prompts
at ViT-Ti/16, 32 px, with our random (perturbed) ViT-Ti weights, instead of a pretrained ViT-B. Their prompt
and head initialisation (SiNet's nn.Linear pools) is compared in distribution with ours and copied into ours.

3 tasks x 10 training images (2 classes; each task's images are noise around a colour and pattern of its
own), 4 held-out images per task.
  0. features with given prompts: their ViT_Prompts.forward (one prompt for the batch, one per sample, none)
     against our prompted / query, on the same weights
  1. per task: their incremental_train (update_fc, SGD momentum 0.9 under CosineAnnealingLR, train_function
     for 3 epochs of one batch = 3 SGD steps, clustering) and our fit_task: optimiser settings, the lr, loss
     and features of every step, prompt and head after the steps; the K-Means keys against their clustering
     call on the same images in order, at the n_init of the release's scikit-learn (10)
  2. after the 3 tasks, on the held-out images and blends of two tasks' images: prompt-free features, the
     selected task, logits and predictions of their _eval_cnn / interface and our predict_test, with the keys
     of their clustering call in order and with the keys their own pipeline made (shuffled loader)
  3. keys constructed around the held-out features so that the L1 (the release's) and L2 nearest keys belong
     to different tasks, installed in both: selection, logits and predictions
"""

import functools
import json
import os

import common
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from common import info, mad, report
from PIL import Image
from scipy.optimize import linear_sum_assignment
from sklearn.cluster import KMeans

from proteus.streams.base import Task

T, EPOCHS, N_TRAIN, N_TEST = 3, 3, 10, 4
# ours is built first: importing their models/vit.py re-registers timm's vit_* names with their builders.
clf, plain = common.setup_ours("s-prompt", epochs=EPOCHS, batch_size=N_TRAIN)
b, D = clf.options_, clf.embed_dim
common.add_path("theirs_sprompt")
common.cpu_cuda()
common.stub(
    "models.slinet", SliNet=None
)  # the CLIP variant "slip" (needs clip, ftfy): imported, unused by "sip"
import methods.sprompt as their_sp  # noqa: E402  (their code, importable only after add_path)
import models.sinet as their_sinet  # noqa: E402
from methods.sprompt import SPrompts  # noqa: E402
from models.sinet import SiNet  # noqa: E402

INF = float("inf")


# ============================================================================ harness
def make_tasks():
    """T tasks of N_TRAIN training and N_TEST held-out 32x32 images: task k's images are a colour and a
    pattern of its own plus noise; labels 2k, 2k+1 alternating"""
    rng = np.random.default_rng(0)

    def draw(k, base, n):
        ims = [np.clip(base + rng.normal(0, 25, base.shape), 0, 255).astype(np.uint8) for _ in range(n)]
        return [(Image.fromarray(im), 2 * k + i % 2) for i, im in enumerate(ims)]

    tasks = []
    for k in range(T):
        base = rng.integers(40, 216, 3) + rng.normal(0, 40, (32, 32, 3))
        train = draw(k, base, N_TRAIN)
        tasks.append(Task(k, [2 * k, 2 * k + 1], ["a", "b"], train, draw(k, base, N_TEST)))
    return tasks


class Recording(torch.optim.SGD):
    """torch.optim.SGD recording, per construction, the side that made it, its keyword arguments and the lr
    of every step"""

    log = []
    side = None

    def __init__(self, params, *a, **k):
        super().__init__(params, *a, **k)
        self.rec = {"side": Recording.side, "kw": dict(k), "lrs": []}
        Recording.log.append(self.rec)

    def step(self, *a, **k):
        self.rec["lrs"].append(self.param_groups[0]["lr"])
        return super().step(*a, **k)


class Items(torch.utils.data.Dataset):
    """their datasets' items: (index, image tensor, label)"""

    def __init__(self, X, Y):
        self.X, self.Y = X, Y

    def __len__(self):
        return len(self.Y)

    def __getitem__(self, i):
        return i, self.X[i], int(self.Y[i])


def images(task, split):
    items = getattr(task, split)
    return torch.stack([clf.eval_transform_(im) for im, _ in items]), torch.as_tensor([y for _, y in items])


class DataManager:
    """the two calls of their data manager that incremental_train makes: the open task's training images,
    the held-out images of the classes seen"""

    def __init__(self, k):
        self.k = k

    def get_task_size(self, task):
        return 2

    def get_dataset(self, indices, source, mode):
        if source == "train":
            return Items(*images(tasks[self.k], "train"))
        X, Y = zip(*[images(t, "test") for t in tasks])
        keep = np.isin(torch.cat(Y).numpy(), indices)
        return Items(torch.cat(X)[keep], torch.cat(Y)[keep])


def row(batch, x):
    """the row of batch equal to x"""
    return int(((batch - x).abs().flatten(1).amax(1) == 0).nonzero()[0])


def safe_mad(a, b):
    a, b = torch.as_tensor(a), torch.as_tensor(b)
    return mad(a, b) if a.shape == b.shape else INF


def centroid_diff(ours, theirs):
    """max abs difference of two sets of centroids matched one to one (Hungarian on the L1 distance); inf when
    their numbers differ; and whether the matching is the identity"""
    ours, theirs = torch.as_tensor(ours).double(), torch.as_tensor(theirs).double()
    if ours.shape != theirs.shape:
        return INF, False
    r, c = linear_sum_assignment(torch.cdist(ours, theirs, p=1).numpy())
    return mad(ours[r], theirs[c]), bool((c == np.arange(len(c))).all())


def ks_statistic(a, b):
    """two-sample Kolmogorov-Smirnov statistic sup |F_a - F_b| of the values of a and b"""
    a, b = a.flatten().double().sort().values, b.flatten().double().sort().values
    grid = torch.cat([a, b])
    fa = torch.searchsorted(a, grid, right=True).double() / len(a)
    fb = torch.searchsorted(b, grid, right=True).double() / len(b)
    return float((fa - fb).abs().max())


def logit_diff(ours, theirs):
    """max abs difference of (N, C) logits where -inf must sit at the same places (inf otherwise)"""
    oi, ti = torch.isinf(ours), torch.isinf(theirs)
    if ours.shape != theirs.shape or not torch.equal(oi, ti):
        return INF
    return mad(ours[~oi], theirs[~ti])


# ---------------------------------------------------------------------------- their learner
def their_vit(variant, pretrained=False, **kw):
    """replaces their _create_vision_transformer('vit_base_patch16_224', pretrained=True): their
    ViT_Prompts at ViT-Ti/16, 32 px, with our ViT-Ti's weights (nothing downloaded)"""
    m = their_sinet.ViT_Prompts(img_size=32, patch_size=16, embed_dim=D, depth=12, num_heads=3, num_classes=0)
    missing, unexpected = m.load_state_dict(plain.state_dict(), strict=False)
    assert not unexpected and all("_grow" in k for k in missing), (missing, unexpected)
    return m.eval()


their_sinet._create_vision_transformer = their_vit
their_sp.tqdm = functools.partial(their_sp.tqdm, disable=True)
cfg_dir = os.path.join(common.theirs("theirs_sprompt"), "configs")
args = json.load(open(os.path.join(cfg_dir, "cddb_sip.json")))
init_from = json.load(open(os.path.join(cfg_dir, "core50_slip.json")))  # cddb_sip.json has no init_* keys
filled = [k for k in ("init_epoch", "init_lr", "init_lr_decay", "init_weight_decay") if k not in args]
args.update({k: init_from[k] for k in filled})
# two devices: their _train reads self._network.module, which only their DataParallel wrap provides
args.update(net_type="sip", embd_dim=D, total_sessions=T, init_epoch=EPOCHS, epochs=EPOCHS)
args.update(batch_size=N_TRAIN, num_workers=0, device=["cpu", "cpu"])
info(
    "their settings (configs/cddb_sip.json; init_* from core50_slip.json)",
    f"init_lr={args['init_lr']} lrate={args['lrate']} init_weight_decay={args['init_weight_decay']} "
    f"weight_decay={args['weight_decay']} prompt_length={args['prompt_length']}; momentum 0.9 in _train",
    f"filled from core50_slip.json: {filled}; epochs set to {EPOCHS}, batch to {N_TRAIN}",
)
info(
    "our settings (the s-prompt declaration)",
    f"optimizer={b.optimizer} lr={b.lr} momentum={b.momentum} schedule={b.schedule} "
    f"wd={clf.config.train.weight_decay} (x{clf.first_task_decay} on task 0) prompt_length={b.prompt_length}",
)
torch.manual_seed(100)
their = SPrompts(args)  # their __init__: SiNet(args) with its prompt and head pools
net = their._network
their_init = {
    "prompt": [p.weight.detach().clone() for p in net.prompt_pool],
    "head": [(h.weight.detach().clone(), h.bias.detach().clone()) for h in net.classifier_pool],
}
tasks = make_tasks()

# ============================================================================ 0. features with given prompts
print("== 0. features with given prompts: their ViT_Prompts.forward vs our prompted / query (same weights)")
X0, _ = images(tasks[0], "test")
z0 = clf.prefix(X0)
g = torch.Generator().manual_seed(5)
P = [torch.randn(b.prompt_length, D, generator=g) for _ in range(T)]
sel0 = torch.tensor([0, 2, 1, 2])
enc = net.image_encoder
with torch.no_grad():
    clf.prompts_ = [nn.Parameter(p) for p in P]  # given prompts (N(0,1)), removed below
    report(
        "0. features, one prompt for the batch (their training forward's (L, d) path)",
        safe_mad(clf.prompted(z0, torch.ones(4, dtype=torch.long)), enc(X0, P[1])),
        1e-5,
    )
    report(
        "0. features, a prompt per sample (their interface's (B, L, d) path)",
        safe_mad(clf.prompted(z0, sel0), enc(X0, torch.stack(P)[sel0])),
        1e-5,
        f"tasks {sel0.tolist()}",
    )
    clf.prompts_ = []
    report("0. prompt-free class token (the query)", safe_mad(clf.query(z0), enc(X0)), 1e-5)
    report(
        "0. normalised prompt-free class token: their extract_vector",
        safe_mad(F.normalize(clf.query(z0), dim=-1), net.extract_vector(X0)),
        1e-6,
    )

# ============================================================================ 1. training, keys
print(
    f"== 1. {T} tasks: their incremental_train and our fit_task, {EPOCHS} epochs of one batch "
    f"({EPOCHS} SGD steps)"
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
_begin = clf.begin_task


def begin_with_their_prompt(k, z, loader):
    _begin(k, z, loader)
    cap.setdefault("our_prompt_init", []).append(clf.prompts_[-1].detach().clone())
    with torch.no_grad():
        clf.prompts_[-1].copy_(their_init["prompt"][k])


clf.begin_task = begin_with_their_prompt
_Linear = nn.Linear


class TheirHeadInit(_Linear):
    """our head nn.Linear, its own draw recorded, then their classifier_pool[k]'s initial values copied in"""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        cap.setdefault("our_head_init", []).append((self.weight.detach().clone(), self.bias.detach().clone()))
        with torch.no_grad():
            self.weight.copy_(their_init["head"][cap["task"]][0])
            self.bias.copy_(their_init["head"][cap["task"]][1])


def rec_their_forward(m, a, out):
    """their training forwards (the ones with grad): the input images and the features"""
    if torch.is_grad_enabled():
        cap.setdefault("their_h", []).append((a[0].detach().clone(), out.detach().clone()))


def _rec_ce(*a, **k):
    loss = F.cross_entropy(*a, **k)
    cap.setdefault("their_losses", []).append(float(loss))
    return loss


their_sp.F = type("F", (), {"cross_entropy": staticmethod(_rec_ce)})
KMEANS_THEN = functools.partial(KMeans, n_init=10)  # scikit-learn's default before 1.4 (1.2 warned of it)

_SGD = torch.optim.SGD
torch.optim.SGD = Recording
their_keys_pipeline, their_keys_then = [], []
try:
    for k, task in enumerate(tasks):
        X, Y = images(task, "train")
        z = clf.prefix(X)
        for key in ("our_z", "our_h", "their_losses", "their_h"):
            cap.pop(key, None)
        # ours: the real fit_task, their initial prompt and head copied in
        cap["task"], Recording.side = k, "ours"
        nn.Linear = TheirHeadInit
        try:
            clf.fit_task(task, stream_tasks=T)
        finally:
            nn.Linear = _Linear
        # theirs: incremental_train as it is (update_fc, DataLoader, _train, train_function, clustering)
        Recording.side = "theirs"
        hook = net.image_encoder.register_forward_hook(rec_their_forward)
        their.incremental_train(DataManager(k))
        hook.remove()
        their_keys_pipeline.append(their.all_keys[-1].clone())
        ro, rt = [r for r in Recording.log if r["side"] == "ours"][-1], Recording.log[-1]
        assert rt["side"] == "theirs"

        # --- optimiser
        for name in ("lr", "momentum", "weight_decay"):
            report(
                f"1.task{k}: SGD {name}",
                abs(float(ro["kw"].get(name, 0.0)) - float(rt["kw"].get(name, 0.0))),
                0,
                f"ours {ro['kw'].get(name)} theirs {rt['kw'].get(name)}",
            )
        report(
            f"1.task{k}: SGD dampening, nesterov",
            float(ro["kw"].get("dampening", 0) != rt["kw"].get("dampening", 0))
            + float(bool(ro["kw"].get("nesterov")) != bool(rt["kw"].get("nesterov"))),
            0,
        )
        report(
            f"1.task{k}: lr of every step (their CosineAnnealingLR(T_max={EPOCHS}) stepped per epoch)",
            max(abs(a - c) for a, c in zip(ro["lrs"], rt["lrs"]))
            if len(ro["lrs"]) == len(rt["lrs"])
            else INF,
            1e-12,
            f"theirs {[round(x, 8) for x in rt['lrs']]}",
        )
        # --- losses and features of every step
        tl = cap.get("their_losses", [])
        report(
            f"1.task{k}: CE loss, steps 1..{EPOCHS} (their train_function's)",
            max(abs(r["loss"] - t) for r, t in zip(clf.train_log_, tl))
            if len(tl) == len(clf.train_log_) == EPOCHS
            else INF,
            1e-5,
            f"theirs {[round(x, 6) for x in tl]}",
        )
        dh = 0.0 if len(cap.get("their_h", [])) == len(cap["our_h"]) == EPOCHS else INF
        for s in range(EPOCHS if dh == 0 else 0):  # both sides shuffle: rows matched by their input
            x_t, h_t = cap["their_h"][s]
            rows_t = [row(x_t, X[j]) for j in range(N_TRAIN)]  # image j's row in their batch
            rows_o = [row(cap["our_z"][s], z[j]) for j in range(N_TRAIN)]  # its prefix output's row in ours
            dh = max(dh, mad(cap["our_h"][s][rows_o], h_t[rows_t]))
        report(f"1.task{k}: features of every step (class token with the task's prompt)", dh, 1e-5)
        # --- state after the steps
        report(
            f"1.task{k}: prompt after {EPOCHS} SGD steps",
            safe_mad(clf.prompts_[k], net.prompt_pool[k].weight),
            1e-6,
            f"shape {tuple(clf.prompts_[k].shape)}",
        )
        report(
            f"1.task{k}: head after {EPOCHS} SGD steps",
            max(
                safe_mad(clf.heads_[k].weight, net.classifier_pool[k].weight),
                safe_mad(clf.heads_[k].bias, net.classifier_pool[k].bias),
            ),
            1e-6,
        )
        # --- keys: their clustering call on the task's images in order (ours: in order), n_init of its time
        loader = torch.utils.data.DataLoader(Items(X, Y), batch_size=N_TRAIN, shuffle=False)
        _km, their_sp.KMeans = their_sp.KMeans, KMEANS_THEN
        try:
            their.clustering(loader)
        finally:
            their_sp.KMeans = _km
        then_keys = their.all_keys.pop()
        their_keys_then.append(then_keys.clone())
        d, ident = centroid_diff(clf.keys_[k], then_keys)
        report(
            f"1.task{k}: K-Means keys (their clustering, same images in order, n_init=10)",
            d,
            1e-5,
            f"ours {tuple(clf.keys_[k].shape)} theirs {tuple(then_keys.shape)}; matched order "
            f"{'identity' if ident else 'permuted' if d < INF else '-'}",
        )
        their.clustering(loader)
        now_keys = their.all_keys.pop()
        info(
            f"1.task{k}: keys of their call in order, scikit-learn's default today (n_init='auto': 1 start)",
            f"{centroid_diff(clf.keys_[k], now_keys)[0]:.3e}",
            "max abs diff to ours after matching",
        )
        info(
            f"1.task{k}: keys of their pipeline (shuffled train loader, n_init='auto')",
            f"{centroid_diff(clf.keys_[k], their_keys_pipeline[k])[0]:.3e}",
            "max abs diff to ours after matching; these keys are used in part 2",
        )
        their.after_task()  # _known_classes moves on (their clustering above reads the open task's labels)
finally:
    torch.optim.SGD = _SGD
    clf.begin_task = _begin
    clf.features = _feat

our_p0, their_p0 = torch.stack(cap["our_prompt_init"]), torch.stack(their_init["prompt"])
n_p = our_p0.numel()
report(
    "1. initial prompts: two-sample KS statistic, ours vs their nn.Linear(d, L) weights",
    ks_statistic(our_p0, their_p0) if our_p0.shape == their_p0.shape else INF,
    1.95 * (2.0 / n_p) ** 0.5,
    f"{n_p} values each; tol = KS critical value at level 0.001",
)
report(
    "1. initial prompts: max |P| (the uniform bound 1/sqrt(d))",
    abs(float(our_p0.abs().max()) - float(their_p0.abs().max())),
    2e-3,
    f"ours {float(our_p0.abs().max()):.5f} theirs {float(their_p0.abs().max()):.5f} 1/sqrt(d) {D**-0.5:.5f}",
)
our_w0 = torch.cat([torch.cat([w.flatten(), bb]) for w, bb in cap["our_head_init"]])
their_w0 = torch.cat([torch.cat([w.flatten(), bb]) for w, bb in their_init["head"]])
report(
    "1. initial heads: two-sample KS statistic, ours vs their classifier_pool",
    ks_statistic(our_w0, their_w0) if our_w0.shape == their_w0.shape else INF,
    1.95 * (2.0 / our_w0.numel()) ** 0.5,
    f"{our_w0.numel()} values each",
)
report(
    f"1. every task's prompt and head after all {T} tasks (old ones untouched)",
    max(
        max(safe_mad(clf.prompts_[t], net.prompt_pool[t].weight) for t in range(T)),
        max(safe_mad(clf.heads_[t].weight, net.classifier_pool[t].weight) for t in range(T)),
    ),
    1e-6,
)


# ============================================================================ 2. test after training
def their_test(X, Y):
    """their _eval_cnn on one batch: (selection, (N, C) logits with -inf outside the selected task, global
    predictions)"""
    rec = {}

    def interface(image, selection):
        out = SiNet.interface(net, image, selection)
        rec["sel"], rec["out"] = selection.clone(), out.detach().clone()
        return out

    net.interface = interface
    try:
        y_pred, _ = their._eval_cnn(torch.utils.data.DataLoader(Items(X, Y), batch_size=len(Y)))
    finally:
        del net.interface
    sel, out = rec["sel"], rec["out"]
    full = torch.full((len(Y), 2 * T), -INF)
    for i, t in enumerate(sel.tolist()):
        full[i, 2 * t : 2 * t + 2] = out[i]
    preds = torch.as_tensor([clf.task_classes_[t][int(c)] for t, c in zip(sel.tolist(), y_pred[:, 0])])
    return sel, full, preds


def our_test(z):
    logits, sel = clf.infer(z)
    preds = clf.predict_test(type("Cache", (), {"prefix": lambda self, tau: z})(), 0, T - 1).label
    return sel, logits, preds


print("== 2. after training, held-out images and blends of two tasks' images: selection, logits, predictions")
XT, YT = zip(*[images(t, "test") for t in tasks])
XT, YT = torch.cat(XT), torch.cat(YT)
zT = clf.prefix(XT)
# blends w x_i + (1 - w) x_j of held-out images of two different tasks: inputs between the tasks' keys
PAIRS = [(0, 4, 0.5), (5, 9, 0.6), (10, 2, 0.55), (3, 11, 0.45), (6, 1, 0.4), (8, 7, 0.5)]
XB = torch.stack([w * XT[i] + (1 - w) * XT[j] for i, j, w in PAIRS])
XA, YA = torch.cat([XT, XB]), torch.cat([YT, YT[[i for i, _, _ in PAIRS]]])
zA = clf.prefix(XA)
with torch.no_grad():
    fA = net.extract_vector(XA)
fT = fA[: len(YT)]
report(
    "2. normalised prompt-free features (held-out images and blends)",
    safe_mad(F.normalize(clf.query(zA), dim=-1), fA),
    1e-6,
)


def l1_margin(f, keys):
    """per input: the second-nearest task's L1 distance minus the nearest's (how robust a selection is)"""
    d = torch.stack([torch.cdist(f.double(), c.double(), p=1).min(1).values for c in keys], 1)
    s2 = d.sort(1).values
    return s2[:, 1] - s2[:, 0]


true_task = YT // 2
for label, keys, X_, z_ in (
    ("their clustering's keys, in order, n_init=10", their_keys_then, XA, zA),
    ("the keys of their pipeline (shuffled loader, n_init='auto')", their_keys_pipeline, XT, zT),
):
    their.all_keys = [k_.clone() for k_ in keys]
    s_o, l_o, p_o = our_test(z_)
    s_t, l_t, p_t = their_test(X_, torch.zeros(len(X_), dtype=torch.long))
    n = len(X_)
    report(
        f"2. selected task, theirs with {label}: inputs that differ (of {n})",
        float((s_o != s_t).sum()),
        0,
        f"ours {s_o.tolist()} theirs {s_t.tolist()}",
    )
    report(f"2. logits (N, 6), {label}: the selected task's head, -inf elsewhere", logit_diff(l_o, l_t), 1e-5)
    report(
        f"2. predictions, {label}: inputs that differ", float((p_o != p_t).sum()), 0, f"ours {p_o.tolist()}"
    )
    m = l1_margin(fA[:n], keys)
    info(
        f"2. {label}: retrieval accuracy on the held-out images; smallest L1 margin",
        f"ours {float((s_o[: len(YT)] == true_task).float().mean()):.2f} "
        f"theirs {float((s_t[: len(YT)] == true_task).float().mean()):.2f}; margin {float(m.min()):.2e}",
        "margin: second-nearest task's distance minus the nearest's (their keys, their features)",
    )

# ============================================================================ 3. constructed L1 / L2 keys
print("== 3. keys constructed so that the L1 (release) and L2 nearest keys belong to different tasks")
N = len(YT)
gap = float(torch.cdist(fT.double(), fT.double()).add(torch.eye(N, dtype=torch.float64) * 1e9).min())
delta = 0.1 * gap  # one coordinate moved by delta: L1 = L2 = delta
eps = delta / (
    2 * D**0.5
)  # every coordinate moved by +-eps: L1 = delta sqrt(d)/2 > delta, L2 = delta/2 < delta
gs = torch.Generator().manual_seed(9)
A_task = torch.arange(N) % T  # the L1 choice
B_task = (torch.arange(N) + 1) % T  # the L2 choice
keysets = [[] for _ in range(T)]
for i in range(N):
    ka = fT[i].double().clone()
    ka[(7 * i) % D] += delta
    kb = fT[i].double() + eps * (torch.randint(0, 2, (D,), generator=gs).double() * 2 - 1)
    keysets[int(A_task[i])].append(ka)
    keysets[int(B_task[i])].append(kb)
ckeys = [torch.stack(ks).float() for ks in keysets]


def nearest(q, keys, p):
    return torch.stack([torch.cdist(q.double(), c.double(), p=p).min(1).values for c in keys], 1).argmin(1)


l1, l2 = nearest(fT, ckeys, 1.0), nearest(fT, ckeys, 2.0)
assert torch.equal(l1, A_task) and torch.equal(l2, B_task), "construction failed: inputs too close"
info(
    "3. constructed keys: inputs whose L1 and L2 nearest tasks differ (harness's own computation)",
    f"{int((l1 != l2).sum())} of {N}",
    f"delta {delta:.2e} (0.1 x the closest pair of held-out features), eps {eps:.2e}",
)
clf.keys_ = [c.clone() for c in ckeys]
their.all_keys = [c.clone() for c in ckeys]
s_o, l_o, p_o = our_test(zT)
s_t, l_t, p_t = their_test(XT, YT)
report(
    "3. selected task on the constructed keys, inputs that differ",
    float((s_o != s_t).sum()),
    0,
    f"theirs {s_t.tolist()} (L1 construction {A_task.tolist()}, L2 would pick {B_task.tolist()})",
)
report("3. logits (N, 6) on the constructed keys", logit_diff(l_o, l_t), 1e-5)
report("3. predictions on the constructed keys, inputs that differ", float((p_o != p_t).sum()), 0)
common.summary()
