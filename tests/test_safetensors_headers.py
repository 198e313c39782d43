import torch
from safetensors.torch import save_file

from hybridflow.safetensors_headers import stored_shapes


def test_shapes_of_every_file_without_the_metadata_and_none_for_a_broken_header(tmp_path):
    save_file({"a.weight": torch.zeros(3, 2)}, str(tmp_path / "model-1.safetensors"))
    save_file({"b.bias": torch.zeros(5)}, str(tmp_path / "model-2.safetensors"), {"k": "v"})
    assert stored_shapes(tmp_path) == {"a.weight": (3, 2), "b.bias": (5,)}
    (tmp_path / "model-3.safetensors").write_bytes((10).to_bytes(8, "little") + b"not json!!")
    assert stored_shapes(tmp_path) is None
