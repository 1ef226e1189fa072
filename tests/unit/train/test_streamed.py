"""Older versions' forwards streamed from their files (train/streamed.py): the same logits as a loaded
copy, no parameter memory outside a module's forward, damaged or foreign files refused before any forward."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from echo2swarm.train.grpo import _accepts_logits_to_keep, completion_logits
from echo2swarm.train.streamed import StreamedPolicy, TensorWeights, VersionWeights
from echo2swarm.train.verify import load_policy_weights


def _perturbed(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """Another version: every tensor moved, as bf16 (what a bf16 swarm publishes), tied names left out."""
    g = torch.Generator().manual_seed(seed)
    state = {n: t for n, t in model.state_dict().items() if n != "lm_head.weight"}
    return {n: (t + 0.05 * torch.randn(t.shape, generator=g)).to(torch.bfloat16).contiguous() for n, t in state.items()}


@pytest.fixture(scope="module")
def policy(tiny_model_dir: Path) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    assert model.config.tie_word_embeddings  # the tied case: lm_head's weight is read by its alias
    return model.eval()


def test_a_streamed_forward_gives_the_logits_of_the_version_loaded_whole(policy, tmp_path: Path) -> None:
    other = _perturbed(policy, seed=1)
    save_file(other, tmp_path / "model.safetensors")
    loaded = copy.deepcopy(policy)
    load_policy_weights(loaded, {n: t.float() for n, t in other.items()})
    streamed = StreamedPolicy(policy)
    where: dict[str, int] = {}  # module -> where its weight was loaded
    for name, module in streamed.inner.named_modules():
        if "weight" in module._parameters:  # a hook registered after the loader's sees the loaded weight
            module.register_forward_pre_hook(lambda m, _, name=name: where.__setitem__(name, m.weight.data_ptr()))
    ids = torch.randint(0, policy.config.vocab_size, (3, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = loaded(input_ids=ids).logits
        for weights in (VersionWeights(tmp_path), TensorWeights(other)):
            with streamed.use(weights):
                got = streamed(input_ids=ids).logits
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # GEMM paths may differ by alignment
            # Layers of one shape load into one buffer, one after the other.
            assert where["model.layers.0.mlp.up_proj"] == where["model.layers.1.mlp.up_proj"]
        # The policy itself is untouched, and the skeleton holds no parameter memory between forwards.
        assert not torch.equal(policy(input_ids=ids).logits, want)
    assert all(p.is_meta for p in streamed.parameters())
    assert sum(b.numel() for b in streamed.buffers()) == sum(b.numel() for b in policy.buffers())
    # Callers see that it keeps only the logits asked for (an 8B's full logits would be large).
    mask = torch.ones_like(ids)
    completions = torch.zeros_like(ids, dtype=torch.bool)
    completions[:, -4:] = True
    with torch.no_grad():
        with streamed.use(TensorWeights(other)):
            kept = completion_logits(streamed, ids, mask, completions)
        torch.testing.assert_close(kept.logits, completion_logits(loaded, ids, mask, completions).logits,
                                   rtol=1e-5, atol=1e-5)
    assert _accepts_logits_to_keep(streamed)


def test_weights_that_do_not_fit_the_policy_are_refused_before_any_forward(policy, tmp_path: Path) -> None:
    streamed = StreamedPolicy(policy)
    other = _perturbed(policy, seed=2)
    name = "model.norm.weight"
    with pytest.raises(ValueError, match=f"no tensor for 1 parameter.*{name}"):
        with streamed.use(TensorWeights({n: t for n, t in other.items() if n != name})):
            pass
    with pytest.raises(ValueError, match=f"another shape for 1 parameter.*{name}"):
        with streamed.use(TensorWeights({**other, name: torch.zeros(3)})):
            pass
    with pytest.raises(RuntimeError, match="within"):
        streamed(input_ids=torch.zeros((1, 2), dtype=torch.long))
    # A forward that fails midway leaves nothing loaded.
    with pytest.raises(RuntimeError):
        with streamed.use(TensorWeights(other)):
            streamed(input_ids=torch.zeros((1, 2), dtype=torch.float64))  # ids of the wrong dtype
    assert all(p.is_meta for p in streamed.parameters())


def test_damaged_files_are_refused_with_their_name(policy, tmp_path: Path) -> None:
    save_file(_perturbed(policy, seed=3), tmp_path / "model.safetensors")
    good = (tmp_path / "model.safetensors").read_bytes()
    length = int.from_bytes(good[:8], "little")
    header = json.loads(good[8:8 + length])
    cases = {
        "truncated": good[: len(good) - 16],
        "not safetensors": b"\xff" * 64,
    }
    name = next(n for n in header if n != "__metadata__")
    header[name]["data_offsets"][1] += 4  # a range that does not fit its shape
    bad = json.dumps(header).encode()
    cases["range"] = len(bad).to_bytes(8, "little") + bad + good[8 + length:]
    for what, data in cases.items():
        path = tmp_path / what.replace(" ", "_")
        path.mkdir()
        (path / "model.safetensors").write_bytes(data)
        with pytest.raises(ValueError, match="model.safetensors"):
            VersionWeights(path)
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        VersionWeights(tmp_path / "range" / "nowhere")
    # What the good file holds reads back bit for bit.
    weights = VersionWeights(tmp_path)
    want = load_file(tmp_path / "model.safetensors")[name]
    assert torch.equal(weights.read_into(name, torch.empty_like(want)), want)
