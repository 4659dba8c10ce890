"""Pure-torch Nemotron-H modules that read and write the runtime's slot pool.

Parameter names match the Hugging Face checkpoints (below the ``backbone.`` / ``model.``
prefix), so :mod:`hybridmeta.runtime.loader` loads a state dict without renaming leaves.

Every Mamba2 layer reads one thing: the forward's :class:`~hybridmeta.model.Mamba2Metadata`
(built by :mod:`hybridmeta.planner`), and runs the ops of :mod:`hybridmeta.kernels` on it
(Triton on CUDA, the ops' references on the CPU: the op call's choice). Three entry
points run all layers: :meth:`NemotronH.forward_prefill` over the flat tokens of a
forward's prefill rows, :meth:`NemotronH.forward_decode` over one token per row with fixed
shapes, which is what a decode graph captures, and :meth:`NemotronH.forward_verify` over
``draft_token_num`` tokens per row of a speculative target-verify forward (fixed shapes:
what a verify graph captures). Prefill and decode end with the forward's track-save
(:func:`~hybridmeta.kernels.track_save_from_metadata`): rows flagged in
``mamba_track_mask`` save their state into their track slot. A verify forward writes no
slot: its Mamba2 layers keep the state after every draft token in the pool's intermediate
buffers, and the commit (:func:`~hybridmeta.kernels.spec_commit_from_metadata`, the
engine's, once the draft is judged) copies the accepted one into the working slot and the
one on a track boundary into the track slot.
"""

from __future__ import annotations

import math

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from hybridmeta import kernels
from hybridmeta.model import Mamba2Metadata
from hybridmeta.runtime.config import NemotronHConfig
from hybridmeta.runtime.plan import AttentionPlan
from hybridmeta.runtime.state import StatePool

__all__ = [
    "Attention", "Block", "Forward", "Linear", "Mamba2Mixer", "NemotronH", "RMSNorm", "Relu2MLP",
]


@attrs.frozen(kw_only=True, eq=False)
class Forward:
    """What every layer of one forward reads.

    Attributes
    ----------
    md : Mamba2Metadata
        The forward's metadata: the Mamba2 layers' only input besides the activations.
    pool : StatePool
    attention : AttentionPlan or None
        The attention layers' plan of a prefill forward (``None``: a decode forward).
    positions : torch.Tensor or None
        ``[B]`` position of each decode row's token, ``[B * T]`` of each verify token
        (attention; ``None`` in prefill).
    """

    md: Mamba2Metadata
    pool: StatePool
    attention: AttentionPlan | None = None
    positions: torch.Tensor | None = None


def _capturing(t: torch.Tensor) -> bool:
    """Whether ``t``'s device is capturing a CUDA graph on the current stream."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def _pad_rows(flat: torch.Tensor, plan: AttentionPlan) -> torch.Tensor:
    """``[T, ...]`` flat tokens -> ``[P, L, ...]`` padded rows (pad cells are zero)."""
    zero = flat.new_zeros((1, *flat.shape[1:]))
    return torch.cat([flat, zero], dim=0)[plan.gather]


def _unpad_rows(padded: torch.Tensor, plan: AttentionPlan) -> torch.Tensor:
    """``[P, L, ...]`` padded rows -> ``[T, ...]`` flat tokens."""
    return padded.reshape(plan.num_rows * plan.padded_len, *padded.shape[2:])[plan.scatter]


class Linear(nn.Linear):
    """``nn.Linear`` through :func:`hybridmeta.kernels.linear`: on the GPU a one-row input
    (the decode step of one row) runs the GEMV kernel, 2 to 16 rows the skinny GEMM where
    its rule (``kernels.linear.skinny_blocks``) says so, anything else ``F.linear``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x + residual), x + residual)`` in one pass (fused add + RMSNorm)."""
        return kernels.add_rms_norm(x.contiguous(), residual, self.weight, self.eps)


class GatedRMSNorm(nn.Module):
    def __init__(self, size: int, group_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.group_size = group_size
        self.eps = eps

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        # z is a column slice of the input projection: the kernel reads it in place (rows
        # strided, channels contiguous), no copy.
        return kernels.gated_rms_norm(y, z, self.weight, self.group_size, self.eps)


class Relu2MLP(nn.Module):
    """``down(relu(up(x))**2)``."""

    def __init__(self, config: NemotronHConfig) -> None:
        super().__init__()
        self.up_proj = Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = Linear(
            config.intermediate_size, config.hidden_size, bias=config.mlp_bias
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # relu and square inside the down projection: the GEMV (one row) and the skinny
        # GEMM apply them as they load the input; before cuBLAS one relu_square kernel runs
        down = self.down_proj
        out: torch.Tensor = kernels.linear(
            self.up_proj(x), down.weight, down.bias, input_activation="relu2"
        )
        return out


class Mamba2Mixer(nn.Module):
    """Mamba2 mixer: in_proj -> causal conv1d -> SSD -> gated RMSNorm -> out_proj."""

    A: torch.Tensor
    dt_bias_f32: torch.Tensor

    def __init__(self, config: NemotronHConfig, index: int) -> None:
        super().__init__()
        self.config = config
        #: position of this layer among the model's Mamba layers (its row in the pool)
        self.index = index
        inner = config.mamba_intermediate
        self.num_heads = config.mamba_num_heads
        self.head_dim = config.mamba_head_dim
        self.state_size = config.ssm_state_size
        self.n_groups = config.n_groups
        self.conv_dim = config.conv_dim
        self.in_proj = Linear(
            config.hidden_size,
            inner + config.conv_dim + config.mamba_num_heads,
            bias=config.use_bias,
        )
        self.conv1d = nn.Conv1d(
            config.conv_dim,
            config.conv_dim,
            kernel_size=config.conv_kernel,
            groups=config.conv_dim,
            bias=config.use_conv_bias,
        )
        self.dt_bias = nn.Parameter(torch.ones(config.mamba_num_heads))
        self.A_log = nn.Parameter(torch.zeros(config.mamba_num_heads))
        self.D = nn.Parameter(torch.ones(config.mamba_num_heads))
        # Derived once from the weights, not per forward (each was three or four tiny
        # kernels per layer per step): ``A = -exp(A_log)`` and ``dt_bias`` in fp32. Not in
        # the state dict; ``derive_constants`` refreshes them, and runs after every
        # ``load_state_dict`` (hook below) and, in an eager forward, whenever ``A_log`` or
        # ``dt_bias`` changed in place since.
        self.register_buffer("A", torch.empty(config.mamba_num_heads), persistent=False)
        self.register_buffer("dt_bias_f32", torch.empty(config.mamba_num_heads), persistent=False)
        self._derived_from: tuple[int, ...] = ()
        self.derive_constants()
        self.register_load_state_dict_post_hook(  # type: ignore[no-untyped-call]
            lambda module, _: module.derive_constants()
        )
        self.norm = GatedRMSNorm(inner, inner // config.n_groups, config.layer_norm_epsilon)
        self.out_proj = Linear(inner, config.hidden_size, bias=config.use_bias)

    def _split(self, proj: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        inner = self.config.mamba_intermediate
        z, xbc, dt = torch.split(proj, [inner, self.conv_dim, self.num_heads], dim=-1)
        return z, xbc, dt

    def _weights_key(self) -> tuple[int, ...]:
        a, b = self.A_log, self.dt_bias
        return (a._version, a.data_ptr(), b._version, b.data_ptr())

    @torch.no_grad()
    def derive_constants(self) -> None:
        """Recompute ``A = -exp(A_log)`` and the fp32 ``dt_bias`` from the weights.

        In place while the module keeps its device and dtype, so a captured CUDA graph that
        reads them sees the new values on its next replay; after ``Module.to`` (which moves
        or casts the buffers too) they are made anew, in fp32, on the weights' device.
        """
        if self.A_log.is_meta:
            return
        a = -torch.exp(self.A_log.float())
        # a copy even when dt_bias is fp32 already: never the parameter itself
        b = self.dt_bias.detach().to(torch.float32, copy=True)
        if self.A.is_meta or self.A.device != a.device or self.A.dtype != a.dtype:
            # first derivation, or the module was moved or cast (``Module.to`` casts buffers)
            self.A = a
            self.dt_bias_f32 = b
        else:
            self.A.copy_(a)
            self.dt_bias_f32.copy_(b)
        self._derived_from = self._weights_key()

    def _constants(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._weights_key() != self._derived_from and not _capturing(self.A):
            self.derive_constants()
        return self.A, self.dt_bias_f32

    @property
    def dt_limit(self) -> tuple[float, float]:
        """The model's dt limits: ``time_step_min`` below, none above."""
        return (self.config.time_step_min, math.inf)

    def _dt(self, dt: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
        # The prefill scan's discretisation: the decode and verify kernels apply the same
        # bias, softplus and clamp (``dt_limit``) inside. ``dt`` (activation dtype) + the
        # fp32 bias promotes to fp32 in the add itself.
        return F.softplus(torch.add(dt, dt_bias)).clamp_(*self.dt_limit)

    def forward(self, h: torch.Tensor, fwd: Forward) -> torch.Tensor:
        """``h``: ``[T, hidden]`` (prefill tokens first, then one token per decode row).

        Writes the rows' conv and SSM state, and the extend track plan's boundaries, into
        this layer's rows of the pool; everything it reads comes from ``fwd.md``.
        """
        md = fwd.md
        z, xbc, dt = self._split(self.in_proj(h))
        conv_state = fwd.pool.conv[self.index]  # [S, C, K-1]
        ssm_state = fwd.pool.ssm[self.index]  # [S, H, D, N]
        weight = self.conv1d.weight.squeeze(1)  # [C, K]
        A, dt_bias = self._constants()
        H, D, G, N = self.num_heads, self.head_dim, self.n_groups, self.state_size
        tp = md.num_prefill_tokens
        parts: list[torch.Tensor] = []
        if md.num_prefills:
            dt_p = self._dt(dt[:tp], dt_bias)  # [tp, H] fp32, discretised for the scan
            xbc_p = xbc[:tp]
            conv = kernels.causal_conv1d_prefill(
                xbc_p, weight, self.conv1d.bias, md=md, conv_state=conv_state
            )
            x, b, c = kernels.split_xbc(conv.out, H, D, G, N)
            params = kernels.SSMParams(
                A=A, D=self.D, dt_bias=torch.zeros_like(A), dt_softplus=False
            )
            scan = kernels.ssd_chunked_scan(
                x, dt_p, b, c, params=params, md=md, ssm_state=ssm_state
            )
            kernels.extend_track_save(
                md, xbc=xbc_p, conv=conv, scan=scan, conv_state=conv_state, ssm_state=ssm_state
            )
            parts.append(scan.y.reshape(tp, -1))
        if md.is_target_verify:
            parts.append(
                self._verify(md, fwd.pool, xbc, dt, A, dt_bias, conv_state, ssm_state, weight)
            )
        elif md.num_decodes:
            u = kernels.causal_conv1d_update_from_metadata(
                md, xbc[tp:], conv_state, weight, self.conv1d.bias
            )
            x, b, c = kernels.split_xbc(u, H, D, G, N)
            # raw dt: the bias, softplus and clamp happen in the kernel
            y = kernels.ssm_state_update_from_metadata(
                md, ssm_state, x, dt[tp:], A, b, c, D=self.D, dt_bias=dt_bias, dt_softplus=True,
                dt_limit=self.dt_limit,
            )  # fmt: skip
            parts.append(y.reshape(md.num_decodes, -1))
        y_all = parts[0] if len(parts) == 1 else torch.cat(parts)
        out: torch.Tensor = self.out_proj(self.norm(y_all, z).to(h.dtype))
        return out

    def _verify(
        self,
        md: Mamba2Metadata,
        pool: StatePool,
        xbc: torch.Tensor,
        dt: torch.Tensor,
        A: torch.Tensor,
        dt_bias: torch.Tensor,
        conv_state: torch.Tensor,
        ssm_state: torch.Tensor,
        weight: torch.Tensor,
    ) -> torch.Tensor:
        """The verify rows: ``T = md.draft_token_num`` tokens each, no slot written; the
        state after every token goes to this layer's intermediate buffers ``[:B, :T]``."""
        B, T = md.num_decodes, md.draft_token_num
        H, D, G, N = self.num_heads, self.head_dim, self.n_groups, self.state_size
        inter_conv, inter_ssm = pool.verify_states(B, T)
        u = kernels.conv_verify_update_from_metadata(
            md, xbc.view(B, T, -1), conv_state, weight, self.conv1d.bias,
            inter=inter_conv[self.index],
        )  # fmt: skip
        x, b, c = kernels.split_xbc(u.view(B * T, -1), H, D, G, N)
        y = kernels.ssm_verify_update_from_metadata(
            md, ssm_state, x.view(B, T, H, D), dt.view(B, T, H), A, b.view(B, T, G, N),
            c.view(B, T, G, N), D=self.D, dt_bias=dt_bias, dt_softplus=True,
            dt_limit=self.dt_limit, inter=inter_ssm[self.index],
        )  # fmt: skip
        return y.reshape(B * T, -1)


class Attention(nn.Module):
    """Grouped-query attention without positional encoding (Nemotron-H has none)."""

    def __init__(self, config: NemotronHConfig, index: int) -> None:
        super().__init__()
        self.index = index
        self.num_heads = config.num_attention_heads
        self.num_kv = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        h = config.hidden_size
        self.q_proj = Linear(h, self.num_heads * self.head_dim, bias=False)
        self.k_proj = Linear(h, self.num_kv * self.head_dim, bias=False)
        self.v_proj = Linear(h, self.num_kv * self.head_dim, bias=False)
        self.o_proj = Linear(self.num_heads * self.head_dim, h, bias=False)

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """``q [R, Lq, Hq, hd]``, ``k/v [R, M, KVH, hd]``, ``mask [R, Lq, M]`` -> ``[R, Lq, Hq*hd]``."""
        r, lq = q.shape[:2]
        qg = q.reshape(r, lq, self.num_kv, self.num_heads // self.num_kv, self.head_dim)
        scores = torch.einsum("rlgqd,rmgd->rgqlm", qg, k).float() * self.scale
        scores = scores.masked_fill(~mask[:, None, None], -torch.inf)
        probs = torch.softmax(scores, dim=-1).to(v.dtype)
        out = torch.einsum("rgqlm,rmgd->rlgqd", probs, v)
        return out.reshape(r, lq, self.num_heads * self.head_dim)

    def _qkv(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        t = h.shape[0]
        q = self.q_proj(h).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(h).view(t, self.num_kv, self.head_dim)
        v = self.v_proj(h).view(t, self.num_kv, self.head_dim)
        return q, k, v

    def forward(self, h: torch.Tensor, fwd: Forward) -> torch.Tensor:
        """Prefill rows on their padded grid (``fwd.attention``), or one token per decode row
        at ``fwd.positions``. The KV slot of a row is its working slot; a pad row (slot
        ``-1``) reads and writes the KV pool's scratch row."""
        q, k, v = self._qkv(h)
        pool = fwd.pool
        kc, vc = pool.k[self.index], pool.v[self.index]  # [S + 1, M, KVH, hd]
        plan = fwd.attention
        if plan is not None:
            keys = torch.arange(pool.max_len, device=h.device)
            slots = fwd.md.prefill_slots  # [P]
            token_slot = slots.index_select(0, plan.token_row)
            kc.index_put_((token_slot, plan.token_pos), k.to(kc.dtype))
            vc.index_put_((token_slot, plan.token_pos), v.to(vc.dtype))
            qpos = plan.starts[:, None] + torch.arange(plan.padded_len, device=h.device)
            mask = keys[None, None, :] <= qpos[:, :, None]  # [P, L, M]
            out = self._attend(_pad_rows(q, plan), kc[slots], vc[slots], mask)
            res: torch.Tensor = self.o_proj(_unpad_rows(out, plan))
            return res
        return self._rows(q, k, v, kc, vc, fwd)

    def _rows(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kc: torch.Tensor,
        vc: torch.Tensor,
        fwd: Forward,
    ) -> torch.Tensor:
        """``T = draft_token_num`` tokens per row (decode: ``T = 1``; verify: the pending
        token and a chain of drafts): each token's KV is written at its position in the
        row's slot, and each token attends to the row's keys up to its own position (the
        committed prefix and the tokens before it). KV rows of drafts that will be rejected
        lie past the accepted length: the next forward overwrites them before any query
        reaches them, and until then the causal mask hides them. Two kernels: the KV write
        and the attention, both reading the slots from the metadata (a pad row, slot
        ``-1``, writes nothing and gets zeros)."""
        assert fwd.positions is not None
        md = fwd.md
        B, T = md.num_decodes, md.draft_token_num
        slot = md.mamba_cache_indices  # [B]
        pos = fwd.positions.view(B, T)
        kv_shape = (B, T, self.num_kv, self.head_dim)
        kernels.kv_cache_write(k.view(kv_shape), v.view(kv_shape), kc, vc, slot, pos)
        out = kernels.decode_attention(
            q.view(B, T, self.num_heads, self.head_dim), kc, vc, slot, pos, self.scale
        )
        res: torch.Tensor = self.o_proj(out.reshape(B * T, -1))
        return res


class Block(nn.Module):
    """Pre-norm residual block around one mixer."""

    def __init__(self, config: NemotronHConfig, kind: str, index: int) -> None:
        super().__init__()
        self.kind = kind
        self.norm = RMSNorm(config.hidden_size, config.layer_norm_epsilon)
        self.mixer: nn.Module
        if kind == "M":
            self.mixer = Mamba2Mixer(config, index)
        elif kind == "*":
            self.mixer = Attention(config, index)
        elif kind == "-":
            self.mixer = Relu2MLP(config)
        else:
            raise ValueError(f"Block: unsupported layer kind {kind!r} (supported: 'M', '*', '-')")

    def forward(
        self, delta: torch.Tensor, residual: torch.Tensor | None, fwd: Forward
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The previous layer's output ``delta`` joins the residual stream (one fused add +
        norm); returns this layer's output and the stream: ``h = residual + delta``,
        ``(mixer(norm(h)), h)``. The first layer gets the embeddings and no residual."""
        x, h = self.norm(delta, residual)
        if isinstance(self.mixer, Mamba2Mixer | Attention):
            return self.mixer.forward(x, fwd), h
        mlp: torch.Tensor = self.mixer(x)
        return mlp, h


class NemotronH(nn.Module):
    """Nemotron-H causal LM over the runtime's slot pool."""

    def __init__(self, config: NemotronHConfig) -> None:
        super().__init__()
        self.config = config
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        layers: list[Block] = []
        n_mamba = n_attn = 0
        for kind in config.pattern:
            if kind == "M":
                layers.append(Block(config, kind, n_mamba))
                n_mamba += 1
            elif kind == "*":
                layers.append(Block(config, kind, n_attn))
                n_attn += 1
            else:
                layers.append(Block(config, kind, -1))
        self.layers = nn.ModuleList(layers)
        self.norm_f = RMSNorm(config.hidden_size, config.layer_norm_epsilon)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embeddings.weight

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """LM head of final-normed hidden states, fp32 logits."""
        out: torch.Tensor = self.lm_head(h)
        return out.float()

    def _layers(self, h: torch.Tensor, fwd: Forward) -> torch.Tensor:
        """Every layer, then the final norm: ``[T, hidden]`` normed hidden states."""
        delta, residual = h, None
        for layer in self.layers:
            assert isinstance(layer, Block)
            delta, residual = layer.forward(delta, residual, fwd)
        # The forward's track-save: every row flagged in mamba_track_mask (a decode row at a
        # boundary, a prefill row whose boundary is its last token) saves its state now. A
        # verify forward's boundaries are saved by its commit, once the draft is judged.
        if not fwd.md.is_target_verify:
            kernels.track_save_from_metadata(fwd.md, fwd.pool.conv, fwd.pool.ssm)
        out: torch.Tensor = self.norm_f(delta, residual)[0]
        return out

    def forward_prefill(
        self,
        input_ids: torch.Tensor,
        md: Mamba2Metadata,
        attention: AttentionPlan,
        pool: StatePool,
        *,
        all_logits: bool = False,
    ) -> torch.Tensor:
        """Run a forward of prefill rows (``md.num_decodes == 0``).

        Parameters
        ----------
        input_ids : torch.Tensor
            ``[T]`` int64 flat new tokens of all rows, row after row.
        md : Mamba2Metadata
            The forward's metadata (:func:`hybridmeta.planner.plan_mixed_batch`).
        attention : AttentionPlan
            The attention layers' plan of the same rows.

        Returns
        -------
        torch.Tensor
            ``[P, V]`` logits of each row's last token, or ``[T, V]`` with ``all_logits``.
        """
        if md.num_decodes or input_ids.shape != (md.num_prefill_tokens,):
            raise ValueError(
                f"NemotronH.forward_prefill: input_ids must have shape ({md.num_prefill_tokens},) "
                f"and the metadata no decode rows, got {tuple(input_ids.shape)} and "
                f"{md.num_decodes} decode rows"
            )
        h = self._layers(self.embeddings(input_ids), Forward(md=md, pool=pool, attention=attention))
        return self.logits(h if all_logits else h[attention.last])

    def forward_decode(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        md: Mamba2Metadata,
        pool: StatePool,
    ) -> torch.Tensor:
        """One token per row -> ``[B, V]`` logits; capturable (fixed shapes, no host reads).

        Parameters
        ----------
        input_ids, positions : torch.Tensor
            ``[B]`` int64 token and position of each row (pad rows: any value).
        md : Mamba2Metadata
            Decode metadata of exactly ``B`` rows (pad rows carry slot ``-1``).
        """
        if md.is_target_verify:
            raise ValueError(
                "NemotronH.forward_decode: the metadata is a target-verify forward; use "
                "forward_verify"
            )
        h = self.embeddings(input_ids)
        return self.logits(self._layers(h, Forward(md=md, pool=pool, positions=positions)))

    def forward_verify(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        md: Mamba2Metadata,
        pool: StatePool,
    ) -> torch.Tensor:
        """A speculative target-verify forward: ``[B * T]`` tokens -> ``[B * T, V]`` logits.

        Row ``b``'s tokens are ``input_ids[b * T : (b + 1) * T]``: its pending token, then
        its draft (a chain). Logits of token ``t`` judge draft token ``t + 1``. No state
        slot is written: the Mamba2 layers leave the state after each token in the pool's
        intermediate buffers for the commit. Capturable (fixed shapes, no host reads).

        Parameters
        ----------
        input_ids, positions : torch.Tensor
            ``[B * T]`` int64 token and position of each token (pad rows: any value).
        md : Mamba2Metadata
            Target-verify metadata (:func:`~hybridmeta.model.prepare_target_verify`) of
            exactly ``B`` rows and ``T = md.draft_token_num``.
        """
        n = md.num_decodes * md.draft_token_num
        if not md.is_target_verify or input_ids.shape != (n,) or positions.shape != (n,):
            raise ValueError(
                f"NemotronH.forward_verify: needs target-verify metadata and input_ids / "
                f"positions of shape ({n},) (rows x draft_token_num), got is_target_verify="
                f"{md.is_target_verify}, {tuple(input_ids.shape)} and {tuple(positions.shape)}"
            )
        h = self.embeddings(input_ids)
        return self.logits(self._layers(h, Forward(md=md, pool=pool, positions=positions)))
