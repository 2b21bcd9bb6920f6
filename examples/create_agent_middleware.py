"""``create_agent`` with KVMemoryMiddleware: per-tool policies from a mapping and from a decorator.

python -m examples.create_agent_middleware
"""

from langchain.agents import create_agent
from langchain_core.messages import HumanMessage
from langchain_core.tools import tool

from kvmemory.integrations import ChatKVMemory, KVMemoryMiddleware, kv_policy


@kv_policy(ratio=20)  # test logs: squeeze hard
@tool
def run_tests() -> str:
    """Run the project's tests and return the log."""
    return "tests/test_ledger.py::test_restock FAILED\nE   assert 10 == 18\n1 failed, 8 passed in 0.07s"


@tool
def read_settings() -> str:
    """Read the project's settings file."""
    return "DATABASE_PORT = 5433\nAPI_TIMEOUT_SECONDS = 17\nRELEASE_CODENAME = 'blue-heron'"


def main() -> None:
    chat = ChatKVMemory.from_pretrained("default", max_new_tokens=64)
    agent = create_agent(
        chat,
        tools=[run_tests, read_settings],
        middleware=[KVMemoryMiddleware(tool_policies={"read_settings": {"ratio": 2}}, compact_every=2)],
    )
    result = agent.invoke(
        {"messages": [HumanMessage("Run the tests, then tell me which test fails.")]},
        config={"configurable": {"thread_id": "middleware-example"}},
    )
    for msg in result["messages"]:
        print(f"{msg.type}: {msg.content or getattr(msg, 'tool_calls', '')}")
    print("rules:", [r.name for r in chat.policy.rules])
    print("kvmemory:", result["kvmemory"])


if __name__ == "__main__":
    main()
