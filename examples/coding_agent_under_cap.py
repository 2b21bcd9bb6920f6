"""The reference coding agent (model-driven tool calls) on a copy of the sample project under a memory cap.

Every reply calls a tool, in the model's own format (``tool_choice="required"``); ``finish`` ends the run. The
default Qwen2.5-Coder-0.5B calls real tools but rarely finds the bug; ``--model qwen2.5-coder-1.5b`` plans better.

    python -m examples.coding_agent_under_cap [--model default] [--max-slots 2048]  (any kvmemory-agent flag)
"""

import sys

from kvmemory.agents.coding_agent.cli import main

if __name__ == "__main__":
    main(["--sample", "--max-slots", "2048", "--max-steps", "6", "--max-new-tokens", "96", *sys.argv[1:]])
