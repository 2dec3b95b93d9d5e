"""The fused per-tensor activation fake quantization of block reconstruction against the general one."""
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from oq.bridge.dropquant import coin, drop_quantize  # noqa: E402
from oq.bridge.fakequant import fake_quantize  # noqa: E402


def _data(seed=0, n=4000):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g, dtype=torch.float32) * 3.0
    x[:10] = torch.tensor([0.25, 0.75, -0.25, 12.5, 100.0, -100.0, 0.0, 6.35, 6.4, -6.45])  # ties, saturation
    return x


@pytest.mark.parametrize("zp,qmin,qmax", [(0, -128, 127), (0, -127, 127), (128, 0, 255), (3, -8, 7)])
def test_forward_matches_fake_quantize_bit_for_bit(zp, qmin, qmax):
    x = _data()
    scale = torch.tensor(0.05)
    want = fake_quantize(x, scale, float(zp), qmin, qmax)
    got = drop_quantize(x, scale, "fixed", qmin - zp, qmax - zp)
    assert torch.equal(got, want)
    got_log = drop_quantize(x, torch.log(scale), "log", qmin - zp, qmax - zp)
    assert torch.equal(got_log, fake_quantize(x, torch.exp(torch.log(scale)), float(zp), qmin, qmax))


def test_lsq_gradients_match_general_path():
    x = _data(1)
    p = torch.tensor(math.log(0.05), requires_grad=True)
    xa = x.clone().requires_grad_(True)
    weights = torch.linspace(-1, 1, x.numel())
    (drop_quantize(xa, p, "log", -128, 127) * weights).sum().backward()
    p2 = torch.tensor(math.log(0.05), requires_grad=True)
    xb = x.clone().requires_grad_(True)
    (fake_quantize(xb, torch.exp(p2), 0.0, -128, 127, method="lsq", grad_scale=1.0) * weights).sum().backward()
    assert torch.equal(xa.grad, xb.grad)
    assert p.grad.item() == pytest.approx(p2.grad.item(), rel=1e-4)
    assert p.grad.item() != 0.0


def test_power_of_two_gradients_match_general_path():
    x = _data(2)
    l1 = torch.tensor(-4.3, requires_grad=True)
    weights = torch.linspace(-1, 1, x.numel())
    y1 = drop_quantize(x, l1, "log2", -128, 127)
    (y1 * weights).sum().backward()
    l2 = torch.tensor(-4.3, requires_grad=True)
    y2 = fake_quantize(x, l2, 0.0, -128, 127, method="pot")
    (y2 * weights).sum().backward()
    assert torch.equal(y1, y2)  # scale 2^-4
    assert l1.grad.item() == pytest.approx(l2.grad.item(), rel=1e-4)


def test_dropped_values_pass_unquantized_and_carry_no_scale_gradient():
    x = _data(3)
    dropped = torch.zeros(x.shape, dtype=torch.bool)
    dropped[::3] = True
    p = torch.tensor(math.log(0.05), requires_grad=True)
    xa = x.clone().requires_grad_(True)
    weights = torch.linspace(-1, 1, x.numel())
    y = drop_quantize(xa, p, "log", -128, 127, dropped)
    (y * weights).sum().backward()
    assert torch.equal(y[dropped], x[dropped])
    assert torch.equal(y[~dropped], fake_quantize(x, torch.tensor(0.05).log().exp(), 0.0, -128, 127)[~dropped])
    assert torch.equal(xa.grad[dropped], weights[dropped])  # identity where dropped, saturated or not
    # the scale gradient is the general path's with the dropped values' upstream gradient removed
    p2 = torch.tensor(math.log(0.05), requires_grad=True)
    y2 = fake_quantize(x, torch.exp(p2), 0.0, -128, 127, method="lsq", grad_scale=1.0)
    (y2 * torch.where(dropped, 0.0, weights)).sum().backward()
    assert p.grad.item() == pytest.approx(p2.grad.item(), rel=1e-4)


def test_fixed_scale_has_input_gradient_only_and_unknown_kind_is_refused():
    x = _data(4).requires_grad_(True)
    y = drop_quantize(x, torch.tensor(0.05), "fixed", -128, 127)
    y.sum().backward()
    r = (x.detach() / 0.05).round()
    saturated = (r < -128) | (r > 127)
    assert saturated.sum() > 50
    assert torch.equal(x.grad, (~saturated).float())
    with pytest.raises(ValueError, match="unknown scale kind 'exp'"):
        drop_quantize(x, torch.tensor(0.05), "exp", -128, 127)


@pytest.mark.parametrize("p", [0.5, 0.25])
def test_coin_is_fair_deterministic_and_shaped(p):
    shape = (7, 3, 33, 17)  # not a multiple of 64 values
    a = coin(shape, p, torch.Generator().manual_seed(5))
    b = coin(shape, p, torch.Generator().manual_seed(5))
    c = coin(shape, p, torch.Generator().manual_seed(6))
    assert a.shape == shape and a.dtype == torch.bool
    assert torch.equal(a, b) and not torch.equal(a, c)
    big = coin((200_000,), p, torch.Generator().manual_seed(0)).numpy()
    assert abs(big.mean() - p) < 0.006
    if p == 0.5:  # every bit position of the unpacked words is fair (20000 draws each: 0.02 is 5.6 sigma)
        by_position = coin((1_280_000,), p, torch.Generator().manual_seed(1)).numpy().reshape(-1, 64).mean(axis=0)
        assert np.all(np.abs(by_position - 0.5) < 0.02)
        assert abs(np.mean(big[1:] == big[:-1]) - 0.5) < 0.006
