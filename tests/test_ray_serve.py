"""kvmemory on Ray Serve, on a real local Ray cluster (loopback only): two replicas of a tiny model behind the
OpenAI-compatible ingress. A thread sticks to one replica, answers equal the single-process server's, and
killing the replica that holds a thread loses nothing: the next request is served by the other replica from
the thread's saved state.

Select with ``-m ray`` (or skip with ``-m "not ray"``): starting Ray and two replicas takes a while."""

from __future__ import annotations

import random
import socket

import openai
import pytest

from integrations.server import create_app, serve_in_thread
from kvmemory import Engine, SessionStore
from tests.test_contract import tiny_chat_engine

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

pytestmark = [pytest.mark.ray, pytest.mark.default_model]  # the tiny model speaks through the default tokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The tiny chat model on disk, so that every replica loads the same weights."""
    path = tmp_path_factory.mktemp("tiny-chat")
    engine = tiny_chat_engine()
    engine.model.save_pretrained(path)
    engine.tokenizer.save_pretrained(path)
    return path


def free_port_outside_the_ephemeral_range() -> int:
    """A port Ray's proxy can bind: Ray takes a number, so it is probed first, but below the kernel's
    ephemeral range (32768 and up), where no outgoing connection or port-0 bind can be handed it meanwhile."""
    for port in random.Random().sample(range(20000, 32000), 200):
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port between 20000 and 32000")


@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory):
    """Ray on this machine with two replicas sharing a sessions directory; yields (base URL, sessions dir)."""
    from integrations.ray_serve import build_app

    sessions = tmp_path_factory.mktemp("sessions")
    port = free_port_outside_the_ephemeral_range()
    ray.init(num_cpus=4, include_dashboard=False, configure_logging=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(str(model_dir), sessions, replicas=2, replica_cpus=1), name="kvmemory", route_prefix="/")
        yield f"http://127.0.0.1:{port}", sessions
    finally:
        serve.shutdown()
        ray.shutdown()


def ask(base: str, thread: str, messages: list[dict]):
    chat = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", default_headers={"x-session-id": thread})
    raw = chat.chat.completions.with_raw_response.create(model="tiny", messages=messages, max_tokens=6)
    return raw.parse(), raw.headers


def conversation(turns: int, replies: list[str]) -> list[dict]:
    messages = [{"role": "system", "content": "Be brief."}]
    for i in range(turns):
        messages.append({"role": "user", "content": f"Question {i}: name a prime number above {10 * i}."})
        if i < len(replies):
            messages.append({"role": "assistant", "content": replies[i]})
    return messages


def single_process_replies(model_dir, turns: int) -> list[str]:
    """What one process serving the same model answers on the same thread."""
    engine = Engine.from_pretrained(str(model_dir))
    replies = []
    with serve_in_thread(create_app(engine, SessionStore(engine))) as base:
        for turn in range(turns):
            reply, _ = ask(base, "reference", conversation(turn + 1, replies))
            replies.append(reply.choices[0].message.content)
    return replies


def test_a_session_keeps_its_replica_unless_that_replica_leaves():
    from integrations.ray_serve import by_affinity

    replicas, sessions = ["r1", "r2", "r3"], [f"thread-{i}" for i in range(300)]
    home = {s: by_affinity(s, replicas)[0] for s in sessions}
    assert all(by_affinity(s, replicas[::-1])[0] == home[s] for s in sessions)  # whatever order they come in
    assert all(60 < list(home.values()).count(r) < 140 for r in replicas)  # spread evenly
    for s in sessions:  # r2 leaves: only its sessions move, each to its next-ranked replica
        assert by_affinity(s, ["r1", "r3"])[0] == (home[s] if home[s] != "r2" else by_affinity(s, replicas)[1])


def test_a_thread_sticks_to_one_replica_and_survives_that_replica_dying(cluster, model_dir):
    base, sessions = cluster
    expected = single_process_replies(model_dir, turns=4)
    replies, replicas, sources = [], [], []
    for turn in range(3):
        reply, headers = ask(base, "thread-a", conversation(turn + 1, replies))
        replies.append(reply.choices[0].message.content)
        replicas.append(headers["x-kvmemory-replica"])
        sources.append(headers.get("x-kvmemory-session"))
        if turn:
            assert reply.usage.prompt_tokens_details.cached_tokens > 0  # the cache stayed on the replica
    assert replies == expected[:3]
    assert len(set(replicas)) == 1 and sources == ["new", "resident", "resident"]
    assert any(sessions.iterdir())  # every turn was saved to the shared directory

    holder = next(
        a for a in ray.util.list_named_actors(all_namespaces=True) if replicas[0] in a["name"]
    )  # the replica actor serving the thread
    ray.kill(ray.get_actor(holder["name"], namespace=holder["namespace"]), no_restart=True)

    reply, headers = ask(base, "thread-a", conversation(4, replies))
    assert headers["x-kvmemory-replica"] != replicas[0]
    assert headers["x-kvmemory-session"] == "loaded"  # from the saved turn, not rebuilt
    assert reply.usage.prompt_tokens_details.cached_tokens > 0
    assert reply.choices[0].message.content == expected[3]


def test_every_thread_keeps_to_its_replica_and_streams_through_the_ingress(cluster):
    base, _ = cluster
    for thread in ("thread-b", "thread-c", "thread-d"):
        first, headers = ask(base, thread, conversation(1, []))
        _, again = ask(base, thread, conversation(2, [first.choices[0].message.content]))
        assert again["x-kvmemory-replica"] == headers["x-kvmemory-replica"]
    chat = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", default_headers={"x-session-id": "thread-s"})
    usage = {"include_usage": True}
    stream = chat.chat.completions.create(
        model="tiny", messages=conversation(1, []), max_tokens=6, stream=True, stream_options=usage
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == first.choices[0].message.content  # thread-d's first turn asked the same
    assert chunks[-1].usage.completion_tokens == 6
