"""What this CPU can do for meshrl's kernels, asked the way PyTorch decides, and what to say when it cannot.

Two x86 CPUs that both run meshrl can differ in what bf16 costs on them. PyTorch sends a bf16 matmul to oneDNN only
where oneDNN has bf16 instructions to run it with (AVX-512 BW/VL/DQ, AVX-512 BF16, AMX, or AVX-NE-CONVERT); on a CPU
with AVX2 only it falls back to a reference kernel that converts every element, and oneDNN's weight reorder for
bf16 (the native decoder's prepacked GEMMs) refuses to run at all. :func:`bf16_gemm_native` asks PyTorch's own
check, so the answer moves with PyTorch's rule and with ``ONEDNN_MAX_CPU_ISA`` (which the tests use to run the AVX2
path on an AVX-512 machine). Measured figures behind :data:`BF16_EMULATED_COST`: benchmarks/README.md, "CPUs without
native bf16".
"""

from __future__ import annotations

import functools
import logging
import os
import platform
from typing import Any

log = logging.getLogger("meshrl")

#: Flags that decide which kernels run; recorded beside every benchmark figure.
KERNEL_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512_vnni",
                "avx_vnni", "avx_ne_convert", "amx_bf16", "amx_tile")

#: What bf16 costs where PyTorch has no native bf16 path (measured; the step-rate protocol, SmolLM2-135M,
#: 4 x 8 rollouts x 48 new tokens, 2 threads).
BF16_EMULATED_COST = ("on an AVX2-only AMD EPYC the SmolLM2-135M step-rate protocol's first step took 525 s under "
                      "bf16 autocast against about 9 s in float32 (~58x); the decoder's GEMMs alone ran 3-5x slower "
                      "than float32 ones")


@functools.cache
def bf16_gemm_native() -> bool:
    """True where PyTorch runs bf16 matmuls through oneDNN (and oneDNN can reorder bf16 weights): PyTorch's own
    ``mkldnn_bf16_device_check`` through ``torch.ops.mkldnn._is_mkldnn_bf16_supported``; where that op is missing, a
    probe of the reorder on a tiny bf16 weight. False on a CPU with AVX2 but no AVX-512, and without oneDNN."""
    import torch

    if not torch.backends.mkldnn.is_available():
        return False
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    if check is not None:
        try:
            return bool(check())
        except (RuntimeError, AttributeError):
            pass
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=torch.bfloat16), None)
    except (RuntimeError, AttributeError):
        return False
    return True


def capability() -> str:
    """PyTorch's CPU capability for its own vectorised kernels (``AVX512``, ``AVX2``, ``DEFAULT``, ...)."""
    import torch

    try:
        return str(torch.backends.cpu.get_cpu_capability())
    except (AttributeError, RuntimeError):
        return "unknown"


def _cpuinfo() -> tuple[str, set[str]]:
    """The CPU's model name and flags from /proc/cpuinfo (Linux); ``platform.processor()`` and no flags elsewhere."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        text = open("/proc/cpuinfo").read()  # noqa: SIM115 (read once, closed by the collector at once)
    except OSError:
        return model, flags
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and value.strip():
            model = value.strip()
        elif key.strip() == "flags" and not flags:
            flags = set(value.split())
    return model, flags


def cpu_info() -> dict[str, Any]:
    """What a CPU figure depends on: model, PyTorch's capability, the kernel-deciding flags present, native bf16,
    logical CPUs and torch threads, the torch build (its kernels decide the rounding as much as the CPU does), and
    any environment override of the ISA that was in force."""
    import torch

    model, flags = _cpuinfo()
    info: dict[str, Any] = {"model": model, "capability": capability(), "bf16_native": bf16_gemm_native(),
                            "flags": [f for f in KERNEL_FLAGS if f in flags], "cpus": os.cpu_count(),
                            "torch_threads": torch.get_num_threads(), "torch": torch.__version__}
    overrides = {k: os.environ[k] for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")
                 if os.environ.get(k)}
    if overrides:
        info["isa_overrides"] = overrides
    return info


def describe(info: dict[str, Any]) -> str:
    """The one line a benchmark prints beside its figures, from a :func:`cpu_info` record: ``cpu: <model>; PyTorch
    capability <capability>; native bf16 <yes/no>; flags <comma list>; torch <version>`` (where recorded), and the
    ISA overrides where any was in force (a figure taken under ``ONEDNN_MAX_CPU_ISA`` is not this CPU's own)."""
    line = (f"cpu: {info['model']}; PyTorch capability {info['capability']}; "
            f"native bf16 {'yes' if info['bf16_native'] else 'no'}; flags {','.join(info['flags']) or 'none'}")
    if info.get("torch"):
        line += f"; torch {info['torch']}"
    overrides = info.get("isa_overrides")
    if overrides:
        line += "; ISA overrides " + ",".join(f"{k}={v}" for k, v in overrides.items())
    return line


def machine_label(machine: dict[str, Any] | None) -> str:
    """A CPU as far as float rounding goes, from a :func:`cpu_info` record: PyTorch's capability, then the model and
    AMX where the record has them (``AVX512 (Intel(R) Xeon(R) Processor, AMX)``), and any ISA override that was in
    force (its kernels are not the CPU's own); ``-`` for no record. The capability
    alone is too coarse to name a CPU for reproduction: the collapse testbed's GRPO runs repeat bit for bit on an AMD
    EPYC with AVX-512 and part from step 1 on an Intel Xeon with AVX-512 and AMX, both ``AVX512``
    (experiments/collapse_testbed/results.md)."""
    if not machine:
        return "-"
    capability, model = str(machine.get("capability", "?")), machine.get("model")
    if not model:
        return capability
    overrides = "".join(f"; {k}={v}" for k, v in (machine.get("isa_overrides") or {}).items())
    if "flags" not in machine:  # AMX unknown, not absent
        return f"{capability} ({model}, flags not recorded{overrides})"
    return f"{capability} ({model}{', AMX' if 'amx_tile' in machine['flags'] else ''}{overrides})"


def emulated_bf16_settings(settings: dict[str, bool]) -> list[str]:
    """The settings among ``settings`` (``"key=value"`` as the config spells it -> in force) that ask for bf16 on
    a CPU without native bf16 (empty where the CPU has it or none is in force)."""
    on = [name for name, value in settings.items() if value]
    return on if on and not bf16_gemm_native() else []


def warn_emulated_bf16(settings: dict[str, bool]) -> list[str]:
    """Log one warning when any of ``settings`` asks for bf16 that this CPU emulates: names the settings, the
    measured slowdown and the float32 alternative. Returns the settings named (empty: nothing said)."""
    names = emulated_bf16_settings(settings)
    if names:
        log.warning("%s on a CPU without native bf16 (PyTorch capability %s; no AVX-512 BW/VL/DQ, AVX-512 BF16, "
                    "AMX or AVX-NE-CONVERT): bf16 is emulated here and slow: %s. Set %s (float32, the default), "
                    "which is faster on this CPU.", ", ".join(names), capability(), BF16_EMULATED_COST,
                    " and ".join(float32_setting(n) for n in names))
    return names


def float32_setting(name: str) -> str:
    """The float32 alternative of a bf16 ``key=value`` setting: ``=true`` -> ``=false``, ``=bfloat16`` ->
    ``=float32``."""
    key, _, value = name.partition("=")
    return f"{key}={'float32' if value == 'bfloat16' else 'false'}"
