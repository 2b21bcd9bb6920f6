"""The reference coding agent (model-driven tool calls) on a copy of the sample project under a memory cap.

The default 135M model is a weak coder: expect it to call a few tools and then talk. Point --model at a
larger local model (any HF directory or .gguf) for real fixes.

    python -m examples.coding_agent_under_cap [--model default] [--max-slots 1024]  (any kvmemory-agent flag)
"""

import sys

from agents.coding_agent.cli import main

if __name__ == "__main__":
    main(["--sample", "--max-slots", "1024", "--max-steps", "6", "--max-new-tokens", "96", *sys.argv[1:]])
