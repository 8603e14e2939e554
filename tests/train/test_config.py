"""TrainConfig: TOML + flags, validation, batch sizes of strong and weak scaling, the hash."""

from __future__ import annotations

import pytest

from kfac_hpc.train.config import ConfigError, TrainConfig, load_config, parse_duration_s


def test_flags_override_the_toml_file(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('model = "mlp"\nepochs = 7\nlr = 0.5\nlr_decay_epochs = [3, 5]\n')
    config = load_config(path, {"epochs": 2, "lr": None})
    assert (config.model, config.epochs, config.lr) == ("mlp", 2, 0.5)
    assert config.lr_decay_epochs == (3, 5)


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"model": "vgg"}, "model"),
        ({"epochs": 0}, "epochs"),
        ({"factor_decay": 1.0}, "factor_decay"),
        ({"grad_worker_fraction": "half"}, "grad_worker_fraction"),
        ({"stop_at_target": True}, "stop_at_target"),
        ({"dataset": "cifar10"}, "data_path"),
        ({"lr": "fast"}, "lr"),
        ({"modle": "mlp"}, "modle"),
        ({"time_limit": "soon"}, "time_limit"),
    ],
)
def test_bad_values_name_their_field(overrides, field):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert info.value.field == field
    assert "\n" not in str(info.value)


def test_unknown_key_suggests_the_close_name():
    with pytest.raises(ConfigError, match="did you mean 'model'"):
        load_config(None, {"modle": "mlp"})


def test_strong_scaling_keeps_the_global_batch_and_weak_the_per_rank_batch():
    strong = TrainConfig(batch_size=128, scaling="strong")
    weak = TrainConfig(batch_size=128, scaling="weak")
    for world in (1, 2, 4):
        s, w = strong.batch_sizes(world), weak.batch_sizes(world)
        assert (s.global_batch_size, s.per_rank_batch_size) == (128, 128 // world)
        assert (w.global_batch_size, w.per_rank_batch_size) == (128 * world, 128)
    with pytest.raises(ConfigError, match="multiple of the world size"):
        strong.batch_sizes(3)


def test_durations_and_checkpoint_every():
    assert parse_duration_s("90", "x") == 90
    assert parse_duration_s("30m", "x") == 1800
    assert parse_duration_s("1-01:00:00", "x") == 90000
    assert load_config(None, {"checkpoint_every": "25"}).checkpoint_every_steps == 25
    config = load_config(None, {"checkpoint_every": "90s", "time_limit": "2h"})
    assert config.checkpoint_every_min == 1.5
    assert config.checkpoint_every_steps is None
    assert config.time_limit_s == 7200


def test_hash_ignores_operational_fields_only():
    base = TrainConfig()
    assert base.config_hash() == TrainConfig(log_every=3, time_limit_s=60).config_hash()
    assert base.config_hash() != TrainConfig(lr=0.2).config_hash()


def test_kfac_options_use_the_preconditioner_names():
    from kfac_hpc.optim import KFACOptions

    options = TrainConfig(kl_clip=0, grad_worker_fraction="0.5").kfac_options()
    assert options["kl_clip"] is None and options["grad_worker_fraction"] == 0.5
    KFACOptions(**options)  # every name is one the preconditioner accepts


def test_factor_sample_fraction_reaches_every_layer():
    from torch import nn

    from kfac_hpc.optim import KFACPreconditioner

    options = TrainConfig(factor_sample_fraction=0.25).kfac_options()
    pre = KFACPreconditioner(nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)), **options)
    assert [layer.sample_fraction for layer in pre.layers.values()] == [0.25, 0.25]
