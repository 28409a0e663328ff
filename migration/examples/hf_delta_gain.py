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


def _gate(activation: str, x: torch.Tensor) -> torch.Tensor:
    """The gated norm's gate activation (silu or sigmoid)."""
    return torch.sigmoid(x) if activation == "sigmoid" else F.silu(x)


def _gate_slope(activation: str, x: torch.Tensor) -> torch.Tensor:
    """d act(x) / dx of the gated norm's gate activation (silu or sigmoid)."""
    if activation == "sigmoid":
        s = torch.sigmoid(x)
        return s * (1 - s)
    return _silu_slope(x)


def _full(t: torch.Tensor) -> torch.Tensor:
    """A detached fp32 copy of the whole tensor: a DTensor (a model transformers loaded with a TP
    plan shards the projections' weights) is gathered, which every rank does at the same hook."""
    t = t.detach()
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).float()


def _energy(path: torch.Tensor, rounding: torch.Tensor) -> torch.Tensor:
    """An error energy: [0] per unit of the input's squared relative error (the paths), [1] in
    u^2 (the mixer's own roundings); both propagate through the same first-order maps."""
    path, rounding = (torch.as_tensor(x, dtype=torch.float32) for x in (path, rounding))
    return torch.stack(torch.broadcast_tensors(path, rounding))


class DeltaGain:
    """Forward hooks on one delta-rule mixer's own submodules (its input projections, its gated
    norm, its output projection) that derive, per call and token, how the mixer's output error
    depends on its input's: |d out|^2 / |out|^2 <= `gain` * eps_in^2 + `roundings` * u^2 wherever
    the two models' inputs differ (eps_in: the input's relative error; `gain`, `roundings`: [B*T]
    fp32 each, of the last call).

    Error model (hf_moe_bound's own): a linear map passes its input's relative error on, spread
    over its outputs (output i of W x moves by eps |x| |W_i| / sqrt(N) for an error in a random
    direction, by eps sqrt(sum_j W_ij^2 x_j^2) for one relative per element: the larger of the
    two); independent errors add in quadrature (expected squared sizes, as every count of the
    bound); each bf16 rounding of a value that differs between the models adds ROUND u^2 at that
    value's size. Both kinds of energy (`_energy`: [0] per eps_in^2, [1] in u^2) go through the
    same first-order maps, per token t and head h, in fp32 from the recorded projections:
      - q, k, v: the causal conv over the last `kernel` tokens of their projection (its squared
        weights on the energies, times `kernel`: one token's error reaches `kernel` conv outputs
        that the state sums again, correlated), silu's slope, the conv's two roundings; q and k
        are l2-normed, so their relative (direction) error is their energy over |q|^2, |k|^2;
      - the decay's log (its gate's slope on its projection), beta = sigmoid(b) (beta (1 - beta));
      - the state S_t = (I - beta k k^T) S' + beta k v^T, S' = decay * S_{t-1}, recomputed, and
        its error's covariance in key space C_t (core_error): each source's first-order move of
        S_t (exact in q.k, |S'|, v - S'^T k and, for the decay, S' itself), carried through the
        same transition token by token; o = S_t^T q_t moves by q_t^T C_t q_t (the keys written
        need not be random against q: silu makes q and k share a direction) plus q's own
        direction error read through S_t (|S_t|_F^2 |dq|^2 / dk);
      - o's relative error is that over the recorded |o_h|^2: large where q_t meets little of the
        state, the cancellation no constant covers;
      - the gated norm n_i = o_i / rms(o) * weight_i * act(z_i): the normalised o's error lands on
        each element scaled by weight_i * act(z_i) (uneven weights and gates can make n small
        against it), the gate adds its own path (the activation's slope), the norm its roundings;
      - out = W n: E|W dn|^2 = sum_i |W_:i|^2 E[dn_i^2] over the recorded |out|^2, and out's
        rounding.
    The recurrent state, its error energy and the conv window carry across calls (a generate's
    decode steps continue the calls before them) until `reset`."""

    def __init__(self, mixer: torch.nn.Module) -> None:
        self.mixer = mixer
        self.kda = hasattr(mixer, "forget_gate")
        self.norm = mixer.o_norm if self.kda else mixer.norm
        self.norm_roundings = GATED_NORM_ROUNDINGS.get(type(self.norm).__name__, 1)
        self.out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._handles = [m.register_forward_hook(self._keep(n)) for n, m in self._sources()]
        out_proj = mixer.o_proj if self.kda else mixer.out_proj
        self._handles.append(self.norm.register_forward_pre_hook(self._norm_in))
        self._handles.append(out_proj.register_forward_hook(self._gain))
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
            x, p = _full(args[0]), _full(output)
            w2 = _full(module.weight).pow(2)
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
        self.out["o"] = _full(args[0])

    def _inputs(self):
        """(pre-conv q|k|v [B, T, C] and its energy [2, B, T, C], log decay g [B, T, H, dk or 1]
        and its energy, beta [B, T, H] and its energy, the gate z [B, T, H * dv], its energy)."""
        m, out = self.mixer, self.out
        if self.kda:
            names = ("q_proj", "k_proj", "v_proj")
            qkv, e_qkv = (torch.cat([out[n][i] for n in names], dim=-1) for i in (0, 1))
            gate, heads, dk = m.forget_gate, m.num_heads, m.head_dim
            (f, e_f), (b, e_b) = out["f"], out["b_proj"]
            pre = f.reshape(*f.shape[:2], heads, dk) + _full(gate.dt_bias).reshape(heads, dk)
            e_pre = e_f.reshape(2, *pre.shape)
            rate = _full(gate.A_log).exp().reshape(heads, 1)
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
            pre, e_pre = (a + _full(m.dt_bias))[..., None], e_a[..., None]
            rate = _full(m.A_log).exp()[:, None]
            g, slope = -rate * F.softplus(pre), rate * torch.sigmoid(pre)
        e_g = slope**2 * e_pre + _energy(0, ROUND * g**2)  # the gate may round its result
        beta = torch.sigmoid(b)
        e_beta = (beta * (1 - beta)) ** 2 * e_b + _energy(0, ROUND * beta**2)  # sigmoid rounds
        return qkv, e_qkv, g, e_g, beta, e_beta, z, e_z

    def _conv(self, qkv: torch.Tensor, e_qkv: torch.Tensor):
        """The mixer's causal depthwise conv and silu over this call's tokens, continuing the
        window of the calls before: (y [B, T, C], its energy [2, B, T, C])."""
        weight = _full(self.mixer.conv1d.weight)  # [C, 1, kernel]
        x = torch.cat([qkv, e_qkv[0], e_qkv[1]], dim=-1).transpose(1, 2)
        if self.window is None:
            self.window = x.new_zeros(x.shape[0], x.shape[1], weight.shape[-1] - 1)
        x = torch.cat([self.window, x], dim=-1)
        self.window = x[..., x.shape[-1] - self.window.shape[-1] :]
        values, paths, rounds = x.chunk(3, dim=1)
        # a token's projection error enters the conv outputs of `kernel` tokens, which the state
        # sums again: correlated, so their energies are taken `kernel` times (Cauchy-Schwarz over
        # the taps) instead of adding in quadrature
        c = F.conv1d(values, weight, groups=weight.shape[0]).transpose(1, 2)
        e_c = [
            weight.shape[-1] * F.conv1d(e, weight**2, groups=weight.shape[0]).transpose(1, 2)
            for e in (paths, rounds)
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
        state: its values S and its error's covariance in key space C [2, B, H, dk, dk] (an error
        dS of the state, summed over its value channels: E[dS dS^T], so that q reads
        E|dS^T q|^2 = q^T C q exactly, whatever the direction of q against the keys written)."""
        q, k, v, eq, ek, ev = self._heads(*self._conv(qkv, e_qkv))
        batch, tokens, heads, dk = k.shape
        if self.state is None:
            self.state = k.new_zeros(batch, heads, dk, v.shape[-1])
            self.energy = k.new_zeros(2, batch, heads, dk, dk)
        state, cov, errs = self.state, self.energy, []
        eye = torch.eye(dk)
        for t in range(tokens):
            qt, kt, bt = q[:, t], k[:, t], beta[:, t]
            decay = g[:, t].exp()  # [B, H, dk] (KDA) or [B, H, 1]
            prev = state * decay[..., None]  # S' [B, H, dk, dv]
            w = v[:, t] - torch.einsum("bhkv,bhk->bhv", prev, kt)  # v - S'^T k
            state = prev + kt[..., None] * (bt[..., None] * w)[..., None, :]
            # the transition of an error in the state: dS -> (I - beta k k^T) decay dS
            erase = eye - bt[..., None, None] * kt[..., :, None] * kt[..., None, :]
            move = erase * decay[..., None, :]  # [B, H, dk, dk]
            kk = kt[..., :, None] * kt[..., None, :]
            w2, p2 = w.pow(2).sum(-1), prev.pow(2).sum((-2, -1))
            # this token's sources, as key-space covariances (value energy times key outer product)
            new = (ev[:, :, t] * bt**2 + e_beta[:, :, t] * w2)[..., None, None] * kk
            # dk (relative eps_k, random, orthogonal to k) writes dk w^T and erases k (S'^T dk)^T:
            # two terms of one source, correlated: |a + b|^2 <= 2 (|a|^2 + |b|^2)
            ortho = (eye - kk) / (dk - 1)
            k_src = 2 * ek[:, :, t] * bt**2
            new = new + k_src[..., None, None] * (
                w2[..., None, None] * ortho + (p2 / dk)[..., None, None] * kk
            )
            if self.kda:  # an independent error per key channel of the decay
                rows = prev.pow(2).sum(-1)  # |S'_c|^2
                decay_cov = torch.diag_embed(e_g[:, :, t] * rows)
            else:  # one per head: dS = dg (I - beta k k^T) S'
                decay_cov = e_g[:, :, t, ..., :1, None] * (prev @ prev.transpose(-1, -2))
            cov = (
                move @ cov @ move.transpose(-1, -2)
                + new
                + erase @ decay_cov @ erase.transpose(-1, -2)
            )
            read = torch.einsum("cbhk,cbhkl,bhl->cbh", qt.expand(2, *qt.shape), cov, qt)
            s2, q2 = state.pow(2).sum((-2, -1)), (qt * qt).sum(-1)
            errs.append(read + eq[:, :, t] * q2 * s2 / dk)  # and q's own direction error
        self.state, self.energy = state, cov
        return torch.stack(errs, dim=2)

    def _gain(self, module, args, output) -> None:
        """out_proj's hook: this call's gain and roundings from the core error, through the gated
        norm (per element) and out_proj (its own columns, its own output)."""
        qkv, e_qkv, g, e_g, beta, e_beta, z, e_z = self._inputs()
        err = self.core_error(qkv, e_qkv, g, e_g, beta, e_beta)
        shape = err.shape[1:] + (-1,)
        o = self.out["o"].reshape(shape)
        rounding = _energy(0, ROUND).view(2, 1, 1, 1)  # one rounding, per token and head
        rel = err / o.pow(2).sum(-1) + rounding  # o's relative error; o rounds to bf16
        # n_i = m_i * act(z_i), m = o / rms(o) * weight: the normalised o's error (scale-
        # invariant) lands on every element alike, each scaled by its own weight * act(z_i)
        # (where the norm's weights and gates are uneven, n can be small against its error)
        normed = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.norm.variance_epsilon)
        weight, act, z = (
            _full(self.norm.weight),
            getattr(self.norm, "activation", "silu"),
            z.reshape(o.shape),
        )
        m = normed * weight
        n = m * _gate(act, z)
        # the normalised o's error per element: rel * its mean square (1 where |o|^2 / dv >> the
        # norm's epsilon: scale-invariant; below it the norm is linear in o and passes rel on)
        per_element = (rel * normed.pow(2).mean(-1))[..., None]
        dn2 = (weight * _gate(act, z)).pow(2) * per_element
        dn2 = dn2 + _energy(0, ROUND * self.norm_roundings * n**2)  # the norm's roundings
        dn2 = dn2 + (m * _gate_slope(act, z)).pow(2) * e_z.reshape(2, *o.shape)  # the gate
        # out = W n: E|W dn|^2 = sum_i |W_:i|^2 E[dn_i^2] for independent element errors
        columns = _full(module.weight).pow(2).sum(0)  # [H * dv]
        out2 = _full(output).pow(2).sum(-1).reshape(-1)  # |out|^2 per token
        moved = (dn2.flatten(3) @ columns).reshape(2, -1) / out2
        self.gain = moved[0].cpu()
        self.roundings = (moved[1] + ROUND).cpu()  # out_proj rounds its output
