"""Pure-torch Nemotron-H modules that read and write the runtime's slot pool.

Parameter names match the Hugging Face checkpoints (below the ``backbone.`` / ``model.``
prefix), so :mod:`hybridmeta.runtime.loader` loads a state dict without renaming leaves.

Two entry points run all layers: :meth:`NemotronH.forward_prefill` over the flat tokens
of a step's prefill rows (see :class:`~hybridmeta.runtime.plan.PrefillPlan`) and
:meth:`NemotronH.forward_decode` over one token per row with fixed shapes, which is what a
decode graph captures.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridmeta.runtime import ops
from hybridmeta.runtime.config import NemotronHConfig
from hybridmeta.runtime.plan import DecodeInputs, PrefillPlan
from hybridmeta.runtime.state import DUMMY_SLOT, StatePool

__all__ = ["Attention", "Block", "Mamba2Mixer", "NemotronH", "RMSNorm", "Relu2MLP"]


def _pad_rows(flat: torch.Tensor, plan: PrefillPlan) -> torch.Tensor:
    """``[T, ...]`` flat tokens -> ``[P, L, ...]`` padded rows (pad cells are zero)."""
    zero = flat.new_zeros((1, *flat.shape[1:]))
    return torch.cat([flat, zero], dim=0)[plan.gather]


def _unpad_rows(padded: torch.Tensor, plan: PrefillPlan) -> torch.Tensor:
    """``[P, L, ...]`` padded rows -> ``[T, ...]`` flat tokens."""
    return padded.reshape(plan.num_rows * plan.padded_len, *padded.shape[2:])[plan.scatter]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)


class GatedRMSNorm(nn.Module):
    def __init__(self, size: int, group_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.group_size = group_size
        self.eps = eps

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return ops.gated_rms_norm(y, z, self.weight, self.group_size, self.eps)


class Relu2MLP(nn.Module):
    """``down(relu(up(x))**2)``."""

    def __init__(self, config: NemotronHConfig) -> None:
        super().__init__()
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(
            config.intermediate_size, config.hidden_size, bias=config.mlp_bias
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(torch.square(F.relu(self.up_proj(x))))
        return out


class Mamba2Mixer(nn.Module):
    """Mamba2 mixer: in_proj -> causal conv1d -> SSD -> gated RMSNorm -> out_proj."""

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
        self.in_proj = nn.Linear(
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
        self.norm = GatedRMSNorm(inner, inner // config.n_groups, config.layer_norm_epsilon)
        self.out_proj = nn.Linear(inner, config.hidden_size, bias=config.use_bias)

    def _split(self, proj: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        inner = self.config.mamba_intermediate
        z, xbc, dt = torch.split(proj, [inner, self.conv_dim, self.num_heads], dim=-1)
        return z, xbc, dt

    def _xbc(self, conv_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        gn = self.n_groups * self.state_size
        x, b, c = torch.split(conv_out, [self.config.mamba_intermediate, gn, gn], dim=-1)
        return x, b, c

    def _dt(self, dt: torch.Tensor) -> torch.Tensor:
        # the clamp is the model's dt lower limit; applied in prefill and decode alike so a
        # cache hit and a cold recompute see the same discretisation
        return F.softplus(dt.float() + self.dt_bias.float()).clamp(min=self.config.time_step_min)

    def _conv_weight(self) -> torch.Tensor:
        return self.conv1d.weight.squeeze(1)  # [C, K]

    def forward_prefill(self, h: torch.Tensor, plan: PrefillPlan, pool: StatePool) -> torch.Tensor:
        """``h``: ``[T, hidden]`` flat prefill tokens -> ``[T, hidden]``; writes the rows' state."""
        z, xbc, dt = self._split(self.in_proj(h))
        if plan.mamba is not None:
            y_flat = self._prefill_hybridmeta(xbc, dt, plan, pool)
        else:
            y_flat = self._prefill_torch(xbc, dt, plan, pool)
        out: torch.Tensor = self.out_proj(self.norm(y_flat, z).to(h.dtype))
        return out

    def _prefill_hybridmeta(
        self, xbc: torch.Tensor, dt: torch.Tensor, plan: PrefillPlan, pool: StatePool
    ) -> torch.Tensor:
        """Mamba prefill through :mod:`hybridmeta.prefill` (global chunk grid); ``[T, I]``."""
        from hybridmeta.prefill import (
            SSMParams,
            causal_conv1d_prefill,
            extend_track_save,
            ssd_chunked_scan,
            ssd_chunked_scan_triton,
        )

        # The Triton scan is 2.2-3.1x the torch scan on an H200 (benchmarks/results/
        # h200_bench_prefill.json); on the CPU it would only run interpreted.
        scan_fn = ssd_chunked_scan_triton if xbc.is_cuda else ssd_chunked_scan
        mplan = plan.mamba
        assert mplan is not None
        t = plan.num_tokens
        conv_state = pool.conv[self.index]  # [S, C, K-1]
        ssm_state = pool.ssm[self.index]  # [S, H, D, N]
        conv = causal_conv1d_prefill(
            xbc, self._conv_weight(), self.conv1d.bias, plan=mplan, conv_state=conv_state
        )
        x, b, c = self._xbc(conv.out)
        # dt is discretised here (softplus + the model's lower clamp) and handed over as is
        params = SSMParams(
            A=-torch.exp(self.A_log.float()),
            D=self.D,
            dt_bias=torch.zeros_like(self.dt_bias, dtype=torch.float32),
            dt_softplus=False,
        )
        scan = scan_fn(
            x.reshape(t, self.num_heads, self.head_dim),
            self._dt(dt),
            b.reshape(t, self.n_groups, self.state_size),
            c.reshape(t, self.n_groups, self.state_size),
            params=params,
            plan=mplan,
            ssm_state=ssm_state,
        )
        extend_track_save(
            mplan, xbc=xbc, conv=conv, scan=scan, conv_state=conv_state, ssm_state=ssm_state
        )
        return scan.y.reshape(t, -1).float()

    def _prefill_torch(
        self, xbc: torch.Tensor, dt: torch.Tensor, plan: PrefillPlan, pool: StatePool
    ) -> torch.Tensor:
        """Mamba prefill with the padded per-row torch scan; ``[T, I]`` fp32."""
        p, seq = plan.num_rows, plan.padded_len
        k1 = self.config.conv_kernel - 1
        conv_state = pool.conv[self.index]  # [S, C, K-1]
        ssm_state = pool.ssm[self.index]  # [S, H, D, N]
        init_mask = plan.has_init[:, None, None]
        context = torch.where(init_mask, conv_state[plan.slots], 0)  # [P, C, K-1]
        conv_out, window = ops.causal_conv_prefill(
            _pad_rows(xbc, plan), context, self._conv_weight(), self.conv1d.bias
        )  # [P, L, C], [P, C, K-1+L]
        x, b, c = self._xbc(conv_out)
        dt_rows = self._dt(_pad_rows(dt, plan)) * plan.valid[..., None]  # [P, L, H]; 0 at pads
        init = torch.where(plan.has_init[:, None, None, None], ssm_state[plan.slots], 0)
        a = -torch.exp(self.A_log.float())
        y, states = ops.ssd_chunked(
            x.reshape(p, seq, self.num_heads, self.head_dim),
            dt_rows,
            a,
            b.reshape(p, seq, self.n_groups, self.state_size),
            c.reshape(p, seq, self.n_groups, self.state_size),
            self.D,
            init,
            self.config.chunk_size,
        )  # [P, L, H, D], [P, L/chunk+1, H, D, N]

        # final state of every row; pads after the last token leave it unchanged (dt = 0)
        ar = torch.arange(k1, device=xbc.device)
        idx = (plan.lengths[:, None] + ar)[:, None, :].expand(-1, self.conv_dim, -1)
        conv_state.index_copy_(0, plan.slots, window.gather(2, idx).to(conv_state.dtype))
        ssm_state.index_copy_(0, plan.slots, states[:, -1])
        if plan.num_tracks:
            # track boundaries are chunk boundaries of their row: read the chunk states
            tw = window[plan.track_row]  # [K, C, K-1+L]
            tidx = (plan.track_rel[:, None] + ar)[:, None, :].expand(-1, self.conv_dim, -1)
            conv_state.index_copy_(0, plan.track_slot, tw.gather(2, tidx).to(conv_state.dtype))
            ssm_state.index_copy_(0, plan.track_slot, states[plan.track_row, plan.track_chunk])

        return _unpad_rows(y, plan).reshape(plan.num_tokens, -1)  # [T, I] fp32

    def forward_decode(
        self, h: torch.Tensor, inputs: DecodeInputs, pool: StatePool
    ) -> torch.Tensor:
        """``h``: ``[B, hidden]`` one token per row -> ``[B, hidden]``; fixed shapes, no syncs."""
        bsz = h.shape[0]
        z, xbc, dt = self._split(self.in_proj(h))
        conv_state = pool.conv[self.index]
        ssm_state = pool.ssm[self.index]
        if inputs.kernels == "triton":
            y = self._decode_triton(xbc, dt, inputs, conv_state, ssm_state)
        else:
            y = self._decode_torch(xbc, dt, inputs, conv_state, ssm_state)
        out: torch.Tensor = self.out_proj(self.norm(y.reshape(bsz, -1), z).to(h.dtype))
        return out

    def _decode_triton(
        self,
        xbc: torch.Tensor,
        dt: torch.Tensor,
        inputs: DecodeInputs,
        conv_state: torch.Tensor,
        ssm_state: torch.Tensor,
    ) -> torch.Tensor:
        """Decode through :mod:`hybridmeta.kernels` (pad rows: slot -1, no state touched)."""
        from hybridmeta.kernels import causal_conv1d_update, ssm_state_update

        bsz = xbc.shape[0]
        conv_out = causal_conv1d_update(
            xbc,
            conv_state,
            self._conv_weight(),
            self.conv1d.bias,
            cache_indices=inputs.slots,
            activation="silu",
        )
        x, b, c = self._xbc(conv_out)
        # dt is discretised here (softplus + lower clamp), as in the prefill
        return ssm_state_update(
            ssm_state,
            x.reshape(bsz, self.num_heads, self.head_dim),
            self._dt(dt),
            -torch.exp(self.A_log.float()),
            b.reshape(bsz, self.n_groups, self.state_size),
            c.reshape(bsz, self.n_groups, self.state_size),
            state_indices=inputs.slots,
            D=self.D,
        ).float()

    def _decode_torch(
        self,
        xbc: torch.Tensor,
        dt: torch.Tensor,
        inputs: DecodeInputs,
        conv_state: torch.Tensor,
        ssm_state: torch.Tensor,
    ) -> torch.Tensor:
        """Decode with the pure-torch ops; pad rows read zeros and write the dummy slot."""
        bsz = xbc.shape[0]
        slot = torch.where(inputs.slots < 0, DUMMY_SLOT, inputs.slots)  # pad rows -> dummy slot
        live = (inputs.slots >= 0)[:, None, None]
        # pad rows load a zero state, so the dummy slot's contents never matter
        c_in = torch.where(live, conv_state[slot], 0)  # [B, C, K-1]
        conv_out, c_new = ops.conv_step(xbc, c_in, self._conv_weight(), self.conv1d.bias)
        conv_state.index_copy_(0, slot, c_new.to(conv_state.dtype))
        x, b, c = self._xbc(conv_out)
        s_in = torch.where(live[..., None], ssm_state[slot], 0)  # [B, H, D, N]
        y, s_new = ops.ssm_step(
            x.reshape(bsz, self.num_heads, self.head_dim),
            self._dt(dt),
            -torch.exp(self.A_log.float()),
            b.reshape(bsz, self.n_groups, self.state_size),
            c.reshape(bsz, self.n_groups, self.state_size),
            self.D,
            s_in,
        )
        ssm_state.index_copy_(0, slot, s_new)
        return y


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
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(h, self.num_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(h, self.num_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=False)

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

    def forward_prefill(self, h: torch.Tensor, plan: PrefillPlan, pool: StatePool) -> torch.Tensor:
        q, k, v = self._qkv(h)
        kc, vc = pool.k[self.index], pool.v[self.index]  # [S, M, KVH, hd]
        kc.index_put_((plan.token_slot, plan.token_pos), k.to(kc.dtype))
        vc.index_put_((plan.token_slot, plan.token_pos), v.to(vc.dtype))
        qpos = plan.starts[:, None] + torch.arange(plan.padded_len, device=h.device)  # [P, L]
        keys = torch.arange(pool.max_len, device=h.device)
        mask = keys[None, None, :] <= qpos[:, :, None]  # [P, L, M]
        out = self._attend(_pad_rows(q, plan), kc[plan.slots], vc[plan.slots], mask)
        res: torch.Tensor = self.o_proj(_unpad_rows(out, plan))
        return res

    def forward_decode(
        self, h: torch.Tensor, inputs: DecodeInputs, pool: StatePool
    ) -> torch.Tensor:
        q, k, v = self._qkv(h)
        slot = torch.where(inputs.slots < 0, DUMMY_SLOT, inputs.slots)
        kc, vc = pool.k[self.index], pool.v[self.index]
        kc.index_put_((slot, inputs.positions), k.to(kc.dtype))
        vc.index_put_((slot, inputs.positions), v.to(vc.dtype))
        keys = torch.arange(pool.max_len, device=h.device)
        mask = keys[None, None, :] <= inputs.positions[:, None, None]  # [B, 1, M]
        out = self._attend(q[:, None], kc[slot], vc[slot], mask)
        res: torch.Tensor = self.o_proj(out[:, 0])
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

    def _mixed(self, h: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.norm(h.to(self.norm.weight.dtype))
        return out

    def forward_prefill(self, h: torch.Tensor, plan: PrefillPlan, pool: StatePool) -> torch.Tensor:
        x = self._mixed(h)
        if isinstance(self.mixer, Mamba2Mixer | Attention):
            return h + self.mixer.forward_prefill(x, plan, pool)
        mlp: torch.Tensor = self.mixer(x)
        return h + mlp

    def forward_decode(
        self, h: torch.Tensor, inputs: DecodeInputs, pool: StatePool
    ) -> torch.Tensor:
        x = self._mixed(h)
        if isinstance(self.mixer, Mamba2Mixer | Attention):
            return h + self.mixer.forward_decode(x, inputs, pool)
        mlp: torch.Tensor = self.mixer(x)
        return h + mlp


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
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embeddings.weight

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head, fp32 logits."""
        out: torch.Tensor = self.lm_head(self.norm_f(h))
        return out.float()

    def forward_prefill(
        self,
        input_ids: torch.Tensor,
        plan: PrefillPlan,
        pool: StatePool,
        *,
        all_logits: bool = False,
    ) -> torch.Tensor:
        """Run the step's prefill rows.

        Parameters
        ----------
        input_ids : torch.Tensor
            ``[T]`` int64 flat new tokens of all rows, row after row.

        Returns
        -------
        torch.Tensor
            ``[P, V]`` logits of each row's last token, or ``[T, V]`` with ``all_logits``.
        """
        if input_ids.shape != (plan.num_tokens,):
            raise ValueError(
                f"NemotronH.forward_prefill: input_ids must have shape ({plan.num_tokens},), "
                f"got {tuple(input_ids.shape)}"
            )
        h = self.embeddings(input_ids)
        for layer in self.layers:
            assert isinstance(layer, Block)
            h = layer.forward_prefill(h, plan, pool)
        return self.logits(h if all_logits else h[plan.last])

    def forward_decode(self, inputs: DecodeInputs, pool: StatePool) -> torch.Tensor:
        """One token per row -> ``[B, V]`` logits; capturable (fixed shapes, no host reads)."""
        h = self.embeddings(inputs.input_ids)
        for layer in self.layers:
            assert isinstance(layer, Block)
            h = layer.forward_decode(h, inputs, pool)
        return self.logits(h)
