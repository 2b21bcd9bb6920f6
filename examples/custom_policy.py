"""Load a memory policy from YAML and watch it compact tool outputs differently.

python -m examples.custom_policy
"""

from pathlib import Path

from kvmemory import Engine
from kvmemory.memory import MemoryManager, MemoryPolicy

LOG = (
    "".join(f"tests/test_mod{i}.py::test_case_{j} PASSED\n" for i in range(6) for j in range(8))
    + "1 failed, 47 passed\n"
)
SOURCE = "".join(
    f"def read_{i}(path):\n    with open(path) as f:\n        return f.read()[:{i * 10}]\n\n" for i in range(30)
)


def main() -> None:
    policy = MemoryPolicy.from_file(Path(__file__).with_name("custom_policy.yaml"))
    engine = Engine.from_pretrained("default")
    session = engine.session(memory=MemoryManager(policy))
    session.append_messages(
        [
            {"role": "system", "content": "You are a debugging agent."},
            {"role": "user", "content": "Find why the tests fail."},
        ]
    )
    for _ in range(3):
        session.append_messages(
            [
                {"role": "tool", "name": "run_tests", "content": LOG},
                {"role": "tool", "name": "read_file", "content": SOURCE},
            ]
        )
    session.memory.compact()
    for seg in session.stats().segments:
        rule = session.memory.rule_for(session.segment(seg["id"])).name
        print(
            f"segment {seg['id']:2d} {seg['kind']:<12} {str(seg['tool_name']):<10} rule {rule:<12} "
            f"{seg['tokens']:5d} tokens → {seg['slots']:7.1f} slots"
        )


if __name__ == "__main__":
    main()
