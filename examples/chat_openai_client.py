"""Point LangChain's ChatOpenAI at a running ``kvmemory serve``: each thread keeps its compacted cache on the
server, so every turn prefills only the new messages.

    kvmemory serve --port 8000 &      # in another terminal
    python -m examples.chat_openai_client [--base-url http://127.0.0.1:8000/v1]
"""

import argparse

import httpx
from langchain_core.messages import HumanMessage
from langchain_openai import ChatOpenAI


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    args = parser.parse_args()
    try:
        httpx.get(args.base_url.removesuffix("/v1") + "/health", timeout=5)
    except httpx.TransportError:
        raise SystemExit(f"no server at {args.base_url}: start one with `kvmemory serve --port 8000`") from None
    model = ChatOpenAI(
        base_url=args.base_url,
        api_key="not-needed",
        model="default",
        max_tokens=40,
        default_headers={"x-session-id": "example-thread"},  # the session whose cache stays resident
    )
    history = [HumanMessage("Name three prime numbers.")]
    for question in ["And their sum?", "Is that sum prime?"]:
        reply = model.invoke(history)
        cached = reply.usage_metadata["input_token_details"].get("cache_read", 0)
        print(f"{reply.content!r}  ({cached} of {reply.usage_metadata['input_tokens']} prompt tokens were cached)")
        history += [reply, HumanMessage(question)]


if __name__ == "__main__":
    main()
