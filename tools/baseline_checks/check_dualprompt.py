"""DualPrompt: ours (proteus.baselines.prompts.DualPrompt) against the PyTorch port
(JH-LEE-KR/dualprompt-pytorch: prompt.py EPrompt, attention.py PreT_Attention, vision_transformer.py
VisionTransformer; engine.train_one_epoch run as it is: CE - coeff * reduce_sim, clip_grad_norm_, Adam).

Ours runs its real fit_task for task 0; task 1 is compared (e-prompt of task 1 starts as task 0's: the port's
shared_prompt_pool=True). Their model: g-prompt blocks 0-1, e-prompt blocks 2-4, prefix tuning, pool_size = 2
(the tasks seen, see below), top_k 1, use_prompt_mask=True (training uses task t's e-prompt), head 'token'.
The port's settings (lr 0.03 x 24 / 256, --clip-grad 1.0, pull_constraint_coeff 1.0) are read from its
configs/cifar100_dualprompt.py; ours trains at the lr of our dualprompt-cifar100 config.
The port's EPrompt reshapes prompt[:, :, idx] (layers, 2, B, ...) to (layers, B, 2, ...) without a permute, so
for B > 1 sample b's key/value prefixes are mixed with other samples' (first half of the batch gets (K, K),
second half (V, V)). Their model is therefore run one sample at a time (B = 1, where the reshape is exact):
task 1 is trained by the port's engine.train_one_epoch on a loader of batches of one sample, and by our
fit_task with batch size 1 on the same samples in the same order (EPOCHS x 4 Adam steps on each side). The
batch-4 forward is reported as a finding.
"""

import argparse
import copy as _copy

import common
import torch
import torch.nn as nn
import torch.nn.functional as F
from common import info, mad, report

from proteus.config import load_yaml, packaged_config

clf, plain = common.setup_ours("dualprompt", epochs=2, batch_size=4)
b = clf.options_
common.add_path("theirs_dualprompt")
# their code, importable only after add_path:
import configs.cifar100_dualprompt as port_config  # noqa: E402
import engine as their_engine  # noqa: E402
import vision_transformer as tvt  # noqa: E402

# the port's settings: the defaults of its configs/cifar100_dualprompt.py, as main.py parses them
_parser = argparse.ArgumentParser()
port_config.get_args_parser(_parser)
PORT = _parser.parse_args([])
PORT_LR = PORT.lr * PORT.batch_size / 256  # main.py: args.lr * global_batch_size / 256 (unscale_lr=True)
OUR_LR = load_yaml(packaged_config("dualprompt-cifar100"))["baseline"]["lr"]

H, hd = 3, 64
info(
    "our config",
    f"g_layers={b.g_layers} g_len={b.g_length} e_layers={b.prompt_layers} e_len={b.prompt_length} "
    f"coeff={b.match_weight} clip_grad={b.clip_grad} Adam lr: method declaration {b.lr}, "
    f"dualprompt-cifar100 config {OUR_LR}",
    f"port cifar100 config: g {PORT.g_prompt_layer_idx} len {PORT.g_prompt_length}, "
    f"e {PORT.e_prompt_layer_idx} len {PORT.length}, coeff {PORT.pull_constraint_coeff}, "
    f"clip_grad {PORT.clip_grad}, Adam lr {PORT.lr}*{PORT.batch_size}/256 = {PORT_LR}",
)

tasks = common.random_tasks(4)  # tasks 0, 1 trained; tasks 2, 3: held-out images for the test below
clf.fit_task(tasks[0], stream_tasks=2)


def their_vit(prompt=True, nc=2, pool=2, batchwise=False, mask=True):
    kw = (
        dict(
            **common.port_prompt_pool(b.prompt_length, pool, 1, batchwise),
            head_type="token",
            use_prompt_mask=mask,
            use_g_prompt=True,
            g_prompt_length=b.g_length,
            g_prompt_layer_idx=b.g_layers,
            use_prefix_tune_for_g_prompt=True,
            use_e_prompt=True,
            e_prompt_layer_idx=b.prompt_layers,
            use_prefix_tune_for_e_prompt=True,
            same_key_value=False,
        )
        if prompt
        else {}
    )
    m = tvt.VisionTransformer(
        img_size=32, patch_size=16, embed_dim=192, depth=12, num_heads=H, num_classes=nc, **kw
    )
    optional = {"head.weight", "head.bias", "g_prompt", "e_prompt.prompt", "e_prompt.prompt_key"}
    return common.load_port_vit(m, plain.state_dict(), optional)


def load_state(m, g_prompt, e_prompts, e_keys, head=None):
    with torch.no_grad():
        m.g_prompt.copy_(g_prompt.reshape(m.g_prompt.shape))  # (n_g, 2, L, d) -> (n_g, 2, L, H, hd)
        for t, (e, k) in enumerate(
            zip(e_prompts, e_keys)
        ):  # (n_e, 2, L, d) -> prompt[:, :, t] (n_e, 2, L, H, hd)
            m.e_prompt.prompt[:, :, t].copy_(e.reshape(e.shape[0], 2, -1, H, hd))
            m.e_prompt.prompt_key[t].copy_(k)
        if head is not None:
            m.head.weight.copy_(head[0])
            m.head.bias.copy_(head[1])


orig = their_vit(prompt=False, nc=0)
task = tasks[1]
X = common.task_images(clf, task)
Y = torch.tensor([0, 1, 0, 1])
z = clf.prefix(X)

# ---------------------------------------------------------------- task 1 through our fit_task: batches of one
# sample, EPOCHS epochs of the task's 4 samples; the sample of every step is recorded (ours shuffles), and the
# port's loader follows the same order
EPOCHS = 2
clf.config.train.epochs, clf.config.train.batch_size = EPOCHS, 1
clf.config.baseline["lr"] = OUR_LR
del clf.options_  # read again from the config
step_z = []
_feat = clf.features


def rec_features(zb, train):
    if train:
        step_z.append(zb.detach().clone())
    return _feat(zb, train)


clf.features = rec_features
with common.recording_optimizer("Adam") as opt_rec:
    stats = clf.fit_task(task, stream_tasks=2)
del clf.features  # the class's own method again
init = opt_rec["init"][-1]  # [g_prompt, e_prompt_1, e_key_1, head.w, head.b]
order = []
for zb in step_z:
    d = (z - zb).abs().flatten(1).amax(1)
    assert zb.shape[0] == 1 and float(d.min()) < 1e-5, (zb.shape, float(d.min()))
    order.append(int(d.argmin()))
n_steps = len(order)
assert n_steps == EPOCHS * len(X) == stats.extra["steps"], (n_steps, stats.extra["steps"])
info(
    "shared pool: max |our task-1 e-prompt at its start - our task-0 trained e-prompt|",
    f"{mad(init[1], clf.e_prompts_[0]):.1e}",
    "the port's start is set by its own rule below, not copied from ours",
)
info("our optimiser", f"Adam {opt_rec['kw'][-1]}")
info(f"samples of the {n_steps} steps (ours shuffles; the port's loader follows)", str(order))


def their_model():
    """the port's model at the start of task 1: task 0's trained state and the g-prompt / task-1 key / head at
    their start copied from ours; the task-1 e-prompt NOT copied, but made by the port's shared-pool rule
    (engine.py train_and_evaluate, inline there: prompt[:, :, cur_idx] = prompt[:, :, prev_idx];
    shared_prompt_pool=True in configs/cifar100_dualprompt.py)"""
    m = their_vit()
    load_state(
        m, init[0], [clf.e_prompts_[0], torch.zeros_like(init[1])], [clf.e_keys_[0], init[2]], init[3:]
    )
    with torch.no_grad():
        m.e_prompt.prompt[:, :, 1] = m.e_prompt.prompt[:, :, 0]
    return m


m = their_model()
with torch.no_grad():
    qt = orig(X)["pre_logits"]
# forward / loss at the initial state (batch of 4 on ours): ours' features at that state reproduced with a
# copy of the initial values
oc = _copy.copy(clf)
oc.g_prompt_ = nn.Parameter(init[0].clone())
oc.e_prompts_ = [clf.e_prompts_[0], nn.Parameter(init[1].clone())]
oc.e_keys_ = [clf.e_keys_[0], nn.Parameter(init[2].clone())]
with torch.no_grad():
    report("query: frozen cls after norm vs original_model pre_logits", mad(clf.query(z), qt), 1e-5)
    h_o = oc.features(z, train=True)
    aux_o = float(oc.aux_loss)
    per = [m(X[j : j + 1], task_id=1, cls_features=qt[j : j + 1], train=True) for j in range(4)]
    h_t = torch.cat([r["pre_logits"] for r in per])
    report("train features, task 1 e-prompt (port run per sample, B=1)", mad(h_o, h_t), 1e-5)
    report(
        "pull constraint: ours -coeff*sum cos/B vs port -coeff*reduce_sim (mean over samples)",
        abs(aux_o + PORT.pull_constraint_coeff * float(torch.stack([r["reduce_sim"] for r in per]).mean())),
        1e-6,
    )
    full = m(X, task_id=1, cls_features=qt, train=True)
    info(
        "FINDING: port with B=4 (EPrompt reshape mixes batch and key/value)",
        f"max|h_ours - h_port| = {mad(h_o, full['pre_logits']):.3e}",
        "rows 0-1 use (K,K), rows 2-3 (V,V)",
    )
    # demonstrate the reshape on the raw tensor
    mask = torch.ones(4, 1, dtype=torch.long)
    ep = m.e_prompt(torch.zeros(4, 5, 192), prompt_mask=mask, cls_features=qt)["batched_prompt"]
    E = m.e_prompt.prompt[:, :, 1]  # (n_e, 2, L, H, hd)
    info(
        "FINDING: port batched_prompt[layer, b, 0] == K for b<2 and == V for b>=2",
        str(
            [[bool(torch.equal(ep[0, bb, d], E[0, dd])) for d in (0, 1) for dd in (0, 1)] for bb in range(4)]
        ),
        "per b: [slot0==K, slot0==V, slot1==K, slot1==V]",
    )

# ---------------------------------------------------------------- task 1 through the port's train_one_epoch
# EPOCHS epochs (engine.train_and_evaluate's loop; constant lr: --sched constant), each a loader of the
# task's 4 samples one at a time in our order, at the port's lr, clip and pull coefficient
torch.cuda.synchronize = lambda *a, **k: None  # CPU: their loop synchronises after every step


def their_training(clip):
    """the port's model from their_model(), trained by their train_one_epoch for EPOCHS epochs; returns
    (model, CE losses, gradient norms before clipping)"""
    m = their_model()
    opt = common.port_adam(m, PORT_LR)  # main.py: freeze blocks, patch_embed, cls_token, norm, pos_embed
    losses, norms = [], []
    ce = torch.nn.CrossEntropyLoss()  # main.py's criterion

    def criterion(logits, target):
        loss = ce(logits, target)
        losses.append(float(loss))
        return loss

    _clip = torch.nn.utils.clip_grad_norm_

    def rec_clip(params, max_norm, *a, **k):
        n = _clip(params, max_norm if clip else float("inf"), *a, **k)
        norms.append(float(n))
        return n

    # the port's parsed settings; the harness's: one process, EPOCHS epochs, a head of the task's 2 classes
    # (ours: a head per task), so train_mask (which sets the other tasks' columns of the port's 100-class
    # head to -inf) has nothing to mask
    args = argparse.Namespace(**vars(PORT))
    args.distributed, args.epochs, args.nb_classes, args.train_mask = False, EPOCHS, 2, False
    torch.nn.utils.clip_grad_norm_ = rec_clip
    try:
        for epoch in range(EPOCHS):
            loader = [(X[j : j + 1], Y[j : j + 1]) for j in order[epoch * len(X) : (epoch + 1) * len(X)]]
            their_engine.train_one_epoch(
                m, orig, criterion, loader, opt, "cpu", epoch, max_norm=PORT.clip_grad,
                set_training_mode=True, task_id=1, class_mask=None, args=args,
            )  # fmt: skip
    finally:
        torch.nn.utils.clip_grad_norm_ = _clip
    return m.eval(), losses, norms


info(
    "clip_grad: ours / the port's --clip-grad",
    f"{b.clip_grad} / {PORT.clip_grad}",
    "compared through the steps below",
)
m, losses, norms = their_training(clip=True)
assert len(losses) == n_steps, (len(losses), n_steps)
for s in range(n_steps):
    report(f"loss: CE step {s + 1} (batch of one)", abs(clf.train_log_[s]["loss"] - losses[s]), 1e-5)
info("port's grad norms before clipping", str([round(x, 3) for x in norms]), "clip active where > 1.0")
tag = f"{n_steps} Adam steps, their train_one_epoch"
report(f"{tag}: g-prompt", mad(clf.g_prompt_, m.g_prompt.reshape(clf.g_prompt_.shape)), 1e-5)
d_e1 = (clf.e_prompts_[1] - m.e_prompt.prompt[:, :, 1].reshape(clf.e_prompts_[1].shape)).abs()
report(
    f"{tag}: e-prompt of task 1",
    float(d_e1.max()),
    0.01 * PORT_LR,
    f"tol 0.01*lr: Adam's step lr*m/(sqrt(v)+1e-8) amplifies fp32 round-off where |g| ~ 1e-8; "
    f"{int((d_e1 > 1e-6).sum())}/{d_e1.numel()} entries differ by > 1e-6",
)
report(f"{tag}: key of task 1", mad(clf.e_keys_[1], m.e_prompt.prompt_key[1]), 1e-5)
report(
    f"{tag}: e-prompt and key of task 0 unchanged on both sides",
    max(
        mad(clf.e_prompts_[0], m.e_prompt.prompt[:, :, 0].reshape(clf.e_prompts_[0].shape)),
        mad(clf.e_keys_[0], m.e_prompt.prompt_key[0]),
    ),
    1e-7,
)
report(
    f"{tag}: head",
    max(mad(clf.heads_[1].weight, m.head.weight), mad(clf.heads_[1].bias, m.head.bias)),
    1e-5,
)
m0, _, _ = their_training(clip=False)
d_noclip = max(
    mad(clf.g_prompt_, m0.g_prompt.reshape(clf.g_prompt_.shape)),
    mad(clf.e_keys_[1], m0.e_prompt.prompt_key[1]),
)
info(
    "port WITHOUT clipping vs ours (expected to differ when a norm > 1.0: the steps check sees the clip)",
    f"{d_noclip:.3e}",
    "max over g-prompt and key of task 1",
)

# ---------------------------------------------------------------- test time, after training: held-out images
# (tasks 2 and 3's), each side's trained prompts and keys; both e-prompts are selected (the margins below)
X2 = torch.cat([common.task_images(clf, t) for t in tasks[2:]])
with torch.no_grad():
    z2 = clf.prefix(X2)
    q2o, q2t = clf.query(z2), orig(X2)["pre_logits"]
    report("held-out queries: ours vs original_model pre_logits", mad(q2o, q2t), 1e-5)
    cos = F.normalize(q2o, dim=1) @ F.normalize(torch.stack(list(clf.e_keys_)), dim=1).T
    margin = (cos[:, 1] - cos[:, 0]).abs()
    sel_o = clf.select(q2o)
    info(
        "held-out queries: e-prompts selected by ours (task 0 / task 1), |cos(q, k1) - cos(q, k0)|",
        f"{int((sel_o == 0).sum())} / {int((sel_o == 1).sum())}; min {float(margin.min()):.3f}",
        "both keys compete; margins far above the keys' difference between the sides",
    )
    outs = [m(X2[j : j + 1], cls_features=q2t[j : j + 1], train=False) for j in range(len(X2))]
    sel_t = torch.cat([o["prompt_idx"][:, 0] for o in outs])
    report(
        f"test selection after {n_steps} steps, held-out queries: e-prompt index = argmax cosine "
        "(port top_k=1, batchwise off)",
        float((sel_o != sel_t).sum()),
        0,
        f"ours {sel_o.tolist()} port {sel_t.tolist()}",
    )
    h_t = torch.cat([o["pre_logits"] for o in outs])
    report(
        f"test features after {n_steps} steps, held-out images, selected e-prompts (port per sample)",
        mad(clf.features(z2, train=False), h_t),
        1e-5,
    )
    mb = their_vit(batchwise=True)
    mb.load_state_dict(m.state_dict())
    info(
        "port default batchwise_prompt=True at test (batch 8, held-out images)",
        str(mb(X2, cls_features=q2t)["prompt_idx"][:, 0].tolist()),
        "majority vote over the batch; ours per sample",
    )
info(
    "design difference",
    "the port ranks all pool_size keys at test (unseen tasks' keys are random); "
    "ours only the seen tasks' keys",
    "compared with pool_size = tasks seen",
)
common.summary()
