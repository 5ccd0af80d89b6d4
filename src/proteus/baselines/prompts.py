"""The prompt baselines of Table 1 on the timm ViTs: L2P, DualPrompt and CODA-Prompt.

All three read a *query*, the frozen ViT's class token (after the final norm) of a prompt-free pass, and
choose or weight prompts from a pool by its match with learned keys; the ViT itself stays frozen. Two ways
of inserting a prompt P into block l:

* prompt tuning (L2P): P's tokens join the sequence before the first block, ``[CLS, P, patches]``, each
  with the class token's position embedding (the PyTorch port's layout);
* prefix tuning (DualPrompt, CODA-Prompt): block l's attention sees P_k and P_v as extra keys and values
  (:func:`block_with_prefix`); the sequence keeps its length.

**L2P** (Wang et al., CVPR 2022): a pool of M prompts of length L with keys; each input takes the N prompts
whose keys are most cosine-similar to its query; the head reads the mean of the prompt tokens' outputs;
the surrogate loss ``-match_weight * sum_n cos(q, k_n)`` pulls the chosen keys towards the queries.

**DualPrompt** (Wang et al., ECCV 2022): a g-prompt shared by all tasks (prefix, blocks 0-1) and one
e-prompt per task with its key (prefix, blocks 2-4). Training uses task t's e-prompt for every input and
pulls key t towards the queries; at test the e-prompt of the most similar key is used. Task t's e-prompt
starts as a copy of task t-1's (the port's shared pool). The head reads the class token.

**CODA-Prompt** (Smith et al., CVPR 2023): per prompted block, M components P_m with keys K_m and attention
vectors A_m; an input's prompt is ``sum_m cos(q * A_m, K_m) P_m``, split in half into prefix keys and
values. Task t trains its own M / T components (Gram-Schmidt-initialised orthogonal to the earlier ones);
earlier components are used but frozen. The head reads the class token.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from proteus.baselines.learner import BaselineOptions, ContinualClassifier
from proteus.baselines.persist import generator_state, load_generator, need
from proteus.config import ConfigError, declare
from proteus.engine.errors import TaskError
from proteus.learners import LEARNERS
from proteus.options import AT_LEAST_1, NON_NEGATIVE, option

__all__ = ["CodaPrompt", "DualPrompt", "L2P", "PromptClassifier", "block_with_prefix", "gram_schmidt"]


def block_with_prefix(
    blk: Any, x: torch.Tensor, prefix: tuple[torch.Tensor, torch.Tensor] | None
) -> torch.Tensor:
    """A timm ViT block whose attention also attends to ``prefix = (P_k, P_v)``, each (B, L_p, d), placed
    before the sequence's own keys and values (prefix tuning). ``prefix=None`` is the plain block. ``blk``
    is duck-typed (timm's blocks are not one class)."""
    if prefix is None:
        return blk(x)
    a = blk.attn
    h = blk.norm1(x)
    B, N, _ = h.shape
    H, hd = a.num_heads, a.head_dim
    q, k, v = a.qkv(h).reshape(B, N, 3, H, hd).permute(2, 0, 3, 1, 4).unbind(0)
    q, k = a.q_norm(q), a.k_norm(k)
    pk, pv = (p.reshape(B, -1, H, hd).transpose(1, 2).to(k.dtype) for p in prefix)
    o = F.scaled_dot_product_attention(q, torch.cat([pk, k], 2), torch.cat([pv, v], 2))
    o = a.proj(a.norm(o.transpose(1, 2).reshape(B, N, -1)))
    x = x + blk.ls1(o)
    return x + blk.ls2(blk.mlp(blk.norm2(x)))


def gram_schmidt(old: torch.Tensor, n: int, generator: torch.Generator) -> torch.Tensor:
    """``n`` unit rows, orthogonal to each other and to the rows of ``old`` (CODA-Prompt's per-task
    initialisation): random normal rows, each minus its projections on all earlier rows, then normalised.
    Classical Gram-Schmidt, as the released code: every projection is of the raw draw (the same rows as
    the modified form when ``old`` is orthonormal; not once training has moved the old rows)."""
    rows = [r for r in old.double()]
    out = []
    for _ in range(n):
        raw = torch.randn(old.shape[1], generator=generator, dtype=torch.float64)
        v = raw.clone()
        for u in rows:
            v = v - (raw @ u) / (u @ u) * u
        v = v / v.norm()
        rows.append(v)
        out.append(v)
    return torch.stack(out).to(old.dtype)


@dataclasses.dataclass
class PromptOptions(BaselineOptions):
    prompt_length: int = option(
        5, help="prompt length L (L2P 5, DualPrompt's e-prompt 5 on CIFAR / 20 on ImageNet-R, CODA 8)",
        range=AT_LEAST_1,
    )  # fmt: skip
    prompt_layers: list[int] = option(
        help="the blocks that receive prompts (DualPrompt's e-prompt blocks, CODA's prefix blocks)",
        factory=lambda: [0],
    )


@dataclasses.dataclass
class L2POptions(PromptOptions):
    pool_size: int = option(10, help="the prompt pool's size M", range=AT_LEAST_1)
    top_k: int = option(5, help="prompts chosen per input (N)", range=AT_LEAST_1)
    match_weight: float = option(
        0.1, help="the key-query matching loss's weight (the surrogate)", range=NON_NEGATIVE
    )


@dataclasses.dataclass
class DualPromptOptions(PromptOptions):
    g_length: int = option(5, help="the g-prompt's length", range=AT_LEAST_1)
    g_layers: list[int] = option(help="the g-prompt's blocks", factory=lambda: [0, 1])
    match_weight: float = option(0.1, help="the pull constraint's weight", range=NON_NEGATIVE)


@dataclasses.dataclass
class CodaOptions(PromptOptions):
    pool_size: int = option(10, help="the prompt components (CODA-Prompt: 100)", range=AT_LEAST_1)
    ortho_weight: float = option(
        0.0, help="the orthogonality penalty's weight (0 in the released scripts)", range=NON_NEGATIVE
    )


class PromptClassifier(ContinualClassifier):
    """A prompt baseline: the prefix is the patch embedding plus the query, the frozen class token."""

    needs_tokens = True
    Options: type = PromptOptions

    @property
    def vit(self) -> Any:
        """The backbone's timm ViT (duck-typed: see :class:`~proteus.backbones.vit.TimmViTBackbone`)."""
        return self.backbone_.vit

    def _setup(self) -> None:
        # prompts enter the first prompted block and the query is a whole frozen pass: every block runs
        # here whatever backbone.adapt_last says (it only shapes the LoRA methods' frozen prefix)
        self._make_state(self.embed_dim)

    def _make_state(self, d: int) -> None:
        raise NotImplementedError

    @torch.no_grad()
    def prefix(self, x: torch.Tensor) -> torch.Tensor:
        """(B, P + 1, d): the patch tokens, then the query (frozen: cached with the patches, so a training
        epoch or an evaluation never runs the prompt-free pass again)."""
        patches = self.vit.patch_embed(x)
        x = self._sequence(patches)
        for blk in self.vit.blocks:
            x = blk(x)
        return torch.cat([patches, self.vit.norm(x)[:, :1]], 1)

    def _sequence(self, patches: torch.Tensor) -> torch.Tensor:
        v = self.vit
        return v.norm_pre(v._pos_embed(patches))

    def tokens(self, z: torch.Tensor) -> torch.Tensor:
        """Prefix outputs -> the sequence of class token and patches with the position embedding."""
        return self._sequence(z[:, :-1])

    @staticmethod
    def query(z: torch.Tensor) -> torch.Tensor:
        """The frozen ViT's class token after the final norm, without prompts (B, d)."""
        return z[:, -1]

    def run_blocks(
        self, x: torch.Tensor, prefixes: dict[int, tuple[torch.Tensor, torch.Tensor]]
    ) -> torch.Tensor:
        for i, blk in enumerate(self.vit.blocks):
            x = block_with_prefix(blk, x, prefixes.get(i))
        return self.vit.norm(x)

    @torch.no_grad()
    def selected_logits(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """For the methods that pick one prompt per input (``select`` on the query, then ``prompted``):
        every seen class's logits (N, C_seen) of prefix outputs under their picked prompts, and (N,) the
        picks, in evaluation batches."""
        outs, picks = [], []
        for chunk in z.split(self.config.eval.batch_size):
            chunk = chunk.to(self.device_)
            t = self.select(self.query(chunk))  # type: ignore[attr-defined]
            with self.embedder_.autocast():
                h = self.prompted(chunk, t).float()  # type: ignore[attr-defined]
            outs.append(torch.cat([head(h) for head in self.heads_], 1).cpu())
            picks.append(t.cpu())
        return torch.cat(outs), torch.cat(picks)

    def _params(self) -> dict[str, nn.Parameter]:
        raise NotImplementedError

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The heads, every prompt and key (``prompt.<name>``) and the state of the generator a method draws
        each task's new prompts from (``rng.prompts``)."""
        out = super().state_tensors()
        out.update({f"prompt.{n}": p.detach().cpu().contiguous() for n, p in self._params().items()})
        if hasattr(self, "_gen"):
            out["rng.prompts"] = generator_state(self._gen)
        return out

    @torch.no_grad()
    def load_state(self, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        """Every prompt and key of :meth:`_params` from ``prompt.<name>`` (a method whose pool grows with the
        tasks creates its entries first) and the generator's state."""
        for n, p in self._params().items():
            t = need(tensors, f"prompt.{n}")
            if t.shape != p.shape:
                raise TaskError(f"prompt.{n}: shape {tuple(t.shape)}, expected {tuple(p.shape)}")
            p.copy_(t)
        if hasattr(self, "_gen"):
            load_generator(self._gen, tensors, "rng.prompts")

    def _to(self, t: torch.Tensor) -> nn.Parameter:
        return nn.Parameter(t.to(next(self.vit.parameters()).device))

    def _frozen(self, t: torch.Tensor) -> nn.Parameter:
        """:meth:`_to`, frozen (``requires_grad_`` is typed to return a plain tensor)."""
        p = self._to(t)
        p.requires_grad_(False)
        return p


@LEARNERS.register("l2p")
class L2P(PromptClassifier):
    """L2P: top-N prompts of a keyed pool by cosine with the query; prompt tuning; surrogate loss."""

    name = "l2p"
    Options = L2POptions
    resumes_legacy = True  # no generator after the set-up: its prompts and keys are all a task reads

    def _make_state(self, d: int) -> None:
        b = self.options_
        if not 1 <= b.top_k <= b.pool_size:
            raise ConfigError(f"l2p: baseline.top_k must be in 1..pool_size={b.pool_size}, got {b.top_k}")
        g = torch.Generator().manual_seed(self.config.seed)
        self.prompt_ = self._to(torch.rand(b.pool_size, b.prompt_length, d, generator=g) * 2 - 1)
        self.key_ = self._to(torch.rand(b.pool_size, d, generator=g) * 2 - 1)

    def _params(self) -> dict[str, nn.Parameter]:
        return {"prompt": self.prompt_, "key": self.key_}

    def trainable(self) -> list[nn.Parameter]:
        return [self.prompt_, self.key_]

    def select(self, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, N) indices of the chosen prompts and their (B, N) cosine similarities with the query."""
        sim = F.normalize(q, dim=-1) @ F.normalize(self.key_, dim=-1).T
        idx = sim.topk(self.options_.top_k, dim=1).indices
        return idx, sim.gather(1, idx)

    def features(self, z: torch.Tensor, train: bool) -> torch.Tensor:
        q = self.query(z)
        idx, cos = self.select(q)
        B, n = idx.shape
        P = self.prompt_[idx].reshape(B, -1, self.embed_dim)  # (B, N L, d)
        x = self.tokens(z)
        pos0 = self.vit.pos_embed[:, :1] if self.vit.pos_embed is not None else 0
        x = torch.cat([x[:, :1], P.to(x.dtype) + pos0, x[:, 1:]], 1)
        x = self.run_blocks(x, {})
        if train:
            self.aux_loss = -self.options_.match_weight * cos.sum() / B
        return x[:, 1 : 1 + P.shape[1]].mean(1)


@LEARNERS.register("dualprompt")
class DualPrompt(PromptClassifier):
    """DualPrompt: a shared g-prompt and per-task e-prompts with keys, both as prefixes."""

    name = "dualprompt"
    Options = DualPromptOptions

    def _make_state(self, d: int) -> None:
        b = self.options_
        g = torch.Generator().manual_seed(self.config.seed)
        n_g, n_e = len(b.g_layers), len(b.prompt_layers)
        self.g_prompt_ = self._to(torch.rand(n_g, 2, b.g_length, d, generator=g) * 2 - 1)
        self._gen = g
        self.e_prompts_: list[nn.Parameter] = []
        self.e_keys_: list[nn.Parameter] = []
        self._shape = (n_e, 2, b.prompt_length, d)

    def _params(self) -> dict[str, nn.Parameter]:
        out = {"g": self.g_prompt_}
        for t, (p, k) in enumerate(zip(self.e_prompts_, self.e_keys_)):
            out[f"e.{t}"], out[f"key.{t}"] = p, k
        return out

    def begin_task(self, k: int, z: torch.Tensor | None, loader: Any) -> None:
        d = self.embed_dim
        fresh = torch.rand(*self._shape, generator=self._gen) * 2 - 1
        key = torch.rand(d, generator=self._gen) * 2 - 1
        # the port's shared pool: task t's e-prompt starts where task t-1's ended (keys start fresh)
        e = self.e_prompts_[-1].detach().clone() if self.e_prompts_ else fresh
        self.e_prompts_.append(self._to(e.cpu()))
        self.e_keys_.append(self._to(key))

    def abort_task(self, k: int) -> None:
        del self.e_prompts_[k:]
        del self.e_keys_[k:]

    def end_task(self, k: int, z: torch.Tensor | None, loader: Any) -> None:
        self.e_prompts_[-1].requires_grad_(False)
        self.e_keys_[-1].requires_grad_(False)

    def load_state(self, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        """Each learned task's e-prompt and key (frozen), then as every prompt method."""
        for _ in range(self.num_tasks):
            self.e_prompts_.append(self._frozen(torch.zeros(self._shape)))
            self.e_keys_.append(self._frozen(torch.zeros(self.embed_dim)))
        super().load_state(meta, tensors)

    def trainable(self) -> list[nn.Parameter]:
        return [self.g_prompt_, self.e_prompts_[-1], self.e_keys_[-1]]

    def select(self, q: torch.Tensor) -> torch.Tensor:
        """(B,) the e-prompt of the key most cosine-similar to each query."""
        keys = torch.stack(list(self.e_keys_))
        return (F.normalize(q, dim=-1) @ F.normalize(keys, dim=-1).T).argmax(1)

    def features(self, z: torch.Tensor, train: bool) -> torch.Tensor:
        b = self.options_
        q = self.query(z)
        B = q.shape[0]
        t = len(self.e_prompts_) - 1
        if train:
            idx = torch.full((B,), t, dtype=torch.long, device=q.device)
            cos = F.cosine_similarity(q, self.e_keys_[t][None], dim=-1)
            self.aux_loss = -b.match_weight * cos.sum() / B
        else:
            idx = self.select(q)
        E = torch.stack(list(self.e_prompts_))[idx]  # (B, n_e, 2, L, d)
        prefixes: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for j, layer in enumerate(b.g_layers):
            G = self.g_prompt_[j][None].expand(B, -1, -1, -1)
            prefixes[layer] = (G[:, 0], G[:, 1])
        for j, layer in enumerate(b.prompt_layers):
            pk, pv = E[:, j, 0], E[:, j, 1]
            if layer in prefixes:
                pk, pv = torch.cat([prefixes[layer][0], pk], 1), torch.cat([prefixes[layer][1], pv], 1)
            prefixes[layer] = (pk, pv)
        x = self.run_blocks(self.tokens(z), prefixes)
        return x[:, 0]


@LEARNERS.register("coda-prompt")
class CodaPrompt(PromptClassifier):
    """CODA-Prompt: per block, a prompt as the attention-weighted sum of components (prefix tuning)."""

    name = "coda-prompt"
    Options = CodaOptions

    def _make_state(self, d: int) -> None:
        b = self.options_
        if b.prompt_length % 2:
            raise ConfigError(
                f"coda-prompt: baseline.prompt_length must be even (k/v halves), got {b.prompt_length}"
            )
        M, L = b.pool_size, b.prompt_length
        self.P_ = {layer: self._to(torch.zeros(M, L, d)) for layer in b.prompt_layers}
        self.K_ = {layer: self._to(torch.zeros(M, d)) for layer in b.prompt_layers}
        self.A_ = {layer: self._to(torch.zeros(M, d)) for layer in b.prompt_layers}
        self._gen = torch.Generator().manual_seed(self.config.seed)

    def _params(self) -> dict[str, nn.Parameter]:
        out = {}
        for layer in self.P_:
            out[f"P.{layer}"], out[f"K.{layer}"], out[f"A.{layer}"] = (
                self.P_[layer],
                self.K_[layer],
                self.A_[layer],
            )
        return out

    def load_state(self, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        """As every prompt method; an earlier release's knowledge base does not give the stream's number of
        tasks, which :meth:`span` divides the pool by: it is read off the components the tasks opened."""
        super().load_state(meta, tensors)
        if self._stream_tasks is None and self.num_tasks and self.P_:
            P = next(iter(self.P_.values())).detach()
            opened = int((P.reshape(P.shape[0], -1).norm(dim=1) > 0).sum())
            per = max(1, opened // self.num_tasks)
            self._stream_tasks = self.options_.pool_size // per

    def span(self, k: int) -> tuple[int, int]:
        """Task k's components [s, f) of the pool."""
        per = self.options_.pool_size // self.task_budget
        if per < 1 or (k + 1) * per > self.options_.pool_size:
            raise ConfigError(
                f"coda-prompt: pool_size {self.options_.pool_size} cannot give task {k + 1} its "
                f"components; raise baseline.pool_size or set baseline.max_tasks"
            )
        return k * per, (k + 1) * per

    @torch.no_grad()
    def begin_task(self, k: int, z: torch.Tensor | None, loader: Any) -> None:
        s, f = self.span(k)
        for tensors in (self.P_, self.K_, self.A_):
            for t in tensors.values():
                flat = t.data.reshape(t.shape[0], -1)
                flat[s:f] = gram_schmidt(flat[:s].cpu(), f - s, self._gen).to(flat.device)
        self._task = k

    def trainable(self) -> list[nn.Parameter]:
        return [t for d in (self.P_, self.K_, self.A_) for t in d.values()]

    def features(self, z: torch.Tensor, train: bool) -> torch.Tensor:
        b = self.options_
        q = self.query(z)
        k = self._task if train else self.num_tasks - 1
        s, f = self.span(k)
        half = b.prompt_length // 2
        prefixes: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        ortho: torch.Tensor | float = 0.0
        for layer in b.prompt_layers:
            parts = []
            for t in (self.K_[layer], self.A_[layer], self.P_[layer]):
                parts.append(torch.cat([t[:s].detach(), t[s:f]]) if train else t[:f])
            K, A, P = parts
            aq = q[:, None, :] * A[None]  # (B, f, d)
            w = (F.normalize(aq, dim=2) * F.normalize(K, dim=1)[None]).sum(2)  # (B, f)
            Pq = torch.einsum("bk,kld->bld", w, P)
            prefixes[layer] = (Pq[:, :half], Pq[:, half:])
            if train and b.ortho_weight > 0:
                ortho = ortho + sum(_ortho_penalty(x.reshape(x.shape[0], -1)) for x in (K, A, P))
        if train:
            self.aux_loss = b.ortho_weight * ortho
        x = self.run_blocks(self.tokens(z), prefixes)
        return x[:, 0]


def _ortho_penalty(x: torch.Tensor) -> torch.Tensor:
    """mean((X X^T - I)^2), CODA-Prompt's orthogonality penalty."""
    return ((x @ x.T - torch.eye(x.shape[0], device=x.device)) ** 2).mean()


declare(
    "l2p",
    "L2P (Wang et al., CVPR 2022): a prompt pool chosen by key-query matching, prompt tuning",
    base=None,
    learner="l2p",
    baseline__optimizer="adam", baseline__lr=1.875e-3, baseline__schedule="constant",
    baseline__pool_size=10, baseline__prompt_length=5, baseline__top_k=5, baseline__match_weight=0.1,
    baseline__prompt_layers=[0], baseline__clip_grad=1.0,
)  # fmt: skip
declare(
    "dualprompt",
    "DualPrompt (Wang et al., ECCV 2022): shared g-prompts and per-task e-prompts, prefix tuning",
    base=None,
    learner="dualprompt",
    baseline__optimizer="adam", baseline__lr=2.8125e-3, baseline__schedule="constant",  # 0.03 * 24 / 256
    baseline__prompt_length=5, baseline__g_length=5, baseline__g_layers=[0, 1],
    baseline__prompt_layers=[2, 3, 4], baseline__match_weight=1.0, baseline__clip_grad=1.0,
)  # fmt: skip
declare(
    "coda-prompt",
    "CODA-Prompt (Smith et al., CVPR 2023): attention-weighted prompt components, prefix tuning",
    base=None,
    learner="coda-prompt",
    baseline__optimizer="adam", baseline__lr=1e-3, baseline__schedule="cosine",
    baseline__pool_size=100, baseline__prompt_length=8, baseline__prompt_layers=[0, 1, 2, 3, 4],
    baseline__ortho_weight=0.0,
)  # fmt: skip
