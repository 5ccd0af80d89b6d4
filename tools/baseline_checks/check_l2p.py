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

clf, plain = common.setup_ours("l2p", epochs=2, batch_size=4)  # 2 epochs x 1 batch: 2 Adam steps
b = clf.config.baseline
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

# ----------------------------------------------------------------- two training steps
with common.recording_optimizer("Adam") as opt_rec:
    stats = clf.fit_task(task, stream_tasks=10)
init = opt_rec["init"][-1]  # [prompt, key, head.w, head.b]


def their_steps(clip):
    m = their_vit()
    with torch.no_grad():
        m.prompt.prompt.copy_(init[0])
        m.prompt.prompt_key.copy_(init[1])
        m.head.weight.copy_(init[2])
        m.head.bias.copy_(init[3])
    opt = common.port_adam(m, b.lr)  # main.py: freeze blocks, patch_embed, cls_token, norm, pos_embed
    losses, norms = [], []
    for _ in range(2):  # engine.train_one_epoch
        with torch.no_grad():
            cls_features = orig(X)["pre_logits"]
        out = m(X, task_id=0, cls_features=cls_features, train=True)
        loss = F.cross_entropy(out["logits"], Y)
        losses.append(float(loss))
        loss = loss - 0.1 * out["reduce_sim"]
        opt.zero_grad()
        loss.backward()
        if clip:
            norms.append(float(torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)))
        opt.step()
    return m, losses, norms


CLIP = 1.0  # the port's --clip-grad (configs/cifar100_l2p.py)
report("our gradient clipping = the port's clip_grad_norm 1.0", abs((b.clip_grad or 0.0) - CLIP), 0)
m, losses, norms = their_steps(clip=True)
report("loss: CE step 1", abs(stats["loss_first"] - losses[0]), 1e-5)
report("loss: CE step 2", abs(stats["loss_last"] - losses[1]), 1e-5)
tol = 1e-5
tag = "both sides clip_grad_norm 1.0"
report(f"2 Adam steps, prompt pool ({tag})", mad(clf.prompt_, m.prompt.prompt), tol)
report(f"2 Adam steps, prompt keys ({tag})", mad(clf.key_, m.prompt.prompt_key), tol)
report(
    f"2 Adam steps, head ({tag})",
    max(mad(clf.heads_[0].weight, m.head.weight), mad(clf.heads_[0].bias, m.head.bias)),
    tol,
    f"port's grad norms before clipping {[round(x, 3) for x in norms]}",
)
report("the clip is active (port's grad norm at step 1 > 1.0)", float(norms[0] <= CLIP), 0)
m0, _, _ = their_steps(clip=False)
info(
    "port WITHOUT clipping vs ours (expected to differ: shows the steps check sees the clip)",
    f"{max(mad(clf.prompt_, m0.prompt.prompt), mad(clf.key_, m0.prompt.prompt_key)):.3e}",
    "max over prompt pool and keys",
)
info("our optimiser", f"Adam {opt_rec['kw'][-1]}")
common.summary()
