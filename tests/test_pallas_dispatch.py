"""The one rule for when compiled Pallas kernels run, with the device list monkeypatched."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

import coat_jax
from pallas_kernels import dispatch
from pallas_kernels import quantize as kq


@dataclasses.dataclass
class FakeDevice:
    device_kind: str
    compute_capability: str | None = None
    platform: str = "gpu"


H200 = FakeDevice("NVIDIA H200", "9.0")
A100 = FakeDevice("NVIDIA A100-SXM4-80GB", "8.0")
B200 = FakeDevice("NVIDIA B200", "10.0")


@pytest.fixture
def devices(monkeypatch):
    """Sets the backend and local devices that ``dispatch`` sees."""

    def use(backend, devs):
        monkeypatch.setattr(dispatch.jax, "default_backend", lambda: backend)
        monkeypatch.setattr(dispatch.jax, "local_devices", lambda: list(devs))

    return use


@pytest.mark.parametrize(
    ("backend", "devs", "want"),
    [
        ("gpu", [H200, H200], True),
        ("gpu", [FakeDevice("NVIDIA H100 80GB HBM3")], True),  # no capability: by name
        ("gpu", [FakeDevice("NVIDIA GH200 480GB", "9.0")], True),
        ("gpu", [A100], False),
        ("gpu", [B200], False),  # not tested on Blackwell: reference
        ("gpu", [H200, A100], False),  # mixed hosts: every device must take the kernel
        ("gpu", [], False),
        ("cpu", [FakeDevice("cpu", None, "cpu")], False),
        ("cpu", [H200], False),  # the backend decides first
    ],
)
def test_hopper_rule(devices, backend, devs, want):
    devices(backend, devs)
    assert dispatch.hopper_gpu() is want


@pytest.mark.parametrize("family", sorted(dispatch.AUTO_USES_KERNEL))
def test_resolve_modes(devices, monkeypatch, family):
    devices("gpu", [H200])
    assert dispatch.resolve("pallas", family) == "pallas"
    assert dispatch.resolve("interpret", family) == "interpret"
    assert dispatch.resolve("reference", family) == "reference"
    monkeypatch.setitem(dispatch.AUTO_USES_KERNEL, family, False)
    assert dispatch.resolve("auto", family) == "reference"
    monkeypatch.setitem(dispatch.AUTO_USES_KERNEL, family, True)
    assert dispatch.resolve("auto", family) == "pallas"
    devices("gpu", [A100])  # a measured win on Hopper says nothing about other GPUs
    assert dispatch.resolve("auto", family) == "reference"
    with pytest.raises(ValueError, match="needs a Hopper GPU"):
        dispatch.resolve("pallas", family)


def test_resolve_rejects_unknown_names():
    with pytest.raises(ValueError, match="kernels='triton'"):
        dispatch.resolve("triton", "adam_step")
    with pytest.raises(ValueError, match="unknown kernel family"):
        dispatch.resolve("auto", "matmul")


# Per family: the GPU measurement behind an AUTO_USES_KERNEL entry, as (results file, the
# kernel's row, the reference's row) of bench/optimizer.py's JSON.
MEASURED = {
    "adam_step": (
        "optimizer_h200_2026-11-30.json",
        "fp8_adamw (Pallas fused moments, expansion)",
        "fp8_adamw (jnp, expansion)",
    ),
    "adam_update": (
        "optimizer_h200_2026-11-30.json",
        "fused FP8 AdamW update (Pallas, expansion)",
        "fused FP8 AdamW update (XLA jnp reference, expansion)",
    ),
    # against what auto ran before: fp32 rebuilt around the fp32 kernel
    "adam_update_parts": (
        "optimizer_master_h200_2026-12-01.json",
        "fused, BF16 + 16-bit remainder (Pallas on the parts)",
        "fused, BF16 + 16-bit remainder (fp32 rebuilt around the Pallas kernel)",
    ),
}


# Per family measured through train.py: (the kernel's log, the reference's log, the log of the
# call that ran both, naming its GPU), tokens/s of the last logged step compared.
MEASURED_THROUGH_TRAIN = {
    family: (
        "train_llama2_7b_b4_coat_fused_mlp_backward_h100_2026-12-06.txt",
        "train_llama2_7b_b4_coat_default_h100_2026-12-06.txt",
        "pending_gpu_part47_h100_2026-12-06.log",
    )
    for family in ("fused_mlp", "fused_backward")
} | {
    "quantize_transpose": (  # the faster of two runs each, one after another on one H100
        "train_llama2_7b_b4_coat_grad_transpose_pallas_run342_h100_2026-12-07.txt",
        "train_llama2_7b_b4_coat_grad_transpose_reference_run135_h100_2026-12-07.txt",
        "pending_gpu_grad_transpose_train_h100_2026-12-07.log",
    )
}


def _last_tokens_per_s(text: str) -> float:
    lines = [line.split() for line in text.splitlines() if " tokens_per_s " in line]
    fields = lines[-1]
    return float(fields[fields.index("tokens_per_s") + 1])


def test_auto_picks_a_kernel_only_where_a_gpu_measurement_shows_it_faster():
    """Each family that ``auto`` sends to its kernel has a committed Hopper result in which the
    kernel beats its reference (an optimizer bench on an H200, or train.py's tokens/s); the
    others have none cited (see the comments in dispatch.py)."""
    import json
    import pathlib

    results = pathlib.Path(__file__).parent.parent / "bench" / "results"
    for family, uses_kernel in dispatch.AUTO_USES_KERNEL.items():
        assert uses_kernel == (family in MEASURED or family in MEASURED_THROUGH_TRAIN), family
        if family in MEASURED:
            name, kernel, reference = MEASURED[family]
            result = json.loads((results / name).read_text())
            rows = {r["optimizer"]: r for r in result["rows"]}
            assert "H200" in result["device"]
            assert rows[kernel]["median_ms"] < rows[reference]["median_ms"], family
        elif family in MEASURED_THROUGH_TRAIN:
            kernel, reference, call = MEASURED_THROUGH_TRAIN[family]
            gpu = (results / call).read_text().splitlines()[0]
            assert "H100" in gpu or "H200" in gpu, gpu
            faster = _last_tokens_per_s((results / kernel).read_text())
            assert faster > _last_tokens_per_s((results / reference).read_text()), family


@pytest.mark.parametrize("family", sorted(dispatch.AUTO_ONE_DEVICE))
def test_auto_keeps_one_device_families_off_under_a_mesh(devices, monkeypatch, family):
    """``auto`` runs these kernels on one Hopper GPU and falls back to the XLA ops under a
    multi-device mesh (their sharded path has not run on several GPUs); ``pallas`` still runs
    them there."""
    devices("gpu", [H200])
    monkeypatch.setitem(dispatch.AUTO_USES_KERNEL, family, True)
    assert dispatch.resolve("auto", family) == "pallas"
    monkeypatch.setattr(dispatch, "multi_device_mesh", lambda: object())
    assert dispatch.resolve("auto", family) == "reference"
    assert dispatch.resolve("pallas", family) == "pallas"


@pytest.mark.parametrize("family", sorted(dispatch.AUTO_USES_KERNEL))
def test_auto_keeps_the_reference_where_sharding_is_unseen(devices, monkeypatch, family):
    """On several devices with no mesh in context, ``jit``'s shardings are invisible to a
    kernel (XLA would gather its operands whole), so ``auto`` keeps the reference; a mesh in
    context (any size) or a caller that places its arrays itself (``placed``) lifts that."""
    devices("gpu", [H200])
    monkeypatch.setitem(dispatch.AUTO_USES_KERNEL, family, True)
    monkeypatch.setattr(dispatch.jax, "device_count", lambda *_: 8)
    assert dispatch.unseen_sharding()
    assert dispatch.resolve("auto", family) == "reference"
    assert dispatch.resolve("auto", family, placed=True) == "pallas"
    assert dispatch.resolve("pallas", family) == "pallas"  # by name it runs
    with jax.set_mesh(jax.make_mesh((1,), ("d",), devices=jax.devices()[:1])):
        assert not dispatch.unseen_sharding()
        assert dispatch.resolve("auto", family) == "pallas"
    monkeypatch.setattr(dispatch.jax, "device_count", lambda *_: 1)
    assert dispatch.resolve("auto", family) == "pallas"


def test_optimizer_routes_through_the_rule(devices, monkeypatch):
    """``scale_by_fp8_adam(kernels="auto")`` runs the moment kernel exactly where the rule
    says (the kernel is replaced by a marker here: no GPU is needed to see the choice)."""
    from pallas_kernels import adam_step

    ran = []
    marker = lambda g, mu, nu, c, **kw: ran.append(g.shape) or (g, mu, nu)
    monkeypatch.setattr(adam_step, "fp8_adam_moments", marker)
    params = {"w": jnp.ones((4, 256))}

    def update():
        opt = coat_jax.scale_by_fp8_adam(min_size=0, kernels="auto")
        jax.eval_shape(opt.update, params, opt.init(params))

    devices("gpu", [H200])
    monkeypatch.setitem(dispatch.AUTO_USES_KERNEL, "adam_step", True)
    update()
    assert ran == [(4, 256)]
    monkeypatch.setitem(dispatch.AUTO_USES_KERNEL, "adam_step", False)
    update()
    assert ran == [(4, 256)]
    monkeypatch.setitem(dispatch.AUTO_USES_KERNEL, "adam_step", True)
    monkeypatch.setattr(dispatch.jax, "device_count", lambda *_: 8)  # no mesh: maybe sharded
    update()
    assert ran == [(4, 256)]
    with jax.set_mesh(jax.make_mesh((1,), ("d",), devices=jax.devices()[:1])):
        opt = coat_jax.scale_by_fp8_adam(min_size=0, kernels="auto")  # built under a mesh ...
        state = opt.init(params)
    jax.eval_shape(opt.update, params, state)  # ... traced where it is not: still not run
    assert ran == [(4, 256)]
    monkeypatch.setattr(dispatch.jax, "device_count", lambda *_: 1)
    devices("cpu", [FakeDevice("cpu", None, "cpu")])
    with pytest.raises(ValueError, match="needs a Hopper GPU"):
        coat_jax.fp8_adamw(1e-3, kernels="pallas")


def test_quantize_refuses_to_compile_off_hopper(devices):
    devices("gpu", [A100])
    with pytest.raises(ValueError, match="interpret=True"):
        kq.quantize_per_group(jnp.ones((4, 32)), "e4m3", 16)
    # interpret mode and untileable shapes never raise
    x = jax.random.normal(jax.random.key(0), (4, 130))
    assert kq.quantize_per_group(x, "e4m3", 16, interpret=True).data.shape == (4, 9, 15)
