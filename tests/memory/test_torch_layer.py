"""SV attention in PyTorch: gradcheck of the exact implicit backward, the approximation gap, learned keys."""
import numpy as np
import pytest
import torch

from cohorts.encoder_data import encode, training_windows
from memory import SVMemory, verify_against_refit
from memory.encoder import EncoderTraining, EventEncoder, evaluate_loss, train_encoder
from memory.torch_layer import (SVAttention, SVCoefficients, approximation_gap, batched_sv_coefficients,
                                project_capped_simplex, rbf_torch)


def keys(regime, n=14, d=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    if regime == "random":
        X = torch.randn(n, d, generator=g, dtype=torch.float64)
    else:
        centers = 2.0 * torch.randn(3, d, generator=g, dtype=torch.float64)
        X = centers[torch.randint(0, 3, (n,), generator=g)] + 0.3 * torch.randn(n, d, generator=g,
                                                                                 dtype=torch.float64)
    return X.requires_grad_(True)


@pytest.mark.parametrize("regime", ["random", "clustered"])
@pytest.mark.parametrize("seed", [0, 1])
def test_gradcheck_of_the_exact_path(regime, seed):
    X = keys(regime, seed=seed)
    g = torch.Generator().manual_seed(seed + 10)
    V = torch.randn(14, 2, generator=g, dtype=torch.float64, requires_grad=True)
    Q = torch.randn(5, 3, generator=g, dtype=torch.float64, requires_grad=True)
    att = SVAttention(C=1 / 5, gamma=0.5, exact=True)
    assert torch.autograd.gradcheck(lambda x, v, q: att(x, v, q), (X, V, Q), eps=1e-6, atol=1e-6, rtol=1e-5)
    assert torch.autograd.gradcheck(lambda x: SVCoefficients.apply(x, 1 / 5, 0.5), (X,), eps=1e-6, atol=1e-6)


def test_coefficient_gradient_matches_finite_differences_of_the_exact_solver():
    X = keys("random", seed=3).detach()
    w = torch.randn(14, dtype=torch.float64, generator=torch.Generator().manual_seed(4))

    def loss_np(Xn):
        mem = SVMemory(C=1 / 5, gamma=0.5)
        for i, x in enumerate(Xn):
            mem.add(x, token_id=i)
        a = mem.alpha_
        return float(sum(w[i] * a[i] for i in range(len(Xn))) + mem.rho_)

    Xg = X.clone().requires_grad_(True)
    a, rho = SVCoefficients.apply(Xg, 1 / 5, 0.5)
    ((a * w).sum() + rho).backward()
    Xn = X.numpy()
    fd = np.zeros_like(Xn)
    h = 1e-6
    for i in range(Xn.shape[0]):
        for j in range(Xn.shape[1]):
            P, M = Xn.copy(), Xn.copy()
            P[i, j] += h
            M[i, j] -= h
            fd[i, j] = (loss_np(P) - loss_np(M)) / (2 * h)
    np.testing.assert_allclose(Xg.grad.numpy(), fd, atol=1e-6)


def test_duplicate_keys_share_their_gradient():
    X = keys("random", n=10, seed=5).detach()
    X = torch.cat([X, X[:2]]).requires_grad_(True)  # two exact copies
    a, _ = SVCoefficients.apply(X, 1 / 4, 0.5)
    assert a[0] == a[10] and a[1] == a[11]
    (a * torch.arange(12, dtype=torch.float64)).sum().backward()
    assert torch.all(torch.isfinite(X.grad))


def test_projection_and_batched_solver_stay_feasible_and_close_to_exact():
    y = torch.randn(7, 20, dtype=torch.float64)
    p = project_capped_simplex(y, 0.1)
    assert torch.allclose(p.sum(-1), torch.ones(7, dtype=torch.float64), atol=1e-10)
    assert (p >= 0).all() and (p <= 0.1 + 1e-12).all()
    for regime in ("random", "clustered"):
        X = keys(regime, n=30, seed=2).detach()
        a_gap, g_gap = approximation_gap(X, 1 / 6, 0.5, iters=200)
        assert a_gap < 5e-3 and g_gap < 5e-3
        coarse, _ = approximation_gap(X, 1 / 6, 0.5, iters=20)
        assert coarse >= a_gap * 0.5  # more iterations do not make it worse
    K = rbf_torch(torch.randn(4, 16, 3), torch.randn(4, 16, 3), 0.5)
    a = batched_sv_coefficients(K @ K.transpose(-1, -2) / 16 + 1e-3 * torch.eye(16), 1 / 4)
    assert a.shape == (4, 16) and torch.allclose(a.sum(-1), torch.ones(4), atol=1e-5)


@pytest.fixture(scope="module")
def windows(tmp_path_factory):
    from cohorts.definitions import load_config
    from pipeline.extract import extract
    from pipeline.generate import GeneratorConfig, generate
    src = generate(tmp_path_factory.mktemp("src"), GeneratorConfig(n_patients=20, seed=9))
    store = tmp_path_factory.mktemp("store")
    extract(src, store)
    return training_windows(store, load_config(), window=48)


def test_training_improves_the_selection_loss_and_the_encoder_round_trips(windows, tmp_path):
    (codes, feats, flags), keyer, events = windows
    torch.manual_seed(0)
    enc = EventEncoder([c for w in codes for c in w])
    before = evaluate_loss(enc, codes, feats, flags)
    enc, hist = train_encoder(codes, feats, flags, EncoderTraining(steps=60), encoder=enc, device=torch.device("cpu"))
    after = evaluate_loss(enc, codes, feats, flags)
    assert after < before - 0.05, (before, after)
    enc.save(tmp_path / "enc.pt")
    back = EventEncoder.load(tmp_path / "enc.pt")
    sample = events.head(100)
    assert np.array_equal(encode(enc, sample, keyer), encode(back, sample, keyer))
    # learned keys feed the exact memory, and decrement still agrees with a refit
    K = encode(back, events.head(120), keyer)
    mem = SVMemory(C=1 / 10, gamma=0.5)
    ids = [mem.add(k) for k in K]
    for t in sorted(mem.partition().margin)[:3]:
        mem.remove(t)
        assert verify_against_refit(mem).max_dev <= 1e-8
    del ids


def test_training_windows_do_not_depend_on_the_input_row_order(windows):
    from cohorts.encoder_data import make_windows
    _, keyer, events = windows
    a = make_windows(events, keyer, window=48)
    b = make_windows(events.sample(fraction=1.0, shuffle=True, seed=5), keyer, window=48)
    assert a[0] == b[0] and np.array_equal(a[1], b[1]) and np.array_equal(a[2], b[2])
