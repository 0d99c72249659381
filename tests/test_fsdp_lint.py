"""The FSDP configuration lint (``--quant-storage``, ``--use-orig-params``, ``--fsdp-wrap``,
``--prepare-kbit-training``): each line fires on its configuration and not on the recipe's, and says what the
real engine does: FSDP1's own ValueError, and bytes equal to the difference the real engine makes on a real
tiny model (torch's fake process group on the host: every buffer FSDP allocates is real)."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from vramguard.cli.app import main
from vramguard.estimate.fsdp_lint import LINT, FsdpSettings, fsdp1_error, lint, user_model, users_choices
from vramguard.measure.storage import local_tensor
from vramguard.workload.models import QLoRAConfig, build_qlora
from vramguard.workload.sharding import ShardingConfig, cpu_mesh, decoder_layers

CONFIG = QLoRAConfig()  # tiny-llama, bf16
FP32 = dataclasses.replace(CONFIG, compute_dtype="fp32")

# (sharding, config, settings, what the line says)
FIRES = {
    "fsdp1-uint8": ("fsdp1", CONFIG, FsdpSettings(quant_storage="uint8"), "Cannot flatten integer dtype"),
    "fsdp1-fp32-storage": ("fsdp1", CONFIG, FsdpSettings(quant_storage="fp32"), "uniform dtype"),
    "fsdp1-layer-wrap": ("fsdp1", CONFIG, FsdpSettings(wrap="layer"), "uniform dtype"),
    "fsdp1-prepare-kbit": ("fsdp1", CONFIG, FsdpSettings(prepare_kbit=True), "uniform dtype"),
    "fsdp1-mixed-units": (
        "fsdp1",
        FP32,
        FsdpSettings(wrap="layer", use_orig_params=True),
        "of gradients per rank",
    ),
    "fsdp2-uint8": ("fsdp2", CONFIG, FsdpSettings(quant_storage="uint8"), "every rank holds all"),
    "fsdp2-prepare-kbit": ("fsdp2", CONFIG, FsdpSettings(prepare_kbit=True), "upcast to fp32"),
}


@pytest.mark.parametrize("case", sorted(FIRES))
def test_each_lint_fires_on_its_config_and_not_on_the_recipe(case: str) -> None:
    sharding, config, settings, says = FIRES[case]
    found = lint(config, ShardingConfig(2, sharding), settings)
    assert len(found) == 1 and found[0].kind == LINT and says in found[0].message, found
    assert found[0].message.startswith("lint: ") and "\n" not in found[0].message
    recipe = FsdpSettings(quant_storage=config.compute_dtype, wrap="peft")
    assert lint(config, ShardingConfig(2, sharding), recipe) == []
    assert lint(config, ShardingConfig(2, sharding), FsdpSettings()) == []


def test_the_recipe_with_use_orig_params_or_mixed_precision_is_clean() -> None:
    """PEFT's wrap keeps every LoRA leaf a unit of its own: use_orig_params mixes nothing, and accelerate's
    fp32 upcast of trainable flat parameters finds them fp32 already (PEFT's adapters)."""
    bf16 = dataclasses.replace(CONFIG, mixed_precision="bf16")
    assert lint(bf16, ShardingConfig(2, "fsdp1"), FsdpSettings(use_orig_params=True)) == []
    assert lint(bf16, ShardingConfig(2, "fsdp2"), FsdpSettings(quant_storage="fp32")) == []
    assert lint(FP32, ShardingConfig(2, "fsdp2"), FsdpSettings(prepare_kbit=True)) == []  # nothing to upcast


# -- against the real engine -------------------------------------------------------------------------------------


def _real(config: QLoRAConfig, settings: FsdpSettings) -> torch.nn.Module:
    """The real tiny model the user's settings build on the host (random weights, real libraries)."""
    with users_choices(config, settings):
        return build_qlora(config, sharded=True).model


def _fsdp1(model: torch.nn.Module, wrap: str, use_orig_params: bool):
    """Real FSDP1 over a fake 2-rank process group (the caller holds it), with the callable wrap policy
    accelerate and Trainer pass."""
    from peft.utils.other import fsdp_auto_wrap_policy
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    if wrap == "peft":
        policy = fsdp_auto_wrap_policy(model)
    else:
        layers = {type(m) for m in decoder_layers(model)}
        policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=layers)
    return FullyShardedDataParallel(
        model,
        process_group=cpu_mesh(2).get_group(),
        auto_wrap_policy=policy,
        use_orig_params=use_orig_params,
        device_id=torch.device("cpu"),
        sync_module_states=False,
    )


@pytest.mark.parametrize(
    "case",
    [
        "fsdp1-uint8",
        "fsdp1-layer-wrap",
        pytest.param("fsdp1-fp32-storage", marks=pytest.mark.slow),
        pytest.param("fsdp1-prepare-kbit", marks=pytest.mark.slow),
    ],
)
def test_the_fsdp1_error_is_the_one_fsdp1_raises(case: str) -> None:
    """The lint's error, found on the meta-built model, is the ValueError real FSDP1 raises on the real one."""
    from vramguard.estimate.distributed import fake_process_group

    _, config, settings, _ = FIRES[case]
    predicted = fsdp1_error(user_model(config, settings), settings.wrap, settings.use_orig_params)
    assert predicted is not None
    model = _real(config, settings)
    with fake_process_group(0, 2), pytest.raises(ValueError) as raised:
        _fsdp1(model, settings.wrap, settings.use_orig_params)
    assert predicted.split(" (unit ")[0] == str(raised.value).splitlines()[0].strip()


def _flat_grad_bytes(config: QLoRAConfig, settings: FsdpSettings) -> int:
    """Rank 0's gradient bytes after one backward under real FSDP1 (fake 2-rank group): every flat parameter's."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    from vramguard.estimate.distributed import fake_process_group

    model = _real(config, settings)
    with fake_process_group(0, 2):
        wrapped = _fsdp1(model, settings.wrap, settings.use_orig_params)
        ids = torch.randint(0, 500, (2, 16), generator=torch.Generator().manual_seed(0))
        wrapped(input_ids=ids, labels=ids).loss.backward()
        flats = [m._flat_param for m in FullyShardedDataParallel.fsdp_modules(wrapped) if m._has_params]
        return sum(f.grad.numel() * f.grad.element_size() for f in flats if f.grad is not None)


def test_the_mixed_unit_gradient_bytes_are_what_fsdp1_allocates() -> None:
    """The layer wrap with use_orig_params (fp32, so the dtypes agree) against PEFT's wrap: the difference in
    rank 0's gradient bytes real FSDP1 allocates is the lint's figure, to the byte."""
    _, config, settings, _ = FIRES["fsdp1-mixed-units"]
    (found,) = lint(config, ShardingConfig(2, "fsdp1"), settings)
    user = _flat_grad_bytes(config, settings)
    recipe = _flat_grad_bytes(config, FsdpSettings())
    assert found.bytes == user - recipe > 0


def _fsdp2_param_bytes(model: torch.nn.Module, ignored: set[torch.nn.Parameter] | None = None) -> int:
    """Rank 0's parameter bytes once the real ``fully_shard`` (each decoder layer, then the root, fake 2-rank
    group) has sharded ``model``; ``ignored``: left out of sharding, as accelerate's ``ignored_params``."""
    from torch.distributed.fsdp import fully_shard

    from vramguard.estimate.distributed import fake_process_group

    with fake_process_group(0, 2):
        mesh = cpu_mesh(2)
        kwargs = {"ignored_params": ignored} if ignored else {}
        for layer in decoder_layers(model):
            fully_shard(layer, mesh=mesh, **kwargs)
        fully_shard(model, mesh=mesh, **kwargs)
        return sum(local_tensor(p).numel() * local_tensor(p).element_size() for p in model.parameters())


@pytest.fixture(scope="module")
def recipe_fsdp2_bytes() -> int:
    return _fsdp2_param_bytes(build_qlora(CONFIG, sharded=True).model)


def test_uint8_storage_under_fsdp2_costs_what_accelerate_leaves_unsharded(recipe_fsdp2_bytes: int) -> None:
    """accelerate's fsdp2_prepare_model passes the integer Params4bit as ignored_params: real fully_shard that
    way keeps them whole on rank 0; the difference from the recipe is the lint's figure."""
    _, config, settings, _ = FIRES["fsdp2-uint8"]
    (found,) = lint(config, ShardingConfig(2, "fsdp2"), settings)
    model = _real(config, settings)
    ignored = {
        p for p in model.parameters() if type(p).__name__ == "Params4bit" and not p.is_floating_point()
    }
    assert ignored
    assert found.bytes == _fsdp2_param_bytes(model, ignored) - recipe_fsdp2_bytes > 0


@pytest.mark.slow
def test_prepare_kbit_under_fsdp2_costs_its_upcast(recipe_fsdp2_bytes: int) -> None:
    _, config, settings, _ = FIRES["fsdp2-prepare-kbit"]
    (found,) = lint(config, ShardingConfig(2, "fsdp2"), settings)
    assert found.bytes == _fsdp2_param_bytes(_real(config, settings)) - recipe_fsdp2_bytes > 0


# -- the commands --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["estimate", "--quant-storage", "uint8"], "give --world-size and --sharding"),
        (["estimate", "--world-size", "2", "--sharding", "fsdp2", "--use-orig-params"], "FSDP1 settings"),
        (["audit", "--world-size", "2", "--sharding", "fsdp2", "--fsdp-wrap", "layer"], "FSDP1 settings"),
        (["audit", "--world-size", "2", "--sharding", "fsdp1", "--quant-storage", "int4"], "invalid choice"),
    ],
)
def test_bad_lint_input_is_one_line_and_exit_2(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0], err


def test_estimate_shows_the_lint_line(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["estimate", "--world-size", "2", "--sharding", "fsdp2", "--target", "cpu", "--steps", "1"]
    assert main([*argv, "--quant-storage", "uint8", "--quiet"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("vramguard: lint: fsdp2 with bnb_4bit_quant_storage uint8"), (
        err
    )
