"""A small AIME-format problem set written by the project (not real AIME problems), for data tests."""

import json

PROBLEMS = [
    {"problem": "Let $N$ be the number of ordered pairs $(a,b)$ of positive integers with $a+b=26$. Find $N$.", "answer": "025"},
    {"problem": "Find the remainder when $7^{100}$ is divided by $1000$.", "answer": "001"},
    {"problem": "A bag holds $12$ red and $30$ blue marbles. How many marbles are in the bag?", "answer": "42"},
    {"problem": "Find the number of positive divisors of $2^{5}\\cdot 3^{2}$.", "answer": 18},
    {"problem": "What is the sum of the first $20$ positive odd integers?", "answer": "400"},
]


def write_jsonl(path, rows=PROBLEMS, repeat=1) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for _ in range(repeat) for row in rows))
