"""Evaluation runner: ``python experiments/evaluate.py [overrides]`` (see :mod:`selfspec.cli.evaluate`).

    python experiments/evaluate.py model=qwen2.5-coder-1.5b dataset=gsm8k
    python experiments/evaluate.py -m dataset=humaneval,gsm8k,mtbench,summarization decoding.k=2,4,6
    python experiments/evaluate.py +experiment=headline
"""

from selfspec.cli.evaluate import main

if __name__ == "__main__":
    main()
