"""The names ``grpo_npu.data`` accepts, declared once and torch-free (the config validates against them)."""

# data.truncation: what rl_dataset does with a prompt over data.max_prompt_length
# (error refuses; left keeps the end, right keeps the start, middle keeps both ends)
TRUNCATION_MODES = ("error", "left", "right", "middle")
