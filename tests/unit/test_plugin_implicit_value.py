"""``plugins.implicit_value`` (VIMPO): the implied advantages against a double loop, the whitening against
``torch.std``, and bad settings named by key (the trainer's gradient and runs on the tiny model:
tests/integration/test_plugin_implicit_value_train.py)."""

from __future__ import annotations

import pytest
import torch

from meshrl.trainer import load_config
from meshrl.trainer.plugins.implicit_value import centred_rewards, implied_advantages, masked_whiten


def test_implied_advantages_equal_a_double_loop():
    g = torch.Generator().manual_seed(0)
    tau = torch.randn(3, 6, generator=g, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0], [0, 0, 0, 0, 0, 0]], dtype=torch.float64)
    for lam in (1.0, 0.7, 0.0):
        got = implied_advantages(tau * mask, mask, lam)
        for i in range(3):
            length = int(mask[i].sum())
            for t in range(6):
                want = sum(lam ** (k - t) * float(tau[i, k]) for k in range(t, length)) if t < length else 0.0
                assert float(got[i, t]) == pytest.approx(want, abs=1e-12)


def test_masked_whiten_and_centred_rewards():
    x = torch.tensor([[1.0, 2.0, 9.0], [4.0, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.float64)
    valid = torch.tensor([1.0, 2.0, 4.0], dtype=torch.float64)
    want = (valid - valid.mean()) / torch.sqrt(valid.std() ** 2 + 1e-8)  # torch.std is unbiased
    got = masked_whiten(x, mask)
    torch.testing.assert_close(got[mask > 0], want)
    assert float(got[0, 2]) == 0 and float(got[1, 1]) == 0
    assert masked_whiten(x, torch.zeros_like(mask)).abs().sum() == 0
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0], dtype=torch.float64)
    assert centred_rewards(r, ["a", "a", "b", "b", "a"]).tolist() == pytest.approx([1 / 3, -2 / 3, -0.5, 0.5, 1 / 3])


@pytest.mark.parametrize(("override", "key"), [
    ("plugins.implicit_value.beta=0", "plugins.implicit_value.beta"),
    ("plugins.implicit_value.actor_coef=-1", "plugins.implicit_value.actor_coef"),
    ("plugins.implicit_value.value_coef=0", "plugins.implicit_value.value_coef"),
    ("plugins.implicit_value.lam=1.5", "plugins.implicit_value.lam"),
])
def test_bad_settings_name_the_key(override, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        load_config(overrides=[override])


def test_a_second_kl_path_is_refused():
    with pytest.raises(ValueError, match=r"plugins\.implicit_value\.enabled needs algo\.kl_coef=0"):
        load_config(overrides=["plugins.implicit_value.enabled=true", "algo.kl_coef=0.01"])


def test_entropy_advantage_is_refused_beside_it():
    """entropy_adv's absolute bonus would dwarf VIMPO's advantages, which actor_coef scales by 5e-3."""
    from meshrl.trainer import load_config

    with pytest.raises(ValueError, match="plugins.implicit_value.enabled and plugins.entropy_adv.enabled exclude"):
        load_config(overrides=["plugins.implicit_value.enabled=true", "plugins.entropy_adv.enabled=true"])
