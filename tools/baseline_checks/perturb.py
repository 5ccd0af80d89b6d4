"""Shows that the side-by-side checks can fail: each perturbation changes one quantity of OUR baselines and
runs the check script that should see it.

Every perturbation is a text replacement in a temporary copy of ``src/`` (under /tmp, removed afterwards;
the repository is never modified). The check then runs in a subprocess with ``PYTHONPATH`` pointing at the
patched copy, one at a time, one thread. A perturbation is caught when the check reports at least one FAIL
line; a check that crashes is reported as "error", which does not count as caught. Prints the table
``perturbation | script | caught (n FAIL lines)`` and exits 1 if any perturbation is not caught.

    PROTEUS_THEIRS=/path/to/scratch python perturb.py            # all perturbations
    PROTEUS_THEIRS=/path/to/scratch python perturb.py sdlora l2p  # those whose script matches a name
    python perturb.py --list                                      # the perturbations, without running
    python perturb.py --texts                                     # each edit's text found once (no run)

A sanity run of every check on the unpatched copy comes first (``--no-baseline`` skips it): a check that
already fails there would make its perturbations look caught.
"""

import os
import re
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.abspath(os.path.join(HERE, "..", "..", "src"))
LORA = "proteus/baselines/lora_methods.py"
PROMPTS = "proteus/baselines/prompts.py"
LEARNER = "proteus/baselines/learner.py"
SPROMPT = "proteus/baselines/sprompt.py"
HIDE = "proteus/baselines/hideprompt.py"
TII = "proteus/engine/task_identity.py"
ADA = "proteus/baselines/adapromptcl.py"
TUNA = "proteus/baselines/tuna.py"
MOS = "proteus/baselines/mos.py"
TOSCA = "proteus/baselines/tosca.py"
MOAL = "proteus/baselines/moal.py"
ADAPTERS = "proteus/baselines/adaptformer.py"

#: (name, check script, file under src, [(old text, new text), ...]); every old text must occur exactly once
PERTURBATIONS = [
    # ---- MoAL (check_moal.py)
    (
        "MoAL: the first task's head without its factor 0.9",
        "moal",
        MOAL,
        [("FIRST_SCALE = 0.9", "FIRST_SCALE = 1.0")],
    ),
    (
        "MoAL: no moving average (the adapter as trained)",
        "moal",
        MOAL,
        [
            (
                'adapter = state["ema"] if k else clone_set(state["adapter"])',
                'adapter = clone_set(state["adapter"])',
            )
        ],
    ),
    ("MoAL: the moving average at alpha 0.99", "moal", MOAL, [("a = b.adapter_ema", "a = 0.99")]),
    (
        "MoAL: dropout off while training",
        "moal",
        MOAL,
        [("            training=train,\n", "            training=False,\n")],
    ),
    (
        "MoAL: the later tasks' new cosine rows drawn, not zero",
        "moal",
        MOAL,
        [
            (
                "torch.cat([self.rows_.cpu(), torch.zeros(len(classes), d)])",
                "torch.cat([self.rows_.cpu(), self._new_rows(len(classes))])",
            )
        ],
    ),
    (
        "MoAL: the recursive update keeps R",
        "moal",
        MOAL,
        [("return R - RA @ torch.linalg.solve(K, RA.T), W", "return R, W")],
    ),
    ("MoAL: the drift map's cosine period 20 epochs, not 10", "moal", MOAL, [("32, 10, 0.9", "32, 20, 0.9")]),
    (
        "MoAL: the earlier class means not carried by the drift map",
        "moal",
        MOAL,
        [("old_means = f(old_means)", "old_means = old_means + 0 * f(old_means)")],
    ),
    (
        "MoAL: pseudo-features not shifted by the class means' difference",
        "moal",
        MOAL,
        [("xs.append(xs[r] - new_means[r].double() + old_means[j].double())", "xs.append(xs[r].clone())")],
    ),
    (
        "MoAL: the rumination on every row, not the misclassified ones",
        "moal",
        MOAL,
        [("wrong = (A @ W0).argmax(1) != yb", "wrong = (A @ W0).argmax(1) >= 0")],
    ),
    (
        "MoAL: the misclassified rows judged by the head the rumination updates",
        "moal",
        MOAL,
        [("wrong = (A @ W0).argmax(1) != yb", "wrong = (A @ W).argmax(1) != yb")],
    ),
    # ---- TOSCA (check_tosca.py)
    (
        "TOSCA: no residual inside the adapter's LayerNorm",
        "tosca",
        TOSCA,
        [("m = mod.norm(x + mod.mlp(x))", "m = mod.norm(mod.mlp(x))")],
    ),
    ("TOSCA: the L1 term left out", "tosca", TOSCA, [("aux = b.l1 * sum(", "aux = 0.0 * sum(")]),
    (
        "TOSCA: sigma not trained",
        "tosca",
        TOSCA,
        [
            (
                'return [{"params": [*module.parameters(), rows, sigma]}]',
                'return [{"params": [*module.parameters(), rows]}]',
            )
        ],
    ),
    (
        "TOSCA: the trained rows kept (no prototypes)",
        "tosca",
        TOSCA,
        [("rows[known + i] = out[y == c].mean(0)", "rows[known + i] = rows[known + i]")],
    ),
    (
        "TOSCA: later modules keep torch's default initialisation",
        "tosca",
        TOSCA,
        [("(module if k == 0 else module.xavier_())", "module")],
    ),
    (
        "TOSCA: the most entropic task selected (per input)",
        "tosca",
        TOSCA,
        [("task = ent.argmin(0)", "task = ent.argmax(0)")],
    ),
    (
        "TOSCA: the batch's most entropic task selected",
        "tosca",
        TOSCA,
        [("task = ent.mean(1).argmin()", "task = ent.mean(1).argmax()")],
    ),
    (
        "TOSCA: later tasks' new rows drawn uniformly, not zero",
        "tosca",
        TOSCA,
        [("        if k:\n            return torch.zeros(n, self.embed_dim, device=self.device_)\n", "")],
    ),
    # ---- TUNA (check_tuna.py)
    (
        "TUNA: CosFace margin added to the target cosine instead of subtracted",
        "tuna",
        TUNA,
        [("s * (cos - m * F.one_hot(target", "s * (cos + m * F.one_hot(target")],
    ),
    (
        "TUNA: orthogonality weight exp(-t) instead of exp(-(t+1))",
        "tuna",
        TUNA,
        [("math.exp(-(k + 1))", "math.exp(-k)")],
    ),
    (
        "TUNA: the adapter of the most entropic logits selected",
        "tuna",
        TUNA,
        [("return entropy(logits, EPS).argmin(0)", "return entropy(logits, EPS).argmax(0)")],
    ),
    (
        "TUNA: EMR merge takes the agreeing entries' mean magnitude, not the largest",
        "tuna",
        ADAPTERS,
        [("merged[key] = agree.max(0).values * flag", "merged[key] = agree.mean(0) * flag")],
    ),
    (
        "TUNA: adapter output scale 0.11 instead of 0.1",
        "tuna",
        ADAPTERS,
        [("return up * scale", "return up * scale * 1.1")],
    ),
    (
        "TUNA: the alignment's mean decay with a positive task size",
        "tuna",
        TUNA,
        [("(i // -n_k + 1) / (k + 1) * 0.1", "(i // n_k + 1) / (k + 1) * 0.1")],
    ),
    ("TUNA: alignment cosine period 10 instead of 5", "tuna", TUNA, [("CA_PERIOD = 5", "CA_PERIOD = 10")]),
    # ---- MOS (check_mos.py)
    (
        "MOS: each pull towards the sum of the earlier adapters over t + 1, not their mean",
        "mos",
        MOS,
        [("return (1 - beta) * w + beta * total / idx", "return (1 - beta) * w + beta * total / (idx + 1)")],
    ),
    (
        "MOS: the training forward pulls once (before block 0), not before every block",
        "mos",
        MOS,
        [
            (
                "h = self.embed(z, self.open_, train=True, before_block=lambda _: self._pull_open(k))",
                "h = self.embed(z, self.open_, train=True, before_block=lambda i: i or self._pull_open(k))",
            )
        ],
    ),
    (
        "MOS: no pull after each step (adapter_merge)",
        "mos",
        MOS,
        [("after_step=lambda: self._pull_open(k)", "after_step=lambda: None")],
    ),
    (
        "MOS: test adapters' block l pulled l times, not l + 1",
        "mos",
        MOS,
        [("for _ in range(i + 1):", "for _ in range(i):")],
    ),
    (
        "MOS: prototypes under the task's own adapter, not the first task's",
        "mos",
        MOS,
        [
            (
                "h0, y0 = self.plain_features(task, z, y, self.adapters_[0])",
                "h0, y0 = self.plain_features(task, z, y, self.adapters_[-1])",
            )
        ],
    ),
    (
        "MOS: self-refinement ends after 3 looks, not 4",
        "mos",
        MOS,
        [("(look >= steps)", "(look >= steps - 1)")],
    ),
    (
        "MOS: ensemble's prototype logits not multiplied by the number of tasks",
        "mos",
        MOS,
        [("F.softmax(orig / (1 / m), 1)", "F.softmax(orig, 1)")],
    ),
    # ---- the review's table (notes/baselines-next.md)
    (
        "InfLoRA: A scaled by 1/sqrt(2) instead of 1/sqrt(3)",
        "inflora",
        LORA,
        [("return U[:, :r] / math.sqrt(3)", "return U[:, :r] / math.sqrt(2)")],
    ),
    (
        "InfLoRA: DualGPM threshold with (t+1)/T instead of t/T",
        "inflora",
        LORA,
        [("(1.0 - start) * k / self.task_budget", "(1.0 - start) * (k + 1) / self.task_budget")],
    ),
    (
        "L2P: keys not normalised in the match",
        "l2p",
        PROMPTS,
        [
            (
                "sim = F.normalize(q, dim=-1) @ F.normalize(self.key_, dim=-1).T",
                "sim = F.normalize(q, dim=-1) @ self.key_.T",
            )
        ],
    ),
    (
        "L2P: prompts ranked by raw dot product (true cosines returned)",
        "l2p",
        PROMPTS,
        [
            (
                "idx = sim.topk(self.options_.top_k, dim=1).indices",
                "idx = (q @ self.key_.T).topk(self.options_.top_k, dim=1).indices",
            )
        ],
    ),
    (
        "CODA: modified instead of classical Gram-Schmidt",
        "coda",
        PROMPTS,
        [("v = v - (raw @ u) / (u @ u) * u", "v = v - (v @ u) / (u @ u) * u")],
    ),
    (
        "DualPrompt: e-prompt key/value halves swapped",
        "dualprompt",
        PROMPTS,
        [("pk, pv = E[:, j, 0], E[:, j, 1]", "pk, pv = E[:, j, 1], E[:, j, 0]")],
    ),
    (
        "SD-LoRA: magnitudes start at 1.0 instead of 0.8",
        "sdlora",
        LORA,
        [
            (
                "torch.full((k + 1,), b.magnitude_init, device=dev)",
                "torch.full((k + 1,), 1.0, device=dev)",
            )
        ],
    ),
    (
        "SD-LoRA: new B starts at 0.01 instead of 0",
        "sdlora",
        LORA,
        [
            (
                'self.model_.begin_task(b.rank, "zero", False, task_seed(self.config.seed, k))',
                'self.model_.begin_task(b.rank, "zero", False, task_seed(self.config.seed, k))\n'
                "        for _u in self.model_.units.values():\n"
                "            _u.B_new.data.fill_(0.01)",
            )
        ],
    ),
    # ---- further perturbations
    (
        "SD-LoRA: old branches not normalised by ||B|| ||A||",
        "sdlora",
        LORA,
        [("u.s_fixed = alpha[owners] / norms", "u.s_fixed = alpha[owners]")],
    ),
    (
        "SD-LoRA: new A drawn with twice the bound (2/sqrt(d))",
        "sdlora",
        LORA,
        [
            (
                'self.model_.begin_task(b.rank, "zero", False, task_seed(self.config.seed, k))',
                'self.model_.begin_task(b.rank, "zero", False, task_seed(self.config.seed, k))\n'
                "        for _u in self.model_.units.values():\n"
                "            _u.A_new.data.mul_(2.0)",
            )
        ],
    ),
    (
        "SGD: momentum 0 instead of baseline.momentum (SD-LoRA)",
        "sdlora",
        LEARNER,
        [("momentum=b.momentum, weight_decay=wd", "momentum=0.0, weight_decay=wd")],
    ),
    (
        "InfLoRA: A designed from C without the DualGPM projection",
        "inflora",
        LORA,
        [
            (
                "U, _, _ = torch.linalg.svd(self.project(C), full_matrices=False)",
                "U, _, _ = torch.linalg.svd(C, full_matrices=False)",
            )
        ],
    ),
    (
        "InfLoRA: Adam beta2 0.99 instead of 0.999 (visible from the second step on)",
        "inflora",
        LEARNER,
        [
            (
                "torch.optim.Adam(params, lr=b.lr, betas=(0.9, 0.999), weight_decay=wd)",
                "torch.optim.Adam(params, lr=b.lr, betas=(0.9, 0.99), weight_decay=wd)",
            )
        ],
    ),
    (
        "learning rate x1.5 in the training loop (L2P)",
        "l2p",
        LEARNER,
        [
            (
                'epoch_lr(b.lr * group.get("lr_scale", 1.0), b.schedule, epoch, epochs)',
                'epoch_lr(1.5 * b.lr * group.get("lr_scale", 1.0), b.schedule, epoch, epochs)',
            )
        ],
    ),
    (
        "SD-LoRA: method declaration's lr 1e-2 instead of 8e-3",
        "sdlora",
        LORA,
        [('baseline__optimizer="sgd", baseline__lr=8e-3', 'baseline__optimizer="sgd", baseline__lr=1e-2')],
    ),
    (
        "gradient clipping off (L2P)",
        "l2p",
        LEARNER,
        [("if b.clip_grad is not None:", "if False:")],
    ),
    (
        "L2P: features from the class token instead of the prompt tokens' mean",
        "l2p",
        PROMPTS,
        [("return x[:, 1 : 1 + P.shape[1]].mean(1)", "return x[:, 0]")],
    ),
    (
        "DualPrompt: pull-constraint weight 0.1 instead of 1.0",
        "dualprompt",
        PROMPTS,
        [("self.aux_loss = -b.match_weight * cos.sum() / B", "self.aux_loss = -0.1 * cos.sum() / B")],
    ),
    (
        "DualPrompt: no shared pool (task t's e-prompt starts fresh)",
        "dualprompt",
        PROMPTS,
        [
            (
                "e = self.e_prompts_[-1].detach().clone() if self.e_prompts_ else fresh",
                "e = fresh",
            )
        ],
    ),
    (
        "CODA: cosine schedule without the released 2-epoch start at lr",
        "coda",
        LEARNER,
        [("max(epoch - 1, 0)", "epoch")],
    ),
    (
        "CODA: attention weights without normalising K",
        "coda",
        PROMPTS,
        [
            (
                "w = (F.normalize(aq, dim=2) * F.normalize(K, dim=1)[None]).sum(2)",
                "w = (F.normalize(aq, dim=2) * K[None]).sum(2)",
            )
        ],
    ),
    # ---- seen only by several optimiser steps of the released training step (Adam's first step is
    # lr * sign(g): blind to a gradient scaled by a constant, and the lr schedule starts at lr)
    (
        "DualPrompt: gradient clipped at norm 10 instead of 1.0 (visible from the second step on)",
        "dualprompt",
        PROMPTS,
        [
            (
                "baseline__prompt_layers=[2, 3, 4], baseline__match_weight=1.0, baseline__clip_grad=1.0,",
                "baseline__prompt_layers=[2, 3, 4], baseline__match_weight=1.0, baseline__clip_grad=10.0,",
            )
        ],
    ),
    (
        "CODA: training loop at a constant lr (epoch_lr itself unchanged; the cosine from epoch 3 on)",
        "coda",
        LEARNER,
        [
            (
                'epoch_lr(b.lr * group.get("lr_scale", 1.0), b.schedule, epoch, epochs)',
                'epoch_lr(b.lr * group.get("lr_scale", 1.0), "constant", epoch, epochs)',
            )
        ],
    ),
    # ---- S-Prompt (check_sprompt.py)
    (
        "S-Prompt: L2 instead of the release's L1 distance in the task selection",
        "sprompt",
        SPROMPT,
        [
            (
                'getattr(self, "keys_", []), p=1.0)',
                'getattr(self, "keys_", []), p=2.0)',
            )
        ],
    ),
    (
        "S-Prompt: the test query not normalised before the nearest key",
        "sprompt",
        SPROMPT,
        [("return nearest_key_task(F.normalize(q.float(), dim=-1), ", "return nearest_key_task(q.float(), ")],
    ),
    (
        "S-Prompt: features not normalised before K-Means",
        "sprompt",
        SPROMPT,
        [
            (
                "q = torch.cat([F.normalize(self.query(c).float(), dim=-1).cpu() for c in",
                "q = torch.cat([self.query(c).float().cpu() for c in",
            )
        ],
    ),
    ("S-Prompt: 4 K-Means keys per task instead of 5", "sprompt", SPROMPT, [("N_KEYS = 5", "N_KEYS = 4")]),
    (
        "S-Prompt: K-Means with one start (scikit-learn 1.4+'s default) instead of the release-era 10",
        "sprompt",
        SPROMPT,
        [
            (
                "KMeans(n_clusters=n, random_state=0, n_init=10)",
                "KMeans(n_clusters=n, random_state=0, n_init=1)",
            )
        ],
    ),
    (
        "S-Prompt: prompt inserted before the class token",
        "sprompt",
        SPROMPT,
        [("x = torch.cat([x[:, :1], P.to(x.dtype), x[:, 1:]], 1)", "x = torch.cat([P.to(x.dtype), x], 1)")],
    ),
    (
        "S-Prompt: prompt receives the class token's position embedding",
        "sprompt",
        SPROMPT,
        [
            (
                "x = torch.cat([x[:, :1], P.to(x.dtype), x[:, 1:]], 1)",
                "x = torch.cat([x[:, :1], P.to(x.dtype) + self.vit.pos_embed[:, :1], x[:, 1:]], 1)",
            )
        ],
    ),
    (
        "S-Prompt: prediction over every task's head instead of the selected task's",
        "sprompt",
        SPROMPT,
        [
            (
                'return logits.masked_fill(owner[None] != tasks[:, None], float("-inf")), tasks',
                "return logits, tasks",
            )
        ],
    ),
    (
        "S-Prompt: first-task weight decay 2e-4 instead of 5e-4",
        "sprompt",
        SPROMPT,
        [("first_task_decay: float = 2.5", "first_task_decay: float = 1.0")],
    ),
    (
        "S-Prompt: SGD momentum 0 instead of 0.9 (its declaration)",
        "sprompt",
        SPROMPT,
        [("baseline__lr=0.01, baseline__momentum=0.9,", "baseline__lr=0.01, baseline__momentum=0.0,")],
    ),
    (
        "S-Prompt: cosine annealing stepped before the epoch instead of after",
        "sprompt",
        SPROMPT,
        [("math.cos(math.pi * epoch / max(epochs, 1))", "math.cos(math.pi * (epoch + 1) / max(epochs, 1))")],
    ),
    # ---- HiDe-Prompt (check_hideprompt.py)
    (
        "HiDe-Prompt: prompt momentum 0.1 instead of 0.01",
        "hideprompt",
        HIDE,
        [("baseline__prompt_momentum=0.01", "baseline__prompt_momentum=0.1")],
    ),
    (
        "HiDe-Prompt: momentum mixes in the open prompt itself, not the old prompts' mean",
        "hideprompt",
        HIDE,
        [("m * torch.stack([o.detach() for o in old]).mean(0).to(raw.dtype)", "m * raw.detach()")],
    ),
    (
        "HiDe-Prompt: orth_loss temperature 1.0 instead of 0.8",
        "hideprompt",
        HIDE,
        [("TEMPERATURE = 0.8", "TEMPERATURE = 1.0")],
    ),
    (
        "HiDe-Prompt: stage 1 CE over every seen class (other tasks' classes not masked)",
        "hideprompt",
        TII,
        [
            (
                "local = {c: i for i, c in enumerate(classes)}",
                "local = {c: i + sum(h.out_features for h in self.net.heads[:-1])"
                " for i, c in enumerate(classes)}",
            ),
            ("self.net(q.to(self.device).float(), slice(k, k + 1))", "self.net(q.to(self.device).float())"),
        ],
    ),
    (
        "HiDe-Prompt: head at the prompt's lr (1x instead of 0.1x)",
        "hideprompt",
        HIDE,
        [("head_lr_scale = 0.1", "head_lr_scale = 1.0")],
    ),
    (
        "HiDe-Prompt: pseudo-features from the centroid means only (variances not used)",
        "hideprompt",
        TII,
        [("stds.append((var + 1e-4).sqrt().float())", "stds.append((0 * var + 1e-4).sqrt().float())")],
    ),
    (
        "HiDe-Prompt: TII task from the latest task's head only (not the argmax over every seen class)",
        "hideprompt",
        TII,
        [
            (
                "return owner[self.net(q.float()).argmax(1)]",
                "return owner[self.net(q.float(), slice(-1, None)).argmax(1) + sum(sizes[:-1])]",
            )
        ],
    ),
    (
        "HiDe-Prompt: one centroid more per class (n_centroids + 1)",
        "hideprompt",
        TII,
        [("k = min(n_centroids, len(x))", "k = min(n_centroids + 1, len(x))")],
    ),
    (
        "HiDe-Prompt: alignment SGD without momentum",
        "hideprompt",
        TII,
        [
            (
                "opt = torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=weight_decay)",
                "opt = torch.optim.SGD(params, lr=lr, momentum=0.0, weight_decay=weight_decay)",
            )
        ],
    ),
    # ---- AdaPromptCL
    (
        "AdaPromptCL: converge threshold 0.4 -> 0.5",
        "adapromptcl",
        ADA,
        [
            (
                "    converge_thrh: float = option(\n        0.4,",
                "    converge_thrh: float = option(\n        0.5,",
            )
        ],
    ),
    (
        "AdaPromptCL: post-merge threshold 0.6 -> 0.7",
        "adapromptcl",
        ADA,
        [("    postmerge_thrh: float = option(0.6,", "    postmerge_thrh: float = option(0.7,")],
    ),
    (
        "AdaPromptCL: warm-up prompts not normalised before clustering",
        "adapromptcl",
        ADA,
        [("return F.normalize(v, dim=0).double().numpy()", "return v.double().numpy()")],
    ),
    (
        "AdaPromptCL: K-Means top-n 2 -> 1",
        "adapromptcl",
        ADA,
        [("    kmeans_top_n: int = option(\n        2,", "    kmeans_top_n: int = option(\n        1,")],
    ),
    (
        "AdaPromptCL: K-Means counts above the worst silhouette's count, not the best",
        "adapromptcl",
        ADA,
        [("base = max(silhouettes, key=", "base = min(silhouettes, key=")],
    ),
    (
        "AdaPromptCL: head not restored after the warm-up",
        "adapromptcl",
        ADA,
        [
            (
                "the head after the warm-up from the second task on\n"
                "            run.head.load_state_dict(head0)",
                "the head after the warm-up from the second task on\n            pass",
            )
        ],
    ),
    (
        "AdaPromptCL: pull-constraint coefficient 1.0 -> 0.5 (method declaration)",
        "adapromptcl",
        ADA,
        [
            (
                "baseline__match_weight=1.0, baseline__clip_grad=1.0,",
                "baseline__match_weight=0.5, baseline__clip_grad=1.0,",
            )
        ],
    ),
    (
        "AdaPromptCL: test-time selection by raw dot product",
        "adapromptcl",
        ADA,
        [
            (
                "best = (F.normalize(q, dim=-1) @ F.normalize(keys, dim=-1).T).argmax(1)",
                "best = (q @ keys.T).argmax(1)",
            )
        ],
    ),
    (
        "AdaPromptCL: merged prompts copied without their base's key (a fresh key)",
        "adapromptcl",
        ADA,
        [
            (
                "self._new_prompt(self.pool_[base], self.keys_[base])",
                "self._new_prompt(self.pool_[base], torch.rand(self.embed_dim, generator=self._gen) * 2 - 1)",
            )
        ],
    ),
    (
        "AdaPromptCL: no reinit_clf (head_last_epochs 10 -> 100)",
        "adapromptcl",
        ADA,
        [
            (
                "    head_last_epochs: int = option(\n        10,",
                "    head_last_epochs: int = option(\n        100,",
            )
        ],
    ),
]


def patched_copy(edits, rel):
    """a temporary copy of src/ with the edits applied to src/<rel>; returns its path (caller removes it)"""
    tmp = tempfile.mkdtemp(prefix="proteus_perturb_")
    dst = os.path.join(tmp, "src")
    shutil.copytree(SRC, dst, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    path = os.path.join(dst, rel)
    text = open(path).read()
    for old, new in edits:
        n = text.count(old)
        if n != 1:
            shutil.rmtree(tmp)
            raise SystemExit(f"perturbation text found {n} times in {rel} (expected once): {old!r}")
        text = text.replace(old, new)
    with open(path, "w") as f:
        f.write(text)
    return tmp


def texts():
    """every perturbation's text found exactly once in its file: the code they perturb is still there"""
    bad = 0
    for name, _, rel, edits in PERTURBATIONS:
        text = open(os.path.join(SRC, rel)).read()
        for old, _ in edits:
            if text.count(old) != 1:
                bad += 1
                print(f"{name}: found {text.count(old)} times in {rel}: {old!r}")
    print(f"{len(PERTURBATIONS)} perturbations, {bad} texts not found once")
    return 1 if bad else 0


def run_check(script, src):
    env = dict(os.environ, PYTHONPATH=src, OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")
    p = subprocess.run(
        [sys.executable, os.path.join(HERE, f"check_{script}.py")],
        cwd=HERE,
        env=env,
        capture_output=True,
        text=True,
    )
    out = p.stdout
    fails = [ln for ln in out.splitlines() if ln.startswith("FAIL |")]
    m = re.search(r"SUMMARY: (\d+) pass, (\d+) fail, (\d+) info", out)
    return p.returncode, fails, m, out + p.stderr


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    if "--list" in sys.argv:
        for name, script, rel, _ in PERTURBATIONS:
            print(f"{name} | check_{script}.py | {rel}")
        return 0
    if "--texts" in sys.argv:
        return texts()
    todo = [p for p in PERTURBATIONS if not args or any(a in p[1] for a in args)]
    scripts = sorted({p[1] for p in todo})
    if "--no-baseline" not in sys.argv:
        for script in scripts:
            rc, fails, m, out = run_check(script, SRC)
            print(f"unperturbed check_{script}.py: rc {rc}, {m.group(0) if m else 'no SUMMARY'}", flush=True)
            if rc or fails or not m:
                print(out[-3000:])
                print(f"check_{script}.py fails without a perturbation: fix that first")
                return 1
    rows = []
    for name, script, rel, edits in todo:
        tmp = patched_copy(edits, rel)
        try:
            rc, fails, m, out = run_check(script, os.path.join(tmp, "src"))
        finally:
            shutil.rmtree(tmp)
        if m is None:
            caught = "error (no SUMMARY)"
            print(out[-2000:])
        elif fails:
            caught = f"yes ({len(fails)} FAIL)"
        else:
            caught = "NO (0 FAIL)"
        rows.append((name, f"check_{script}.py", caught, fails))
        print(f"{name} | check_{script}.py | {caught}", flush=True)
        for ln in fails:
            print(f"    {ln[:160]}")
    print()
    print("| perturbation | script | caught (n FAIL lines) |")
    print("|---|---|---|")
    for name, script, caught, _ in rows:
        print(f"| {name} | `{script}` | {caught} |")
    missed = [r for r in rows if not r[2].startswith("yes")]
    print(f"\n{len(rows) - len(missed)} of {len(rows)} perturbations caught")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
