"""The tiny model as a judge, for the tests that run a judge component (integration, slurm)."""

# The tiny arithmetic model as a judge: the prompt it gets names the row's answer and the completion's length,
# and its reply (a number) is the score, over 10000. Greedy: the same prompt always gets the same score.
TINY_JUDGE = ["reward.functions=[{type: exact_integer}, {type: judge, weight: 0.1}]",
              "reward.judge.model=../rltools/assets/tiny-arith", "reward.judge.dtype=float32",
              "reward.judge.template=What is {{ answer }}+{{ completion | length }}?", "reward.judge.score_pattern=(\\d+)",
              "reward.judge.score_max=10000", "reward.judge.max_tokens=6", "reward.judge.kv_cache_memory_bytes=67108864"]
