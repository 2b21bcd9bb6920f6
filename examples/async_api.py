"""Minimal async API: a session, a chat turn, streamed tokens, a second turn that reuses the cache.

python -m examples.async_api
"""

import asyncio

from kvmemory import Engine


async def main() -> None:
    engine = Engine.from_pretrained("default")
    async with engine.async_session() as session:
        await session.append_messages(
            [{"role": "user", "content": "Name three prime numbers."}], add_generation_prompt=True
        )
        answer = ""
        async for piece in session.stream(max_new_tokens=40):
            print(piece, end="", flush=True)
            answer += piece
        print()
        before = session.prefilled_tokens
        # the streamed reply is already the conversation's assistant message: append only the new question
        await session.append_messages([{"role": "user", "content": "And their sum?"}], add_generation_prompt=True)
        print(f"(second turn prefilled {session.prefilled_tokens - before} new tokens of {len(session.tokens)})")
        print((await session.generate(max_new_tokens=30)).text)
        stats = await session.stats()
        print(
            f"{stats.logical_tokens} tokens, {stats.slots_per_head} slots a head, "
            f"{stats.kv_bytes / 2**20:.1f} MiB of KV"
        )


if __name__ == "__main__":
    asyncio.run(main())
