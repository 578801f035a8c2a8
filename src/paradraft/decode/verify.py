"""THE acceptance rule (one place): greedy and rejection-sampling verification, pure tensor functions, batched.

Shapes: B rows, K draft tokens per row, V target vocabulary.
"""

from __future__ import annotations

import torch


def greedy_accept(draft: torch.Tensor, target_argmax: torch.Tensor):
    """Temperature 0.

    draft [B, K], target_argmax [B, K+1] (the verifier's argmax after the prefix and after each draft).
    Draft i is accepted while draft[:, :i+1] == target_argmax[:, :i+1]; the verifier then contributes its own
    token at the first mismatch (the correction) or after all K (the bonus): out = target_argmax[b, n_b].
    -> (n_accepted [B], next_token [B]).
    """
    match = (draft == target_argmax[:, :-1]).int()  # [B, K]
    n = match.cumprod(dim=1).sum(dim=1)  # length of the all-equal prefix
    nxt = target_argmax.gather(1, n[:, None]).squeeze(1)
    return n, nxt


def rejection_accept(draft: torch.Tensor, q: torch.Tensor, p: torch.Tensor, generator: torch.Generator | None = None):
    """Temperature > 0 (Leviathan et al. 2023; Chen et al. 2023): lossless speculative sampling.

    draft [B, K] sampled from q [B, K, V]; p [B, K+1, V] the verifier's distributions (same processing as q).
    Draft x_i is accepted with probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection the verifier's token is
    drawn from norm(max(0, p_i - q_i)); if all K are accepted a bonus token is drawn from p_K. The emitted
    tokens are then distributed exactly as sampling from p one token at a time.
    -> (n_accepted [B], next_token [B]).
    """
    B, K = draft.shape
    px = p[:, :K].gather(2, draft[..., None]).squeeze(-1)  # [B, K]
    qx = q.gather(2, draft[..., None]).squeeze(-1)  # [B, K]
    u = torch.rand(B, K, generator=generator, device=draft.device)
    ok = (u * qx <= px).int()  # u < p/q without dividing by q (q(x) > 0: x was drawn from q)
    n = ok.cumprod(dim=1).sum(dim=1)  # [B]
    # residual distribution at the first rejected position; p_K itself when all were accepted
    q_pad = torch.cat([q, torch.zeros_like(p[:, :1])], dim=1)  # [B, K+1, V]
    idx = n[:, None, None].expand(B, 1, p.shape[-1])
    p_n, q_n = p.gather(1, idx).squeeze(1), q_pad.gather(1, idx).squeeze(1)  # [B, V]
    resid = torch.clamp(p_n - q_n, min=0)
    mass = resid.sum(-1, keepdim=True)
    resid = torch.where(mass > 0, resid / mass.clamp_min(1e-30), p_n)  # p == q: any token of p is exact
    nxt = torch.multinomial(resid, 1, generator=generator).squeeze(-1)
    return n, nxt
