"""Shared fixtures: the demo models are built once per machine into the cache folder."""

import pytest
import torch


@pytest.fixture(scope="session")
def demo_path():
    from serve_app.models.demo import ensure_demo_model

    return ensure_demo_model("demo")


@pytest.fixture(scope="session")
def hf_demo(demo_path):
    """transformers' own model on the same weights: the reference we must match."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(demo_path, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def prompts():
    """Prompts of many lengths, random ids from the ordinary vocabulary."""
    generator = torch.Generator().manual_seed(1234)
    lengths = [1, 2, 7, 16, 31, 64, 100, 150, 5]
    return [torch.randint(0, 151643, (n,), generator=generator).tolist() for n in lengths]


def transformers_greedy(model, prompts, max_new_tokens=16, ignore_eos=True):
    """transformers' greedy continuation of each prompt, with the log-probability of each
    chosen token: (tokens, logprobs). ignore_eos: exactly max_new_tokens each; else a prompt
    stops at the model's EOS, as ours do."""
    tokens, logprobs = [], []
    with torch.inference_mode():
        for ids in prompts:
            out = model.generate(
                torch.tensor([ids]),
                max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens if ignore_eos else None,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
            )
            chosen = out.sequences[0, len(ids) :]
            steps = torch.cat(out.logits).float().log_softmax(-1)
            tokens.append(chosen.tolist())
            logprobs.append(steps.gather(1, chosen[:, None])[:, 0].tolist())
    return tokens, logprobs


@pytest.fixture(scope="session")
def hf_greedy(hf_demo, prompts):
    """transformers' greedy continuation of each prompt (16 tokens, EOS ignored) and the
    log-probability of each chosen token: the demo model's argmax is decisive by design, so
    parity of the log-probabilities is what shows that every cached position was attended."""
    return transformers_greedy(hf_demo, prompts)


@pytest.fixture(scope="session")
def greedy_reference(hf_greedy):
    return hf_greedy[0]


@pytest.fixture(scope="session")
def smollm2_path():
    """The built-in SmolLM2-135M-Instruct folder (`make install` converts it; else now)."""
    from serve_app.models import smollm2

    return smollm2.ensure()


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def hf_greedy_of():
    """transformers_greedy, for test modules with prompts and models of their own."""
    return transformers_greedy
