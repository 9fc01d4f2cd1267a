import pytest

from lossbeat.diagnosis.thresholds import ThresholdsError, load_thresholds


def test_defaults_carry_the_articles_numbers():
    t = load_thresholds()
    assert t.profile.name == "causal-lm"
    assert t.profile.loss_good == (0.5, 3.0)
    assert (t.profile.loss_warn_low, t.profile.loss_warn_high) == (0.1, 5.0)
    assert (t.loss.trend_improving, t.loss.trend_rising) == (0.05, -0.02)
    assert (t.loss.cv_warning, t.loss.cv_danger) == (0.15, 0.30)
    assert (t.loss.spike_sigma, t.loss.spike_min_rise) == (5.0, 0.05)  # robust sigma: heavy per-step tails
    assert (t.gradients.explosion, t.gradients.vanishing) == (10.0, 1e-4)
    assert (t.gradients.healthy_low, t.gradients.healthy_high) == (0.1, 5.0)
    assert (t.gradients.layer_explosion, t.gradients.layer_vanishing) == (10.0, 1e-5)
    assert (t.learning_rate.too_small, t.learning_rate.too_large) == (1e-6, 1e-3)
    assert (t.windows.cv_steps, t.windows.trend_steps) == (50, 20)
    assert t.profiles["classification"].loss_good == (0.1, 1.0)
    assert t.profiles["classification"].loss_warn_high == 2.0
    assert t.profiles["regression"].loss_good is None
    # Judged against the run's own level: the article's 10 is a ceiling, a jump is x10 the baseline.
    assert (t.gradients.jump_ratio, t.gradients.ceiling_ratio, t.gradients.climb_ratio) == (10.0, 3.0, 5.0)
    assert (t.windows.trend_fraction, t.windows.trend_min_steps) == (0.25, 100)
    assert (t.hysteresis.warning_enter, t.hysteresis.danger_enter, t.hysteresis.leave) == (2, 1, 3)
    assert t.overfitting.evals == 2


def test_task_profiles_for_preference_and_rl():
    t = load_thresholds()
    dpo = t.profiles["preference"]
    assert dpo.loss_good[0] < 0.6931 <= dpo.loss_good[1] < dpo.loss_warn_high  # starts at ln 2: usual
    assert dpo.loss_warn_low is None  # no "label leakage" for a low preference loss
    rl = t.profiles["rl"]
    assert (rl.loss_good, rl.loss_warn_low, rl.loss_warn_high, rl.trend) == (None, None, None, False)
    assert t.profiles["causal-lm"].loss_init_high == 15.0  # above ln V for any tokenizer


def test_every_default_states_its_basis():
    """Each number in the packaged thresholds.yaml has a comment with its basis within its block."""
    from importlib import resources

    text = resources.files("lossbeat").joinpath("thresholds.yaml").read_text()
    assert "BASIS" in text and "[A §" in text and "[M" in text and "[S" in text
    section = text.split("\nalerts:")[0]
    for block in section.split("\n\n"):
        numbers = [
            line
            for line in block.splitlines()
            if ":" in line and not line.lstrip().startswith("#") and any(ch.isdigit() for ch in line.split(":", 1)[1])
        ]
        if numbers and "profiles:" not in block and "version:" not in block:
            assert "[" in block or "#" in block, block


def test_a_user_file_overrides_a_subset(tmp_path):
    path = tmp_path / "t.yaml"
    path.write_text("gradients:\n  explosion: 25\nprofile: classification\n")
    t = load_thresholds(path)
    assert t.gradients.explosion == 25.0
    assert t.gradients.vanishing == 1e-4  # untouched keys keep the defaults
    assert t.profile.name == "classification"


def test_profile_argument_selects_a_profile():
    assert load_thresholds(profile="regression").profile.loss_good is None
    with pytest.raises(ThresholdsError, match="profile: unknown profile 'nope'"):
        load_thresholds(profile="nope")


@pytest.mark.parametrize(
    "text, key",
    [
        ("gradients:\n  explosion: high\n", "gradients.explosion: expected a number"),
        ("gradients:\n  explosoin: 3\n", "gradients.explosoin: unknown key"),
        ("loss:\n  cv_warning: 0.5\n", "loss.cv_warning: must be below loss.cv_danger"),
        ("windows:\n  cv_steps: 0\n", "windows.cv_steps: must be > 0"),
        ("windows:\n  cv_steps: 2.5\n", "windows.cv_steps: expected an integer"),
        ("windows:\n  trend_fraction: 0.6\n", "windows.trend_fraction: must be below 0.5"),
        ("hysteresis:\n  leave: 0\n", "hysteresis.leave: must be > 0"),
        ("profiles:\n  rl:\n    trend: maybe\n", "profiles.rl.trend: expected true or false"),
        ("alerts:\n  plateau_for: soon\n", "alerts.plateau_for: expected a Prometheus duration"),
        ("profiles:\n  causal-lm:\n    loss_good: [3, 1]\n", "profiles.causal-lm.loss_good"),
        ("- just\n- a list\n", "expected a mapping at the top level"),
        ("gradients: [1, 2\n", "not valid YAML"),
    ],
)
def test_a_bad_file_names_the_key(tmp_path, text, key):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ThresholdsError, match=key.replace("[", r"\[")):
        load_thresholds(path)


def test_a_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(ThresholdsError, match="cannot read thresholds file"):
        load_thresholds(tmp_path / "absent.yaml")


def test_a_non_path_is_a_type_error():
    with pytest.raises(TypeError, match="thresholds"):
        load_thresholds(42)
