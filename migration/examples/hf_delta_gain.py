"""The gain of a delta-rule token mixer (gated DeltaNet, KDA) in the logits bound of
hf_moe_bound.py, per call and token, derived from the unmodified model's own recorded values
(`DeltaGain`): a delta rule's output is linear in q.k and in its state (no softmax), so where those
cancel, its relative error exceeds its input's by far more than any constant."""

from __future__ import annotations

import torch
import torch.nn.functional as F

# the delta-rule mixers: Qwen3-Next's, Qwen3.5-MoE's and Lara-mini's gated DeltaNet (one decay per
# head), Kimi-Linear's and Bailing-Hybrid's KDA (one decay per key channel)
DELTA_MIXERS = (
    "Qwen3NextGatedDeltaNet",
    "Qwen3_5MoeGatedDeltaNet",
    "LaraMiniGatedDeltaNet",
    "KimiLinearDeltaAttention",
    "BailingHybridDeltaAttention",
)
# roundings to the activation dtype in one call of a gated norm: Qwen3-Next's and Qwen3.5's round
# the normalised row (`.to(input_dtype)`), its product with the bf16 weight and the gated result
# (3); Lara-mini's, Kimi-Linear's and Bailing-Hybrid's compute in fp32 and round once (1)
GATED_NORM_ROUNDINGS = {"Qwen3NextRMSNormGated": 3, "Qwen3_5MoeRMSNormGated": 3}
# a rounding to bf16 that both models take on values that differ: 2 u^2 at the value's size
# (hf_moe_bound's counting, once per model)
ROUND = 2.0


def _silu_slope(x: torch.Tensor) -> torch.Tensor:
    s = torch.sigmoid(x)
    return s * (1 + x * (1 - s))


def _gate_slope(activation: str, x: torch.Tensor) -> torch.Tensor:
    """d act(x) / dx of the gated norm's gate activation (silu or sigmoid)."""
    if activation == "sigmoid":
        s = torch.sigmoid(x)
        return s * (1 - s)
    return _silu_slope(x)


def _energy(path: torch.Tensor, rounding: torch.Tensor) -> torch.Tensor:
    """An error energy: [0] per unit of the input's squared relative error (the paths), [1] in
    u^2 (the mixer's own roundings); both propagate through the same first-order maps."""
    path, rounding = (torch.as_tensor(x, dtype=torch.float32) for x in (path, rounding))
    return torch.stack(torch.broadcast_tensors(path, rounding))


class DeltaGain:
    """Forward hooks on one delta-rule mixer's own submodules (its input projections, its gated
    norm) that derive, per call and token, how the mixer's output error depends on its input's:
    |d out|^2 / |out|^2 <= `gain` * eps_in^2 + `roundings` * u^2 wherever the two models' inputs
    differ (eps_in: the input's relative error; `gain`, `roundings`: [B*T] fp32 each, of the last
    call).

    Error model (hf_moe_bound's own): a linear map passes its input's relative error on spread
    evenly over its outputs (output i of W x moves by eps |x| |W_i| / sqrt(N), a random direction);
    independent errors add in quadrature; each bf16 rounding of a value that differs between the
    models adds ROUND u^2 at that value's size. Per token t and head h, in fp32 from the recorded
    projections, both kinds of energy carried through the same first-order maps:
      - q, k, v: the causal conv over the last `kernel` tokens of their projection (its squared
        weights on the energies), silu's slope, the conv's roundings; q and k are l2-normed, so
        their relative (direction) error is their energy over |q|^2, |k|^2;
      - the decay's log (its gate's slope on its projection), beta = sigmoid(b) (beta (1 - beta));
      - the core output o = S_t^T q_t, S_t = (I - beta k k^T) S' + beta k v^T, S' = decay * S_{t-1}:
        o's first-order move per source, with the exact q.k, |S|, |S'|, |v - S'^T k|, S'^T q, and
        a direction error of q or k taken as random (|S^T dq|^2 = |S|_F^2 |dq|^2 / dk); the state's
        own error energy is carried (decayed, (I - beta k k^T) contracts) across tokens and read
        the same way;
      - o's relative error is its energy over the recorded |o_h|^2: large where q_t meets little
        of the state (the cancellation no constant covers); the gated norm passes it on (scale-
        invariant) with its roundings, the gate z adds its own path (the activation's slope);
      - over the heads, relative to the whole normed output n: sum_h |dn_h|^2 / sum_h |n_h|^2;
        out_proj, a random linear map, keeps it, and rounds once more.
    The recurrent state, its error energy and the conv window carry across calls (a generate's
    decode steps continue the calls before them) until `reset`."""

    def __init__(self, mixer: torch.nn.Module) -> None:
        self.mixer = mixer
        self.kda = hasattr(mixer, "forget_gate")
        self.norm = mixer.o_norm if self.kda else mixer.norm
        self.norm_roundings = GATED_NORM_ROUNDINGS.get(type(self.norm).__name__, 1)
        self.out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._handles = [m.register_forward_hook(self._keep(n)) for n, m in self._sources()]
        self._handles.append(self.norm.register_forward_pre_hook(self._norm_in))
        self._handles.append(self.norm.register_forward_hook(self._gain))
        self.reset()

    def _sources(self) -> list:
        """(name, nn.Linear) of every projection the gain reads."""
        m = self.mixer
        if self.kda:
            gate = m.forget_gate
            names = ["q_proj", "k_proj", "v_proj", "b_proj"]
            pairs = [(n, getattr(m, n)) for n in names]
            pairs.append(("f", gate.f_b_proj if hasattr(gate, "f_b_proj") else gate.f_proj))
            return pairs + [("z", m.g_b_proj if hasattr(m, "g_b_proj") else m.g_proj)]
        if hasattr(m, "in_proj_qkvz"):  # Qwen3-Next
            return [("in_proj_qkvz", m.in_proj_qkvz), ("in_proj_ba", m.in_proj_ba)]
        names = ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"]
        return [(n, getattr(m, n)) for n in names]

    def reset(self) -> None:
        """Forget the state and the conv window: the next call starts new sequences."""
        self.state: torch.Tensor | None = None  # [B, H, dk, dv] fp32
        self.energy: torch.Tensor | None = None  # [2, B, H]: the state's error energy
        self.window: torch.Tensor | None = None  # [B, 3C, kernel - 1]: pre-conv values, energies
        self.gain: torch.Tensor | None = None
        self.roundings: torch.Tensor | None = None

    def remove(self) -> None:
        for h in self._handles:
            h.remove()

    def _keep(self, name: str):
        def hook(module, args, output):
            x, p = args[0].detach().float(), output.detach().float()
            w2 = module.weight.detach().float().pow(2)
            # an error spread in a random direction (|x|^2 |W_i|^2 / N) or one relative per
            # element, as roundings make (sum_j W_ij^2 x_j^2): the larger
            isotropic = x.pow(2).sum(-1, keepdim=True) * w2.sum(-1) / x.shape[-1]
            spread = torch.maximum(isotropic, x.pow(2) @ w2.T)
            # the projection rounds its output; a projection fed by another (Kimi-Linear's
            # f_a_proj -> f_b_proj, g_a_proj -> g_b_proj) also carries that one's rounding
            chained = name in ("f", "z") and self.kda and hasattr(self.mixer, "g_a_proj")
            self.out[name] = (p, _energy(spread, ROUND * (p**2 + (spread if chained else 0))))

        return hook

    def _norm_in(self, module, args) -> None:
        self.out["o"] = args[0].detach().float()

    def _inputs(self):
        """(pre-conv q|k|v [B, T, C] and its energy [2, B, T, C], log decay g [B, T, H, dk or 1]
        and its energy, beta [B, T, H] and its energy, the gate z [B, T, H * dv], its energy)."""
        m, out = self.mixer, self.out
        if self.kda:
            names = ("q_proj", "k_proj", "v_proj")
            qkv, e_qkv = (torch.cat([out[n][i] for n in names], dim=-1) for i in (0, 1))
            gate, heads, dk = m.forget_gate, m.num_heads, m.head_dim
            (f, e_f), (b, e_b) = out["f"], out["b_proj"]
            pre = f.reshape(*f.shape[:2], heads, dk) + gate.dt_bias.float().reshape(heads, dk)
            e_pre = e_f.reshape(2, *pre.shape)
            rate = gate.A_log.float().exp().reshape(heads, 1)
            if getattr(gate, "safe_gate", False):  # lower_bound * sigmoid(rate * pre)
                s = torch.sigmoid(rate * pre)
                g, slope = gate.lower_bound * s, gate.lower_bound * rate * s * (1 - s)
            else:  # -rate * softplus(pre)
                g, slope = -rate * F.softplus(pre), rate * torch.sigmoid(pre)
            z, e_z = out["z"]
        else:
            if "in_proj_qkvz" in out:  # the module's own reordering, on values and energies
                (qkvz, e_qkvz), (ba, e_ba) = out["in_proj_qkvz"], out["in_proj_ba"]
                parts = [m.fix_query_key_value_ordering(qkvz, ba)]
                parts += [m.fix_query_key_value_ordering(e_qkvz[i], e_ba[i]) for i in (0, 1)]
                flat = [[x.reshape(*x.shape[:2], -1) for x in p] for p in parts]
                qkv, e_qkv = flat[0][0:3], [f[0:3] for f in flat[1:]]
                qkv = torch.cat(qkv, dim=-1)
                e_qkv = torch.stack([torch.cat(e, dim=-1) for e in e_qkv])
                z, b, a = flat[0][3:]
                e_z, e_b, e_a = (torch.stack([f[i] for f in flat[1:]]) for i in (3, 4, 5))
            else:
                (qkv, e_qkv), (z, e_z) = out["in_proj_qkv"], out["in_proj_z"]
                (b, e_b), (a, e_a) = out["in_proj_b"], out["in_proj_a"]
            pre, e_pre = (a + m.dt_bias.float())[..., None], e_a[..., None]
            rate = m.A_log.float().exp()[:, None]
            g, slope = -rate * F.softplus(pre), rate * torch.sigmoid(pre)
        e_g = slope**2 * e_pre + _energy(0, ROUND * g**2)  # the gate may round its result
        beta = torch.sigmoid(b)
        e_beta = (beta * (1 - beta)) ** 2 * e_b + _energy(0, ROUND * beta**2)  # sigmoid rounds
        return qkv, e_qkv, g, e_g, beta, e_beta, z, e_z

    def _conv(self, qkv: torch.Tensor, e_qkv: torch.Tensor):
        """The mixer's causal depthwise conv and silu over this call's tokens, continuing the
        window of the calls before: (y [B, T, C], its energy [2, B, T, C])."""
        weight = self.mixer.conv1d.weight.float()  # [C, 1, kernel]
        x = torch.cat([qkv, e_qkv[0], e_qkv[1]], dim=-1).transpose(1, 2)
        if self.window is None:
            self.window = x.new_zeros(x.shape[0], x.shape[1], weight.shape[-1] - 1)
        x = torch.cat([self.window, x], dim=-1)
        self.window = x[..., x.shape[-1] - self.window.shape[-1] :]
        values, paths, rounds = x.chunk(3, dim=1)
        c = F.conv1d(values, weight, groups=weight.shape[0]).transpose(1, 2)
        e_c = [
            F.conv1d(e, weight**2, groups=weight.shape[0]).transpose(1, 2) for e in (paths, rounds)
        ]
        y = F.silu(c)
        # the conv rounds its output, and silu rounds again (bf16)
        e_c = _energy(e_c[0], e_c[1] + ROUND * c**2)
        return y, _silu_slope(c) ** 2 * e_c + _energy(0, ROUND * y**2)

    def _heads(self, y: torch.Tensor, e_y: torch.Tensor):
        """Post-conv q|k|v and energies -> q, k [B, T, H, dk] (l2-normed, q scaled by dk^-1/2),
        v [B, T, H, dv]; relative energies of q, k and absolute of v, [2, B, T, H] each."""
        m = self.mixer
        if self.kda:
            dims, dk, dv, rep = [m.qkv_dim] * 3, m.head_dim, m.head_dim, 1
        else:
            dims, dk, dv = [m.key_dim, m.key_dim, m.value_dim], m.head_k_dim, m.head_v_dim
            rep = m.num_v_heads // m.num_k_heads
        shape = y.shape[:2]
        parts = []
        for t, e, width in zip(y.split(dims, -1), e_y.split(dims, -1), (dk, dk, dv)):
            parts += [t.reshape(*shape, -1, width), e.reshape(2, *shape, -1, width).sum(-1)]
        q, eq, k, ek, v, ev = parts
        eq, ek = eq / q.pow(2).sum(-1), ek / k.pow(2).sum(-1)
        if rep > 1:
            q, k = (x.repeat_interleave(rep, dim=2) for x in (q, k))
            eq, ek = (x.repeat_interleave(rep, dim=3) for x in (eq, ek))
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) / dk**0.5
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        return q, k, v, eq, ek, ev

    def core_error(self, qkv, e_qkv, g, e_g, beta, e_beta) -> torch.Tensor:
        """This call's error energy of the core output o, [2, B, T, H], advancing the carried
        state (its values and its error energy)."""
        q, k, v, eq, ek, ev = self._heads(*self._conv(qkv, e_qkv))
        batch, tokens, heads, dk = k.shape
        if self.state is None:
            self.state = k.new_zeros(batch, heads, dk, v.shape[-1])
            self.energy = k.new_zeros(2, batch, heads)
        state, energy, errs = self.state, self.energy, []
        for t in range(tokens):
            qt, kt, bt = q[:, t], k[:, t], beta[:, t]
            prev = state * g[:, t].exp()[..., None]  # S' [B, H, dk, dv]
            w = v[:, t] - torch.einsum("bhkv,bhk->bhv", prev, kt)  # v - S'^T k
            state = prev + kt[..., None] * (bt[..., None] * w)[..., None, :]
            kq, q2 = (kt * qt).sum(-1), (qt * qt).sum(-1)
            s2, p2, w2 = state.pow(2).sum((-2, -1)), prev.pow(2).sum((-2, -1)), w.pow(2).sum(-1)
            p = qt - (bt * kq)[..., None] * kt  # (I - beta k k^T) q
            rows = prev.pow(2).sum(-1)  # |S'_c|^2 per key channel
            e_gt = e_g[:, :, t]
            if self.kda:  # an independent error per key channel of the decay
                decay_o = (e_gt * p**2 * rows).sum(-1)
            else:  # one per head: o moves by dg * S'^T (I - beta k k^T) q exactly
                decay_o = e_gt[..., 0] * torch.einsum("bhkv,bhk->bhv", prev, p).pow(2).sum(-1)
            carried = (2 * g[:, t]).exp().amax(-1) * energy
            k_terms = 2 * ek[:, :, t] * bt**2 / dk  # dk's two terms (erase, write): correlated
            err = eq[:, :, t] * q2 * s2 / dk + ev[:, :, t] * (bt * kq) ** 2
            err = err + e_beta[:, :, t] * kq**2 * w2 + k_terms * (q2 * w2 + kq**2 * p2)
            errs.append(err + decay_o + carried * q2 / dk)
            energy = carried + ev[:, :, t] * bt**2 + e_beta[:, :, t] * w2
            energy = energy + k_terms * (w2 * dk + p2) + (e_gt * rows).sum(-1)
        self.state, self.energy = state, energy
        return torch.stack(errs, dim=2)

    def _gain(self, module, args, output) -> None:
        qkv, e_qkv, g, e_g, beta, e_beta, z, e_z = self._inputs()
        err = self.core_error(qkv, e_qkv, g, e_g, beta, e_beta)
        shape = err.shape[1:] + (-1,)
        o = self.out["o"].reshape(shape)
        n2 = output.detach().float().reshape(shape).pow(2).sum(-1)
        rounding = _energy(0, ROUND).view(2, 1, 1, 1)  # one rounding, per token and head
        rel = err / o.pow(2).sum(-1) + rounding  # o rounds to bf16
        # the gate's path: n_i = m_i * act(z_i), m the normed o times the weight
        m = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.norm.variance_epsilon)
        m = m * self.norm.weight.float()
        slope = _gate_slope(getattr(self.norm, "activation", "silu"), z.reshape(o.shape))
        gate = ((m * slope).pow(2) * e_z.reshape(2, *o.shape)).sum(-1)
        dn2 = n2 * (rel + rounding * self.norm_roundings) + gate
        whole = dn2.sum(-1) / n2.sum(-1)
        self.gain = whole[0].reshape(-1).cpu()
        self.roundings = (whole[1] + ROUND).reshape(-1).cpu()  # out_proj rounds its output
