import torch
from safetensors.torch import save_file

from hybridflow.safetensors_headers import stored_shapes


def test_shapes_of_every_file_without_the_metadata_and_none_for_a_broken_header(tmp_path):
    save_file({"a.weight": torch.zeros(3, 2)}, str(tmp_path / "model-1.safetensors"))
    save_file({"b.bias": torch.zeros(5)}, str(tmp_path / "model-2.safetensors"), {"k": "v"})
    assert stored_shapes(tmp_path) == {"a.weight": (3, 2), "b.bias": (5,)}
    (tmp_path / "model-3.safetensors").write_bytes((10).to_bytes(8, "little") + b"not json!!")
    assert stored_shapes(tmp_path) is None


def test_a_header_with_shapes_no_tensor_has_gives_none(tmp_path):
    """A negative or textual size was a traceback where the shapes were turned into tensors."""
    import json

    for shape in ([-4], "4", [2.0]):
        text = json.dumps({"a": {"dtype": "F32", "shape": shape, "data_offsets": [0, 16]}})
        (tmp_path / "model.safetensors").write_bytes(
            len(text).to_bytes(8, "little") + text.encode()
        )
        assert stored_shapes(tmp_path) is None
    deep = b"[" * 100_000 + b"]" * 100_000
    (tmp_path / "model.safetensors").write_bytes(len(deep).to_bytes(8, "little") + deep)
    assert stored_shapes(tmp_path) is None
