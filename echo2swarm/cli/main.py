"""`echo2swarm` entry point. Importing this module must stay cheap: no torch, no hivemind."""

from __future__ import annotations

import click

from echo2swarm import __version__
from echo2swarm.cli.daemon import daemon
from echo2swarm.cli.demo import demo
from echo2swarm.cli.doctor import doctor
from echo2swarm.cli.artifacts import keygen, tiny_model
from echo2swarm.cli.peers import peers
from echo2swarm.cli.plan import plan
from echo2swarm.cli.simulate import simulate

HELP = """echo2swarm: RL post-training of LLMs on a peer-to-peer swarm of cheap GPUs.

\b
Start a swarm on one laptop and watch it:      echo2swarm demo
Join a swarm as a rollout peer:                echo2swarm daemon --role rollout --price 0.3 --initial-peers /ip4/.../p2p/...
See who is in a swarm:                         echo2swarm peers --initial-peers /ip4/.../p2p/...
Which peers to activate, at what cost:         echo2swarm plan --initial-peers /ip4/.../p2p/...
Check this machine before joining:             echo2swarm doctor --initial-peers /ip4/.../p2p/...
"""


@click.group(help=HELP, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(__version__, prog_name="echo2swarm")
def cli() -> None:
    pass


cli.add_command(daemon)
cli.add_command(peers)
cli.add_command(plan)
cli.add_command(keygen)
cli.add_command(tiny_model)
cli.add_command(demo)
cli.add_command(doctor)
cli.add_command(simulate)


def main() -> None:
    cli()


if __name__ == "__main__":
    main()
