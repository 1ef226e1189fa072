"""write_model_dir: a template's files with new weights, as the labs publish versions."""

from __future__ import annotations

from pathlib import Path

import pytest

from echo2swarm.models.files import write_model_dir


def test_new_weights_replace_the_templates_and_its_shard_index(tmp_path: Path) -> None:
    template = tmp_path / "template"
    template.mkdir()
    for name, data in (("config.json", b"{}"), ("tokenizer.json", b"tok"), ("model-00001-of-00002.safetensors", b"a"),
                       ("model.safetensors.index.json", b"{}")):
        (template / name).write_bytes(data)
    (template / "sub").mkdir()  # directories are not part of a model's files
    out = write_model_dir(template, tmp_path / "v1", b"weights")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert (out / "model.safetensors").read_bytes() == b"weights" and (out / "tokenizer.json").read_bytes() == b"tok"
    with pytest.raises(FileExistsError):  # a version is written once
        write_model_dir(template, out, b"other")
