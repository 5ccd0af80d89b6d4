"""AdaPromptCL: ours (proteus.baselines.adapromptcl) against the released code (kaist-dmlab/AdaPromptCL
@ fb67cc1: engine.py train_and_evaluate / train_one_epoch / uni_or_specific_prompts / manage_blocks /
remove_duplicates / copy_base_prompts, prompt.py EPrompt, vision_transformer.py VisionTransformer,
attention.py PreT_Attention), with the README's CIFAR-100 flags parsed by their own
configs/cifar100_dualprompt.py.

1. The semantic grouping alone. Constructed warm-up prompts (5 blocks x key/value x length 8 x 192, each a
   chosen mean vector of chosen norm plus zero-mean noise) go through their uni_or_specific_prompts (BIRCH 0.4
   assign, post-merge BIRCH 0.6, 1000 BIRCH orderings, silhouettes, K-Means top-2, manage_blocks,
   copy_base_prompts) one task after the other, and through our SemanticGroups (as our learner builds it, so
   with its thresholds) fed by our warmup_vector. Per task: the decision (specific / shared / merge and the
   prompts trained, named by the tasks they belong to: up to relabelling), the epochs after the warm-up, the
   merged prompts' bases, the blocks, the fewest-cluster partitions, the prompts in use at test, the merge
   candidates and the fine BIRCH partition. The four prompt sets are built so that the converge threshold,
   the post-merge threshold, the K-Means counts and the silhouette choice each change some decision; two of
   them are also run by both sides at other thresholds (0.3 / 0.5 and 0.5 / 0.7).
2. The learner. Five tasks (4 random images each, batch 1) through our fit_task and through their whole
   train_and_evaluate (their train_one_epoch, grouping, head restore, optimiser re-creation, reinit_clf,
   evaluate_till_now), from the same state. Compared per task: the cross-entropy and the pull term of every
   step of the warm-up and after it, the prompt, key and head at the end of the warm-up, the grouping of
   those warm-up prompts, the head after its restore and after reinit_clf, the epochs where a new optimiser
   starts, the trained prompts at their start (merged ones: copies of their base), every prompt and key and
   the task's head at the end of the task.
3. Test time after the last task: the frozen [CLS] query, the prompt selected (cosine of the query and the
   keys of the prompts in use, top 1), features and logits over every class; with the trained keys and with
   keys set to compete at very different norms (where the raw dot product would choose otherwise).

Two findings are shown as INFO: their pool is one tensor under Adam, so a merged prompt that no input of a
step drew still moves by its momentum (ours: no gradient, no step); and a second reinit_clf within one task
does not restore their head (it aliases the saved copy). See README.md ("Harness adaptations", "Known
differences").
"""

import argparse
import contextlib
import copy
import io
import types

import common
import numpy as np
import torch
import torch.nn as nn
from common import info, mad, report

import proteus.baselines.adapromptcl as ada

T = 5  # tasks of the learner comparison
E = 9  # train.epochs / their --epochs: the epochs after the warm-up (the release's 50); see README
INIT_MEAN = 0.3  # the common initial prompt keeps this share of its mean over blocks, key/value and length


# -------------------------------------------------------------------------------- our runs
def our_learner(epochs):
    """our learner (common.setup_ours: a random ViT-Ti at 32 px, batch 1), its common initial prompt with
    INIT_MEAN of its mean over blocks, key/value and length (see README: it spreads the warm-up vectors)"""
    c, vit = common.setup_ours("adapromptcl", epochs=epochs, batch_size=1)
    with torch.no_grad():
        c.init_prompt_ -= (1 - INIT_MEAN) * c.init_prompt_.mean((0, 1, 2), keepdim=True)
    return c, vit


def our_run(c, tasks, zero_fill):
    """c.fit_task on every task, recording per task: each epoch's order of the images, the prompt each step
    used, each optimiser's first step and its parameters' values then, the candidate's prompt and key and the
    head at the end of the warm-up, the training log, the decision and the state at the end of the task.
    zero_fill: a parameter of the optimiser without a gradient gets a zero one before each Adam step (the
    release's pool is one tensor: its prompts not drawn in a step have zero gradients, see README)"""
    runs, cur = [], {}
    warm, batches, prompted = ada.warmup_vector, c.batches, c.prompted

    def rec_warm(p):
        cur["warm"] = (
            p.detach().clone(),
            c.keys_[c._cand].detach().clone(),
            [x.detach().clone() for x in cur["head"]],
        )
        return warm(p)

    def rec_batches(z, y, loader, g):
        order = []
        cur["orders"].append(order)
        for zb, yb in batches(z, y, loader, g):
            order += [int((z - r).flatten(1).abs().sum(1).argmin()) for r in zb]
            yield zb, yb

    def rec_prompted(z, pid):
        if cur.get("training"):
            cur["picks"].append(int(pid[0]))
        return prompted(z, pid)

    class RecAdam(torch.optim.Adam):
        def __init__(self, params, *a, **k):
            params = list(params)
            cur["head"] = params[-2:]
            cur["adam"].append((len(c.train_log_), [p.detach().clone() for p in params]))
            super().__init__(params, *a, **k)

        def step(self, *a, **k):
            if zero_fill:
                for group in self.param_groups:
                    for p in group["params"]:
                        if p.grad is None:
                            p.grad = torch.zeros_like(p)
            return super().step(*a, **k)

    ada.warmup_vector, c.batches, c.prompted = rec_warm, rec_batches, rec_prompted
    adam, torch.optim.Adam = torch.optim.Adam, RecAdam
    try:
        for task in tasks:
            cur.clear()
            cur.update(orders=[], picks=[], adam=[], training=True)
            stats = c.fit_task(task, stream_tasks=len(tasks))
            cur["training"] = False
            d = c.decisions_[-1]
            cur.update(
                stats=stats,
                log=list(c.train_log_),
                decision=d,
                left=c.left_epochs(d),
                head=[p.detach().clone() for p in c.heads_[-1].parameters()],
                pool={i: p.detach().clone() for i, p in enumerate(c.pool_)},
                keys={i: q.detach().clone() for i, q in enumerate(c.keys_)},
                inference=list(c.groups_.inference_pids),
                groups=copy.deepcopy(c.groups_),
            )
            runs.append(dict(cur))
    finally:
        ada.warmup_vector, torch.optim.Adam = warm, adam
        del c.batches, c.prompted
    return runs


# ours are built before their vision_transformer.py is imported (it re-registers timm's vit_* names)
clf, plain = our_learner(E)
b = clf.options_
W = clf.evolve_epoch + 1  # warm-up epochs
n_img = 4
FRESH_GROUPS = copy.deepcopy(clf.groups_)  # the learner's grouping before any task: its thresholds, counts
tasks = common.random_tasks(T)
OURS = our_run(clf, tasks, zero_fill=True)
clf_asis = our_learner(E)[0]
OURS_ASIS = our_run(clf_asis, tasks, zero_fill=False)
E_ALIAS = 11  # the aliasing finding: two reinit_clf resets in one task (a shared task, uni_epochs 12)
clf_alias = our_learner(E_ALIAS)[0]
clf_alias.uni_epochs = 12
OURS_ALIAS = our_run(clf_alias, tasks[:2], zero_fill=True)

# -------------------------------------------------------------------------------- their code
# their files import these at the top; none is used with the README's flags (CLIP, kornia augmentations of
# --cl_prompts, pytorch_metric_learning's supcon); timm >= 0.9 moved timm.models.pretrained
common.add_path("theirs_adapromptcl")
common.stub("clip")
_k = common.stub("kornia")
_k.augmentation = common.stub(
    "kornia.augmentation",
    RandomResizedCrop=None,
    RandomHorizontalFlip=None,
    ColorJitter=None,
    RandomGrayscale=None,
)
_k.augmentation.auto = common.stub("kornia.augmentation.auto", RandAugment=None)
common.stub("pytorch_metric_learning").losses = common.stub("pytorch_metric_learning.losses")
import timm.models  # noqa: E402

common.stub("timm.models.pretrained", generate_default_cfgs=timm.models.generate_default_cfgs)
import engine  # noqa: E402  (their code, importable only after add_path)
import prompt as tprompt  # noqa: E402
import vision_transformer as tvt  # noqa: E402
from configs.cifar100_dualprompt import get_args_parser  # noqa: E402

torch.cuda.synchronize = lambda *a, **k: None  # CPU: their loop synchronises after every step
README_CIFAR = (
    "cifar100_dualprompt --model vit_base_patch16_224 --batch-size 64 --data-path x --output_dir x "
    "--use_e_prompt --e_prompt_layer_idx 0 1 2 3 4 --seed 0 --data_driven_evolve --uni_or_specific "
    "--converge_thrh 0.4 --mergable_prompts --postmerge_thrh 0.6"
)
H, HD, NL, L, D = 3, 64, len(b.prompt_layers), b.prompt_length, clf.embed_dim


def their_args(num_tasks, **over):
    """the README's CIFAR-100 command parsed by their configs/cifar100_dualprompt.py, then what main.py and
    train_and_evaluate set: the lr scaled by the global batch (64 on each of 2 GPUs), DDP on, no output"""
    parser = argparse.ArgumentParser()
    get_args_parser(parser.add_subparsers(dest="subparser_name").add_parser("cifar100_dualprompt"))
    a = parser.parse_args(README_CIFAR.split())
    a.world_size, a.distributed, a.device, a.output_dir = 2, True, "cpu", ""
    a.lr = a.lr * (a.batch_size * a.world_size * a.accum_step) / 256.0  # main.py, scale_lr
    a.num_tasks, a.uni_or_spcf_gt = num_tasks, []  # train_and_evaluate sets uni_or_spcf_gt = []
    for key, v in over.items():
        setattr(a, key, v)
    return a


class DDP(nn.Module):
    """DistributedDataParallel's interface as their code uses it (model.module): the README runs it on 2 GPUs,
    and uni_or_specific_prompts / train_and_evaluate read model.module whatever args.distributed says. It
    records each training forward's reduce_sim and prompt_idx."""

    def __init__(self, m):
        super().__init__()
        self.module = m
        self.reduce_sims = self.picks = None

    def forward(self, *a, **k):
        out = self.module(*a, **k)
        if k.get("train") and self.reduce_sims is not None:
            self.reduce_sims.append(float(out["reduce_sim"]))
            self.picks.append(int(out["prompt_idx"].reshape(-1)[0]))
        return out


def canon(cand_pid, block_pid):
    """prompt id -> ('cand', t) for task t's own candidate, ('block', tasks) for a merged prompt"""
    m = {int(p): ("cand", t) for t, p in enumerate(cand_pid)}
    m.update(
        {
            int(p): ("block", tuple(sorted(int(x) for x in blk)))
            for blk, p in block_pid.items()
            if len(blk) > 1
        }
    )
    return m


def relabel(lab):
    first = {}
    return [first.setdefault(int(x), len(first)) for x in lab]


KIND = {"spcf": "specific", "uni": "shared", "mergable": "merge"}


def their_outcome(t, ep, res, args):
    """task t's decision as their uni_or_specific_prompts left it (its return value and the e-prompt)"""
    _, _, _, left, kind, _, _, mp_info, rm_info = res
    blocks, block2pid, reduce_hist, _ = rm_info
    cm = canon(range(args.num_tasks), block2pid)
    if kind == "mergable":
        train = [int(p) for p in ep.training_mergable_pids]
        new = [
            (p, block2pid[frozenset(set(blk) - {t})])
            for blk, p in block2pid.items()
            if t in blk and len(blk) > 1
        ]
    else:
        train, new = [int(ep.converged_p[t])], []
    return dict(
        kind="first" if t == 0 else KIND[kind],
        left=int(left),
        train=[cm[p] for p in train],
        train_pids=train,
        new=sorted((cm[p], cm[q]) for p, q in new),
        blocks=[sorted(int(x) for x in s) for s in blocks],
        hist={
            int(k): (int(v[0]), sorted(sorted(int(x) for x in s) for s in v[1]))
            for k, v in reduce_hist.items()
        },
        inference=sorted(cm[int(p)] for p in ep.pids4inf),
        seen=[int(x) for x in mp_info[3]],
        fine=relabel(mp_info[1][t]),
        cm=cm,
    )


def our_outcome(t, g, d, left):
    cm = canon(g.cand_pid, g.block_pid)
    return dict(
        kind=d.kind,
        left=int(left),
        train=[cm[p] for p in d.train_pids],
        new=sorted((cm[p], cm[q]) for p, q in d.new_prompts),
        blocks=[sorted(s) for s in g.blocks],
        hist={k: (v[0], sorted(sorted(s) for s in v[1])) for k, v in g.reduce_hist.items()},
        inference=sorted(cm[p] for p in g.inference_pids),
        seen=list(g.seen),
        fine=relabel(g.fine_labels()),
        cm=cm,
    )


FIELDS = [
    ("decision: kind and prompts trained (named by their tasks)", ("kind", "train")),
    ("epochs after the warm-up (left_epochs, before the --epochs cap)", ("left",)),
    ("merged prompts and the prompt each is copied from", ("new",)),
    ("blocks, and the fewest-cluster partition of each re-clustering (reduce_hist)", ("blocks", "hist")),
    ("merge candidates (seen) and the fine BIRCH partition (up to relabelling)", ("seen", "fine")),
    ("prompts in use at test (pids4inf)", ("inference",)),
]


def differing(ours, theirs, keys):
    return [t for t, (o, th) in enumerate(zip(ours, theirs)) if any(o[k] != th[k] for k in keys)]


def report_grouping(tag, ours, theirs):
    for name, keys in FIELDS:
        bad = differing(ours, theirs, keys)
        shown = "; ".join(
            f"t{t}: ours {[ours[t][k] for k in keys]} theirs {[theirs[t][k] for k in keys]}" for t in bad[:2]
        )
        report(f"{tag}: {name}, tasks differing", float(len(bad)), 0, shown)


# -------------------------------------------------------------------------------- 1. grouping
def their_grouping(prompts, args):
    """their uni_or_specific_prompts once per task, as train_and_evaluate calls it at the end of the warm-up,
    on an EPrompt whose slot t holds task t's warm-up prompt"""
    with contextlib.redirect_stdout(io.StringIO()):
        ep = tprompt.EPrompt(
            length=L,
            embed_dim=D,
            embedding_key="cls",
            prompt_init="uniform",
            prompt_pool=True,
            prompt_key=True,
            pool_size=args.size,
            top_k=1,
            num_layers=NL,
            use_prefix_tune_for_e_prompt=True,
            num_heads=H,
            args=args,
        )
    ep.prompt.grad, ep.prompt_key.grad = torch.zeros_like(ep.prompt), torch.zeros_like(ep.prompt_key)
    model = DDP(types.SimpleNamespace(e_prompt=ep, parameters=lambda: iter(())))
    opt = types.SimpleNamespace(param_groups=[{}])  # copy_base_prompts rebinds param_groups[0]['params']
    st = dict(converge_hist=None, warmup_prompts=[], birch=None, postmerge_birch=None)
    st.update(mergable_prompts_info=None, reduce_mergable_info=None)
    out = []
    for t, P in enumerate(prompts):
        with torch.no_grad():
            ep.prompt[:, :, t] = P.reshape(NL, 2, L, H, HD)
        with contextlib.redirect_stdout(io.StringIO()):
            res = engine.uni_or_specific_prompts(model=model, optimizer=opt, task_id=t, args=args, **st)
        st.update(zip(["converge_hist", "warmup_prompts", "birch"], res[:3]))
        st.update(postmerge_birch=res[5], mergable_prompts_info=res[7], reduce_mergable_info=res[8])
        out.append(their_outcome(t, ep, res, args))
    return out


def our_grouping(prompts, g):
    """our SemanticGroups fed as AdaPromptCL.learn_task feeds it: warmup_vector of the candidate, the
    candidate's prompt id and the pool's size (merged prompts numbered from there)"""
    n, out = 0, []
    for t, P in enumerate(prompts):
        cand, n = n, n + 1
        d = g.assign(t, ada.warmup_vector(P), cand, n)
        n += len(d.new_prompts)
        out.append(our_outcome(t, g, d, clf.left_epochs(d)))
    return out


def construct(vectors, seed=0):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for v in vectors:
        noise = 0.3 * torch.randn(NL, 2, L, D, generator=gen)
        out.append(noise - noise.mean((0, 1, 2), keepdim=True) + torch.as_tensor(v, dtype=torch.float32))
    return out


def vec(deg, z=0.0, norm=1.0):
    v = np.zeros(D)
    v[:3] = np.cos(np.deg2rad(deg)), np.sin(np.deg2rad(deg)), z
    return v / np.linalg.norm(v) * norm


NORMS = [2.0, 0.5, 3.0, 1.0, 1.5]
SETS = {  # angle in the plane of the first two axes, height on the third, norm
    "A (0.4 vs 0.5 apart)": [vec(a, 0, n) for a, n in zip([0, 55, 80, 160, 27], NORMS)],
    "B (0.6 vs 0.7 apart)": [
        vec(a, z, n) for a, z, n in zip([88, 110.7, 143.4, 42.6], [0.12, 0.16, -0.17, -0.4], NORMS)
    ],
    "C (a block from K-Means' second count)": [
        vec(a, z, n) for a, z, n in zip([75.1, 11.6, 73.3, 31.9], [-0.29, 0.0, 0.23, -0.16], NORMS)
    ],
    "D (the best silhouette's count)": [
        vec(a, z, n)
        for a, z, n in zip([147.5, 125.1, 140.9, 76.4, 116.0], [0.4, -0.39, -0.02, 0.2, -0.22], NORMS)
    ],
}
args0 = their_args(10)
info(
    "settings: ours / theirs (README flags, cifar100 config)",
    f"converge {clf.converge_thrh}/{args0.converge_thrh}, "
    f"post-merge {clf.postmerge_thrh}/{args0.postmerge_thrh}, "
    f"orderings {clf.remerge_samples}/{args0.sampling_size_for_remerge}, "
    f"K-Means runs {clf.kmeans_run}/{args0.kmeans_run}, top-n {clf.kmeans_top_n}/{args0.kmeans_top_n}, "
    f"uni/spcf/merge epochs {clf.uni_epochs}/{args0.uni_epochs} {clf.spcf_epochs}/{args0.spcf_epochs} "
    f"{clf.mergable_epochs},{clf.max_mergable_epochs}/{args0.mergable_epochs},"
    f"{args0.max_mergable_epochs}, evolve {clf.evolve_epoch}/{args0.evolve_epoch}",
    "compared through the decisions below",
)
for name, vectors in SETS.items():
    P = construct(vectors)
    np.random.seed(0)  # theirs: np.random's permutations and K-Means seeds; ours: seed*1000 + t
    theirs = their_grouping(P, args0)
    ours = our_grouping(P, copy.deepcopy(FRESH_GROUPS))
    info(f"set {name}: decisions (theirs)", str([o["kind"] for o in theirs]), f"{len(P)} tasks")
    report_grouping(f"set {name}", ours, theirs)

# the same machinery at other thresholds, both sides set alike (300 orderings, 30 K-Means runs each)
ALL = [k for _, ks in FIELDS for k in ks]
for name in list(SETS)[:2]:
    P = construct(SETS[name])
    for c, pm in ((0.3, 0.5), (0.5, 0.7)):
        a = their_args(10, converge_thrh=c, postmerge_thrh=pm, sampling_size_for_remerge=300, kmeans_run=30)
        np.random.seed(0)
        theirs = their_grouping(P, a)
        ours = our_grouping(P, ada.SemanticGroups(c, pm, True, 300, 30, clf.kmeans_top_n, clf.config.seed))
        report(
            f"set {name} at {c} / {pm}: every field above, tasks differing",
            float(len(differing(ours, theirs, ALL))),
            0,
            f"theirs {[o['kind'] for o in theirs]}, ours {[o['kind'] for o in ours]}",
        )


# -------------------------------------------------------------------------------- 2. learner
def their_vit(args, prompt):
    """their VisionTransformer at ViT-Ti/16, 32 px, with main.py's create_model arguments, ours' weights"""
    kw = (
        dict(
            prompt_length=args.length,
            embedding_key=args.embedding_key,
            prompt_init=args.prompt_key_init,
            prompt_pool=args.prompt_pool,
            prompt_key=args.prompt_key,
            pool_size=args.size,
            top_k=args.top_k,
            batchwise_prompt=args.batchwise_prompt,
            prompt_key_init=args.prompt_key_init,
            head_type=args.head_type,
            use_prompt_mask=args.use_prompt_mask,
            use_g_prompt=args.use_g_prompt,
            g_prompt_length=args.g_prompt_length,
            g_prompt_layer_idx=args.g_prompt_layer_idx,
            use_prefix_tune_for_g_prompt=args.use_prefix_tune_for_g_prompt,
            use_e_prompt=args.use_e_prompt,
            e_prompt_layer_idx=args.e_prompt_layer_idx,
            use_prefix_tune_for_e_prompt=args.use_prefix_tune_for_e_prompt,
            same_key_value=args.same_key_value,
            eval_prototype_clf=args.eval_prototype_clf,
        )
        if prompt
        else {}
    )
    with contextlib.redirect_stdout(io.StringIO()):
        m = tvt.VisionTransformer(
            img_size=32,
            patch_size=16,
            embed_dim=D,
            depth=12,
            num_heads=H,
            num_classes=args.nb_classes,
            drop_rate=args.drop,
            drop_path_rate=args.drop_path,
            args=args,
            **kw,
        )
    optional = {"head.weight", "head.bias", "e_prompt.prompt", "e_prompt.prompt_key"}
    return common.load_port_vit(m, plain.state_dict(), optional)


class Replay:
    """one task's training images, one per batch, in the order our run drew them: one epoch per iteration"""

    def __init__(self, X, Y, orders):
        self.X, self.Y, self.orders = X, Y, [list(o) for o in orders]

    def __len__(self):
        return len(self.X)

    def __iter__(self):  # (an epoch our run did not train, when the two sides decide differently: in order)
        for i in self.orders.pop(0) if self.orders else range(len(self.X)):
            yield self.X[i : i + 1], self.Y[i : i + 1]


def their_run(c, runs, tasks, epochs, **over):
    """their train_and_evaluate on the tasks, from our run's starting state and batch orders; records per task
    what our_run records (their train_one_epoch, uni_or_specific_prompts and evaluate_till_now wrapped)"""
    args = their_args(len(tasks), epochs=epochs, nb_classes=2 * len(tasks), **over)
    model, original = their_vit(args, True), their_vit(args, False)
    for p in original.parameters():  # main.py's freeze
        p.requires_grad = False
    for n, p in model.named_parameters():
        if n.startswith(tuple(args.freeze)):
            p.requires_grad = False
    ep = model.e_prompt
    with torch.no_grad():  # the starting state: ours' draws (prompt_same_init: one draw in every slot)
        ep.prompt.copy_(c.init_prompt_.reshape(NL, 2, 1, L, H, HD).expand_as(ep.prompt))
        for t, o in enumerate(runs):
            start = o["adam"][0][1]  # the warm-up's optimiser: candidate prompt, its key, the head
            ep.prompt_key[t].copy_(start[1])
            model.head.weight[2 * t : 2 * t + 2].copy_(start[2])
            model.head.bias[2 * t : 2 * t + 2].copy_(start[3])
    our_canon = canon(c.groups_.cand_pid, c.groups_.block_pid)
    rec = [dict(losses=[], sims=[], picks=[], epochs=[], choices=0, choice_miss=0) for _ in tasks]
    ddp, now = DDP(model), {}

    def head_now():
        return [model.head.weight.detach().clone(), model.head.bias.detach().clone()]

    class RecCE(nn.CrossEntropyLoss):
        def forward(self, logits, target):
            loss = super().forward(logits, target)
            rec[now["t"]]["losses"].append(float(loss))
            return loss

    toe, uos, etn = engine.train_one_epoch, engine.uni_or_specific_prompts, engine.evaluate_till_now

    def rec_toe(**kw):
        t = now["t"] = kw["task_id"]
        R = rec[t]
        ddp.reduce_sims, ddp.picks = R["sims"], R["picks"]
        slots = {}
        if kw["epoch"] == W and "outcome" in R:  # the prompts trained after the warm-up, at their start
            slots = {p: ep.prompt[:, :, p].detach().clone() for p in set(R["outcome"]["train_pids"])}
        R["epochs"].append(dict(epoch=kw["epoch"], opt=id(kw["optimizer"]), head=head_now(), slots=slots))
        return toe(**kw)

    def rec_uos(**kw):
        t = kw["task_id"]
        rec[t]["warm"] = (ep.prompt[:, :, t].detach().clone(), ep.prompt_key[t].detach().clone(), head_now())
        res = uos(**kw)
        rec[t]["outcome"] = their_outcome(t, ep, res, args)
        return res

    def rec_etn(**kw):
        rec[kw["task_id"]]["end"] = dict(
            prompt=ep.prompt.detach().clone(), key=ep.prompt_key.detach().clone(), head=head_now()
        )
        return etn(**kw)

    class Random:
        """np.random for their prompt.py: choice() (a merged task's prompt for each input) returns the prompt
        our run drew at that step (named by its tasks, then numbered as theirs); the rest is numpy's"""

        def __getattr__(self, name):
            return getattr(np.random, name)

        def choice(self, a, size=None, replace=True):
            R, picks = rec[now["t"]], runs[now["t"]]["picks"]
            i = W * n_img + R["choices"]
            want = our_canon[picks[i]] if i < len(picks) else None
            R["choices"] += 1
            match = [int(p) for p in a if R["outcome"]["cm"][int(p)] == want]
            R["choice_miss"] += not match
            return np.array((match or [int(a[0])]) * size, dtype=np.int64)

    class NP:
        random = Random()

        def __getattr__(self, name):
            return getattr(np, name)

    loaders = []
    for t, task in enumerate(tasks):
        X = common.task_images(c, task)
        Y = torch.tensor([y for _, y in task.train])
        loaders.append(
            dict(
                train=Replay(X, Y, runs[t]["orders"]),
                val=[(X[j : j + 1], Y[j : j + 1]) for j in range(len(X))],
            )
        )
    engine.train_one_epoch, engine.uni_or_specific_prompts, engine.evaluate_till_now = (
        rec_toe,
        rec_uos,
        rec_etn,
    )
    np_, tprompt.np = tprompt.np, NP()
    try:
        np.random.seed(args.seed)  # main.py
        optimizer = engine.create_optimizer(args, model)  # main.py: create_optimizer(args, model_without_ddp)
        with contextlib.redirect_stdout(io.StringIO()):
            engine.train_and_evaluate(
                ddp,
                model,
                original,
                RecCE(),
                loaders,
                optimizer,
                None,
                torch.device("cpu"),
                class_mask=[[2 * t, 2 * t + 1] for t in range(len(tasks))],
                ema_model=None,
                args=args,
            )
    finally:
        engine.train_one_epoch, engine.uni_or_specific_prompts, engine.evaluate_till_now = toe, uos, etn
        tprompt.np = np_
    their_canon = rec[-1]["outcome"]["cm"]
    by_name = {x: q for q, x in their_canon.items()}
    to_theirs = {
        p: by_name[cn] for p, cn in our_canon.items() if cn in by_name
    }  # ours' prompts theirs also has
    return dict(args=args, model=model, original=original, rec=rec, to_theirs=to_theirs, our_canon=our_canon)


RUN = their_run(clf, OURS, tasks, E)
args, model, original, THEIRS, TO_THEIRS, OUR_CANON = (
    RUN[k] for k in ("args", "model", "original", "rec", "to_theirs", "our_canon")
)
ep = model.e_prompt
info(
    "learner run",
    f"{T} tasks of {n_img} images, batch 1 (both sides); warm-up {W} epochs, --epochs {E}; "
    f"Adam lr ours {b.lr} / "
    f"theirs {args.lr} (0.025 x 128/256), clip {b.clip_grad} / {args.clip_grad}, pull {b.match_weight} / "
    f"{args.pull_constraint_coeff}, pool {b.pool_size} / {args.size}, length {L} / {args.length}, "
    f"blocks {b.prompt_layers} / {args.e_prompt_layer_idx}",
    "compared through the steps below",
)
info(
    "decisions: ours / theirs",
    f"{[(o['decision'].kind, o['decision'].train_pids) for o in OURS]} / "
    f"{[(R['outcome']['kind'], R['outcome']['train_pids']) for R in THEIRS]}",
    "prompt ids: each side's own",
)
info(
    "our candidates all start from the one draw (prompt_same_init)",
    f"{max(mad(o['adam'][0][1][0], clf.init_prompt_) for o in OURS):.1e}",
    "their slots are all set to it",
)


def slot(x):
    return x.reshape(NL, 2, L, D)


def worst(pairs):
    """the largest max |a - b| over the pairs; inf when they cannot be formed (a prompt, an epoch or a step
    one side does not have: the two sides decided differently) or differ in shape"""
    try:
        return max((mad(x, y) for x, y in pairs), default=0.0)
    except (KeyError, IndexError, StopIteration, AssertionError, TypeError):
        return float("inf")


def big(pairs, tol=1e-5):
    try:
        return sum(int(((x.double() - y.double()).abs() > tol).sum()) for x, y in pairs)
    except (KeyError, IndexError, StopIteration, RuntimeError, TypeError):
        return -1


def epoch_head(R, e):
    return next(x for x in R["epochs"] if x["epoch"] == e)["head"]


def rows(h, t):  # the task's 2 rows of their global head, as (weight | bias)
    return torch.cat([h[0][2 * t : 2 * t + 2], h[1][2 * t : 2 * t + 2, None]], 1)


def ours_head(h):
    return torch.cat([h[0], h[1][:, None]], 1)


def series(runs, key, sl):
    return [torch.tensor([r[key] for r in o["log"][sl]]) for o in runs]


nw = W * n_img
post = slice(nw, None)
TOL_P = 0.2 * b.lr  # prompts / keys after up to 48 Adam steps of batch 1: see README (fp32 round-off)
report(
    "steps per task (warm-up and after it)",
    float(sum(len(o["log"]) != len(R["losses"]) for o, R in zip(OURS, THEIRS))),
    0,
    f"ours {[len(o['log']) for o in OURS]} theirs {[len(R['losses']) for R in THEIRS]}",
)
report(
    f"warm-up: CE of every step ({T} tasks x {nw} Adam steps)",
    worst(zip(series(OURS, "loss", slice(0, nw)), [torch.tensor(R["losses"][:nw]) for R in THEIRS])),
    1e-4,
)
report(
    "warm-up: pull term of every step, ours -coeff*mean cos vs theirs -pull_constraint_coeff*reduce_sim",
    worst(
        zip(
            series(OURS, "penalty", slice(0, nw)),
            [-args.pull_constraint_coeff * torch.tensor(R["sims"][:nw]) for R in THEIRS],
        )
    ),
    1e-5,
)
pairs = [(o["warm"][0], slot(R["warm"][0])) for o, R in zip(OURS, THEIRS)]
report(
    "warm-up: candidate prompt at its end (every task)",
    worst(pairs),
    TOL_P,
    f"{big(pairs, 1e-4)} of {sum(x.numel() for x, _ in pairs)} entries differ by > 1e-4",
)
report(
    "warm-up: candidate key at its end (every task)",
    worst((o["warm"][1], R["warm"][1]) for o, R in zip(OURS, THEIRS)),
    TOL_P,
)
report(
    "warm-up: head at its end (every task; theirs: the task's 2 rows)",
    worst((ours_head(o["warm"][2]), rows(R["warm"][2], t)) for t, (o, R) in enumerate(zip(OURS, THEIRS))),
    1e-4,
)

# the grouping of those warm-up prompts: in the two runs, and their function on our warm-up prompts
ours_out = [our_outcome(t, o["groups"], o["decision"], o["left"]) for t, o in enumerate(OURS)]
report_grouping("learner run", ours_out, [R["outcome"] for R in THEIRS])
np.random.seed(0)
theirs_on_ours = their_grouping([o["warm"][0] for o in OURS], args)
report(
    "their uni_or_specific_prompts on our warm-up prompts: every field above, tasks differing",
    float(len(differing(ours_out, theirs_on_ours, ALL))),
    0,
)

after = [(t, o["adam"][1][1][-2:]) for t, o in enumerate(OURS) if t > 0]
report(
    "head after the warm-up's restore (tasks > 0)",
    worst((ours_head(a), rows(epoch_head(THEIRS[t], W), t)) for t, a in after),
    1e-6,
)
info(
    "ours: the restored head equals the head at the task's start (bit-equal)",
    str([all(torch.equal(x, y) for x, y in zip(a, OURS[t]["adam"][0][1][-2:])) for t, a in after]),
)


def fresh_epochs_ours(o):
    return sorted({s // n_img for s, _ in o["adam"] if s < len(o["log"])})


def fresh_epochs_theirs(R):
    return [e["epoch"] for i, e in enumerate(R["epochs"]) if i == 0 or e["opt"] != R["epochs"][i - 1]["opt"]]


fe = [(fresh_epochs_ours(o), fresh_epochs_theirs(R)) for o, R in zip(OURS, THEIRS)]
report(
    "epochs where a new optimiser takes its first step (task start, after the warm-up, reinit_clf)",
    float(sum(x != y for x, y in fe)),
    0,
    f"ours {[x for x, _ in fe]} theirs {[y for _, y in fe]}",
)
resets = [(t, s, vals) for t, o in enumerate(OURS) for s, vals in o["adam"][2:] if s < len(o["log"])]
report(  # reinit_clf: the head at the new optimiser vs theirs at the start of that epoch
    f"head after reinit_clf ({len(resets)} resets)",
    worst((ours_head(vals[-2:]), rows(epoch_head(THEIRS[t], s // n_img), t)) for t, s, vals in resets),
    1e-6,
)

starts = [
    (t, i, p)
    for t, o in enumerate(OURS)
    if len(o["log"]) > nw
    for i, p in enumerate(sorted(set(o["decision"].train_pids)))
]
report(  # our optimiser's order: prompts (sorted ids), keys, head
    f"prompts trained after the warm-up, at their start ({len(starts)}; merged: copies of their base)",
    worst(
        (OURS[t]["adam"][1][1][i], slot(THEIRS[t]["epochs"][W]["slots"][TO_THEIRS[p]])) for t, i, p in starts
    ),
    TOL_P,
)
report(
    "merged tasks: the prompt drawn for each input, ours fed to their np.random.choice "
    "(draws not among theirs)",
    float(sum(R["choice_miss"] for R in THEIRS)),
    0,
    f"{sum(R['choices'] for R in THEIRS)} draws",
)
report(
    "prompt used by every step, warm-up and after (named by its tasks)",
    float(
        sum(
            OUR_CANON[p] != R["outcome"]["cm"][q]
            for o, R in zip(OURS, THEIRS)
            for p, q in zip(o["picks"], R["picks"])
        )
    ),
    0,
)
report(
    "after the warm-up: CE of every step",
    worst(zip(series(OURS, "loss", post), [torch.tensor(R["losses"][nw:]) for R in THEIRS])),
    1e-4,
)
report(
    "after the warm-up: pull term of every step",
    worst(
        zip(
            series(OURS, "penalty", post),
            [-args.pull_constraint_coeff * torch.tensor(R["sims"][nw:]) for R in THEIRS],
        )
    ),
    1e-5,
)
pairs = [
    (o["pool"][p], slot(R["end"]["prompt"][:, :, TO_THEIRS[p]]))
    for o, R in zip(OURS, THEIRS)
    for p in o["pool"]
    if p in TO_THEIRS
]
missing = sum(p not in TO_THEIRS for o in OURS for p in o["pool"])
report(
    "end of every task: every prompt of ours vs their slot of the same tasks",
    worst(pairs) if not missing else float("inf"),
    TOL_P,
    f"{big(pairs, 1e-4)} of {sum(x.numel() for x, _ in pairs)} entries differ by > 1e-4",
)
report(
    "end of every task: every key",
    worst((o["keys"][p], R["end"]["key"][TO_THEIRS[p]]) for o, R in zip(OURS, THEIRS) for p in o["keys"]),
    TOL_P,
)
report(
    "end of every task: the task's head",
    worst((ours_head(o["head"]), rows(R["end"]["head"], t)) for t, (o, R) in enumerate(zip(OURS, THEIRS))),
    1e-4,
)

# ---- findings: ours as it is (no zero gradients) and a task with two reinit_clf resets
merged = [
    t for t, o in enumerate(OURS) if o["decision"].kind == "merge" and len(set(o["decision"].train_pids)) > 1
]
same_until = [t for t in range(T) if t < (merged[0] if merged else T)]
info(
    "ours as it is: max |prompt - the zero-gradient run's| at the end of the tasks before the first merge "
    "of >= 2 prompts",
    f"{worst((OURS_ASIS[t]['pool'][p], x) for t in same_until for p, x in OURS[t]['pool'].items()):.1e}",
    f"tasks {same_until}",
)


def asis_pairs(t):
    end = THEIRS[t]["end"]["prompt"]
    return ((OURS_ASIS[t]["pool"][p], slot(end[:, :, TO_THEIRS[p]])) for p in OURS_ASIS[t]["pool"])


info(
    "FINDING: ours as it is vs theirs at the end of the merge tasks (>= 2 prompts drawn at random, batch 1)",
    ", ".join(f"task {t}: prompts {worst(asis_pairs(t)):.2e}" for t in merged),
    "their pool is one tensor under Adam: a prompt no input drew in a step moves by its momentum; ours has "
    "no "
    "gradient there and Adam skips it (equal when every prompt is drawn in every step)",
)
ALIAS = their_run(clf_alias, OURS_ALIAS, tasks[:2], E_ALIAS, uni_epochs=12)
oa, Ra = OURS_ALIAS[1], ALIAS["rec"][1]
head0 = oa["adam"][0][1][-2:]
second = [s // n_img for s, _ in oa["adam"][2:] if s < len(oa["log"])]
try:
    assert oa["decision"].kind == "shared" and len(second) == 2, "task 1 is not a shared task with two resets"
    h0 = ours_head(head0)
    gaps = [
        f"{mad(ours_head(oa['adam'][2 + i][1][-2:]), h0):.1e} / {mad(rows(epoch_head(Ra, e), 1), h0):.2e}"
        for i, e in enumerate(second)
    ]
    info(
        f"FINDING: a shared task with uni_epochs 12, --epochs {E_ALIAS}: reinit_clf resets before epochs "
        f"{second}; max |head - head at the task's start| after the first, the second: ours / theirs",
        ", ".join(gaps),
        "theirs: head.weight.data = temp_head_params[...] makes the head share the saved tensor, which Adam "
        "then trains in place: a second reset in the task restores nothing (the release's --epochs 50: "
        "merges of 8 or 9 prompts)",
    )
    info(
        "  the same task's head at its end, ours vs theirs",
        f"{mad(ours_head(oa['head']), rows(Ra['end']['head'], 1)):.2e}",
        f"steps ours {len(oa['log'])} theirs {len(Ra['losses'])}",
    )
except (AssertionError, StopIteration, IndexError) as err:
    info(
        "FINDING (reinit_clf aliasing): not shown",
        f"{err}: task 1 {oa['decision'].kind}, resets before epochs {second}",
    )

# -------------------------------------------------------------------------------- 3. test time
X = torch.cat([common.task_images(clf, task) for task in tasks])
z = clf.prefix(X)
with torch.no_grad():
    q_t = original(X)["pre_logits"]
    q_o = clf.query(z)
report("query: frozen [CLS] after the norm vs their original_model pre_logits", mad(q_o, q_t), 1e-5)
in_use = list(clf.groups_.inference_pids)


def test_time(tag):
    with torch.no_grad():
        sel_o = clf.select(q_o)
        outs = [
            model(X[j : j + 1], task_id=T - 1, cls_features=q_t[j : j + 1], train=False)
            for j in range(len(X))
        ]
        sel_t = [THEIRS[-1]["outcome"]["cm"][int(o["prompt_idx"].reshape(-1)[0])] for o in outs]
        miss = sum(OUR_CANON[int(p)] != s for p, s in zip(sel_o, sel_t))
        report(
            f"{tag}: prompt selected (argmax cosine, top 1; named by its tasks)",
            float(miss),
            0,
            f"ours {[OUR_CANON[int(p)][1] for p in sel_o]}",
        )
        report(
            f"{tag}: features",
            mad(clf.features(z, train=False), torch.cat([o["pre_logits"] for o in outs])),
            1e-4,
        )
        report(
            f"{tag}: logits over all {2 * T} classes",
            mad(clf.logits_prefix(z), torch.cat([o["logits"] for o in outs])),
            1e-4,
        )
        return sel_o


info("prompts in use at test", str([OUR_CANON[p] for p in in_use]))
test_time("test, trained keys")
# keys set to compete: key i towards query 5 i (+ 0.3 x its own), scaled by very different norms; the cosine
# ignores the norms, the raw dot product would not
norms = [1.0, 8.0, 0.2, 3.0, 0.5, 5.0, 0.1]
with torch.no_grad():
    for i, p in enumerate(in_use):
        k = (q_o[(5 * i) % len(q_o)] + 0.3 * clf.keys_[p]) * norms[i % len(norms)]
        clf.keys_[p].copy_(k)
        if p in TO_THEIRS:
            ep.prompt_key[TO_THEIRS[p]].copy_(k)
sel = test_time("test, keys of very different norms")
keys = torch.stack([clf.keys_[p] for p in in_use])
raw = torch.as_tensor(in_use)[(q_o @ keys.T).argmax(1)]
info("  the raw dot product would select differently for", f"{int((raw != sel).sum())} of {len(sel)} queries")
common.summary()
