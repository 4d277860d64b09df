"""Build the AIME 2024 evaluation file (JSONL: {"problem": ..., "answer": <int>, "id": ...}) for configs/aime.yaml.

    python scripts/prepare_aime.py --out data/aime_2024.jsonl                          # online: HF datasets
    python scripts/prepare_aime.py --source HuggingFaceH4/aime_2024 --split train --out ...
    python scripts/prepare_aime.py --source my_copy.parquet --out data/aime_2024.jsonl # offline: a local file

`scripts/prepare_math.py --set aime_2024` under the name configs/aime.yaml and older docs cite, with
the same flags (--source, --split, --out, --problem-key, --answer-key, --any-integer); see
prepare_math.py for the sources it reads and what it checks. Other sets (AIME 2025, MATH-500,
GSM8K): scripts/prepare_math.py.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from prepare_math import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(fixed_set="aime_2024"))
