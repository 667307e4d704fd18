"""Config loading: YAML, --set overrides, type coercion and errors that name the key."""

from __future__ import annotations

import pytest

from meshrl.trainer.config import RunConfig, load_config, parse_override


def test_defaults_validate_and_resolve_recipe():
    cfg = load_config()
    assert isinstance(cfg, RunConfig)
    assert cfg.resolved_recipe().name == "grpo"


def test_set_overrides_nested_keys_and_recipe_fields():
    cfg = load_config(overrides=["optim.lr=3e-4", "rollout.group_size=4", "recipe=dapo", "algo.clip_high=0.3"])
    assert cfg.optim.lr == pytest.approx(3e-4)
    assert cfg.rollout.group_size == 4
    rec = cfg.resolved_recipe()
    assert rec.clip_high == pytest.approx(0.3) and rec.dynamic_sampling  # preset kept, one field changed


def test_yaml_file_then_overrides_take_precedence(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("recipe: gspo\nsteps: 7\noptim:\n  lr: 1.0e-4\n  warmup_steps: 2\n")
    cfg = load_config(f, ["steps=9"])
    assert (cfg.recipe, cfg.steps, cfg.optim.warmup_steps) == ("gspo", 9, 2)
    assert cfg.optim.lr == pytest.approx(1e-4)


def test_string_numbers_are_coerced_to_the_field_type(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("optim:\n  lr: 1e-5\n")  # YAML 1.1 reads this as a string
    assert load_config(f).optim.lr == pytest.approx(1e-5)


@pytest.mark.parametrize(
    "override, needle",
    [
        ("optim.lrr=1", "optim.lrr"),
        ("recipe=nope", "unknown recipe 'nope'"),
        ("algo.clip_hi=0.3", "clip_hi"),
        ("rollout.group_size=0", "rollout.group_size"),
        ("reward.strict=maybe", "reward.strict"),
        ("optim.lr=fast", "optim.lr"),
    ],
)
def test_bad_values_name_the_key(override, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(")):
        load_config(overrides=[override])


def test_parse_override_requires_equals():
    with pytest.raises(ValueError, match="key=value"):
        parse_override("optim.lr")


def test_missing_config_file_is_named(tmp_path):
    with pytest.raises(ValueError, match="not found"):
        load_config(tmp_path / "absent.yaml")


def test_set_into_a_commented_out_section(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("optim:\n  # lr: 1\n")
    assert load_config(f, ["optim.lr=0.5"]).optim.lr == 0.5


def test_dr_grpo_with_adv_scale_std_is_refused_naming_both_settings():
    """Dr. GRPO's estimator never divides by the group std: ``adv_scale=std`` beside it would be silently ignored."""
    for overrides in (["recipe=dr_grpo", "algo.adv_scale=std"], ["algo.advantage=dr_grpo", "algo.adv_scale=std"]):
        with pytest.raises(ValueError, match=r"algo.advantage=dr_grpo .*contradicts algo.adv_scale=std"):
            load_config(overrides=overrides)
    # Without an explicit adv_scale the resolved recipe records what runs: no std division.
    assert load_config(overrides=["algo.advantage=dr_grpo"]).resolved_recipe().adv_scale == "none"
    assert load_config(overrides=["recipe=dr_grpo"]).resolved_recipe().adv_scale == "none"
    assert load_config(overrides=["recipe=grpo"]).resolved_recipe().adv_scale == "std"
