"""PyTorch reference CTR models with attention over a user-behaviour history: DIN and DIEN.

Both are written the way PyTorch users write them (deepctr-torch and the papers' reference code), with
seeded random weights, in eval mode:

- ``din``: user / target item / target category ids, a padded history of item and category ids [B, T] and
  its length [B]. Embeddings (18) → local activation unit (MLP 80-40 over concat[q, k, q-k, q*k],
  [B, T, 4C] → one score per position) → padded positions' scores set to 0 (no softmax, as in the paper
  and deepctr-torch's default), weighted sum → MLP 200-80 with Dice (BatchNorm-style running
  statistics) → sigmoid. Works for any history length
  (``has_sequence=True``).
- ``dien``: the same inputs. History embeddings (36) → interest extraction with ``nn.GRU`` (the ONNX GRU
  op with both torch exporters) → attention of the target over the GRU outputs (masked softmax) →
  interest evolution with an ``AUGRUCell`` unrolled over the T steps in a Python loop (updates masked past
  each row's length) → BatchNorm + MLP 200-80 with PReLU → sigmoid. The export fixes T
  (``has_sequence=False``): the builder's ``seq_len`` decides it.

The feeds ``sample`` produces: ids inside their tables, history lengths in [0, T] with an empty and a full
history when batch >= 2, padded history ids 0.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from .spec import Input, TorchModel

EMB = 18  # embedding dim of every table
N_USERS = 1000
N_ITEMS = 5000  # id 0 is the padding id of histories
N_CATES = 100
OUTPUTS = ["ctr"]


# --------------------------------------------------------------------------------------------- layers


class Dice(nn.Module):
    """Data-adaptive activation of DIN (deepctr-torch's ``Dice`` for 2-D inputs).

    p = sigmoid(BN(x)) with the running statistics in eval mode; out = p * x + (1 - p) * alpha * x.
    """

    def __init__(self, dim: int, eps: float = 1e-8):
        super().__init__()
        self.bn = nn.BatchNorm1d(dim, eps=eps, affine=False)
        self.alpha = nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        p = torch.sigmoid(self.bn(x))
        return p * x + (1 - p) * self.alpha * x


class LocalActivationUnit(nn.Module):
    """DIN's attention unit: MLP over concat[q, k, q-k, q*k] → one score per history position."""

    def __init__(self, dim: int, hidden=(80, 40)):
        super().__init__()
        layers, d = [], 4 * dim
        for h in hidden:
            layers += [nn.Linear(d, h), nn.Sigmoid()]
            d = h
        self.mlp = nn.Sequential(*layers)
        self.out = nn.Linear(d, 1)

    def forward(self, query, keys):
        # query [B, C], keys [B, T, C] -> scores [B, T]
        q = query.unsqueeze(1).expand_as(keys)
        att_in = torch.cat([q, keys, q - keys, q * keys], dim=-1)  # [B, T, 4C]
        return self.out(self.mlp(att_in)).squeeze(-1)


def masked_softmax(scores, mask):
    """DIN/DIEN reference code: padded positions get -2**32 + 1, then softmax over the history."""
    paddings = torch.full_like(scores, -(2.0**32) + 1)
    return torch.softmax(torch.where(mask, scores, paddings), dim=-1)


def history_mask(hist_len, seq_len: int | torch.Tensor, like):
    positions = torch.arange(seq_len, device=like.device).unsqueeze(0)  # [1, T]
    return positions < hist_len.unsqueeze(1)  # [B, T] bool


class AUGRUCell(nn.Module):
    """GRU with attentional update gate (DIEN's interest evolution; deepctr-torch ``AUGRUCell``)."""

    def __init__(self, input_size: int, hidden_size: int):
        super().__init__()
        self.weight_ih = nn.Parameter(torch.empty(3 * hidden_size, input_size))
        self.weight_hh = nn.Parameter(torch.empty(3 * hidden_size, hidden_size))
        self.bias_ih = nn.Parameter(torch.empty(3 * hidden_size))
        self.bias_hh = nn.Parameter(torch.empty(3 * hidden_size))
        bound = 1.0 / hidden_size**0.5
        for w in self.parameters():
            nn.init.uniform_(w, -bound, bound)

    def forward(self, x, hx, att):
        # x [B, I], hx [B, H], att [B, 1]
        gi = F.linear(x, self.weight_ih, self.bias_ih)
        gh = F.linear(hx, self.weight_hh, self.bias_hh)
        i_r, i_u, i_c = gi.chunk(3, 1)
        h_r, h_u, h_c = gh.chunk(3, 1)
        r = torch.sigmoid(i_r + h_r)
        u = torch.sigmoid(i_u + h_u)
        c = torch.tanh(i_c + r * h_c)
        u = att * u
        return (1.0 - u) * hx + u * c


# --------------------------------------------------------------------------------------------- models


class _Embeddings(nn.Module):
    def __init__(self):
        super().__init__()
        self.user = nn.Embedding(N_USERS, EMB)
        self.item = nn.Embedding(N_ITEMS, EMB)
        self.cate = nn.Embedding(N_CATES, EMB)
        for e in (self.user, self.item, self.cate):
            nn.init.normal_(e.weight, std=0.5)

    def forward(self, user_id, item_id, cate_id, hist_item_id, hist_cate_id):
        user = self.user(user_id)  # [B, 18]
        target = torch.cat([self.item(item_id), self.cate(cate_id)], dim=-1)  # [B, 36]
        hist = torch.cat([self.item(hist_item_id), self.cate(hist_cate_id)], dim=-1)  # [B, T, 36]
        return user, target, hist


class DIN(nn.Module):
    def __init__(self):
        super().__init__()
        c = 2 * EMB
        self.emb = _Embeddings()
        self.attention = LocalActivationUnit(c)
        self.fc1 = nn.Linear(EMB + 3 * c, 200)
        self.act1 = Dice(200)
        self.fc2 = nn.Linear(200, 80)
        self.act2 = Dice(80)
        self.out = nn.Linear(80, 1)

    def forward(self, user_id, item_id, cate_id, hist_item_id, hist_cate_id, hist_len):
        user, target, hist = self.emb(user_id, item_id, cate_id, hist_item_id, hist_cate_id)
        mask = history_mask(hist_len, hist.shape[1], hist)
        # DIN keeps the raw activations (no softmax, "to reserve the intensity of user interests"):
        # padded positions get weight 0, so an empty history gives a zero interest vector.
        scores = self.attention(target, hist)  # [B, T]
        weights = torch.where(mask, scores, torch.zeros_like(scores))
        interest = torch.bmm(weights.unsqueeze(1), hist).squeeze(1)  # [B, 36]
        x = torch.cat([user, target, interest, target * interest], dim=-1)
        x = self.act1(self.fc1(x))
        x = self.act2(self.fc2(x))
        return torch.sigmoid(self.out(x)).squeeze(-1)


class DIEN(nn.Module):
    def __init__(self, seq_len: int):
        super().__init__()
        c = 2 * EMB
        self.seq_len = seq_len
        self.emb = _Embeddings()
        self.interest_extractor = nn.GRU(c, c, batch_first=True)
        self.attention = LocalActivationUnit(c)
        self.interest_evolution = AUGRUCell(c, c)
        self.bn = nn.BatchNorm1d(EMB + 2 * c)
        self.fc1 = nn.Linear(EMB + 2 * c, 200)
        self.act1 = nn.PReLU(200)
        self.fc2 = nn.Linear(200, 80)
        self.act2 = nn.PReLU(80)
        self.out = nn.Linear(80, 1)

    def forward(self, user_id, item_id, cate_id, hist_item_id, hist_cate_id, hist_len):
        user, target, hist = self.emb(user_id, item_id, cate_id, hist_item_id, hist_cate_id)
        # Interest extraction over the padded history: the GRU is causal, so the outputs at t < length
        # do not depend on the padding; later ones are masked below.
        interests, _ = self.interest_extractor(hist)  # [B, T, 36]
        mask = history_mask(hist_len, self.seq_len, hist)  # [B, T]
        att = masked_softmax(self.attention(target, interests), mask)  # [B, T]
        h = torch.zeros_like(target)
        for t in range(self.seq_len):  # unrolled: the export has one AUGRU cell per step
            h_new = self.interest_evolution(interests[:, t], h, att[:, t : t + 1])
            h = torch.where(mask[:, t : t + 1], h_new, h)
        x = self.bn(torch.cat([user, target, h], dim=-1))
        x = self.act1(self.fc1(x))
        x = self.act2(self.fc2(x))
        return torch.sigmoid(self.out(x)).squeeze(-1)


# --------------------------------------------------------------------------------------------- builders


def _randomise(module: nn.Module, gen: torch.Generator, gain: float) -> None:
    """Weights as after training: Linear layers N(0, gain^2 / fan_in) (so the CTR spreads over (0, 1)
    instead of sitting at 0.5), non-trivial BatchNorm running statistics and affine terms, Dice alphas."""
    for m in module.modules():
        if isinstance(m, nn.Linear):
            m.weight.data.copy_(torch.randn(m.weight.shape, generator=gen) * gain / m.in_features**0.5)
            m.bias.data.copy_(0.1 * torch.randn(m.bias.shape, generator=gen))
        elif isinstance(m, nn.BatchNorm1d):
            n = m.num_features
            m.running_mean.copy_(0.2 * torch.randn(n, generator=gen))
            m.running_var.copy_(0.5 + torch.rand(n, generator=gen))
            if m.affine:
                m.weight.data.copy_(1.0 + 0.1 * torch.randn(n, generator=gen))
                m.bias.data.copy_(0.1 * torch.randn(n, generator=gen))
        elif isinstance(m, Dice):
            m.alpha.data.copy_(0.25 + 0.1 * torch.randn(m.alpha.shape, generator=gen))


def _inputs(seq_len) -> list[Input]:
    return [
        Input("user_id", np.dtype(np.int64), (None,)),
        Input("item_id", np.dtype(np.int64), (None,)),
        Input("cate_id", np.dtype(np.int64), (None,)),
        Input("hist_item_id", np.dtype(np.int64), (None, seq_len)),
        Input("hist_cate_id", np.dtype(np.int64), (None, seq_len)),
        Input("hist_len", np.dtype(np.int64), (None,)),
    ]


def sample(batch: int, seq_len: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Valid feeds for DIN / DIEN: ids inside their tables, padded histories consistent with lengths."""
    lengths = rng.integers(0, seq_len + 1, size=batch)
    if batch >= 2:
        lengths[0], lengths[1] = 0, seq_len
    valid = np.arange(seq_len)[None, :] < lengths[:, None]
    hist_item = np.where(valid, rng.integers(1, N_ITEMS, size=(batch, seq_len)), 0)
    hist_cate = np.where(valid, rng.integers(1, N_CATES, size=(batch, seq_len)), 0)
    return {
        "user_id": rng.integers(0, N_USERS, size=batch).astype(np.int64),
        "item_id": rng.integers(1, N_ITEMS, size=batch).astype(np.int64),
        "cate_id": rng.integers(1, N_CATES, size=batch).astype(np.int64),
        "hist_item_id": hist_item.astype(np.int64),
        "hist_cate_id": hist_cate.astype(np.int64),
        "hist_len": lengths.astype(np.int64),
    }


def din(seq_len: int = 100, seed: int = 0) -> TorchModel:
    """DIN; the export works for any history length (``seq_len`` only sets the default of ``sample``)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        module = DIN()
    with torch.no_grad():
        _randomise(module, gen, gain=1.5)
    module.eval()
    return TorchModel(module, _inputs(None), list(OUTPUTS), sample, has_sequence=True)


def dien(seq_len: int = 100, seed: int = 0) -> TorchModel:
    """DIEN with the AUGRU unrolled over ``seq_len`` steps (the export fixes the history length)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        module = DIEN(seq_len)
    with torch.no_grad():
        _randomise(module, gen, gain=1.5)
    module.eval()

    def sample_fixed(batch: int, n: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
        if n != seq_len:
            raise ValueError(f"this DIEN was built for a history of {seq_len} steps, not {n}")
        return sample(batch, n, rng)

    return TorchModel(module, _inputs(seq_len), list(OUTPUTS), sample_fixed, has_sequence=False)
