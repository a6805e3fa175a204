"""Benchmarks: each module measures grpo_npu against a baseline side by side and reports ratios."""
