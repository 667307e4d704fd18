"""Rollouts with vLLM (optional extra ``meshrl[vllm]``, GPU).

vLLM is imported inside the class, so ``meshrl.rollout`` imports without it. The engine is built from
a directory holding the *current* policy (saved at construction), runs in the trainer's process
(colocated, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and receives new weights in place after each
optimiser step through the model's own ``load_weights``; ``weight_sync="reload"`` instead saves the
policy and rebuilds the engine (slow, but independent of vLLM internals).

Engine log-probs (``Rollouts.engine_logprobs``): vLLM returns the log-prob of each sampled token. By
default (V1 engine) they are *raw* log-probs (log-softmax of the unscaled logits, i.e. temperature 1);
pass ``logprobs_mode="processed_logprobs"`` in ``llm_kwargs`` (vLLM >= 0.10.2) to get those after
temperature (and top-p, renormalised over the nucleus). The trainer compares them with
``log softmax(logits / T)[y]`` over the whole vocabulary (the convention of the ``native`` and ``hf``
backends), so the comparison is like for like with the default mode at ``temperature = 1, top_p = 1`` and
with ``processed_logprobs`` at any temperature and ``top_p = 1``. Not tested here (no GPU in CI).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from meshrl.models.lora import base_model, merged_state_dict
from meshrl.rollout.base import RolloutBackend, Rollouts, SamplingParams, cut_at_eos, eos_ids, register_backend

# Attribute paths from the LLM object to the torch module inside its in-process worker, newest first.
_MODEL_PATHS = (
    "llm_engine.model_executor.driver_worker.worker.model_runner.model",
    "llm_engine.model_executor.driver_worker.model_runner.model",
    "llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner.model",
)


def _resolve(obj, dotted: str):
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def save_policy(model, tokenizer, out_dir: Path) -> None:
    """Write the policy (LoRA merged) as a plain Hugging Face directory vLLM can load."""
    base_model(model).save_pretrained(out_dir, state_dict=merged_state_dict(model))
    tokenizer.save_pretrained(out_dir)


@register_backend("vllm")
class VLLMBackend(RolloutBackend):
    """``vllm.LLM`` behind the rollout interface, with engine log-probs of the sampled tokens.

    ``gpu_memory_utilization`` defaults low because the trainer shares the GPU. Other ``llm_kwargs`` go
    to ``vllm.LLM`` (``dtype`` default "bfloat16", ``max_model_len``, ``enforce_eager``,
    ``logprobs_mode``, ...). Attention kernels need a supported head size (32, 64, 128, ...): use
    ``tiny:medium`` (head_dim 32) rather than ``tiny`` (16) with this backend.
    """

    name = "vllm"

    def __init__(
        self,
        model,
        tokenizer,
        *,
        gpu_memory_utilization: float = 0.3,
        weight_sync: str = "inplace",
        work_dir: str | os.PathLike | None = None,
        **llm_kwargs,
    ):
        if weight_sync not in ("inplace", "reload"):
            raise ValueError(f"weight_sync must be 'inplace' or 'reload', got {weight_sync!r}")
        try:
            import vllm  # noqa: F401  (fail early with a clear message)
        except ImportError as exc:
            raise ImportError("the vllm backend needs vLLM and a GPU: pip install 'meshrl[vllm]'") from exc
        # In-place weight loading needs the engine core and worker inside this process.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        self.tokenizer = tokenizer
        self.eos = eos_ids(model, tokenizer)
        self.weight_sync = weight_sync
        # bfloat16 by default: vLLM's flash-attention kernels do not take float32 (the tiny models and
        # the converted SmolLM2 are saved in float32).
        self.llm_kwargs = {"dtype": "bfloat16", **llm_kwargs, "gpu_memory_utilization": gpu_memory_utilization}
        self._own_dir = work_dir is None
        self.work_dir = Path(work_dir) if work_dir is not None else Path(tempfile.mkdtemp(prefix="meshrl-vllm-"))
        self.llm = self._build_engine(model)

    def _build_engine(self, model):
        from vllm import LLM

        policy_dir = self.work_dir / "policy"
        if policy_dir.exists():
            shutil.rmtree(policy_dir)
        save_policy(model, self.tokenizer, policy_dir)
        return LLM(model=str(policy_dir), tokenizer=str(policy_dir), **self.llm_kwargs)

    def _engine_model(self):
        for dotted in _MODEL_PATHS:
            try:
                return _resolve(self.llm, dotted)
            except AttributeError:
                continue
        raise RuntimeError(
            "cannot reach the model inside vLLM (multiprocess engine?); set "
            "VLLM_ENABLE_V1_MULTIPROCESSING=0 before creating the backend or use weight_sync='reload'"
        )

    def sync_weights(self, model) -> None:
        if self.weight_sync == "reload":
            del self.llm
            self.llm = self._build_engine(model)
            return
        weights = merged_state_dict(model)
        self._engine_model().load_weights(weights=iter(weights.items()))
        # Cached KV blocks were computed with the old weights.
        if hasattr(self.llm, "reset_prefix_cache"):
            self.llm.reset_prefix_cache()

    def _sampling_params(self, params: SamplingParams, seed: int):
        from vllm import SamplingParams as VSamplingParams

        return VSamplingParams(
            n=params.n,
            temperature=params.temperature,
            top_p=params.top_p,
            max_tokens=params.max_new_tokens,
            seed=seed,
            logprobs=0,  # 0: only the sampled token's log-prob
            stop_token_ids=self.eos,
            skip_special_tokens=True,
        )

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams, *, seed: int) -> Rollouts:
        # One SamplingParams per prompt so that each prompt gets its own seeded generator.
        sampling = [self._sampling_params(params, seed + i) for i in range(len(prompt_ids))]
        requests = [{"prompt_token_ids": list(p)} for p in prompt_ids]
        outputs = self.llm.generate(requests, sampling, use_tqdm=False)
        result = Rollouts(engine_logprobs=[])
        for index, (prompt, request_out) in enumerate(zip(prompt_ids, outputs, strict=True)):
            for completion in request_out.outputs:
                self._append(result, index, list(prompt), completion)
        return result

    def _append(self, result: Rollouts, index: int, prompt: list[int], completion) -> None:
        tokens, no_eos = cut_at_eos(list(completion.token_ids), self.eos)
        logprobs = [step[tok].logprob for step, tok in zip(completion.logprobs or [], tokens, strict=False)]
        result.prompt_index.append(index)
        result.prompt_ids.append(prompt)
        result.response_ids.append(tokens)
        # vLLM keeps the eos in token_ids; if a version drops it, "stop" still means it ended properly.
        result.truncated.append(no_eos and completion.finish_reason == "length")
        result.texts.append(self.tokenizer.decode(tokens, skip_special_tokens=True))
        if result.engine_logprobs is not None:
            result.engine_logprobs.append(logprobs)

    def close(self) -> None:
        """Free the engine and the saved policy directory."""
        self.llm = None
        if self._own_dir:
            shutil.rmtree(self.work_dir, ignore_errors=True)
