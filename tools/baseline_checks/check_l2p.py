"""L2P: ours (proteus.baselines.prompts.L2P) against the PyTorch port (JH-LEE-KR/l2p-pytorch: prompt.py
Prompt, vision_transformer.py VisionTransformer with prompt pool, resize_pos_embed; engine.py train step).

Their ViT is built at ViT-Ti/16, 32 px, with ours' weights; the position embedding of the prompt tokens is
made by their resize_pos_embed (the class token's, expanded), as when the port loads pretrained weights.
batchwise_prompt=False (ours selects per sample; the port's default True takes a batch-wise majority vote).
Their training step (engine.train_one_epoch): CE + (-coeff * reduce_sim), clip_grad_norm_(1.0), Adam.
Ours clips at baseline.clip_grad (1.0 in the l2p method declaration); the optimiser steps are compared with
clipping on both sides, and the port without clipping is shown as info (it must differ: the clip is active).
"""

import common
import torch
import torch.nn.functional as F
from common import info, mad, report

clf, plain = common.setup_ours("l2p", epochs=3, batch_size=4)  # 3 epochs x 1 batch: 3 Adam steps
b = clf.options_
common.add_path("theirs_l2p")
import vision_transformer as tvt  # noqa: E402  (their code, importable only after add_path)

info(
    "our config",
    f"pool={b.pool_size} L={b.prompt_length} top_k={b.top_k} coeff={b.match_weight} Adam lr={b.lr} "
    f"clip_grad={b.clip_grad}",
    "port cifar100: size 10, length 5, top_k 5, coeff 0.1, Adam lr 0.03*bs/256, clip_grad 1.0",
)


def their_vit(batchwise=False, prompt=True, nc=2):
    kw = (
        dict(
            **common.port_prompt_pool(b.prompt_length, b.pool_size, b.top_k, batchwise),
            head_type="prompt",
            use_prompt_mask=False,
        )
        if prompt
        else {}
    )
    m = tvt.VisionTransformer(
        img_size=32, patch_size=16, embed_dim=192, depth=12, num_heads=3, num_classes=nc, **kw
    )
    sd = {k: v for k, v in plain.state_dict().items()}
    sd["pos_embed"] = tvt.resize_pos_embed(plain.pos_embed.detach(), m.pos_embed, 1, m.patch_embed.grid_size)
    return common.load_port_vit(m, sd, {"head.weight", "head.bias", "prompt.prompt", "prompt.prompt_key"})


orig = their_vit(prompt=False, nc=0)
model = their_vit()
with torch.no_grad():
    model.prompt.prompt.copy_(clf.prompt_)
    model.prompt.prompt_key.copy_(clf.key_)

task = common.random_tasks(1)[0]
X = common.task_images(clf, task)
Y = torch.tensor([0, 1, 0, 1])
z = clf.prefix(X)

# ----------------------------------------------------------------- selection and forward at the initial state
with torch.no_grad():
    qo = clf.query(z)
    qt = orig(X)["pre_logits"]
    report("query: frozen cls after norm (ours) vs original_model pre_logits", mad(qo, qt), 1e-5)
    idx_o, cos_o = clf.select(qo)
    res = model(X, cls_features=qt, train=True)
    report(
        "selection: per-sample top-5 prompt indices (batchwise off)",
        float((idx_o != res["prompt_idx"]).sum()),
        0,
        f"ours {idx_o.tolist()}",
    )
    res_bw = their_vit(batchwise=True)
    res_bw.prompt.load_state_dict(model.prompt.state_dict())
    idx_bw = res_bw(X, cls_features=qt)["prompt_idx"]
    info(
        "selection with the port's default batchwise_prompt=True",
        f"{idx_bw.tolist()}",
        "design difference: ours per sample",
    )
    h_o = clf.features(z, train=True)
    report(
        "features: mean of prompt-token outputs ([CLS, prompts, patches])", mad(h_o, res["pre_logits"]), 1e-5
    )
    report(
        "aux: our -coeff*sum cos/B vs port -coeff*reduce_sim",
        abs(float(clf.aux_loss) + b.match_weight * float(res["reduce_sim"])),
        1e-6,
    )

# ----------------------------------------------------------------- selection on constructed keys
# keys of very different norms (x 0.2 .. x 5, same directions): cosine and raw-dot rankings then differ, so a
# ranking by raw dot product (or by unnormalised keys) cannot agree with the port's cosine top-k
with torch.no_grad():
    scale = torch.logspace(-0.7, 0.7, b.pool_size)[
        torch.randperm(b.pool_size, generator=torch.Generator().manual_seed(5))
    ]
    key_saved = clf.key_.detach().clone()
    clf.key_.mul_(scale[:, None])
    model.prompt.prompt_key.copy_(clf.key_)
    idx_o, cos_o = clf.select(qo)
    res = model(X, cls_features=qt, train=True)
    dot_idx = (qo @ clf.key_.T).topk(b.top_k, dim=1).indices
    info(
        "constructed keys (norms x0.2..x5): raw-dot top-5 differs from cosine top-5 in n of 4 samples",
        int((dot_idx.sort(1).values != res["prompt_idx"].sort(1).values).any(1).sum()),
        "the case below can tell the two rankings apart",
    )
    report(
        "selection with constructed key norms: per-sample top-5 indices, ours vs port",
        float((idx_o != res["prompt_idx"]).sum()),
        0,
        f"ours {idx_o.tolist()}",
    )
    clf.features(z, train=True)
    report(
        "aux with constructed key norms: our -coeff*sum cos/B vs port -coeff*reduce_sim",
        abs(float(clf.aux_loss) + b.match_weight * float(res["reduce_sim"])),
        1e-6,
    )
    clf.key_.copy_(key_saved)
    model.prompt.prompt_key.copy_(key_saved)

# ----------------------------------------------------------------- training: their engine.train_one_epoch
# our fit_task and the port's engine.train_one_epoch (CE - coeff * reduce_sim, clip_grad_norm_, Adam),
# E epochs of the task's one batch of 4, each side from the same initial prompts, keys and head
import argparse  # noqa: E402

import engine as their_engine  # noqa: E402

EPOCHS = 3
CLIP = 1.0  # the port's --clip-grad (configs/cifar100_l2p.py)
PORT_LR = 0.03 * 16 / 256  # configs/cifar100_l2p.py: --lr 0.03, --batch-size 16; main.py scales by bs/256
clf.config.train.epochs = EPOCHS
with common.recording_optimizer("Adam") as opt_rec:
    stats = clf.fit_task(task, stream_tasks=10)
init = opt_rec["init"][-1]  # [prompt, key, head.w, head.b]
torch.cuda.synchronize = lambda *a, **k: None  # CPU: their loop synchronises after every step


def their_training(clip):
    """the port's model from our initial state, trained by their train_one_epoch for EPOCHS epochs; returns
    (model, CE losses, gradient norms before clipping)"""
    m = their_vit()
    with torch.no_grad():
        m.prompt.prompt.copy_(init[0])
        m.prompt.prompt_key.copy_(init[1])
        m.head.weight.copy_(init[2])
        m.head.bias.copy_(init[3])
    opt = common.port_adam(m, PORT_LR)  # main.py: freeze blocks, patch_embed, cls_token, norm, pos_embed
    losses, norms = [], []

    def criterion(logits, target):
        loss = F.cross_entropy(logits, target)
        losses.append(float(loss))
        return loss

    _clip = torch.nn.utils.clip_grad_norm_

    def rec_clip(params, max_norm, *a, **k):
        n = _clip(params, max_norm if clip else float("inf"), *a, **k)
        norms.append(float(n))
        return n

    args = argparse.Namespace(
        distributed=False, epochs=EPOCHS, print_freq=10, train_mask=False, nb_classes=2,
        pull_constraint=True, pull_constraint_coeff=b_coeff,
    )  # fmt: skip
    torch.nn.utils.clip_grad_norm_ = rec_clip
    try:
        for epoch in range(EPOCHS):
            their_engine.train_one_epoch(
                m, orig, criterion, [(X, Y)], opt, "cpu", epoch, max_norm=CLIP, task_id=0, args=args
            )
    finally:
        torch.nn.utils.clip_grad_norm_ = _clip
    return m.eval(), losses, norms


b_coeff = 0.1  # the port's pull_constraint_coeff (configs/cifar100_l2p.py)
info(
    "clip_grad: ours / the port's --clip-grad", f"{b.clip_grad} / {CLIP}", "compared through the steps below"
)
m, losses, norms = their_training(clip=True)
for e in range(EPOCHS):
    report(f"loss: CE step {e + 1}", abs(clf.train_log_[e]["loss"] - losses[e]), 1e-5)
tol = 1e-5
tag = f"{EPOCHS} Adam steps, their train_one_epoch"
report(f"{tag}: prompt pool", mad(clf.prompt_, m.prompt.prompt), tol)
report(f"{tag}: prompt keys", mad(clf.key_, m.prompt.prompt_key), tol)
report(
    f"{tag}: head",
    max(mad(clf.heads_[0].weight, m.head.weight), mad(clf.heads_[0].bias, m.head.bias)),
    tol,
)
info("port's gradient norms before clipping (the clip acts where > 1.0)", f"{[round(x, 3) for x in norms]}")
m0, _, _ = their_training(clip=False)
info(
    "port WITHOUT clipping vs ours (expected to differ: shows the steps check sees the clip)",
    f"{max(mad(clf.prompt_, m0.prompt.prompt), mad(clf.key_, m0.prompt.prompt_key)):.3e}",
    "max over prompt pool and keys",
)

# ----------------------------------------------------------------- selection after training
# queries of other images (a second task's), the trained keys of each side; and the trained keys rescaled
# to different norms (the trained directions kept)
with torch.no_grad():
    X2 = common.task_images(clf, common.random_tasks(2)[1])
    z2 = clf.prefix(X2)
    q2o, q2t = clf.query(z2), orig(X2)["pre_logits"]
    idx_o, _ = clf.select(q2o)
    res = m(X2, cls_features=q2t, train=False)
    report(
        f"selection after {EPOCHS} training steps (each side's trained keys; new queries)",
        float((idx_o != res["prompt_idx"]).sum()),
        0,
        f"ours {idx_o.tolist()}",
    )
    report(
        f"features after {EPOCHS} training steps (test forward, new queries)",
        mad(clf.features(z2, train=False), res["pre_logits"]),
        1e-5,
    )
    clf.key_.mul_(scale[:, None])
    m.prompt.prompt_key.mul_(scale[:, None])
    idx_o, _ = clf.select(q2o)
    res = m(X2, cls_features=q2t, train=False)
    report(
        "selection after training, trained keys rescaled to norms x0.2..x5",
        float((idx_o != res["prompt_idx"]).sum()),
        0,
        f"ours {idx_o.tolist()}",
    )
info("our optimiser", f"Adam {opt_rec['kw'][-1]}")
common.summary()
