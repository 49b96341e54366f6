"""GAT with the same initial weights and PyG's math, trained with the package's hashed dropout masks or with
masks from torch's generator: does the masks' source change the accuracy? (issue 32)

A plain-torch replay of ``lightning_dorylus.models.GAT`` (``torch.manual_seed(seed)`` then ``GAT(...)``: the
recipe's initial weights) with PyG's ``examples/gat.py`` forward: dropout on the features, on each edge's
attention per head after the softmax (both layers) and on the ELU output. ``--masks`` picks each site's source
in forward order (features, attention 1, hidden, attention 2): ``h`` the package's hash keyed like the model
(``dropout_key(seed, epoch, step, site)``, global vertex and edge ids), ``t`` torch's generator. With ``hhhh``
it reproduces the package's runs (Cora seeds 0 and 1: 81.4, 81.8 as the 2-server recipe; CiteSeer seeds 0-9:
71.41 +- 0.59 as ``strategy="auto"``), at a fraction of the cost. Per seed it prints the test accuracy of the
best validation epoch and the mean test accuracy over epochs 100-199 (less noisy: no single selected epoch).

``--sparse`` drops and multiplies only the features' nonzeros (the same hashed masks, no dense mask or
product; torch's masks then come from another stream), ``--init pyg`` starts from PyG's
``examples/gat.py`` weights for the same seed, ``--salt S`` keys the hashed masks by ``seed + S`` (other
draws of the same hash: does the hash itself cost accuracy, or did these seeds draw badly?).

    python benchmarks/gat_masks.py --masks hhhh --seeds 0-9 [--dataset CiteSeer --data DIR] [--sparse]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor
from torch_geometric.data import Data
from torch_geometric.utils import add_self_loops, remove_self_loops, softmax

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.pyg_gat import PyGGAT, planetoid  # noqa: E402
from lightning_dorylus.models import GAT  # noqa: E402
from lightning_dorylus.nn.dropout import dropout_key, dropout_mask, entry_hashes  # noqa: E402

P = 0.6


def attention_layer(h: Tensor, att_src: Tensor, att_dst: Tensor, bias: Tensor, edges: Tensor,
                    keep: Tensor | None, concat: bool) -> Tensor:
    """PyG's ``GATConv`` after its projection ``h (n, H*C)``; ``keep (E, H)`` scales the attention."""
    src, dst = edges
    n, (heads, channels) = h.size(0), att_src.shape
    hv = h.view(n, heads, channels)
    score = F.leaky_relu((hv * att_src).sum(-1)[src] + (hv * att_dst).sum(-1)[dst], 0.2)
    attention = softmax(score, dst, num_nodes=n)
    if keep is not None:
        attention = attention * keep
    out = torch.zeros_like(hv).index_add_(0, dst, attention[:, :, None] * hv[src])
    return (out.reshape(n, heads * channels) if concat else out.mean(1)) + bias


class Nonzeros:
    """The features' nonzero pattern as CSR index arrays, row-major and transposed (``perm`` takes
    row-major values to column-major order)."""

    def __init__(self, rows: Tensor, cols: Tensor, shape: torch.Size) -> None:
        n, f = shape
        self.shape = (n, f)
        self.crow = torch.searchsorted(rows, torch.arange(n + 1))
        self.col = cols
        self.perm = torch.argsort(cols * n + rows)
        self.ccol = torch.searchsorted(cols[self.perm], torch.arange(f + 1))
        self.row = rows[self.perm]


class SparseProduct(torch.autograd.Function):
    """``X W`` for ``X`` given as its nonzeros' ``values`` (no gradient) on a :class:`Nonzeros` pattern;
    the backward ``X^T dY`` through the transposed CSR (no sort per step)."""

    @staticmethod
    def forward(ctx, values: Tensor, nz: Nonzeros, weight: Tensor) -> Tensor:
        ctx.save_for_backward(values)
        ctx.nz = nz
        return torch.sparse_csr_tensor(nz.crow, nz.col, values, nz.shape) @ weight

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[None, None, Tensor]:
        (values,), nz = ctx.saved_tensors, ctx.nz
        transposed = torch.sparse_csr_tensor(nz.ccol, nz.row, values[nz.perm], nz.shape[::-1])
        return None, None, transposed @ grad


def initial_weights(data: Data, seed: int, init: str) -> list[Tensor]:
    """``[W1 (F, H*C), att_src1 (H, C), att_dst1, b1, W2, att_src2, att_dst2, b2]`` after
    ``torch.manual_seed(seed)``: the package's ``GAT`` (``init="package"``) or PyG's ``examples/gat.py``
    model (``init="pyg"``, :class:`benchmarks.pyg_gat.PyGGAT`, in the package's layout)."""
    torch.manual_seed(seed)
    classes = int(data.y.max()) + 1
    if init == "package":
        model = GAT(data.num_features, 8, classes)
        convs = [(c.weight, c.att_src, c.att_dst, c.bias) for c in (model.conv1, model.conv2)]
    else:
        pyg = PyGGAT(data.num_features, classes)
        convs = [(c.lin.weight.t(), c.att_src[0], c.att_dst[0], c.bias) for c in (pyg.conv1, pyg.conv2)]
    return [t.detach().clone().contiguous().requires_grad_() for conv in convs for t in conv]


def run(data: Data, seed: int, masks: str, init: str = "package", sparse: bool = False,
        salt: int = 0, epochs: int = 200) -> tuple[float, float]:
    """(best-validation-epoch test accuracy, mean test accuracy over epochs 100..) of one seed.

    ``sparse``: the features' dropout and product over their nonzeros only (the package's hashed masks are
    the same entries; the product sums in another order, so a seed's figures can move by a vertex or two,
    and torch's masks are drawn for the nonzeros only): CiteSeer's features are 0.85 % nonzero.
    ``salt``: hashed masks keyed by ``seed + salt`` (other draws of the same hash; 0: the package's)."""
    n = data.num_nodes
    edges, _ = add_self_loops(remove_self_loops(data.edge_index)[0], num_nodes=n)
    ids = {"vertex": torch.arange(n), "edge": edges[0] * n + edges[1]}  # the package's global ids
    params = initial_weights(data, seed, init)
    w1, as1, ad1, b1, w2, as2, ad2, b2 = params
    optimizer = torch.optim.Adam(params, lr=0.005, weight_decay=5e-4)
    gen = torch.Generator().manual_seed(seed + 1000)

    def keep(epoch: int, site: int, kind: str, width: int) -> Tensor:
        rows = ids[kind]
        if masks[site] == "h":
            return dropout_mask(rows, width, P, dropout_key(seed + salt, epoch, epoch, site), torch.float32)
        return (torch.rand(rows.numel(), width, generator=gen) >= P).float() / (1 - P)

    nz_rows, nz_cols = data.x.nonzero(as_tuple=True)
    nz_values = data.x[nz_rows, nz_cols]
    nonzeros = Nonzeros(nz_rows, nz_cols, data.x.shape)

    def sparse_keep(epoch: int) -> Tensor:
        """The features' scaled mask at their nonzeros (site 0)."""
        if masks[0] == "h":
            hashed = entry_hashes(dropout_key(seed + salt, epoch, epoch, 0), ids["vertex"], nz_rows, nz_cols)
            kept = hashed >= round(P * 2**32) - 2**31  # dropout._keep's threshold
        else:
            kept = torch.rand(nz_values.numel(), generator=gen) >= P
        return kept.float() / (1 - P)

    def project(epoch: int | None) -> Tensor:
        """Layer 1's ``dropout(x) @ W1``."""
        if not sparse:
            x = data.x * keep(epoch, 0, "vertex", data.num_features) if epoch is not None else data.x
            return x @ w1
        values = nz_values * sparse_keep(epoch) if epoch is not None else nz_values
        return SparseProduct.apply(values, nonzeros, w1)

    def forward(epoch: int | None) -> Tensor:
        drop = epoch is not None
        att1 = keep(epoch, 1, "edge", 8) if drop else None
        h = F.elu(attention_layer(project(epoch), as1, ad1, b1, edges, att1, concat=True))
        h = h * keep(epoch, 2, "vertex", h.size(1)) if drop else h
        att2 = keep(epoch, 3, "edge", 1) if drop else None
        return attention_layer(h @ w2, as2, ad2, b2, edges, att2, concat=False)

    best_val, test_at_best, late = -1.0, 0.0, []
    for epoch in range(epochs):
        optimizer.zero_grad()
        out = forward(epoch)
        F.cross_entropy(out[data.train_mask], data.y[data.train_mask]).backward()
        optimizer.step()
        with torch.no_grad():
            pred = forward(None).argmax(1)
        val, test = (float((pred[m] == data.y[m]).float().mean()) for m in (data.val_mask, data.test_mask))
        if val > best_val:
            best_val, test_at_best = val, test
        if epoch >= epochs // 2:
            late.append(test)
    return test_at_best, statistics.mean(late)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--masks", default="hhhh", help="per site (features, att 1, hidden, att 2): h or t")
    parser.add_argument("--seeds", default="0-9", help="first-last")
    parser.add_argument("--init", default="package", choices=("package", "pyg"),
                        help="initial weights: the package's GAT or PyG's examples/gat.py, same seed")
    parser.add_argument("--sparse", action="store_true",
                        help="features' dropout and product over their nonzeros (fast; see run())")
    parser.add_argument("--salt", type=int, default=0,
                        help="hashed masks keyed by seed + SALT (0: the package's)")
    parser.add_argument("--dataset", default="Cora", choices=("Cora", "CiteSeer", "PubMed"))
    parser.add_argument("--data", type=Path, default=REPO / "data",
                        help="folder holding planetoid/<Name>/raw")
    parser.add_argument("--processed", type=Path, default=REPO / ".cache" / "gat_masks")
    args = parser.parse_args()
    if len(args.masks) != 4 or set(args.masks) - {"h", "t"}:
        parser.error(f"--masks {args.masks!r}: expected 4 letters h or t (features, att 1, hidden, att 2)")
    torch.set_num_threads(1)
    data = planetoid(args.data / "planetoid", args.dataset, args.processed)
    first, last = map(int, args.seeds.split("-"))
    results = []
    for seed in range(first, last + 1):
        results.append(run(data, seed, args.masks, args.init, args.sparse, args.salt))
        print(f"seed {seed}: best-val test {100 * results[-1][0]:.1f}  late mean {100 * results[-1][1]:.2f}",
              flush=True)
    for name, values in (("best-val test", [r[0] for r in results]), ("late mean", [r[1] for r in results])):
        pct = [100 * v for v in values]
        std = statistics.stdev(pct) if len(pct) > 1 else 0.0
        print(f"{args.dataset} masks={args.masks} init={args.init} salt={args.salt} {name}: "
              f"{statistics.mean(pct):.2f} +- {std:.2f}")


if __name__ == "__main__":
    main()
