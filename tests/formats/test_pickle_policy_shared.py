"""Hostile pickles against the pickle policy's shared state: BUILD applied to a global the
allow-list hands out (a dtype, an enum's stand-in, a stand-in class, a real class) must not
change it for the rest of the process; a dangerous callable reached through a dotted name is
"may be malicious", not "not supported yet". Hand-made bytes: no writer makes these."""

from __future__ import annotations

import contextlib
import fractions
import io
import pickle

import pytest

from ckpttool.formats.codecs import dtypes, policy, torchsave
from ckpttool.formats.dcp.metadata import _METADATA_CLASSES, allowed_global


def _bs(text: str) -> bytes:
    raw = text.encode()
    return b"X" + len(raw).to_bytes(4, "little") + raw


def _load(data: bytes, lookup: object = torchsave.record_global) -> object:
    return torchsave.AllowListUnpickler(io.BytesIO(data), lookup).load()  # type: ignore[arg-type]


def test_build_cannot_change_a_shared_dtype() -> None:
    before = dtypes.BY_TORCH_NAME["float32"]
    data = b"\x80\x02ctorch\nfloat32\n}" + _bs("itemsize") + b"K\x01sb."
    with pytest.raises(Exception):  # noqa: B017,PT011 - refused, however the unpickler says it
        _load(data)
    assert dtypes.BY_TORCH_NAME["float32"].itemsize == 4 and before.itemsize == 4


def test_build_cannot_patch_a_real_class() -> None:
    data = b"\x80\x02cfractions\nFraction\nN}" + _bs("__new__") + b"cbuiltins\nset\ns\x86b."
    with contextlib.suppress(Exception):
        _load(data)
    assert "__new__" not in vars(fractions.Fraction) or \
        vars(fractions.Fraction)["__new__"] is not policy._set
    assert fractions.Fraction(1, 2) == fractions.Fraction("1/2")


def test_build_cannot_empty_a_cached_enum() -> None:
    data = b"\x80\x02csignal\nSignals\nN}" + _bs("members") + b"}s\x86b."
    with pytest.raises(Exception):  # noqa: B017,PT011
        _load(data)
    signals = policy.data_global("signal", "Signals")
    assert isinstance(signals, policy.EnumClass) and signals.members["SIGTERM"] == 15


def test_build_cannot_patch_a_stand_in_class() -> None:
    module = "torch.distributed.checkpoint.metadata"
    data = (b"\x80\x02c" + module.encode() + b"\nMetadata\nN}" + _bs("field")
            + b"cbuiltins\nset\ns\x86b.")
    with pytest.raises(Exception):  # noqa: B017,PT011
        _load(data, allowed_global)
    stub = _METADATA_CLASSES["Metadata"]
    assert "field" not in vars(stub)


@pytest.mark.parametrize(("module", "name"), [
    ("torch", "os.system"),  # torch's own namespace holds the os module
    ("torch", "serialization.pickle.loads"),
    ("torch", "serialization._load"),
    ("ckpttool_no_such_module", "os.system"),  # even where torch is not imported
    ("ckpttool_no_such_module", "subprocess.Popen"),
    ("torch.fx.graph_module", "reduce_graph_module"),  # exec()s the source it is given
])
def test_a_dangerous_callable_behind_a_dotted_name_runs_code(module: str, name: str) -> None:
    import torch._tensor  # noqa: F401 - imported, as in any process that has torch

    assert policy.kind(module, name) == policy.RUNS_CODE


def test_a_tensor_with_attributes_is_not_malicious() -> None:
    # torch.save of a tensor with a Python attribute (DeepSpeed's ds_id) pickles it through
    # torch._tensor._rebuild_from_type_v2: a genuine file, never "may be malicious".
    import torch._tensor  # noqa: F401

    assert policy.kind("torch._tensor", "_rebuild_from_type_v2") == policy.UNKNOWN


def test_pickle_still_roundtrips_a_dtype() -> None:
    dt = dtypes.BY_TORCH_NAME["bfloat16"]
    assert pickle.loads(pickle.dumps(dt)) == dt


def test_build_cannot_patch_a_format_stand_in_class() -> None:
    from ckpttool.formats.rank_files import stand_ins

    data = (b"\x80\x02ctorch.distributed.tensor._dtensor_spec\nTensorMeta\nN}" + _bs("__new__")
            + b"cbuiltins\nset\ns\x86b.")
    with contextlib.suppress(Exception):
        _load(data, stand_ins.dtensor_global)
    assert "__new__" not in vars(stand_ins._TensorMeta)
