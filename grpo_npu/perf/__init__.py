"""Physical limits of each phase of a step: model FLOPs and bytes, device peaks, per-phase report.

    flops     ModelShape.from_hf_config, forward/train/decode FLOPs, decode bytes
    hardware  DeviceSpec table (Ascend 910B1-B4, H100, H200, A100) and the measured CPU
    report    StepWorkload + step_report -> perf/mfu/*, perf/limit_frac/*, perf/share/*; verdict
    memory    plan_memory: each phase's estimated peak memory per rank (table, warnings, perf/mem_estimate_gb/*)
    advice    passes_advice: the key to try when the verdict's phase is a model pass far from its limit
"""

from grpo_npu.perf.flops import Flops, ModelShape, decode_flops, forward_flops, train_flops
from grpo_npu.perf.hardware import DeviceSpec, cpu_device_spec, device_spec, lookup_device
from grpo_npu.perf.report import PhaseCost, StepReport, StepWorkload, step_report, verdict

__all__ = [
    "DeviceSpec",
    "Flops",
    "ModelShape",
    "PhaseCost",
    "StepReport",
    "StepWorkload",
    "cpu_device_spec",
    "decode_flops",
    "device_spec",
    "forward_flops",
    "lookup_device",
    "step_report",
    "train_flops",
    "verdict",
]
