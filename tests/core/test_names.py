from __future__ import annotations

import pytest

from ckpttool.core.checkpoint.names import (
    canonical_fqn,
    detected_wrappers,
    strip_wrappers,
    unique_names,
)
from ckpttool.errors import InputError


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        (("model", "model.embed_tokens.weight"), "model.embed_tokens.weight"),
        (("model", "_orig_mod.layers.0.w"), "layers.0.w"),
        (("model", "layers.0._checkpoint_wrapped_module.mlp.w"), "layers.0.mlp.w"),
        (("model", "_fsdp_wrapped_module.layers.0._fsdp_wrapped_module.w"), "layers.0.w"),
        (("model.embed_tokens.weight",), "model.embed_tokens.weight"),  # flat: kept
        (("model",), "model"),
        (("step",), "step"),
        (("meta", "lr"), "meta.lr"),
        (("model", "my_orig_mod.x"), "my_orig_mod.x"),  # only whole segments
    ],
)
def test_canonical_fqn(path: tuple[str, ...], expected: str) -> None:
    assert canonical_fqn(path) == expected


def test_collision_is_an_error() -> None:
    entries = [("model._orig_mod.w", ("model", "_orig_mod.w")), ("model.w", ("model", "w"))]
    with pytest.raises(InputError) as e:
        unique_names((fqn, canonical_fqn(path)) for fqn, path in entries)
    assert str(e.value).startswith("tensors 'model._orig_mod.w' and 'model.w' both become 'w'")


def test_detected_wrappers() -> None:
    paths = [("model", "_orig_mod.a._checkpoint_wrapped_module.b"), ("step",)]
    assert detected_wrappers(paths) == ["_checkpoint_wrapped_module", "_orig_mod", "model"]


def test_every_wrapper_segment_passes_the_quick_test() -> None:
    """strip_wrappers skips names without these substrings: a new wrapper must hold one."""
    from ckpttool.core.checkpoint.names import WRAPPER_SEGMENTS, _may_wrap

    for seg in WRAPPER_SEGMENTS:
        assert _may_wrap(seg) and _may_wrap(f"a.{seg}.b")
    assert strip_wrappers("layers.0._orig_mod_x.w") == "layers.0._orig_mod_x.w"
