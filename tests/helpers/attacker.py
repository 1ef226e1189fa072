"""A real rollout peer turned attacker: patch the transformers engine's sampling, then run the daemon.

    python -m helpers.attacker ATTACK <python> -m echo2swarm.cli.main daemon ARGS...

(the tail is what `DaemonProcess(wrap=[python, -m, helpers.attacker, ATTACK])` appends). The daemon
runs in this very process (`main()` of the CLI), so its pid is the one the test started; its engine
must run here too (`engine.isolate = false`, `engine.type = transformers`): the patch lives in this
process only. Nothing in production code knows of attacks: the patch replaces
`TransformersEngine.generate` as someone who edits their own copy of the code would.

Every attacker reports the policy's true logprobs of what it sends (one prefill of the weights the
engine holds, at the lease's temperature and top_p), so every logprob check passes and only the
choices lie; each draws only for leases (`params.sampler` set), the worker's calibration is left alone.

    another_model   samples with a differently initialised model of the same architecture
    hotter, colder  samples at the lease's T + 0.2 / T - 0.2
    top_p           samples with top_p 0.9 (the lease says 1.0)
    best_of_4       4 draws per slot (the lease's and 3 of its own generator), keeps the best by reward
    greedy          greedy decodes
    old_policy      samples with the weights it held 10 loads ago (fewer at first), declares the current
    resend          sends groups it generated for earlier leases again (its first lease honestly)
"""

from __future__ import annotations

import copy
import dataclasses
import math
import sys
from collections import deque
from typing import Any

ATTACKS = ("another_model", "hotter", "colder", "top_p", "best_of_4", "greedy", "old_policy", "resend")


def patch(attack: str) -> None:
    import torch

    from echo2swarm.rollout.engines.base import Completion, SamplingParams
    from echo2swarm.rollout.engines.hf import TransformersEngine
    from echo2swarm.train.sampling import nucleus

    original_generate = TransformersEngine.generate
    original_load = TransformersEngine.load_weights
    state: dict[str, Any] = {"history": deque(maxlen=10), "sent": []}

    def true_logprobs(engine: TransformersEngine, prompts: list[str], outs: list[list[Completion]],
                      params: SamplingParams) -> None:
        """What the weights the engine holds give each sent token at the lease's T and top_p (in place)."""
        temperature = params.temperature or 1.0
        with torch.inference_mode():
            for prompt, completions in zip(prompts, outs):
                prompt_ids = engine.tokenizer(prompt)["input_ids"]
                for c in completions:
                    ids = torch.tensor([prompt_ids + c.token_ids])
                    logits = engine.model(input_ids=ids).logits[0, len(prompt_ids) - 1:-1].float() / temperature
                    logp = torch.log_softmax(logits, dim=-1)
                    chosen = logp.gather(-1, torch.tensor(c.token_ids).unsqueeze(-1)).squeeze(-1)
                    if params.top_p < 1.0:
                        chosen = chosen - nucleus(logp, params.top_p)[0].squeeze(-1)
                    c.logprobs = chosen.tolist()

    def with_model(engine: TransformersEngine, model: Any, prompts: list[str], params: SamplingParams):
        real = engine.model
        engine.model = model
        try:
            return original_generate(engine, prompts, params)
        finally:
            engine.model = real

    def reward(prompt: str, completion: Completion, engine: TransformersEngine) -> float:
        a, b = prompt.rstrip("=").split("+")
        text = engine.tokenizer.decode(completion.token_ids, skip_special_tokens=True).strip()
        return float(completion.finish_reason == "stop" and text == str(int(a) + int(b)))

    def generate(self: TransformersEngine, prompts: list[str], params: SamplingParams):
        if params.sampler is None:  # the worker's calibration, not a lease
            return original_generate(self, prompts, params)
        if attack == "another_model":
            if "other" not in state:
                from transformers import AutoModelForCausalLM

                torch.manual_seed(1)
                state["other"] = AutoModelForCausalLM.from_config(self.model.config).eval()
            outs = with_model(self, state["other"], prompts, params)
        elif attack in ("hotter", "colder"):
            shift = 0.2 if attack == "hotter" else -0.2
            outs = original_generate(self, prompts, dataclasses.replace(params, temperature=params.temperature + shift))
        elif attack == "top_p":
            outs = original_generate(self, prompts, dataclasses.replace(params, top_p=0.9))
        elif attack == "greedy":
            outs = original_generate(self, prompts, dataclasses.replace(params, temperature=0.0))
        elif attack == "best_of_4":
            outs = original_generate(self, prompts, params)
            for draw in range(3):
                own = original_generate(self, prompts, dataclasses.replace(params, sampler=None, prompt_ids=None,
                                                                           seed=params.seed + 1 + draw))
                for prompt, mine, other in zip(prompts, outs, own):
                    for slot, c in enumerate(other):
                        if reward(prompt, c, self) > reward(prompt, mine[slot], self):  # the lease's wins ties
                            mine[slot] = c
        elif attack == "old_policy":
            history = state["history"]
            if history:
                if "old" not in state:
                    state["old"] = copy.deepcopy(self.model)
                state["old"].load_state_dict(history[0])
                outs = with_model(self, state["old"], prompts, params)
            else:
                outs = original_generate(self, prompts, params)
        elif attack == "resend":
            sent = state["sent"]
            if not sent:
                outs = original_generate(self, prompts, params)
                sent.extend(copy.deepcopy(group) for group in outs)
            else:
                outs = [copy.deepcopy(sent[i % len(sent)]) for i in range(len(prompts))]
        else:
            raise ValueError(f"unknown attack {attack!r}; one of {ATTACKS}")
        true_logprobs(self, prompts, outs, params)
        assert all(math.isfinite(x) for group in outs for c in group for x in c.logprobs)
        return outs

    def load_weights(self: TransformersEngine, model_dir: Any) -> float:
        if attack == "old_policy":
            state["history"].append({k: v.detach().clone() for k, v in self.model.state_dict().items()})
        return original_load(self, model_dir)

    TransformersEngine.generate = generate  # type: ignore[method-assign]
    TransformersEngine.load_weights = load_weights  # type: ignore[method-assign]


def main(argv: list[str]) -> None:
    attack, rest = argv[0], argv[1:]
    if attack not in ATTACKS:
        raise SystemExit(f"usage: python -m helpers.attacker {{{','.join(ATTACKS)}}} <python> -m echo2swarm.cli.main "
                         "daemon ARGS...")
    args = rest[rest.index("daemon"):]  # what follows the interpreter and `-m echo2swarm.cli.main`
    patch(attack)
    from echo2swarm.cli.main import main as cli_main

    sys.argv = ["echo2swarm", *args]
    cli_main()


if __name__ == "__main__":
    main(sys.argv[1:])
