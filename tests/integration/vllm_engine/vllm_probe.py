"""Log-probs of fixed tokens from the engine and from the trainer's model, shared by the tests in this folder
(imported by name: pytest puts a test folder without ``__init__.py`` on ``sys.path``)."""

from __future__ import annotations

import torch

# Engine and trainer both compute in float32 but with different kernels (vLLM's CPU attention and GEMM); they
# agree to about 1e-5 on these models. An update at lr 1e-2 moves the log-probs by far more than MATCH_TOL.
MATCH_TOL = 1e-3
MOVED_MIN = 0.05
SEQUENCE = [1, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54]


def engine_logprobs(backend, ids: list[int]) -> torch.Tensor:
    """The engine's log-prob of each token of ``ids`` after the first, given the tokens before it."""
    from vllm import SamplingParams as VSamplingParams

    params = VSamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
    out = backend.llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
    return torch.tensor([step[tok].logprob for step, tok in zip(out.prompt_logprobs[1:], ids[1:], strict=True)])


@torch.no_grad()
def policy_logprobs(model, ids: list[int]) -> torch.Tensor:
    x = torch.tensor([ids])
    logits = model(input_ids=x).logits.float()[0, :-1]
    return torch.log_softmax(logits, -1).gather(-1, x[0, 1:, None])[:, 0]


def optimiser_step(model, lr: float = 1e-2) -> None:
    """One AdamW step that raises the likelihood of SEQUENCE (any update that moves the weights would do)."""
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr)
    loss = -policy_logprobs.__wrapped__(model, SEQUENCE).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    model.eval()
