"""`echo2swarm keygen` and `echo2swarm tiny-model`: the files a learner needs."""

from __future__ import annotations

from pathlib import Path

import click

from echo2swarm.cli._common import fail, warmup_options


@click.command()
@click.argument("path", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--force", is_flag=True, help="Overwrite an existing key (followers pinned to the old one will refuse you).")
def keygen(path: Path, force: bool) -> None:
    """Create the learner's Ed25519 policy key at PATH and its public key at PATH.pub.

    Rollout peers pin the public key with --trust PATH.pub (or the 'ed25519:...' line it holds).
    """
    from echo2swarm.wire.signing import PolicyKey

    key = PolicyKey.generate()
    try:
        pub = key.save(path, overwrite=force)
    except FileExistsError as e:
        fail(f"{e} (pass --force to replace it)")
    click.echo(f"policy key: {path} (keep it secret)\npublic key: {pub}\n{key.public.text}")


@click.command("tiny-model")
@click.argument("out_dir", type=click.Path(file_okay=False, path_type=Path))
@click.option("--seed", type=int, default=0, show_default=True, help="Initialisation seed.")
@click.option("--task", default=None, help="Give the model a supervised warm-up on this task (e.g. arith).")
@warmup_options
def tiny_model(out_dir: Path, seed: int, task: str | None, warmup_steps: int, warmup_accuracy: float | None) -> None:
    """Write a tiny Qwen3-style model with a character tokenizer to OUT_DIR (a Hugging Face model dir).

    With --task arith the model gets a short supervised warm-up first, as RL post-training starts
    from a supervised model.
    """
    from echo2swarm.models.tiny import write_tiny_model

    try:
        path = write_tiny_model(out_dir, seed=seed, task=task, warmup_steps=warmup_steps if task else 0,
                                warmup_accuracy=warmup_accuracy)
    except (FileExistsError, ValueError) as e:
        fail(str(e))
    click.echo(f"wrote tiny model to {path}")
